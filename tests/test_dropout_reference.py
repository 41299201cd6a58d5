"""The host's Philox4x32 (tests/_dropout_reference.py) against the generator's published
known-answer vectors at 10 rounds (the paper's default) and 7 (the kernels' count), and the
keep mask's basic statistics. CPU only."""

import re
from pathlib import Path

import numpy as np

from _dropout_reference import PHILOX_ROUNDS, keep_mask, philox4x32, random8, threshold

# (counter, key, output) known-answer vectors of Philox4x32-10 and Philox4x32-7: Random123's
# kat_vectors lines "philox4x32 10 ..." and "philox4x32 7 ..." (as D. E. Shaw Research's
# Random123-Boost carries them in libs/random/test/test_philox.cpp).
# The 10-round ones check the round function and the key schedule; the 7-round ones, the
# count the kernels run.
KAT_10 = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]
KAT_7 = [
    ((0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
]

ROOT = Path(__file__).resolve().parents[1]


def test_philox_known_answers():
    for rounds, kat in ((10, KAT_10), (7, KAT_7)):
        for counter, key, expected in kat:
            assert tuple(int(x) for x in philox4x32(counter, key, rounds=rounds)) == expected


def test_philox_defaults_to_the_kernels_seven_rounds():
    """The reference, cudaflash's torch mirror (return_attn_probs' masks) and the kernels'
    header all run 7 rounds, and the default call gives the 7-round known answers."""
    from cudaflash import _dropout

    header = (ROOT / "cuda_src" / "philox.cuh").read_text()
    kernel_rounds = re.findall(r"constexpr int kPhiloxRounds = (\d+);", header)
    assert kernel_rounds == ["7"]
    assert PHILOX_ROUNDS == _dropout.PHILOX_ROUNDS == 7
    for counter, key, expected in KAT_7:
        assert tuple(int(x) for x in philox4x32(counter, key)) == expected


def test_torch_philox_equals_the_numpy_one_at_both_counts():
    """cudaflash._dropout.philox4x32 (int64 torch ops) against the reference, by default
    and at 10 rounds, on the known-answer inputs and on counters with every bit pattern."""
    import torch

    from cudaflash import _dropout

    rng = np.random.default_rng(0)
    counters = np.concatenate([np.array([k[0] for k in KAT_7], dtype=np.uint32),
                               rng.integers(0, 2**32, (64, 4), dtype=np.uint32)])
    keys = np.concatenate([np.array([k[1] for k in KAT_7], dtype=np.uint32),
                           rng.integers(0, 2**32, (64, 2), dtype=np.uint32)])
    c = [torch.from_numpy(counters[:, i].astype(np.int64)) for i in range(4)]
    k = [torch.from_numpy(keys[:, i].astype(np.int64)) for i in range(2)]
    for rounds in (None, 10):
        kwargs = {} if rounds is None else {"rounds": rounds}
        ours = torch.stack(_dropout.philox4x32(*c, *k, **kwargs), -1).numpy()
        assert np.array_equal(ours, philox4x32(counters, keys, **kwargs).astype(np.int64))


def test_philox_broadcasts_over_counters():
    for rounds, kat in ((10, KAT_10), (7, KAT_7)):
        counters = np.array([k[0] for k in kat], dtype=np.uint32)
        keys = np.array([k[1] for k in kat], dtype=np.uint32)
        assert philox4x32(counters, keys, rounds=rounds).tolist() == [list(k[2]) for k in kat]


def test_random8_covers_each_byte_once_per_block():
    """Within a 16 x 16 block, the 256 scores take the 16 bytes of the 16 quads' calls once
    each: no two scores share a random number."""
    q_idx, k_idx = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    quad = 4 * (q_idx % 8 // 2) + k_idx % 8 // 2
    byte = 4 * (q_idx % 2 + 2 * (q_idx // 8)) + k_idx % 2 + 2 * (k_idx // 8)
    assert sorted((16 * quad + byte).ravel().tolist()) == list(range(256))
    values = random8(1234, 1, 1, 0, 0, q_idx, k_idx)
    counts = np.bincount(values.ravel(), minlength=256)
    assert counts.max() <= 8  # 256 uniform bytes: no value drawn suspiciously often


def test_keep_mask_rate_and_seed_dependence():
    assert threshold(0.25) == 64 and threshold(0.1) == 26 and threshold(0.9999) == 255
    mask = keep_mask(7, 0.25, 2, 3, 64, 96)
    assert mask.shape == (2, 3, 64, 96)
    n = mask.size
    rate = mask.mean()
    assert abs(rate - 0.75) < 5 * (0.75 * 0.25 / n) ** 0.5  # within 5 sigma of 1 - p
    assert not np.array_equal(mask, keep_mask(8, 0.25, 2, 3, 64, 96))
    assert np.array_equal(mask, keep_mask(7, 0.25, 2, 3, 64, 96))
    assert keep_mask(7, 0.0, 1, 1, 16, 16).all()


def _byte_perm(x: int, y: int, selector: int) -> int:
    """CUDA's __byte_perm: byte n of the result is byte (selector >> 4n) & 7 of y:x."""
    pool = x | (y << 32)
    return sum(((pool >> (8 * ((selector >> (4 * n)) & 7))) & 0xFF) << (8 * n) for n in range(4))


def _quad_half(words, half: int, transposed: bool):
    """philox.cuh's quad_half, written out."""
    if not transposed:
        return [int(words[half]), int(words[half + 2])]
    s = half
    pick = s | ((s + 4) << 4) | ((s + 2) << 8) | ((s + 6) << 12)
    u01 = _byte_perm(int(words[0]), int(words[1]), pick)
    u23 = _byte_perm(int(words[2]), int(words[3]), pick)
    return [_byte_perm(u01, u23, 0x5410), _byte_perm(u01, u23, 0x7632)]


def _dropout_bytes(seed: int, q16: int, k16: int, dq: int, dk: int, head_index: int, n: int,
                   transposed: bool):
    """philox.cuh's dropout_bytes for a whole warp: [lane][block] -> two words, the pair
    exchange (__shfl_xor_sync(..., 4)) done by indexing the partner lane."""
    key = (seed & 0xFFFFFFFF, seed >> 32)
    own, give, out = {}, {}, [[None] * n for _ in range(32)]
    for lane in range(32):
        half = (lane >> 2) & 1
        quad = 4 * (lane & 3) + (lane >> 3) if transposed else 4 * (lane >> 3) + (lane & 3)
        for i in range(0, n - 1, 2):
            mine = i + half
            words = philox4x32(((q16 + mine * dq), (k16 + mine * dk), head_index, quad), key)
            own[lane, i] = _quad_half(words, half, transposed)
            give[lane, i] = _quad_half(words, half ^ 1, transposed)
        if n % 2:
            words = philox4x32((q16 + (n - 1) * dq, k16 + (n - 1) * dk, head_index, quad), key)
            out[lane][n - 1] = _quad_half(words, half, transposed)
    for lane in range(32):
        half = (lane >> 2) & 1
        for i in range(0, n - 1, 2):
            got = give[lane ^ 4, i]
            out[lane][i] = got if half else own[lane, i]
            out[lane][i + 1] = own[lane, i] if half else got
    return out


def test_device_layouts_pick_each_scores_own_byte():
    """cuda_src/philox.cuh's dropout_bytes in both layouts, its index math, byte shuffles and
    lane exchange written out here: for every lane, block and slot, the byte is random8 of that
    score's (query, key). Forward (m16n8 accumulators, rows: queries): slot (rr, n, cc) of
    lane l is query l/4 + 8 rr, key 2 (l%4) + 8 n + cc. Transposed (the dK/dV kernel, rows:
    keys): key l/4 + 8 rr, query 2 (l%4) + 8 n + cc. Three blocks: one pair and one unpaired."""
    seed, q16, k16, heads, b, h = 0x1234_5678_9ABC_DEF0, 3, 5, 8, 1, 6
    bh = b * heads + h
    for transposed in (False, True):
        dq, dk = (1, 0) if transposed else (0, 1)
        got = _dropout_bytes(seed, q16, k16, dq, dk, bh, 3, transposed)
        for lane in range(32):
            for i in range(3):
                for rr in range(2):
                    for n in range(2):
                        for cc in range(2):
                            row, col = lane // 4 + 8 * rr, 2 * (lane % 4) + 8 * n + cc
                            query, key = (col, row) if transposed else (row, col)
                            query += 16 * (q16 + i * dq)
                            key += 16 * (k16 + i * dk)
                            expected = int(random8(seed, 2, heads, b, h, query, key))
                            word = got[lane][i][rr]
                            assert (word >> (8 * (2 * n + cc))) & 0xFF == expected, (
                                transposed, lane, i, rr, n, cc)


def test_torch_keep_mask_equals_the_numpy_one():
    """cudaflash._dropout.keep_mask (torch int64 ops: what return_attn_probs uses) against
    the numpy reference, bit for bit."""
    import torch

    from cudaflash import _dropout

    d = _dropout.Dropout(0.3, threshold(0.3), 1 / 0.7,
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
    d = _dropout.Dropout(0.25, 64, 4 / 3, torch.tensor([99], dtype=torch.int64))
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


def test_varlen_s_dmask_is_each_sequences_own_matrix():
    """flash_attn_varlen_func's S_dmask (_dropout.varlen_attention_probs): sequence b in entry
    b's corner, built from its own rows and keys with batch entry b's numbers, zeros
    elsewhere; the same as the padded batch's matrix of that sequence alone."""
    import torch

    from cudaflash import _dropout

    torch.manual_seed(1)
    lens_q, lens_k, heads, d = [5, 40, 17], [30, 40, 1], 2, 64
    cu_q = torch.tensor([0, 5, 45, 62], dtype=torch.int32)
    cu_k = torch.tensor([0, 30, 70, 71], dtype=torch.int32)
    q, k = torch.randn(62, heads, d), torch.randn(71, heads, d)
    drop = _dropout.Dropout(0.3, threshold(0.3), 1 / 0.7, torch.tensor([1234], dtype=torch.int64))
    for causal, window in ((False, (-1, -1)), (True, (-1, -1)), (False, (8, 3))):
        probs = _dropout.varlen_attention_probs(q, k, cu_q, cu_k, 40, 40, 0.125, causal, window,
                                                drop)
        assert probs.shape == (3, heads, 40, 40)
        for b, (lq, lk) in enumerate(zip(lens_q, lens_k)):
            qb = q[None, int(cu_q[b]):int(cu_q[b]) + lq]
            kb = k[None, int(cu_k[b]):int(cu_k[b]) + lk]
            keep = _dropout.keep_mask(drop, 3, heads, lq, lk, torch.device("cpu"))[b:b + 1]
            assert torch.equal(keep, _dropout.keep_mask(drop, 3, heads, lq, lk,
                                                        torch.device("cpu"), entry=b))
            want = _dropout.attention_matrix(qb, kb, 0.125, _dropout.visible(
                lq, lk, causal, window, torch.device("cpu")), drop, keep)[0]
            assert torch.equal(probs[b, :, :lq, :lk], want)
            assert not probs[b, :, lq:].any() and not probs[b, :, :, lk:].any()


def test_a_probability_too_small_to_drop_anything_runs_no_dropout():
    """p < 1/512 has threshold 0: nothing is dropped, so no state at all (the forward would
    otherwise scale O by 1 / (1 - p) while the backward, which reads threshold 0 as no
    dropout, would not)."""
    import torch

    from cudaflash import _dropout

    seed = torch.zeros(1, dtype=torch.int64)
    assert _dropout.with_seed(0.0019, seed, torch.device("cpu")) is None
    assert _dropout.with_seed(0.002, seed, torch.device("cpu")).threshold == 1


def test_a_seed_on_another_device_is_refused():
    import pytest
    import torch

    from cudaflash import _dropout

    with pytest.raises(ValueError, match="dropout_seed is on cpu but q is on meta"):
        _dropout.with_seed(0.3, torch.zeros(1, dtype=torch.int64), torch.device("meta"))


def test_padded_head_dims_keep_the_callers_s_dmask_blocks():
    """A head dim padded to the next kernel's (96 -> 128) builds S_dmask inside the padded
    call; flash-attn's tests normalize it with the caller's block size (64 for d 96, 32 for
    d 128), which _padding passes as block_head_dim."""
    import torch

    from cudaflash import _dropout

    torch.manual_seed(3)
    q, k = torch.randn(1, 40, 2, 96), torch.randn(1, 150, 2, 96)
    pad = (0, 32)
    allowed = torch.ones(40, 150, dtype=torch.bool)
    keep = torch.rand(1, 2, 40, 150) > 0.2
    want = _dropout.attention_matrix(q, k, 0.1, allowed, None, keep)
    got = _dropout.attention_matrix(torch.nn.functional.pad(q, pad),
                                    torch.nn.functional.pad(k, pad), 0.1, allowed, None, keep,
                                    block_head_dim=96)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(_dropout.attention_matrix(torch.nn.functional.pad(q, pad),
                                                        torch.nn.functional.pad(k, pad), 0.1,
                                                        allowed, None, keep), want)


def test_s_dmask_with_alibi_adds_the_bias_before_the_block_maxima():
    """S_dmask of a dropout call with ALiBi: flash-attn's kernel (and its tests'
    normalization) add the bias to the scores before the block maxima."""
    import torch

    from cudaflash import _dropout

    torch.manual_seed(4)
    q, k = torch.randn(2, 30, 2, 64), torch.randn(2, 90, 2, 64)
    slopes = torch.tensor([[0.5, 0.25], [0.125, 1.0]])
    drop = _dropout.Dropout(0.2, threshold(0.2), 1 / 0.8, torch.tensor([77], dtype=torch.int64))
    got = _dropout.attention_probs(q, k, 0.125, True, (-1, -1), drop, slopes)
    keep = _dropout.keep_mask(drop, 2, 2, 30, 90, torch.device("cpu"))
    bias = -slopes[:, :, None, None] * (torch.arange(30)[:, None] + 60
                                        - torch.arange(90)[None, :]).abs().float()
    want = _dropout.attention_matrix(q, k, 0.125, _dropout.visible(30, 90, True, (-1, -1),
                                                                   torch.device("cpu")),
                                     drop, keep, bias)
    torch.testing.assert_close(got, want)
    scores = (q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)) * 0.125 + bias
    scores = scores.masked_fill(~_dropout.visible(30, 90, True, (-1, -1),
                                                  torch.device("cpu")), float("-inf"))
    lse = scores.logsumexp(-1)
    blocks = scores.split(64, -1)
    running = torch.cummax(torch.stack([b.amax(-1) for b in blocks], -1).flip(-1),
                           -1).values.flip(-1)
    probs = torch.cat([p.abs() * torch.exp(running[..., n, None] - lse[..., None])
                       for n, p in enumerate(got.split(64, -1))], -1)
    torch.testing.assert_close(probs, scores.softmax(-1), atol=1e-6, rtol=0)


def test_the_runtime_keep_mask_is_the_reference_one_without_a_host_read():
    """cudaflash/_dropout.keep_mask (S_dmask's mask, torch ops on the seed tensor: no .item(),
    so torch.compile can trace it) draws the reference's mask, for seeds whose high word is
    set too, and does not read the seed on the host."""
    import torch

    from cudaflash import _dropout

    class NoHostRead(torch.Tensor):
        def item(self):
            raise AssertionError("keep_mask read the seed on the host")

    for seed in (7, (0x2468ACE0 << 32) | 0x13579BDF, 2**63 - 2):
        state = _dropout.with_seed(0.3, torch.tensor([seed], dtype=torch.int64)
                                   .as_subclass(NoHostRead), "cpu")
        ours = _dropout.keep_mask(state, 2, 3, 40, 72, "cpu")
        assert np.array_equal(ours.numpy(), keep_mask(seed, 0.3, 2, 3, 40, 72)), seed


def test_a_byte_read_as_an_fp16_subnormal_compares_as_the_byte():
    """The kernels' packed mask (philox.cuh, keep_pair_mask) moves each random byte into the
    low byte of a 16-bit half and compares the halves with the threshold as fp16 values
    (set.ge.u32.f16x2): that is the byte test (kept iff byte >= threshold) only because the
    patterns 0x0000-0x00FF are non-negative subnormals ordered as the integers, which IEEE
    half precision (numpy's here, the GPU's without .ftz) guarantees. Every (byte,
    threshold) pair as single fp16 values, and the prmt selectors as __byte_perm defines
    them (re-implemented here); the GPU's packed compare itself is checked by the GPU dropout
    tests, which rebuild each call's mask on the host."""
    byte = np.arange(256, dtype=np.uint16)[:, None]
    thr = np.arange(256, dtype=np.uint16)[None, :]
    as_half = byte.view(np.float16), thr.view(np.float16)
    np.testing.assert_array_equal(as_half[0] >= as_half[1], byte >= thr)
    assert not np.isnan(as_half[0]).any() and (as_half[0] >= 0).all()
    # The prmt selectors put bytes 2n and 2n + 1 of a word into halves 0 and 1.
    word = 0xD4C3B2A1
    for n, selector in ((0, 0x4140), (1, 0x4342)):
        pair = 0
        for i in range(4):  # __byte_perm(word, 0, selector): nibble i picks output byte i
            k = (selector >> (4 * i)) & 0xF
            pair |= (((word >> (8 * k)) & 0xFF) if k < 4 else 0) << (8 * i)
        assert pair & 0xFFFF == (word >> (16 * n)) & 0xFF
        assert pair >> 16 == (word >> (16 * n + 8)) & 0xFF
