"""The host's Philox4x32-10 (tests/_dropout_reference.py) against the generator's published
known-answer vectors, and the keep mask's basic statistics. CPU only."""

import numpy as np

from _dropout_reference import keep_mask, philox4x32_10, random16

# (counter, key, output) known-answer vectors of Philox4x32-10 (Random123's kat_vectors).
KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


def test_philox_known_answers():
    for counter, key, expected in KAT:
        assert tuple(int(x) for x in philox4x32_10(counter, key)) == expected


def test_philox_broadcasts_over_counters():
    counters = np.array([k[0] for k in KAT], dtype=np.uint32)
    keys = np.array([k[1] for k in KAT], dtype=np.uint32)
    assert philox4x32_10(counters, keys).tolist() == [list(k[2]) for k in KAT]


def test_random16_covers_each_half_once_per_block_and_lane():
    """Within a 16 x 16 block, the 256 scores take the 8 halves of the 32 counters once each:
    no two scores share a random number."""
    q_idx, k_idx = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    u, w = q_idx % 16, k_idx % 16
    slot = (4 * (u % 8) + (w % 8) // 2) * 8 + 4 * (u // 8) + 2 * (w // 8) + w % 2
    assert sorted(slot.ravel().tolist()) == list(range(256))
    values = random16(1234, 1, 1, 0, 0, q_idx, k_idx)
    assert len(np.unique(values)) > 240  # 256 16-bit draws: few collisions


def test_keep_mask_rate_and_seed_dependence():
    mask = keep_mask(7, 0.25, 2, 3, 64, 96)
    assert mask.shape == (2, 3, 64, 96)
    n = mask.size
    rate = mask.mean()
    assert abs(rate - 0.75) < 5 * (0.75 * 0.25 / n) ** 0.5  # within 5 sigma of 1 - p
    assert not np.array_equal(mask, keep_mask(8, 0.25, 2, 3, 64, 96))
    assert np.array_equal(mask, keep_mask(7, 0.25, 2, 3, 64, 96))
    assert keep_mask(7, 0.0, 1, 1, 16, 16).all()


def _philox_half(words, half):
    word = int(words[half // 2])
    return word >> 16 if half % 2 else word & 0xFFFF


def test_device_layouts_pick_each_scores_own_number():
    """cuda_src/philox.cuh's two bit layouts, their index math written out here: in the
    forward's m16n8 layout (one counter per lane) and the dK/dV kernel's transposed one (two
    counters per lane), every lane's bit for a score is random16 of that score's (query, key)."""
    seed, q16, k16, bh, thr = 0x1234_5678_9ABC_DEF0, 3, 5, 7, 20000
    key = (seed & 0xFFFFFFFF, seed >> 32)
    heads, b, h = 8, 0, 7  # bh = b * heads + h
    for lane in range(32):
        a, bb = lane // 4, lane % 4
        # forward: queries a + 8r, keys 2bb + 8n + c
        words = philox4x32_10((q16, k16, bh, lane), key)
        for r in range(2):
            for n in range(2):
                for c in range(2):
                    q, k = 16 * q16 + a + 8 * r, 16 * k16 + 2 * bb + 8 * n + c
                    expected = int(random16(seed, 1, heads, b, h, q, k)) >= thr
                    got = _philox_half(words, 4 * r + 2 * n + c) >= thr
                    assert got == expected, ("forward", lane, r, n, c)
        # transposed: keys a + 8r, queries 2bb + 8n + c
        for c in range(2):
            words = philox4x32_10((q16, k16, bh, 4 * (2 * bb + c) + a // 2), key)
            for n in range(2):
                for r in range(2):
                    q, k = 16 * q16 + 2 * bb + 8 * n + c, 16 * k16 + a + 8 * r
                    expected = int(random16(seed, 1, heads, b, h, q, k)) >= thr
                    got = _philox_half(words, 4 * n + 2 * r + (a & 1)) >= thr
                    assert got == expected, ("transposed", lane, r, n, c)


def test_torch_keep_mask_equals_the_numpy_one():
    """cudaflash._dropout.keep_mask (torch int64 ops: what return_attn_probs uses) against
    the numpy reference, bit for bit."""
    import torch

    from cudaflash import _dropout

    d = _dropout.Dropout(0.3, round(0.3 * 65536), 1 / 0.7,
                         torch.tensor([0x0123_4567_89AB_CDEF], dtype=torch.int64))
    got = _dropout.keep_mask(d, 2, 3, 40, 70, torch.device("cpu")).numpy()
    assert np.array_equal(got, keep_mask(0x0123_4567_89AB_CDEF, 0.3, 2, 3, 40, 70))


def test_attention_matrix_recovers_the_softmax_flash_attn_style():
    """Scaling block n of S_dmask by exp(M_n - lse), as flash-attn's tests do, gives the
    softmax probabilities; the signs give the keep mask."""
    import torch

    from cudaflash import _dropout

    torch.manual_seed(0)
    q, k = torch.randn(1, 50, 2, 64), torch.randn(1, 130, 2, 64)
    d = _dropout.Dropout(0.25, 16384, 4 / 3, torch.tensor([99], dtype=torch.int64))
    keep = _dropout.keep_mask(d, 1, 2, 50, 130, torch.device("cpu"))
    allowed = torch.ones(50, 130, dtype=torch.bool)
    s_dmask = _dropout.attention_matrix(q, k, 0.125, allowed, d, keep)
    assert torch.equal(s_dmask >= 0, keep)
    scores = (q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)) * 0.125
    lse = scores.logsumexp(-1)
    blocks = scores.split(64, -1)  # block_size_n for d = 64 with dropout
    block_max = torch.stack([b.amax(-1) for b in blocks], -1)
    running = torch.cummax(block_max.flip(-1), -1).values.flip(-1)
    parts = s_dmask.abs().split(64, -1)
    probs = torch.cat([p * torch.exp(running[..., n, None] - lse[..., None])
                       for n, p in enumerate(parts)], -1)
    assert torch.allclose(probs, scores.softmax(-1), atol=1e-6)
