"""flash_attn_with_kvcache on a GPU: each sequence of the cache, at its own length, against
the attention math in PyTorch (test_gpu_correctness's checker); the in-place append checked
position by position."""

import pytest
import torch

from cudaflash import flash_attn_func, flash_attn_with_kvcache

import _internals as internals
from test_gpu_correctness import (COMBOS, DTYPES, _combo_id, _pick_combo, check_attention,
                                  fp32_reference_without_tf32)  # noqa: F401 (autouse fixture)

pytestmark = pytest.mark.requires_gpu


def cache(b, sq, sc, h, hk, d, dtype, new=0, seed=0):
    """randn q (b, sq, h, d), caches (b, sc, hk, d) and new k, v (b, new, hk, d)."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=g, device="cuda", dtype=dtype)

    return (randn(b, sq, h, d), randn(b, sc, hk, d), randn(b, sc, hk, d), randn(b, new, hk, d),
            randn(b, new, hk, d))


def check_each_sequence(out, lse, q, k_cache, v_cache, used, causal):
    """Sequence b against keys [0, used[b]) of its cache, as its own batch-1 problem."""
    for b, n in enumerate(used):
        check_attention(out[b:b + 1], lse[b:b + 1], q[b:b + 1], k_cache[b:b + 1, :n],
                        v_cache[b:b + 1, :n], causal)


def assert_appended(k_cache, v_cache, k_before, v_before, k, v, lens):
    """The caches hold k, v at positions lens[b] to lens[b] + seqlen_new - 1 of sequence b and
    their contents from before (k_before, v_before) everywhere else."""
    new = k.shape[1]
    for b, n in enumerate(lens):
        assert torch.equal(k_cache[b, n:n + new], k[b]) and torch.equal(v_cache[b, n:n + new], v[b])
        for cache, before in ((k_cache, k_before), (v_cache, v_before)):
            assert torch.equal(cache[b, :n], before[b, :n])
            assert torch.equal(cache[b, n + new:], before[b, n + new:])


# (seqlen_q, seqlen_cache, nheads, nheads_k, cache lengths per sequence)
SHAPES = [
    (1, 300, 4, 2, [0, 1, 299, 300, 77]),  # decoding (GQA): an empty and a full cache
    (1, 4096, 8, 1, [4096, 1000, 17]),  # long cache, MQA: the grid is small, so it splits
    (7, 257, 3, 3, [7, 100, 257, 3]),  # a chunk of queries; fewer keys than queries (row 3..)
    (130, 1000, 2, 2, [130, 999, 500]),  # several query blocks, blocks on the diagonal
]


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"q{s[0]}_c{s[1]}_h{s[2]}_hk{s[3]}")
@pytest.mark.parametrize("combo", COMBOS, ids=_combo_id)
def test_cache_lengths(combo, shape, causal):
    sq, sc, h, hk, lens = shape
    dtype, d = combo
    q, kc, vc, _, _ = cache(len(lens), sq, sc, h, hk, d, DTYPES[dtype], seed=sc)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=causal,
                                       return_softmax_lse=True)
    check_each_sequence(out, lse, q, kc, vc, lens, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("combo", COMBOS, ids=_combo_id)
def test_append_at_each_sequence_position(combo, causal):
    dtype, d = combo
    lens, new, sc = [0, 5, 40, 61], 3, 64
    q, kc, vc, k, v = cache(len(lens), 2, sc, 4, 2, d, DTYPES[dtype], new=new, seed=1)
    kc0, vc0 = kc.clone(), vc.clone()
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=causal,
                                       return_softmax_lse=True)
    assert_appended(kc, vc, kc0, vc0, k, v, lens)
    assert seqlens.tolist() == lens, "cache_seqlens is not updated (flash-attn's contract)"
    check_each_sequence(out, lse, q, kc, vc, [n + new for n in lens], causal)


def test_int_cache_seqlens_is_a_prefix_of_every_sequence():
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, kc, vc, k, v = cache(3, 4, 100, 4, 4, d, DTYPES[dtype], new=4, seed=2)
    kc0 = kc.clone()
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=50, causal=True,
                                       return_softmax_lse=True)
    assert torch.equal(kc[:, 50:54], k) and torch.equal(kc[:, 54:], kc0[:, 54:])
    check_each_sequence(out, lse, q, kc, vc, [54] * 3, True)
    # The same prefix as a tensor of equal lengths over a cache of that length: the same
    # kernel and split count on the same keys, so the same bits.
    same = flash_attn_with_kvcache(q, kc[:, :54], vc[:, :54], cache_seqlens=torch.full(
        (3,), 54, dtype=torch.int32, device="cuda"), causal=True)
    assert torch.equal(same, out)


def test_full_cache_matches_flash_attn_func():
    dtype, d = _pick_combo(("fp16", 64), *COMBOS)
    q, kc, vc, _, _ = cache(2, 1, 2048, 8, 2, d, DTYPES[dtype], seed=3)
    full = torch.full((2,), 2048, dtype=torch.int32, device="cuda")
    for cache_seqlens in (None, full):
        out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=cache_seqlens)
        assert torch.equal(out, flash_attn_func(q, kc, vc))


def test_num_splits_changes_the_order_only():
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    lens = [3000, 1, 1500]
    q, kc, vc, _, _ = cache(3, 1, 3000, 8, 2, d, DTYPES[dtype], seed=4)
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    one, lse1 = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=1,
                                        return_softmax_lse=True)
    five, lse5 = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, num_splits=5,
                                         return_softmax_lse=True)
    check_each_sequence(five, lse5, q, kc, vc, lens, False)
    assert (one.float() - five.float()).abs().max().item() < 1e-2
    assert torch.allclose(lse1, lse5, atol=1e-4, rtol=0)


def test_append_out_of_bounds_is_refused_and_leaves_the_cache():
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, kc, vc, k, v = cache(2, 1, 32, 2, 2, d, DTYPES[dtype], new=4, seed=5)
    kc0 = kc.clone()
    for lens, values in (([10, 29], "[10, 29]"), ([-1, 3], "[-1, 3]")):
        seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        with pytest.raises(ValueError, match=rf"cache_seqlens holds values in \{values}; with "
                                             r"4 new positions they must be in \[0, 28\]"):
            flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens)
    with pytest.raises(ValueError, match=r"cache_seqlens=29; it must be None, a \(batch,\) "
                                         r"int32 tensor or an int in \[0, 28\]"):
        flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=29)
    assert torch.equal(kc, kc0)


@pytest.mark.parametrize("bad,error,match", [
    (torch.tensor([1, 2], dtype=torch.int64), TypeError, "cache_seqlens has dtype torch.int64"),
    (torch.tensor([1, 2, 3], dtype=torch.int32), ValueError,
     r"cache_seqlens has shape \(3,\); it must be \(batch,\) = \(2,\)"),
])
def test_bad_cache_seqlens_tensor(bad, error, match):
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, kc, vc, _, _ = cache(2, 1, 32, 2, 2, d, DTYPES[dtype])
    with pytest.raises(error, match=match):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=bad.cuda())


def test_lengths_out_of_range_are_clamped_not_a_fault():
    """Without an append nothing reads cache_seqlens on the host; the kernel clamps each
    length into [0, seqlen_cache], so the call runs and the GPU stays fine."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, kc, vc, _, _ = cache(2, 1, 64, 2, 2, d, DTYPES[dtype], seed=6)
    bad = torch.tensor([-5, 10**9], dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=bad, return_softmax_lse=True)
    torch.cuda.synchronize()
    check_each_sequence(out, lse, q, kc, vc, [0, 64], False)


def test_debug_checks_the_lengths(monkeypatch):
    monkeypatch.setenv("CUDAFLASH_DEBUG", "1")
    internals.clear_caches()
    try:
        dtype, d = _pick_combo(("bf16", 128), *COMBOS)
        q, kc, vc, _, _ = cache(2, 1, 64, 2, 2, d, DTYPES[dtype], seed=7)
        bad = torch.tensor([3, 65], dtype=torch.int32, device="cuda")
        with pytest.raises(ValueError, match=r"cache_seqlens holds values in \[3, 65\]"):
            flash_attn_with_kvcache(q, kc, vc, cache_seqlens=bad)
    finally:
        monkeypatch.delenv("CUDAFLASH_DEBUG")
        internals.clear_caches()


def test_cuda_graph_capture_and_replay():
    """The decoding step of a server: lengths in a tensor the graph reads at replay."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, kc, vc, _, _ = cache(4, 1, 512, 8, 2, d, DTYPES[dtype], seed=8)
    seqlens = torch.tensor([1, 100, 300, 512], dtype=torch.int32, device="cuda")
    flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)  # load the module outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)
    seqlens.copy_(torch.tensor([512, 7, 0, 64], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    _, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, return_softmax_lse=True)
    check_each_sequence(out, lse, q, kc, vc, [512, 7, 0, 64], False)


def test_repeat_calls_take_new_lengths_and_tensors():
    """The second call of a signature takes the cached plan: it must still read this call's
    tensors and lengths, and still refuse what the plan cannot serve."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    for seed, lens in enumerate(([5, 300, 1], [300, 0, 77], [1, 1, 1])):
        q, kc, vc, _, _ = cache(3, 1, 300, 8, 2, d, DTYPES[dtype], seed=10 + seed)
        seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens,
                                           return_softmax_lse=True)
        check_each_sequence(out, lse, q, kc, vc, lens, False)
    assert internals.kvcache_plans, "the decoding step should have recorded a plan"
    # A q that requires grad (grad mode): not served by the plan as an out without a
    # grad_fn; the call runs as without gradients and its out's backward raises.
    out, _ = flash_attn_with_kvcache(q.clone().requires_grad_(True), kc, vc,
                                     cache_seqlens=seqlens, return_softmax_lse=True)
    assert out.requires_grad
    with pytest.raises(NotImplementedError, match="flash_attn_with_kvcache has no backward"):
        out.float().sum().backward()


def test_append_with_tensor_lengths_is_captured_in_a_graph():
    """The append runs on the GPU (no host read): captured once, replayed at new lengths."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, kc, vc, k, v = cache(2, 1, 64, 2, 2, d, DTYPES[dtype], new=1, seed=9)
    seqlens = torch.tensor([3, 9], dtype=torch.int32, device="cuda")
    flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)  # load the module outside
    kc0, vc0 = kc.clone(), vc.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens)
    torch.cuda.synchronize()
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0), "capturing ran the append"
    for lens in ([3, 9], [40, 0]):
        seqlens.copy_(torch.tensor(lens, dtype=torch.int32))
        kc_before, vc_before = kc.clone(), vc.clone()
        graph.replay()
        torch.cuda.synchronize()
        assert_appended(kc, vc, kc_before, vc_before, k, v, lens)
        lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens + 1,
                                      return_softmax_lse=True)[1]
        check_each_sequence(out, lse, q, kc, vc, [n + 1 for n in lens], False)


def test_a_call_that_cannot_run_leaves_the_cache(monkeypatch):
    """The kernel is selected before the append: when selection fails (no kernel for this
    problem on this GPU, a module that does not load), the cache is untouched."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, kc, vc, k, v = cache(1, 1, 16, 2, 2, d, DTYPES[dtype], new=1)
    kc0, vc0 = kc.clone(), vc.clone()

    def no_kernel(*args, **kwargs):
        raise ValueError("no kernel (test)")

    internals.replace_auto_kernel(monkeypatch, no_kernel)
    for lengths in (3, torch.tensor([3], dtype=torch.int32, device="cuda")):
        with pytest.raises(ValueError, match=r"no kernel \(test\)"):
            flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lengths)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
