"""Head dims without a kernel of their own (anything in [1, 256] but 64, 128 and 256): the
public functions run them zero-padded to the next built head dim, as flash-attn takes any
head dim up to 256. Each form (forward, gradients, varlen, kvcache with an append, the
packed functions, torch.compile) against the float32 reference at the caller's head dim.
"""

import pytest
import torch

from cudaflash import (flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                       flash_attn_with_kvcache)
from cudaflash.config import D_HEADS
import _internals as internals
from test_gpu_backward import assert_compiled_matches_eager, check_grads, run_with_grad
from test_gpu_correctness import COMBOS, DTYPES, _pick_combo, check_attention, make_qkv
from test_gpu_kvcache import assert_appended, cache, check_each_sequence
from test_gpu_varlen import check_varlen, packed

pytestmark = pytest.mark.requires_gpu

# Below, between and above the built 64, 128: the common model head dims (32 BERT-tiny, 40
# and 80 and 160 Stable Diffusion, 96 Phi-3, 192), the smallest (1, 8) and an odd one (100).
HEAD_DIMS = [1, 8, 32, 40, 80, 96, 100, 160, 192]


def _dtype_with(d: int) -> torch.dtype:
    """A dtype whose kernels at head dim ``d`` padded (the next built one) run on this GPU."""
    padded = next(x for x in D_HEADS if x >= d)
    for dtype in ("bf16", "fp16"):
        if (dtype, padded) in COMBOS:
            return DTYPES[dtype]
    pytest.skip(f"no kernel with head dim {padded} is built for this GPU (built: {COMBOS})")


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("d", HEAD_DIMS)
def test_forward(d, causal):
    dtype = _dtype_with(d)
    q, k, v = make_qkv(2, 113, 300, 4, 2, d, dtype, seed=d)
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    check_attention(out, lse, q, k, v, causal)
    # The scale is the caller's head dim's unless given: an explicit one is kept.
    out = flash_attn_func(q, k, v, softmax_scale=0.3, causal=causal)
    check_attention(out, None, q, k, v, causal, scale=0.3)


def test_repeat_calls_take_the_padded_signatures_plan():
    dtype = _dtype_with(96)
    q, k, v = make_qkv(1, 64, 64, 2, 2, 96, dtype, seed=5)
    internals.clear_caches()
    first = flash_attn_func(q, k, v)
    plans = len(internals.plans)
    assert plans == 1  # the padded (d = 128) call's plan
    assert torch.equal(flash_attn_func(q, k, v), first)
    assert len(internals.plans) == plans


def test_non_unit_last_stride_is_fine_when_padded():
    # Padding copies, so the kernels' stride rules do not reach the caller's tensors.
    dtype = _dtype_with(96)
    q, k, v = make_qkv(1, 100, 100, 2, 2, 96, dtype, seed=6)
    qt = q.transpose(1, 3).contiguous().transpose(1, 3)  # last stride != 1
    assert qt.stride(-1) != 1
    check_attention(flash_attn_func(qt, k, v), None, q, k, v, False)


def test_non_unit_last_stride_is_copied_at_kernel_head_dims():
    """flash-attn copies a q, k or v with a strided head dim (maybe_contiguous); so does
    cudaflash, in every function, and the gradients reach the caller's tensors."""
    dtype, d = _pick_combo(("bf16", 64), ("fp16", 64))
    q, k, v = make_qkv(2, 100, 130, 2, 2, d, DTYPES[dtype], seed=7)
    strided = [t.transpose(1, 3).contiguous().transpose(1, 3) for t in (q, k, v)]
    assert all(t.stride(-1) != 1 for t in strided)
    assert torch.equal(flash_attn_func(*strided, causal=True), flash_attn_func(q, k, v, causal=True))
    dout = torch.randn_like(q)
    out, grads = run_with_grad(*strided, dout, causal=True)  # (its clones keep the strides)
    check_attention(out, None, q, k, v, True)
    check_grads(grads, q, k, v, dout, True)
    cu = torch.tensor([0, 100, 200], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 130, 260], dtype=torch.int32, device="cuda")
    flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
    flat_strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in flat]
    assert torch.equal(flash_attn_varlen_func(*flat_strided, cu, cu_k, 100, 130),
                       flash_attn_varlen_func(*flat, cu, cu_k, 100, 130))
    lengths = torch.tensor([130, 64], dtype=torch.int32, device="cuda")
    assert torch.equal(flash_attn_with_kvcache(strided[0][:, :1], k, v, cache_seqlens=lengths),
                       flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=lengths))


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("d", [32, 80, 96])
def test_gradients(d, causal):
    dtype = _dtype_with(d)
    q, k, v = make_qkv(2, 113, 200, 4, 2, d, dtype, seed=d + 1)
    dout = torch.randn_like(q)
    out, grads = run_with_grad(q, k, v, dout, causal=causal)
    check_attention(out, None, q, k, v, causal)
    check_grads(grads, q, k, v, dout, causal)


def test_gradients_with_a_window():
    dtype = _dtype_with(96)
    q, k, v = make_qkv(1, 300, 300, 2, 2, 96, dtype, seed=7)
    dout = torch.randn_like(q)
    out, grads = run_with_grad(q, k, v, dout, window_size=(40, 0), deterministic=True)
    # The same window through a built head dim: q, k, v padded by hand give the same numbers.
    pad = (0, 32)
    ref_out, ref_grads = run_with_grad(*(torch.nn.functional.pad(t, pad) for t in (q, k, v)),
                                       torch.nn.functional.pad(dout, pad), window_size=(40, 0),
                                       softmax_scale=96 ** -0.5, deterministic=True)
    assert torch.equal(out, ref_out[..., :96])
    for ours, ref in zip(grads, ref_grads):
        assert torch.equal(ours, ref[..., :96])


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_varlen(causal):
    dtype = _dtype_with(96)
    q, k, v, cu_q, cu_k = packed([113, 1, 300, 0], [113, 50, 300, 7], 4, 2, 80, dtype, seed=8)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 300, 300, causal=causal,
                                         return_attn_probs=True)
    check_varlen(out, lse, q, k, v, cu_q, cu_k, causal)


def test_kvcache_append_reaches_the_callers_cache():
    dtype = _dtype_with(96)
    lens, new = [0, 5, 40, 61], 3
    q, kc, vc, k, v = cache(len(lens), 2, 64, 4, 2, 96, dtype, new=new, seed=9)
    kc0, vc0 = kc.clone(), vc.clone()
    seqlens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=True,
                                       return_softmax_lse=True)
    assert_appended(kc, vc, kc0, vc0, k, v, lens)
    check_each_sequence(out, lse, q, kc, vc, [n + new for n in lens], True)


def test_kvcache_append_out_of_bounds_leaves_the_cache():
    dtype = _dtype_with(96)
    q, kc, vc, k, v = cache(2, 1, 16, 2, 2, 96, dtype, new=4, seed=10)
    kc0, vc0 = kc.clone(), vc.clone()
    with pytest.raises(ValueError, match="cache_seqlens"):
        flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=14)
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)


def test_qkvpacked():
    dtype = _dtype_with(96)
    g = torch.Generator(device="cuda").manual_seed(11)
    qkv = torch.randn(2, 100, 3, 4, 96, generator=g, device="cuda", dtype=dtype)
    out = flash_attn_qkvpacked_func(qkv, causal=True)
    q, k, v = qkv.unbind(2)
    check_attention(out, None, q, k, v, True)


def test_torch_compile_matches_eager():
    dtype = _dtype_with(96)
    q, k, v = make_qkv(2, 128, 128, 4, 2, 96, dtype, seed=12)
    assert_compiled_matches_eager(q, k, v, torch.randn_like(q), causal=True, deterministic=True)
