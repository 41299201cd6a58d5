"""Softcapping (softcap = c > 0: the scaled scores become c * tanh(scores / c) before the
softmax, as in Gemma 2 and Grok) on a GPU: every built kernel config's softcap entries, whole
and split, then flash_attn_func (plans, decoding, padded head dims, torch.compile),
flash_attn_varlen_func and flash_attn_with_kvcache, against the attention math in PyTorch
with the cap, under FlashAttention's accuracy rule (test_gpu_correctness); gradients (every
backward module's softcap entries, varlen, a window, torch.compile) against autograd through
that math.

The inputs' scores are made large (softmax_scale = 4 / sqrt(d): a standard deviation of about
4) so that each cap changes the answer far beyond the rule's bound; assert_cap_matters checks
that, so a kernel that ignored the cap would fail here."""

import math

import pytest
import torch

from cudaflash import (flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache,
                       forward)
import _internals as internals
from test_gpu_correctness import (COMBOS, DTYPES, KERNELS, _combo_id, _pick_combo, attention_ref,
                                  check_attention, fp32_reference_without_tf32,  # noqa: F401
                                  make_qkv)
from test_gpu_backward import (BWD_COMBOS, assert_compiled_matches_eager, assert_grads_within,
                               for_each_backward_module, run_with_grad)
from test_gpu_varlen import packed
from test_gpu_window import window_ref

pytestmark = pytest.mark.requires_gpu

CAPS = [1.0, 8.0]


def big_scale(d):
    return 4.0 / math.sqrt(d)


def assert_cap_matters(out, q, k, v, causal, scale, min_change=0.05):
    """out is far from the uncapped answer (float32 reference): the cap took effect."""
    uncapped, _ = attention_ref(q, k, v, causal, scale, True)
    change = (out.float() - uncapped).abs().max().item()
    assert change > min_change, (f"out is within {change:.3g} of the uncapped attention: the "
                                 "cap had no visible effect")


# (batch, seqlen_q, seqlen_k, nheads, nheads_k, causal)
CONFIG_SHAPES = [
    (2, 113, 300, 3, 3, False),  # tails in both sequences
    (1, 300, 17, 2, 1, True),  # rows that see no key (out 0, lse -inf), MQA
    (2, 1, 1000, 8, 2, True),  # decoding with GQA: query heads as rows of one head
]


@pytest.mark.parametrize("splits", [1, 3], ids=["whole", "split3"])
@pytest.mark.parametrize("shape", CONFIG_SHAPES,
                         ids=lambda s: "b{}_q{}_k{}_h{}_hk{}_causal{}".format(*s))
@pytest.mark.parametrize("entry", KERNELS, ids=lambda e: e.name)
def test_config(entry, shape, splits):
    """Each config's cudaflash_fwd_softcap, and cudaflash_fwd_split_softcap + combine."""
    b, sq, sk, h, hk, causal = shape
    cfg = entry.config
    q, k, v = make_qkv(b, sq, sk, h, hk, cfg.d_head, DTYPES[cfg.dtype], seed=sq + sk)
    scale, cap = big_scale(cfg.d_head), 2.0
    out = torch.full_like(q, math.nan)  # every element must be written
    _, lse = forward(cfg, q, k, v, out=out, softmax_scale=scale, causal=causal,
                     num_splits=splits, softcap=cap)
    check_attention(out, lse, q, k, v, causal, scale, softcap=cap)
    assert_cap_matters(out, q, k, v, causal, scale)


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("combo", COMBOS, ids=_combo_id)
def test_flash_attn_func(combo, causal, cap):
    dtype, d = DTYPES[combo[0]], combo[1]
    q, k, v = make_qkv(2, 257, 300, 8, 2, d, dtype, seed=11)
    scale = big_scale(d)
    out, lse, _ = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, softcap=cap,
                                  return_attn_probs=True)
    check_attention(out, lse, q, k, v, causal, scale, softcap=cap)
    assert_cap_matters(out, q, k, v, causal, scale)


def test_plans_keep_capped_and_uncapped_calls_apart():
    """Repeat calls take plans keyed with the cap: the same tensors with and without a cap
    (and with another cap), each twice, each against its own reference."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v = make_qkv(1, 200, 200, 4, 4, d, DTYPES[dtype], seed=5)
    scale = big_scale(d)
    internals.clear_caches()
    for cap in (2.0, 0.0, 8.0, 2.0, 0.0):
        results = [flash_attn_func(q, k, v, softmax_scale=scale, softcap=cap) for _ in range(2)]
        assert torch.equal(results[0], results[1])
        check_attention(results[0], None, q, k, v, False, scale, softcap=cap)
    assert sum(1 for key in internals.plans if isinstance(key[0], tuple) and key[2] == 2.0) == 1


@pytest.mark.parametrize("dims", [(1, 1, 8193, 16, 1), (2, 1, 1000, 8, 2), (1, 4, 5000, 4, 4)],
                         ids=["mqa_long", "gqa", "four_rows"])
def test_decoding_splits(dims):
    """Decoding grids are split by flash_attn_func's own rule: the split softcap entry."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v = make_qkv(*dims, d, DTYPES[dtype], seed=3)
    scale = big_scale(d)
    out, lse, _ = flash_attn_func(q, k, v, softmax_scale=scale, causal=True, softcap=4.0,
                                  return_attn_probs=True)
    check_attention(out, lse, q, k, v, True, scale, softcap=4.0)
    assert_cap_matters(out, q, k, v, True, scale)


def test_padded_head_dim():
    """A head dim without a kernel (96) runs zero-padded; the cap goes along."""
    dtype = DTYPES[_pick_combo(("bf16", 128), *COMBOS)[0]]
    q, k, v = make_qkv(2, 130, 130, 4, 2, 96, dtype, seed=9)
    scale = big_scale(96)
    out, lse, _ = flash_attn_func(q, k, v, softmax_scale=scale, causal=True, softcap=2.0,
                                  return_attn_probs=True)
    check_attention(out, lse, q, k, v, True, scale, softcap=2.0)
    assert_cap_matters(out, q, k, v, True, scale)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("shape", [([17, 200, 5, 40], [1000, 50, 0, 40], 3, 3),
                                   ([1, 1, 1], [4096, 17, 2049], 8, 2)],
                         ids=["prefill", "decode"])
def test_varlen(shape, causal):
    lens_q, lens_k, h, hk = shape
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, h, hk, d, DTYPES[dtype], seed=2)
    scale = big_scale(d)
    for _ in range(2):  # the second call takes the plan
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                             softmax_scale=scale, causal=causal, softcap=2.0,
                                             return_attn_probs=True)
        oq, ok = cu_q.tolist(), cu_k.tolist()
        for b in range(len(lens_q)):
            rows, keys = slice(oq[b], oq[b + 1]), slice(ok[b], ok[b + 1])
            check_attention(out[rows][None], lse[:, rows][None], q[rows][None],
                            k[keys][None], v[keys][None], causal, scale, softcap=2.0)
    uncapped = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                      softmax_scale=scale, causal=causal)
    assert (uncapped.float() - out.float()).abs().max().item() > 0.05


def test_kvcache():
    """Decoding steps against a cache, with a cap and then without: the uncapped steps take
    a plan, which must not be a capped call's."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    g = torch.Generator(device="cuda").manual_seed(4)
    lens = [4096, 1000, 17]
    q = torch.randn(3, 1, 8, d, generator=g, device="cuda", dtype=DTYPES[dtype])
    kc, vc = (torch.randn(3, 4096, 2, d, generator=g, device="cuda", dtype=DTYPES[dtype])
              for _ in range(2))
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    scale = big_scale(d)
    internals.clear_caches()
    for cap in (2.0, 0.0, 0.0, 2.0):
        out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, softmax_scale=scale,
                                           causal=True, softcap=cap, return_softmax_lse=True)
        for b, n in enumerate(lens):
            check_attention(out[b:b + 1], lse[b:b + 1], q[b:b + 1], kc[b:b + 1, :n],
                            vc[b:b + 1, :n], True, scale, softcap=cap)


def test_torch_compile_fullgraph():
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v = make_qkv(2, 257, 300, 4, 2, d, DTYPES[dtype], seed=8)
    scale = big_scale(d)

    def attention(q, k, v):
        out, lse, _ = flash_attn_func(q, k, v, softmax_scale=scale, causal=True, softcap=2.0,
                                      return_attn_probs=True)
        return out, lse

    out, lse = torch.compile(attention, fullgraph=True)(q, k, v)
    check_attention(out, lse, q, k, v, True, scale, softcap=2.0)
    eager_out, eager_lse = attention(q, k, v)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)


def reference_grads(q, k, v, dout, causal, scale, cap, upcast, window=(-1, -1)):
    """(dq, dk, dv) of the capped attention math by autograd (float32 or q's dtype)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if window == (-1, -1):
        out, _ = attention_ref(*leaves, causal, scale, upcast, softcap=cap)
    else:
        out, _ = window_ref(*leaves, *window, causal, upcast, scale=scale, softcap=cap)
    out.backward(dout.float() if upcast else dout)
    return [t.grad for t in leaves]


def check_grads(q, k, v, dout, causal, scale, cap, window=(-1, -1), **kwargs):
    """flash_attn_func's gradients with the cap against autograd through the capped math,
    and far from the uncapped ones (so an ignored cap in the backward fails)."""
    out, grads = run_with_grad(q, k, v, dout, causal=causal, softmax_scale=scale, softcap=cap,
                               window_size=window, **kwargs)
    ref = reference_grads(q, k, v, dout, causal, scale, cap, True, window)
    lowp = reference_grads(q, k, v, dout, causal, scale, cap, False, window)
    assert_grads_within(grads, ref, lowp, (q, k, v))
    uncapped = reference_grads(q, k, v, dout, causal, scale, 0.0, True, window)
    change = max((g.float() - u).abs().max().item() for g, u in zip(grads, uncapped))
    assert change > 0.05, f"the gradients are within {change:.3g} of the uncapped ones"
    return out, grads


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_asked", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("dims", [(2, 257, 300, 4, 2), (1, 700, 700, 2, 2)],
                         ids=["gqa_tails", "several_tiles"])
@pytest.mark.parametrize("combo", BWD_COMBOS, ids=_combo_id)
def test_gradients(combo, dims, causal, deterministic):
    """Gradients with a cap, in either scheme asked (a cap always runs the deterministic
    kernels' softcap entries): bitwise reproducible."""
    dtype, d = DTYPES[combo[0]], combo[1]
    q, k, v = make_qkv(*dims, d, dtype, seed=12)
    dout = torch.randn_like(q)
    scale = big_scale(d)
    _, grads = check_grads(q, k, v, dout, causal, scale, 2.0, deterministic=deterministic)
    _, again = run_with_grad(q, k, v, dout, causal=causal, softmax_scale=scale, softcap=2.0,
                             deterministic=deterministic)
    for first, second in zip(grads, again):
        assert torch.equal(first, second)


def test_gradients_with_a_window_and_under_torch_compile():
    dtype, d = _pick_combo(("bf16", 128), *BWD_COMBOS)
    q, k, v = make_qkv(1, 300, 300, 4, 2, d, DTYPES[dtype], seed=13)
    dout = torch.randn_like(q)
    scale = big_scale(d)
    check_grads(q, k, v, dout, True, scale, 2.0, window=(64, 0))
    assert_compiled_matches_eager(q, k, v, dout, causal=True, softmax_scale=scale, softcap=2.0,
                                  deterministic=True)


def test_every_backward_module_that_runs_here(monkeypatch):
    """Each shipped backward module this GPU can run (not only the selected one): its
    dkdv_scoremod and dq_scoremod entries."""
    def body(entry):
        cfg = entry.config
        q, k, v = make_qkv(1, 200, 300, 4, 2, cfg.d_head, DTYPES[cfg.dtype], seed=14)
        check_grads(q, k, v, torch.randn_like(q), True, big_scale(cfg.d_head), 2.0)

    for_each_backward_module(monkeypatch, body, plain=False)  # score modifiers


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_varlen_gradients(causal):
    lens_q, lens_k = [17, 200, 5, 40], [300, 50, 9, 40]
    dtype, d = _pick_combo(("bf16", 128), *BWD_COMBOS)
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, 4, 2, d, DTYPES[dtype], seed=15)
    dout = torch.randn_like(q)
    scale = big_scale(d)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = flash_attn_varlen_func(*leaves, cu_q, cu_k, max(lens_q), max(lens_k),
                                 softmax_scale=scale, causal=causal, softcap=2.0)
    out.backward(dout)
    oq, ok = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lens_q)):
        rows, keys = slice(oq[b], oq[b + 1]), slice(ok[b], ok[b + 1])
        one = (q[rows][None], k[keys][None], v[keys][None])
        ref = reference_grads(*one, dout[rows][None], causal, scale, 2.0, True)
        lowp = reference_grads(*one, dout[rows][None], causal, scale, 2.0, False)
        ours = (leaves[0].grad[rows][None], leaves[1].grad[keys][None],
                leaves[2].grad[keys][None])
        assert_grads_within(ours, ref, lowp, one)
