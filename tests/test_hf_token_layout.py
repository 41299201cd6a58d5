"""The transformers integration's conversion of padded batches to packed ones
(cudaflash/integrations/_token_layout.py), on CPU tensors: no transformers, no GPU.

The claim under test (the module's docstring argues it): attention over the packed real
tokens, causal aligned to each packed sequence's bottom-right corner, equals attention over
the padded batch under the mask transformers means (a key is visible when it is real and
its absolute position is at most the query's, and within the sliding window), on every
real query row; whatever the padding (left, right, holes), the cache offsets and a static
cache's empty slots.
"""

import pytest
import torch

import _flash_reference as reference
from cudaflash.integrations import _token_layout as tl


def masked_reference(q, k, v, allowed, scale=None, softcap=0.0):
    """Attention over (batch, seqlen, heads, d) q, k, v under a (batch, q_len, kv_len) mask of
    visible keys, float32."""
    groups = q.shape[2] // k.shape[2]
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))
    kf, vf = kf.repeat_interleave(groups, 1), vf.repeat_interleave(groups, 1)
    scores = qf @ kf.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return (scores.softmax(-1) @ vf).transpose(1, 2)


def transformers_mask(attention_mask, q_positions, kv_length, kv_offset, window=None):
    """(batch, q_len, kv_len) visible keys as transformers' causal (sliding) masks define
    them, by absolute position."""
    key_pos = torch.arange(kv_length) + kv_offset
    padded = torch.nn.functional.pad(attention_mask.bool(),
                                     (0, max(0, kv_offset + kv_length - attention_mask.shape[1])))
    allowed = padded[:, None, key_pos] & (key_pos[None, None, :] <= q_positions[None, :, None])
    if window is not None:
        allowed &= key_pos[None, None, :] > q_positions[None, :, None] - window
    return allowed


def run_packed(q, k, v, layout, causal=True, window_size=(-1, -1), softcap=0.0):
    p = layout.packed()
    out = reference.varlen_attention(tl.gather(q, p.q_rows), tl.gather(k, p.k_rows),
                                     tl.gather(v, p.k_rows), p.cu_seqlens_q, p.cu_seqlens_k,
                                     p.max_seqlen_q, p.max_seqlen_k, causal=causal,
                                     window_size=window_size, softcap=softcap)
    return tl.scatter(out, p.q_rows, q.shape[0], q.shape[1])


def qkv(batch, q_len, kv_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_len, 4, 16, generator=g)
    k = torch.randn(batch, kv_len, 2, 16, generator=g)
    v = torch.randn(batch, kv_len, 2, 16, generator=g)
    return q * 2, k, v  # sharper attention: a wrong key shows


MASKS = {  # (batch, 12) 2D masks: real tokens
    "left": [[1] * 12, [0] * 5 + [1] * 7, [0] * 11 + [1]],
    "right": [[1] * 12, [1] * 7 + [0] * 5, [1] + [0] * 11],
    "holes": [[1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1], [0] * 3 + [1] * 9, [1] * 12],
}


@pytest.mark.parametrize("kind", list(MASKS))
def test_prefill_packed_equals_masked(kind):
    mask = torch.tensor(MASKS[kind])
    q, k, v = qkv(3, 12, 12)
    positions = tl.query_positions("cpu", 12, 0)
    layout = tl.token_layout(mask, positions, 12, 0, causal=True, batch_size=3)
    assert torch.equal(layout.key_valid, mask.bool()) and torch.equal(layout.query_valid,
                                                                       mask.bool())
    assert not layout.dense()
    got = run_packed(q, k, v, layout, softcap=3.0)
    want = masked_reference(q, k, v, transformers_mask(mask, positions, 12, 0), softcap=3.0)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    assert (got[~real] == 0).all()  # padding rows: zeros


@pytest.mark.parametrize("kind", ["left", "right"])
def test_window_counts_positions_where_real_tokens_are_contiguous(kind):
    mask = torch.tensor(MASKS[kind])
    q, k, v = qkv(3, 12, 12, seed=1)
    positions = tl.query_positions("cpu", 12, 0)
    layout = tl.token_layout(mask, positions, 12, 0, causal=True, batch_size=3)
    window = 4  # transformers' W: itself and 3 keys before -> flash-attn's (3, 0)
    got = run_packed(q, k, v, layout, window_size=(window - 1, 0))
    want = masked_reference(q, k, v, transformers_mask(mask, positions, 12, 0, window))
    torch.testing.assert_close(got[mask.bool()], want[mask.bool()], atol=1e-5, rtol=1e-5)


def test_decoding_step_with_left_padding():
    """One new token per row against a cache of 11: keys at positions 0..11, the query at 11."""
    mask = torch.tensor(MASKS["left"])
    q, k, v = qkv(3, 1, 12, seed=2)
    positions = tl.query_positions("cpu", 1, 11)
    layout = tl.token_layout(mask, positions, 12, 0, causal=True, batch_size=3)
    assert layout.query_valid.all() and not layout.dense()
    got = run_packed(q, k, v, layout)
    want = masked_reference(q, k, v, transformers_mask(mask, positions, 12, 0))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_static_cache_slots_past_the_last_query_are_dropped():
    """A static cache of 20 slots, 12 filled (the last 3 new): keys 12..19 are empty slots;
    q_offset arrives as a tensor (StaticLayer's cumulative length)."""
    mask = torch.tensor(MASKS["left"])  # (batch, past + new) = 12 positions
    q, k, v = qkv(3, 3, 20, seed=3)
    positions = tl.query_positions("cpu", 3, torch.tensor(9))
    layout = tl.token_layout(mask, positions, 20, 0, causal=True, batch_size=3)
    assert not layout.key_valid[:, 12:].any()
    got = run_packed(q, k, v, layout)
    want = masked_reference(q, k, v, transformers_mask(mask, positions, 20, 0))
    real = mask[:, 9:].bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    # the same without a padding mask: only the slots decide
    layout = tl.token_layout(None, positions, 20, 0, causal=True, batch_size=3)
    assert layout.key_valid[:, :12].all() and not layout.key_valid[:, 12:].any()
    assert not layout.dense()


def test_sliding_cache_offset():
    """A sliding-window cache holding positions 6..11 (kv_offset 6) and one new query at 11:
    the mask is indexed by absolute position."""
    mask = torch.tensor(MASKS["left"])
    q, k, v = qkv(3, 1, 6, seed=4)
    positions = tl.query_positions("cpu", 1, 11)
    layout = tl.token_layout(mask, positions, 6, 6, causal=True, batch_size=3)
    assert torch.equal(layout.key_valid, mask[:, 6:].bool())
    got = run_packed(q, k, v, layout, window_size=(5, 0))
    want = masked_reference(q, k, v, transformers_mask(mask, positions, 6, 6, window=6))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_cache_position_convention_equals_q_offset():
    a = tl.query_positions("cpu", cache_position=torch.arange(4, 9))
    b = tl.query_positions("cpu", 5, 4)
    assert torch.equal(a, b)


def test_dense_batch():
    mask = torch.ones(2, 8, dtype=torch.long)
    positions = tl.query_positions("cpu", 8, 0)
    assert tl.token_layout(mask, positions, 8, 0, True, 2).dense()
    assert tl.token_layout(None, positions, 8, 0, True, 2).dense()
    # keys past the last query: not dense although every key is real
    assert not tl.token_layout(None, tl.query_positions("cpu", 4, 0), 8, 0, True, 2).dense()


def test_bidirectional_keeps_every_query():
    mask = torch.tensor(MASKS["right"])
    q, k, v = qkv(3, 12, 12, seed=5)
    layout = tl.token_layout(mask, tl.query_positions("cpu", 12, 0), 12, 0, causal=False,
                             batch_size=3)
    assert layout.query_valid.all()
    got = run_packed(q, k, v, layout, causal=False)
    allowed = mask.bool()[:, None, :].expand(3, 12, 12)
    torch.testing.assert_close(got, masked_reference(q, k, v, allowed), atol=1e-5, rtol=1e-5)


def test_packing_offsets_and_round_trip():
    mask = torch.tensor(MASKS["holes"])
    positions = tl.query_positions("cpu", 12, 0)
    layout = tl.token_layout(mask, positions, 12, 0, causal=True, batch_size=3)
    p = layout.packed()
    assert p.cu_seqlens_q.dtype == torch.int32
    assert p.cu_seqlens_q.tolist() == [0, 8, 17, 29] == p.cu_seqlens_k.tolist()
    assert (p.max_seqlen_q, p.max_seqlen_k) == (12, 12)
    assert layout.packed() is p  # once per layout
    x = torch.randn(3, 12, 2, 4)
    back = tl.scatter(tl.gather(x, p.q_rows), p.q_rows, 3, 12)
    assert torch.equal(back[mask.bool()], x[mask.bool()]) and (back[~mask.bool()] == 0).all()


def test_a_wrong_layout_fails_the_comparison():
    """Test the tester: ignoring the padding of a left-padded batch changes real rows."""
    mask = torch.tensor(MASKS["left"])
    q, k, v = qkv(3, 12, 12)
    positions = tl.query_positions("cpu", 12, 0)
    everything = tl.token_layout(None, positions, 12, 0, causal=True, batch_size=3)
    got = run_packed(q, k, v, everything)
    want = masked_reference(q, k, v, transformers_mask(mask, positions, 12, 0))
    real = mask.bool()
    assert not torch.allclose(got[real], want[real], atol=1e-3)
