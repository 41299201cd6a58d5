"""Correctness on a GPU, against the attention math in PyTorch.

The pass rule is FlashAttention's: with ref32 the math in float32 (TF32 off) and lowp the same
math in the input dtype, ``max|ours - ref32| <= 2 * max|lowp - ref32| + 1e-5``, for out and
(on the rows that see a key) for the log-sum-exp, plus one rounding step of the stored type:
2 * max|round(ref32) - ref32|, so that on a tiny problem, where lowp can land within half an
ulp of ref32 everywhere by luck, ours is not failed for the other half (0 for float32 lse). Rows that see no key (causal with
seqlen_q > seqlen_k) must give out = 0 and lse = -inf exactly.

Every config built for this GPU runs the core shapes (explicit ``forward``, out pre-filled
with NaN); the feature matrix (layouts, GQA, scales, graphs, compile, long sequences) runs
through ``flash_attn_func`` and the config it selects. Inputs are randn with fixed seeds.
"""

import math
import shutil

import pytest
import torch

import cudaflash
from _flash_reference import alibi_bias
from conftest import gpu_skip_reason
from cudaflash import flash_attn_func, forward, manifest

import _internals as internals

pytestmark = pytest.mark.requires_gpu

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _kernels_for_this_gpu():
    """Collected at import: one entry per config usable on cuda:0 (none without a GPU)."""
    if gpu_skip_reason() is not None:
        return []
    try:
        return cudaflash.list_kernels(0)
    except RuntimeError:  # no kernels: test_kernels_are_built reports it
        return []


KERNELS = _kernels_for_this_gpu()
COMBOS = sorted({(e.config.dtype, e.config.d_head) for e in KERNELS})


def _combo_id(combo):
    return f"{combo[0]}_d{combo[1]}"


def _pick_combo(*preferred):
    for combo in preferred:
        if combo in COMBOS:
            return combo
    pytest.skip(f"none of {preferred} is built for this GPU (built: {COMBOS})")


@pytest.fixture(autouse=True, scope="module")
def fp32_reference_without_tf32():
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(old)


# ---- inputs, reference and the checker --------------------------------------------------------


def make_qkv(b, sq, sk, h, hk, d, dtype, seed=0):
    """randn q (b, sq, h, d) and k, v (b, sk, hk, d) on cuda:0."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple(torch.randn(shape, generator=g, device="cuda", dtype=dtype)
                 for shape in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d)))


def attention_ref(q, k, v, causal, scale, upcast, first_row=0, seqlen_q=None, softcap=0.0,
                  alibi_slopes=None):
    """(out, lse) of softmax(scale * q k^T, bottom-right causal mask) v, in BSHD.

    upcast: the math in float32, else in q's dtype. q holds query rows [first_row,
    first_row + q.shape[1]) of a sequence of seqlen_q rows (default: all of it), so the causal
    mask of a slice of rows is the one of the full problem. softcap > 0: the scaled scores
    become softcap * tanh(scores / softcap) before the mask (flash-attn's softcapping).
    alibi_slopes: (h,) or (b, h) float32; flash-attn's ALiBi bias -slope * |i + seqlen_k -
    seqlen_q - j| is added (in float32, as flash-attn's reference does) after the cap.
    """
    seqlen_q = q.shape[1] if seqlen_q is None else seqlen_q
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    groups = q.shape[2] // k.shape[2]  # GQA: query head h reads K/V head h // groups
    k = k.repeat_interleave(groups, dim=2)
    v = v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale  # (b, h, sq, sk)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        rows = torch.arange(first_row, first_row + q.shape[1], device=q.device)
        scores = scores + alibi_bias(alibi_slopes, q.shape[0], q.shape[2], seqlen_q,
                                     k.shape[1], rows)
    if causal:
        seqlen_k = k.shape[1]
        rows = torch.arange(first_row, first_row + q.shape[1], device=q.device)[:, None]
        cols = torch.arange(seqlen_k, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows + seqlen_k - seqlen_q, -math.inf)
    lse = torch.logsumexp(scores.float(), dim=-1)  # (b, h, sq); -inf where no key is seen
    p = torch.softmax(scores, dim=-1)
    p = torch.where(torch.isneginf(lse)[..., None], 0.0, p).to(v.dtype)  # not NaN: zero
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def _assert_within(what, ours, ref, lowp):
    """The pass rule (module docstring) for ``ours`` in the type it was stored in, against the
    float32 reference ``ref`` and the low-precision one ``lowp``."""
    if ref.numel() == 0:
        return
    err = (ours.float() - ref).abs().max().item()
    rounding = (ref.to(ours.dtype).float() - ref).abs().max().item()
    bound = 2 * (lowp.float() - ref).abs().max().item() + 2 * rounding + 1e-5
    assert err <= bound, (f"{what}: max|ours - fp32 ref| = {err:.4g} > 2 * max|low-precision "
                          f"torch - fp32 ref| + 2 * max|fp32 ref rounded to {ours.dtype} - fp32 "
                          f"ref| + 1e-5 = {bound:.4g}")


def check_attention(out, lse, q, k, v, causal, scale=None, first_row=0, seqlen_q=None,
                    softcap=0.0, alibi_slopes=None):
    """Assert FlashAttention's accuracy rule for out and (if given) lse."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    ref, ref_lse = attention_ref(q, k, v, causal, scale, True, first_row, seqlen_q, softcap,
                                 alibi_slopes)
    lowp, lowp_lse = attention_ref(q, k, v, causal, scale, False, first_row, seqlen_q, softcap,
                                   alibi_slopes)
    assert out.shape == q.shape and out.dtype == q.dtype
    bad = (~torch.isfinite(out)).sum().item()
    assert bad == 0, f"out has {bad} NaN/inf elements (unwritten or overflowed)"
    _assert_within("out", out, ref, lowp)
    no_key = torch.isneginf(ref_lse)  # (b, h, sq)
    assert (out.transpose(1, 2)[no_key] == 0).all(), "rows that see no key must be 0"
    if lse is not None:
        assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
        assert torch.equal(torch.isneginf(lse), no_key), \
            "lse must be -inf exactly on the rows that see no key"
        assert not (torch.isnan(lse) | torch.isposinf(lse)).any(), "lse has NaN or +inf"
        _assert_within("lse", lse[~no_key], ref_lse[~no_key], lowp_lse[~no_key])


# ---- every config: the core shapes --------------------------------------------------------------

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, causal)
CORE_SHAPES = [
    (2, 113, 113, 3, 3, False),  # tails in both sequences, odd head count
    (1, 17, 1000, 4, 2, True),  # seqlen_q < seqlen_k, GQA
    (1, 1000, 17, 2, 1, True),  # seqlen_q > seqlen_k: rows that see no key; MQA
    (2, 1, 2049, 2, 2, True),  # one query row (decoding)
    (2, 1, 1000, 8, 2, True),  # decoding with GQA: 4 query heads run as rows of one head
    (1, 1000, 2049, 2, 2, False),
    (1, 2049, 2049, 2, 2, True),  # many blocks on the causal diagonal
]


def test_kernels_are_built():
    assert manifest.load_manifest().kernels
    assert KERNELS, f"no kernel in {manifest.load_manifest().path} runs on this GPU"


@pytest.mark.parametrize("splits", [1, 3], ids=["whole", "split3"])
@pytest.mark.parametrize("shape", CORE_SHAPES, ids=lambda s: "b{}_q{}_k{}_h{}_hk{}_causal{}"
                         .format(*s))
@pytest.mark.parametrize("entry", KERNELS, ids=lambda e: e.name)
def test_config(entry, shape, splits):
    """Each config, whole (cudaflash_fwd) and with the keys cut into up to 3 runs
    (cudaflash_fwd_split + cudaflash_combine; with causal masking some runs see no key)."""
    b, sq, sk, h, hk, causal = shape
    cfg = entry.config
    q, k, v = make_qkv(b, sq, sk, h, hk, cfg.d_head, DTYPES[cfg.dtype], seed=sq + sk)
    out = torch.full_like(q, math.nan)  # every element must be written
    out2, lse = forward(cfg, q, k, v, out=out, causal=causal, num_splits=splits)
    assert out2 is out
    check_attention(out, lse, q, k, v, causal)


def test_split_matches_whole_closely():
    """Splitting only regroups the sums: out stays within two ulps of the largest output of
    the whole kernel's, lse within 1e-4 (not just within the reference's bound)."""
    combo = _pick_combo(("bf16", 128), ("fp16", 64))
    dtype, d = DTYPES[combo[0]], combo[1]
    q, k, v = make_qkv(2, 37, 3000, 4, 2, d, dtype, seed=11)
    cfg = internals.selected_config(0, combo[0], d, False, 37, 3000)[0]
    whole, whole_lse = forward(cfg, q, k, v, num_splits=1)
    for splits in (2, 5, 17):
        out, lse = forward(cfg, q, k, v, num_splits=splits)
        largest = whole.float().abs().max().item()
        assert (out.float() - whole.float()).abs().max().item() <= \
            2 * torch.finfo(dtype).eps * largest
        assert (lse - whole_lse).abs().max().item() <= 1e-4


# ---- features, through flash_attn_func -----------------------------------------------------------

# (batch, seqlen_q, seqlen_k, nheads, nheads_k)
FEATURE_SHAPES = [
    (1, 113, 2049, 2, 2),
    (1, 2049, 113, 2, 2),
    (2, 257, 257, 8, 2),  # GQA
    (1, 300, 500, 3, 1),  # MQA, odd head count
]


# Decoding (seqlen_q = 1): grids too small for the GPU, split by flash_attn_func's own rule.
DECODE_SHAPES = [
    (1, 1, 4096, 8, 8),
    (2, 1, 1000, 8, 2),  # GQA: query heads packed as rows
    (1, 1, 8193, 16, 1),  # MQA, a long cache with a tail
    (3, 1, 77, 6, 3),  # shorter than one split's worth of keys
    (1, 4, 5000, 4, 4),  # a few query rows (speculative decoding)
]


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("shape", FEATURE_SHAPES + DECODE_SHAPES,
                         ids=lambda s: "b{}_q{}_k{}_h{}_hk{}".format(*s))
@pytest.mark.parametrize("combo", COMBOS, ids=_combo_id)
def test_flash_attn_func(combo, shape, causal):
    dtype, d = DTYPES[combo[0]], combo[1]
    q, k, v = make_qkv(*shape, d, dtype, seed=7)
    out, lse, probs = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert probs is None
    check_attention(out, lse, q, k, v, causal)


def _layout(name, b, sq, sk, h, hk, d, dtype):
    g = torch.Generator(device="cuda").manual_seed(3)

    def randn(*shape):
        return torch.randn(shape, generator=g, device="cuda", dtype=dtype)

    if name == "bhsd_transposed":  # (b, h, s, d) memory seen as (b, s, h, d)
        return (randn(b, h, sq, d).transpose(1, 2), randn(b, hk, sk, d).transpose(1, 2),
                randn(b, hk, sk, d).transpose(1, 2))
    if name == "packed_qkv":  # slices of one (b, s, 3, h, d) tensor
        return randn(b, sq, 3, h, d).unbind(2)
    raise ValueError(name)


@pytest.mark.parametrize("layout", ["bhsd_transposed", "packed_qkv"])
@pytest.mark.parametrize("combo", COMBOS, ids=_combo_id)
def test_layouts(combo, layout):
    dtype, d = DTYPES[combo[0]], combo[1]
    hk = 3 if layout == "packed_qkv" else 1
    q, k, v = _layout(layout, 2, 200, 200, 3, hk, d, dtype)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    check_attention(out, lse, q, k, v, causal=True)


@pytest.mark.parametrize("scale", [0.02, 0.3])
@pytest.mark.parametrize("combo", COMBOS, ids=_combo_id)
def test_softmax_scale(combo, scale):
    q, k, v = make_qkv(1, 150, 333, 2, 2, combo[1], DTYPES[combo[0]], seed=11)
    out, lse, _ = flash_attn_func(q, k, v, softmax_scale=scale, return_attn_probs=True)
    check_attention(out, lse, q, k, v, causal=False, scale=scale)


def test_deterministic():
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v = make_qkv(2, 500, 700, 4, 2, d, DTYPES[dtype])
    a = flash_attn_func(q, k, v, causal=True, deterministic=True)
    b = flash_attn_func(q, k, v, causal=True, deterministic=True)
    assert torch.equal(a, b)


def test_side_stream():
    dtype, d = _pick_combo(("fp16", 64), *COMBOS)
    q, k, v = make_qkv(1, 1000, 1000, 2, 2, d, DTYPES[dtype])
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = flash_attn_func(q, k, v, causal=True)
    torch.cuda.current_stream().wait_stream(stream)
    check_attention(out, None, q, k, v, causal=True)


# (2, 300, 300, 4, 2): one kernel; (1, 1, 4096, 8, 2): GQA decoding, split into two kernels
# and a workspace from the graph's memory pool.
@pytest.mark.parametrize("dims", [(2, 300, 300, 4, 2), (1, 1, 4096, 8, 2)],
                         ids=["whole", "decode_split"])
def test_cuda_graph_capture_and_replay(dims):
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    shape = (*dims, d, DTYPES[dtype])
    static = make_qkv(*shape, seed=0)
    # Warm up on a side stream: the module load and kernel choice must happen before capture.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        flash_attn_func(*static, causal=True)
    torch.cuda.current_stream().wait_stream(stream)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = flash_attn_func(*static, causal=True)
    for seed in (1, 2):
        fresh = make_qkv(*shape, seed=seed)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        check_attention(static_out, None, *fresh, causal=True)


@pytest.mark.parametrize("dims", [(2, 257, 300, 4, 2), (1, 1, 4096, 8, 2)],
                         ids=["whole", "decode_split"])
def test_torch_compile_fullgraph(dims):
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v = make_qkv(*dims, d, DTYPES[dtype])

    def attention(q, k, v):
        out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        return out, lse

    out, lse = torch.compile(attention, fullgraph=True)(q, k, v)
    check_attention(out, lse, q, k, v, causal=True)
    eager_out, eager_lse = attention(q, k, v)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_long_sequence(causal):
    """131072 tokens: checked on the first and last 256 query rows (the reference for all rows
    would need 64 GiB of scores)."""
    dtype, d = _pick_combo(("bf16", 128))
    s = 131072
    q, k, v = make_qkv(1, s, s, 1, 1, d, DTYPES[dtype])
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    for first in (0, s - 256):
        rows = slice(first, first + 256)
        check_attention(out[:, rows], lse[:, :, rows], q[:, rows], k, v, causal,
                        first_row=first, seqlen_q=s)


# ---- the checker itself ---------------------------------------------------------------------


def test_checker_rejects_wrong_answers():
    dtype, d = _pick_combo(("fp16", 64), ("fp16", 128))
    q, k, v = make_qkv(1, 200, 200, 2, 2, d, DTYPES[dtype])
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    check_attention(out, lse, q, k, v, causal=True)

    off = out.clone()
    off[0, 100, 1, 7] += 0.05
    nan = out.clone()
    nan[0, 5, 0, 0] = math.nan
    wrong = {
        "the non-causal result": (flash_attn_func(q, k, v, causal=False), lse),
        "one element off by 0.05": (off, lse),
        "one NaN": (nan, lse),
        "lse off by 0.02": (out, lse + 0.02),
    }
    for what, (bad_out, bad_lse) in wrong.items():
        try:
            check_attention(bad_out, bad_lse, q, k, v, causal=True)
        except AssertionError:
            continue
        pytest.fail(f"the checker accepted a wrong answer: {what}")


# ---- edge cases -------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("b, sq, sk", [(0, 16, 16), (2, 0, 16), (2, 16, 0), (2, 0, 0)])
def test_empty_inputs(b, sq, sk, causal):
    dtype, d = COMBOS[0]
    q, k, v = make_qkv(b, sq, sk, 2, 1, d, DTYPES[dtype])
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (b, 2, sq)
    if b and sq and not sk:  # no key for any row
        assert torch.equal(out, torch.zeros_like(q))
        assert torch.isneginf(lse).all()
    config = next(e.config for e in KERNELS if (e.config.dtype, e.config.d_head) == (dtype, d))
    out = torch.full_like(q, math.nan)
    forward(config, q, k, v, out=out, causal=causal)
    if b and sq and not sk:
        assert torch.equal(out, torch.zeros_like(q))


def test_misaligned_view_is_refused():
    dtype, d = COMBOS[0]
    q, k, v = make_qkv(1, 64, 64, 2, 2, d, DTYPES[dtype])
    shifted = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)[1:].view(q.shape)
    with pytest.raises(ValueError, match="q is not 16-byte aligned"):
        flash_attn_func(shifted, k, v)


def test_repeat_calls_recheck_what_the_signature_does_not_fix():
    """A repeat signature takes the recorded plan: new data must still be computed right, and
    a misaligned pointer must still be refused, and a tensor that requires grad must take
    the autograd path (an out with a grad_fn), not the plan's bare launch."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v = make_qkv(2, 300, 200, 4, 2, d, DTYPES[dtype], seed=1)
    flash_attn_func(q, k, v, causal=True)  # records the plan
    assert any(key[0] == q.shape for key in internals.plans)
    q2, k2, v2 = make_qkv(2, 300, 200, 4, 2, d, DTYPES[dtype], seed=2)
    out, lse, _ = flash_attn_func(q2, k2, v2, causal=True, return_attn_probs=True)
    check_attention(out, lse, q2, k2, v2, causal=True)
    out = flash_attn_func(q2, k2, v2, causal=True)  # the plan without lse
    check_attention(out, None, q2, k2, v2, causal=True)

    shifted = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)[1:].view(q.shape)
    assert shifted.stride() == q.stride()  # the same signature, a misaligned pointer
    with pytest.raises(ValueError, match="q is not 16-byte aligned"):
        flash_attn_func(shifted, k, v, causal=True)
    with_grad = flash_attn_func(q.clone().requires_grad_(), k, v, causal=True)
    assert with_grad.grad_fn is not None
    assert torch.equal(with_grad.detach(), flash_attn_func(q, k, v, causal=True))


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_gqa_decoding_with_strided_heads(causal):
    """GQA decoding packs query heads as rows through q's head stride: a q whose heads are
    not d_head apart (a slice of a wider buffer) must still be read right; out is
    empty_like(q), here contiguous, so q and out strides differ."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    g = torch.Generator(device="cuda").manual_seed(9)
    wide = torch.randn(2, 1, 8, 2 * d, generator=g, device="cuda", dtype=DTYPES[dtype])
    q = wide[..., :d]
    _, k, v = make_qkv(2, 1, 3000, 8, 2, d, DTYPES[dtype], seed=10)
    assert q.stride(2) == 2 * d
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, return_attn_probs=True)
    assert out.stride(2) == d
    check_attention(out, lse, q, k, v, causal)


def test_plan_shared_by_contiguous_tensors_with_other_size1_strides():
    """The plan key treats contiguous tensors of one shape alike; a size-1 batch dim with
    another stride (a slice of a larger buffer) must still compute right through it."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v = make_qkv(1, 300, 200, 4, 2, d, DTYPES[dtype], seed=4)
    flash_attn_func(q, k, v, return_attn_probs=True)  # records the plan
    buf = torch.empty(2 * q.numel() + 64, device="cuda", dtype=q.dtype)
    odd = buf[64:].as_strided(q.shape, (q.numel() + 8,) + q.stride()[1:])
    odd.copy_(make_qkv(1, 300, 200, 4, 2, d, DTYPES[dtype], seed=5)[0])
    assert odd.is_contiguous() and odd.stride() != q.stride()
    out, lse, _ = flash_attn_func(odd, k, v, return_attn_probs=True)
    check_attention(out, lse, odd, k, v, causal=False)


def test_repeat_calls_allocate_through_the_plan():
    """The second call of a signature takes its plan, whose out and lse come from torch's
    private _empty_strided_cuda on this torch (_fast_allocator checked it against
    torch.empty_like): same layout as empty_like(q) (q transposed here), same values."""
    dtype, d = _pick_combo(("bf16", 64), *COMBOS)
    q, k, v = make_qkv(2, 200, 300, 4, 2, d, DTYPES[dtype], seed=11)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    internals.clear_caches()
    first, first_lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    (plan,) = internals.plans.values()
    assert plan.new_out is not None and plan.new_lse is not None, \
        "torch's _empty_strided_cuda is missing or differs: plans fall back to empty_like"
    for _ in range(2):
        out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
        assert out.stride() == torch.empty_like(q).stride() and out.device == q.device
        assert lse.shape == first_lse.shape and lse.is_contiguous()
        assert torch.equal(out, first) and torch.equal(lse, first_lse)
    check_attention(out, lse, q, k, v, causal=True)


def test_corrupt_or_missing_kernel_file(tmp_path, monkeypatch):
    entry = KERNELS[0]
    src = manifest.load_manifest().path.parent
    dst = tmp_path / "kernels"
    shutil.copytree(src, dst)
    path = dst / entry.path.relative_to(src)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    q, k, v = make_qkv(1, 64, 64, 2, 2, entry.config.d_head, DTYPES[entry.config.dtype])

    monkeypatch.setenv("CUDAFLASH_KERNEL_DIR", str(dst))
    internals.clear_caches()  # loaded functions are cached per (device, context, kernel)
    try:
        with pytest.raises(RuntimeError, match=f"kernel file {path} is corrupt"):
            forward(entry.config, q, k, v)
        path.unlink()
        with pytest.raises(RuntimeError, match=f"kernel file {path} of {entry.name} is missing"):
            forward(entry.config, q, k, v)
    finally:
        monkeypatch.undo()
        internals.clear_caches()
