"""Sliding-window attention (window_size) on a GPU: flash_attn_func, every built kernel
config, flash_attn_varlen_func and flash_attn_with_kvcache against the attention math in
PyTorch with the window mask, under FlashAttention's accuracy rule (test_gpu_correctness);
gradients (both schemes, every backward module, varlen) against autograd through that math."""

import math

import pytest
import torch

from cudaflash import (flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache,
                       forward)
import _internals as internals
from _flash_reference import alibi_bias
from test_gpu_correctness import (COMBOS, DTYPES, KERNELS, _assert_within, _combo_id,
                                  _pick_combo, fp32_reference_without_tf32,  # noqa: F401
                                  make_qkv)
from test_gpu_backward import (BWD_COMBOS, assert_compiled_matches_eager, assert_grads_within,
                               for_each_backward_module, force_atomic_kernels, run_with_grad)
from test_gpu_varlen import offsets, packed

pytestmark = pytest.mark.requires_gpu


def window_ref(q, k, v, left, right, causal, upcast, scale=None, softcap=0.0,
               alibi_slopes=None):
    """(out, lse) of softmax(q k^T / sqrt(d) with the window mask) v in BSHD: query i sees
    keys j with i + shift - left <= j <= i + shift + right (a side unbounded when -1, or when
    at least seqlen_k, flash-attn's rule; causal is right = 0), shift = seqlen_k - seqlen_q.
    ``scale`` replaces 1 / sqrt(d); softcap > 0 caps the scaled scores (c * tanh(s / c));
    alibi_slopes adds flash-attn's ALiBi bias after the cap (test_gpu_correctness's
    attention_ref)."""
    left = -1 if left >= k.shape[1] else left
    right = -1 if right >= k.shape[1] else right
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * (q.shape[-1] ** -0.5 if scale is None
                                                      else scale)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    sq, sk = q.shape[1], k.shape[1]
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, q.shape[0], q.shape[2], sq, sk)
    offset = (torch.arange(sk, device=q.device)[None, :]
              - torch.arange(sq, device=q.device)[:, None] - (sk - sq))
    right = 0 if causal else right
    hidden = torch.zeros_like(offset, dtype=torch.bool)
    if right >= 0:
        hidden |= offset > right
    if left >= 0:
        hidden |= offset < -left
    scores = scores.masked_fill(hidden, -math.inf)
    lse = torch.logsumexp(scores.float(), dim=-1)
    p = torch.softmax(scores, dim=-1)
    p = torch.where(torch.isneginf(lse)[..., None], 0.0, p).to(v.dtype)
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def check_window(out, lse, q, k, v, left, right, causal):
    ref, ref_lse = window_ref(q, k, v, left, right, causal, True)
    lowp, lowp_lse = window_ref(q, k, v, left, right, causal, False)
    assert out.shape == q.shape and torch.isfinite(out).all()
    _assert_within("out", out, ref, lowp)
    no_key = torch.isneginf(ref_lse)
    assert (out.transpose(1, 2)[no_key] == 0).all(), "rows that see no key must be 0"
    if lse is not None:
        assert torch.equal(torch.isneginf(lse), no_key)
        _assert_within("lse", lse[~no_key], ref_lse[~no_key], lowp_lse[~no_key])


WINDOWS = [(0, 0), (16, 0), (100, -1), (-1, 50), (300, 300), (5, 7), (0, -1), (-1, 0),
           (2**31 - 1, 2**31 - 1)]
# (batch, seqlen_q, seqlen_k, nheads, nheads_k)
SHAPES = [
    (2, 257, 257, 4, 2),
    (1, 100, 1000, 2, 2),  # fewer queries than keys
    (1, 1000, 100, 2, 1),  # more queries than keys: rows whose window holds no key
    (2, 1, 2049, 8, 2),  # decoding with GQA: small grid, split-KV
]


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_q{}_k{}_h{}_hk{}".format(*s))
def test_flash_attn_func_window(shape, window, causal):
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v = make_qkv(*shape, d, DTYPES[dtype], seed=sum(shape))
    out, lse, _ = flash_attn_func(q, k, v, causal=causal, window_size=window,
                                  return_attn_probs=True)
    check_window(out, lse, q, k, v, *window, causal)


@pytest.mark.parametrize("entry", KERNELS, ids=lambda e: e.name)
def test_every_config_with_a_window(entry):
    cfg = entry.config
    q, k, v = make_qkv(1, 300, 700, 2, 2, cfg.d_head, DTYPES[cfg.dtype], seed=7)
    for window, splits in (((64, 32), 1), ((200, -1), 3)):
        out, lse = forward(cfg, q, k, v, window_size=window, num_splits=splits)
        check_window(out, lse, q, k, v, *window, False)


def test_default_window_is_plain_attention():
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v = make_qkv(2, 300, 300, 2, 2, d, DTYPES[dtype])
    assert torch.equal(flash_attn_func(q, k, v, causal=True, window_size=(-1, -1)),
                       flash_attn_func(q, k, v, causal=True))
    # A window wider than the sequence: the same attention.
    wide = flash_attn_func(q, k, v, causal=True, window_size=(4096, 4096))
    assert (wide.float() - flash_attn_func(q, k, v, causal=True).float()).abs().max() < 1e-2


@pytest.mark.parametrize("combo", COMBOS, ids=_combo_id)
def test_varlen_window(combo):
    dtype, d = combo
    lens_q, lens_k = [100, 1, 300], [100, 500, 250]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, 4, 2, d, DTYPES[dtype], seed=2)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 300, 500, causal=True,
                                         window_size=(40, 0), return_attn_probs=True)
    oq, ok = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lens_q)):
        rows, keys = slice(oq[b], oq[b + 1]), slice(ok[b], ok[b + 1])
        check_window(out[rows][None], lse[:, rows][None], q[rows][None], k[keys][None],
                     v[keys][None], 40, 0, True)


def test_kvcache_window():
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(3, 1, 8, d, generator=g, device="cuda", dtype=DTYPES[dtype])
    kc = torch.randn(3, 600, 2, d, generator=g, device="cuda", dtype=DTYPES[dtype])
    vc = torch.randn_like(kc)
    lens = [600, 37, 300]
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor(
        lens, dtype=torch.int32, device="cuda"), causal=True, window_size=(128, 0),
        return_softmax_lse=True)
    for b, n in enumerate(lens):
        check_window(out[b:b + 1], lse[b:b + 1], q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n],
                     128, 0, True)


@pytest.mark.parametrize("window", [(-1, 0), (-1, 2), (3, -1), (0, 0)],
                         ids=lambda w: f"w{w[0]}_{w[1]}")
def test_gqa_decoding_with_a_window(window):
    """One query row, 8 query heads per K/V head: without a window the heads run as rows of
    one head; with one they must not (each would get another position's bounds)."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v = make_qkv(2, 1, 300, 8, 1, d, DTYPES[dtype], seed=11)
    for causal in (False, True):
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, window_size=window,
                                      return_attn_probs=True)
        check_window(out, lse, q, k, v, *window, causal)


def test_a_side_as_long_as_the_keys_is_unbounded():
    """flash-attn's rule, which matters where seqlen_q > seqlen_k: (-1, 300) with 256 keys is
    no window at all, not a bound 300 keys right of each row's diagonal."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v = make_qkv(1, 512, 256, 2, 2, d, DTYPES[dtype], seed=12)
    assert torch.equal(flash_attn_func(q, k, v, window_size=(-1, 300)), flash_attn_func(q, k, v))
    assert torch.equal(flash_attn_func(q, k, v, window_size=(256, 256)),
                       flash_attn_func(q, k, v))


def test_window_pair_as_one_tensor():
    """flash-attn's tests pass window_size as torch.randint(0, seqlen_k, (2,)): the same
    windows as the tuple in every function."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v = make_qkv(2, 300, 300, 2, 2, d, DTYPES[dtype], seed=13)
    for pair in (torch.tensor([40, 7]), torch.tensor([40, 7], device="cuda"),
                 torch.tensor([40, 7]).numpy()):
        assert torch.equal(flash_attn_func(q, k, v, window_size=pair),
                           flash_attn_func(q, k, v, window_size=(40, 7)))
    lens = [100, 200]
    qp, kp, vp, cu_q, cu_k = packed(lens, lens, 2, 2, d, DTYPES[dtype], seed=14)
    assert torch.equal(
        flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, 200, 200, window_size=torch.tensor([9, 3])),
        flash_attn_varlen_func(qp, kp, vp, cu_q, cu_k, 200, 200, window_size=(9, 3)))
    lengths = torch.tensor([300, 120], dtype=torch.int32, device="cuda")
    assert torch.equal(
        flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=lengths,
                                window_size=torch.tensor([64, 0])),
        flash_attn_with_kvcache(q[:, :1], k, v, cache_seqlens=lengths, window_size=(64, 0)))


def test_kvcache_window_sides_count_from_the_capacity():
    """flash_attn_with_kvcache treats a window side as unbounded only from the caches'
    length on (flash-attn's rule there), with an int cache_seqlens too: 10 query rows, 4 used
    keys of 64, window (-1, 5): row i sees keys up to i + 4 - 10 + 5 = i - 1, so row 0 sees
    none (a side counted from the used length would have shown every row all 4 keys)."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    g = torch.Generator(device="cuda").manual_seed(15)
    q = torch.randn(1, 10, 2, d, generator=g, device="cuda", dtype=DTYPES[dtype])
    kc = torch.randn(1, 64, 2, d, generator=g, device="cuda", dtype=DTYPES[dtype])
    vc = torch.randn_like(kc)
    out_int, lse_int = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=4, window_size=(-1, 5),
                                               return_softmax_lse=True)
    out_t, lse_t = flash_attn_with_kvcache(
        q, kc, vc, cache_seqlens=torch.tensor([4], dtype=torch.int32, device="cuda"),
        window_size=(-1, 5), return_softmax_lse=True)
    assert torch.equal(out_int[0, 0], torch.zeros_like(out_int[0, 0]))
    assert torch.isneginf(lse_int[0, :, 0]).all()
    assert (out_int.float() - out_t.float()).abs().max().item() < 1e-2
    # Rows 1..9 against the math: keys 0..i-1 (all 4 from row 5 on).
    for i in range(1, 10):
        sees = min(i, 4)
        ref, _ = window_ref(q[:, i:i + 1], kc[:, :sees], vc[:, :sees], -1, -1, False, True)
        assert (out_int[:, i:i + 1].float() - ref.float()).abs().max().item() < 2e-2


# ---- gradients ---------------------------------------------------------------------------------


def window_grads_ref(q, k, v, dout, left, right, causal, upcast):
    """(dq, dk, dv) of window_ref by autograd, in float32 (upcast) or in q's dtype."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, _ = window_ref(*leaves, left, right, causal, upcast)
    out.backward(dout.float() if upcast else dout)
    return [t.grad for t in leaves]


def check_window_grads(grads, q, k, v, dout, left, right, causal):
    assert_grads_within(grads, window_grads_ref(q, k, v, dout, left, right, causal, True),
                        window_grads_ref(q, k, v, dout, left, right, causal, False), (q, k, v))


GRAD_WINDOWS = [(16, 0), (100, -1), (-1, 50), (5, 7), (0, 0), (300, 300)]
GRAD_SHAPES = [
    (2, 257, 257, 4, 2),  # tails, GQA
    (1, 100, 1000, 2, 2),  # fewer queries than keys
    (1, 1000, 100, 2, 1),  # more queries than keys: rows whose window holds no key
    (1, 700, 700, 2, 2),  # many query tiles per key tile: windows skip most of them
]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("window", GRAD_WINDOWS, ids=lambda w: f"w{w[0]}_{w[1]}")
@pytest.mark.parametrize("shape", GRAD_SHAPES, ids=lambda s: "b{}_q{}_k{}_h{}_hk{}".format(*s))
def test_window_gradients(shape, window, causal, deterministic, monkeypatch):
    force_atomic_kernels(monkeypatch)
    dtype, d = _pick_combo(("bf16", 128), *BWD_COMBOS)
    q, k, v = make_qkv(*shape, d, DTYPES[dtype], seed=sum(shape) + window[0])
    dout = torch.randn_like(q)
    out, grads = run_with_grad(q, k, v, dout, causal=causal, window_size=window,
                                deterministic=deterministic)
    check_window(out, None, q, k, v, *window, causal)
    check_window_grads(grads, q, k, v, dout, *window, causal)


@pytest.mark.parametrize("window", [(70, 90), (0, 0), (200, -1)])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_d256_warp_specialized_backward_with_a_window(causal, window, monkeypatch):
    """The d256 warp-specialized kernels (the module a plain d256 call takes on Hopper) with
    sliding windows: tiles the window's edges cut, CTAs whose rows or keys see nothing."""
    from test_gpu_backward import d256_warp_specialized_backward, launched_backward_modules

    ws = d256_warp_specialized_backward(torch.bfloat16)
    q, k, v = make_qkv(2, 333, 517, 4, 2, 256, torch.bfloat16, seed=29)
    dout = torch.randn_like(q)
    launched = launched_backward_modules(monkeypatch)
    _, grads = run_with_grad(q, k, v, dout, causal=causal, window_size=window)
    assert {name for name, role in launched if role in ("dkdv", "dq")} == {ws.name}, launched
    check_window_grads(grads, q, k, v, dout, *window, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_every_backward_module_with_a_window(causal, monkeypatch):
    """Each backward module this GPU runs, in each scheme it serves, with a two-sided window
    over several key and query tiles."""
    force_atomic_kernels(monkeypatch)
    window = (70, 90)

    def body(entry):
        cfg = entry.config
        q, k, v = make_qkv(2, 333, 517, 4, 2, cfg.d_head, DTYPES[cfg.dtype], seed=23)
        dout = torch.randn_like(q)
        for scheme in entry.schemes:
            _, grads = run_with_grad(q, k, v, dout, causal=causal, window_size=window,
                                     deterministic=scheme == "deterministic")
            try:
                check_window_grads(grads, q, k, v, dout, *window, causal)
            except AssertionError as e:
                raise AssertionError(f"({scheme}) {e}") from None

    for_each_backward_module(monkeypatch, body)


@pytest.mark.parametrize("window", [(40, 0), (30, 60)], ids=lambda w: f"w{w[0]}_{w[1]}")
def test_varlen_window_gradients(window):
    dtype, d = _pick_combo(("bf16", 128), *BWD_COMBOS)
    lens_q, lens_k = [100, 1, 300, 200], [100, 500, 250, 0]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, 4, 2, d, DTYPES[dtype], seed=5)
    dout = torch.randn_like(q)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = flash_attn_varlen_func(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), causal=True,
                                 window_size=window)
    out.backward(dout)
    oq, ok = cu_q.tolist(), cu_k.tolist()
    for b in range(len(lens_q)):
        rows, keys = slice(oq[b], oq[b + 1]), slice(ok[b], ok[b + 1])
        grads = [leaves[0].grad[rows][None], leaves[1].grad[keys][None],
                 leaves[2].grad[keys][None]]
        check_window_grads(grads, q[rows][None], k[keys][None], v[keys][None],
                           dout[rows][None], *window, True)


@pytest.mark.parametrize("window", [(64, 0), (30, 70)], ids=lambda w: f"w{w[0]}_{w[1]}")
def test_window_gradients_under_torch_compile_fullgraph_match_eager(window):
    """Windowed calls compile into one graph (the custom ops carry the window); output and
    gradients are the eager ones, bitwise (deterministic scheme)."""
    dtype, d = _pick_combo(("bf16", 128), *BWD_COMBOS)
    q, k, v = make_qkv(2, 256, 256, 4, 2, d, DTYPES[dtype], seed=13)
    assert_compiled_matches_eager(q, k, v, torch.randn_like(q), causal=True,
                                  window_size=window, deterministic=True)


def test_varlen_window_under_torch_compile_fullgraph():
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v, cu_q, cu_k = packed([100, 1, 300], [100, 500, 250], 4, 2, d, DTYPES[dtype],
                                 seed=14)

    def attention(q, k, v, cu_q, cu_k):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 300, 500, causal=True,
                                      window_size=(40, 0), return_attn_probs=True)[:2]

    torch._dynamo.reset()
    out, lse = torch.compile(attention, fullgraph=True)(q, k, v, cu_q, cu_k)
    eager_out, eager_lse = attention(q, k, v, cu_q, cu_k)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)


# ---- repeat calls take plans keyed with the window --------------------------------------------


def _refuse(*args, **kwargs):
    raise AssertionError("the repeat call took the checked path")


def test_repeat_windowed_calls_take_a_plan(monkeypatch):
    """flash_attn_func: the second call of a windowed signature replays its plan on the new
    tensors; another window is another plan, not this one."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v = make_qkv(2, 300, 300, 4, 2, d, DTYPES[dtype], seed=31)
    flash_attn_func(q, k, v, causal=True, window_size=(64, 0))
    q2, k2, v2 = make_qkv(2, 300, 300, 4, 2, d, DTYPES[dtype], seed=32)
    with monkeypatch.context() as m:
        internals.replace_checked_forward(m, _refuse)
        out = flash_attn_func(q2, k2, v2, causal=True, window_size=(64, 0))
    check_window(out, None, q2, k2, v2, 64, 0, True)
    out, lse, _ = flash_attn_func(q2, k2, v2, causal=True, window_size=(16, 0),
                                  return_attn_probs=True)
    check_window(out, lse, q2, k2, v2, 16, 0, True)


def test_repeat_windowed_decoding_steps_take_a_plan(monkeypatch):
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    g = torch.Generator(device="cuda").manual_seed(33)
    q = torch.randn(3, 1, 8, d, generator=g, device="cuda", dtype=DTYPES[dtype])
    kc = torch.randn(3, 600, 2, d, generator=g, device="cuda", dtype=DTYPES[dtype])
    vc = torch.randn_like(kc)
    lens = torch.tensor([600, 37, 300], dtype=torch.int32, device="cuda")
    flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True, window_size=(128, 0))
    new_lens = [1, 599, 128]
    lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
    with monkeypatch.context() as m:
        internals.replace_run(m, _refuse)
        out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True,
                                      window_size=(128, 0))
    for b, n in enumerate(new_lens):
        check_window(out[b:b + 1], None, q[b:b + 1], kc[b:b + 1, :n], vc[b:b + 1, :n],
                     128, 0, True)
    # An equal window of another type is not served by that plan: the checks refuse it.
    with pytest.raises(ValueError, match="window_size="):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, causal=True,
                                window_size=(128, False))


def test_repeat_windowed_varlen_calls_take_a_plan(monkeypatch):
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v, cu_q, cu_k = packed([100, 200], [300, 50], 4, 2, d, DTYPES[dtype], seed=34)
    flash_attn_varlen_func(q, k, v, cu_q, cu_k, 200, 300, causal=True, window_size=(40, 0))
    cu_q2, cu_k2 = offsets([200, 100]), offsets([50, 300])
    with monkeypatch.context() as m:
        internals.replace_run_varlen(m, _refuse)
        out = flash_attn_varlen_func(q, k, v, cu_q2, cu_k2, 200, 300, causal=True,
                                     window_size=(40, 0))
    oq, ok = cu_q2.tolist(), cu_k2.tolist()
    for b in range(2):
        rows, keys = slice(oq[b], oq[b + 1]), slice(ok[b], ok[b + 1])
        check_window(out[rows][None], None, q[rows][None], k[keys][None], v[keys][None], 40,
                     0, True)
