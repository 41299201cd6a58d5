"""flash_attn_varlen_func's backward on a GPU: each packed sequence's dq, dk, dv against
autograd through the attention math in PyTorch (test_gpu_backward's accuracy rule), rows of
no sequence zero, in either scheme (deterministic=True: bitwise reproducible; the atomic
scheme's warp-specialized fused kernel on Hopper)."""

import pytest
import torch

from cudaflash import flash_attn_varlen_func
from test_gpu_backward import BWD_COMBOS, check_grads
from test_gpu_correctness import (DTYPES, _combo_id,  # noqa: F401 (autouse fixture)
                                  fp32_reference_without_tf32)
from test_gpu_varlen import packed

pytestmark = pytest.mark.requires_gpu


def run_with_grad(q, k, v, cu_q, cu_k, max_q, max_k, dout, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = flash_attn_varlen_func(*leaves, cu_q, cu_k, max_q, max_k, **kwargs)
    assert out.grad_fn is not None
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves]


def check_each_sequence(grads, q, k, v, dout, cu_q, cu_k, causal):
    """Each sequence's gradients as those of its own batch-1 problem; rows outside every
    sequence zero."""
    dq, dk, dv = grads
    oq, ok = cu_q.tolist(), cu_k.tolist()
    for b in range(len(oq) - 1):
        rows, keys = slice(oq[b], oq[b + 1]), slice(ok[b], ok[b + 1])
        check_grads([dq[rows][None], dk[keys][None], dv[keys][None]], q[rows][None],
                    k[keys][None], v[keys][None], dout[rows][None], causal)
    assert not dq[oq[-1]:].any() and not dk[ok[-1]:].any() and not dv[ok[-1]:].any()


def check_sequences_after_nan_rows(grads, q, k, v, dout, cu_q, cu_k, causal, window):
    """check_each_sequence for the tests whose packed tensors end with 3 NaN rows (a tile past
    a sequence's end reads its neighbour's rows, here those): each sequence within the rule
    (check_window_grads where ``window`` is not (-1, -1)), a sequence without keys gets no
    gradient, and the NaN rows none."""
    from test_gpu_window import check_window_grads

    dq, dk, dv = grads
    oq, ok = cu_q.tolist(), cu_k.tolist()
    for b in range(len(oq) - 1):
        rows, keys = slice(oq[b], oq[b + 1]), slice(ok[b], ok[b + 1])
        one = [t[None] for t in (dq[rows], dk[keys], dv[keys])]
        args = (q[rows][None], k[keys][None], v[keys][None], dout[rows][None])
        if ok[b + 1] == ok[b]:  # no keys: no gradient
            assert not dq[rows].any()
        elif window == (-1, -1):
            check_grads(one, *args, causal)
        else:
            check_window_grads(one, *args, *window, causal)
    assert not any(g[-3:].any() for g in grads), "the spare rows got gradients"


# (query lengths, key lengths, nheads, nheads_k)
SHAPES = [
    ([113, 1, 300, 64], [113, 1, 300, 64], 4, 2),  # self-attention, tails, GQA
    ([17, 200, 5, 40], [1000, 50, 0, 40], 3, 3),  # cross lengths; no keys; rows that see none
    ([129, 640], [700, 640], 2, 1),  # several tiles, blocks on the diagonal, MQA
    ([0, 64, 33], [10, 64, 0], 2, 2),  # a sequence with keys but no query rows, one without keys
]


@pytest.mark.parametrize("scheme", ["deterministic", "atomic"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"b{len(s[0])}_h{s[2]}_hk{s[3]}")
@pytest.mark.parametrize("combo", BWD_COMBOS, ids=_combo_id)
def test_varlen_gradients(combo, shape, causal, scheme, monkeypatch):
    """Either scheme (atomic: every shape made to take its kernels, the fused warp-specialized
    one on Hopper)."""
    lens_q, lens_k, h, hk = shape
    dtype, d = combo
    if scheme == "atomic":
        import _internals as internals
        internals.force_atomic_kernels(monkeypatch)
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, h, hk, d, DTYPES[dtype], seed=len(lens_q))
    # A spare row after the last sequence in q and k: its gradients must stay zero.
    q, k, v = (torch.cat([t, torch.randn_like(t[:1])]) for t in (q, k, v))
    dout = torch.randn_like(q)
    _, grads = run_with_grad(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), dout,
                             causal=causal, deterministic=scheme == "deterministic")
    check_each_sequence(grads, q, k, v, dout, cu_q, cu_k, causal)


def test_varlen_gradients_are_reproducible():
    """deterministic=True: bitwise the same gradients every run."""
    dtype, d = BWD_COMBOS[-1]
    q, k, v, cu_q, cu_k = packed([300, 77, 1000], [300, 500, 1000], 4, 2, d, DTYPES[dtype])
    dout = torch.randn_like(q)
    first = run_with_grad(q, k, v, cu_q, cu_k, 1000, 1000, dout, causal=True,
                          deterministic=True)[1]
    again = run_with_grad(q, k, v, cu_q, cu_k, 1000, 1000, dout, causal=True,
                          deterministic=True)[1]
    for a, b in zip(first, again):
        assert torch.equal(a, b)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)),
                                           (False, (90, 40))],
                         ids=["noncausal", "causal", "window"])
def test_varlen_atomic_scheme_takes_the_fused_warp_specialized_kernel(d, dtype, causal, window,
                                                                      monkeypatch):
    """On Hopper a packed batch in the atomic scheme runs the warp-specialized fused dK/dV +
    dQ kernel per sequence (each sequence from its first row of maps over the packed tensors)
    and dQ from the packed accumulator: within the rule per sequence, the NaN rows after the
    last sequence kept out (a tile past a sequence's end reads them: its K, V, Q and dO tail
    rows are zeroed), no gradient outside the sequences. The same call with
    deterministic=True runs the deterministic kernels, also within the rule."""
    import _internals as internals
    from test_gpu_backward import launched_backward_modules, warp_specialized_backward

    internals.force_atomic_kernels(monkeypatch)
    ws = warp_specialized_backward(dtype, d)
    lens_q, lens_k = [70, 1, 300, 129, 64], [200, 64, 300, 0, 65]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, 4, 2, d, dtype, seed=d + 7)
    q, k, v = (torch.cat([t, torch.full_like(t[:3], float("nan"))]) for t in (q, k, v))
    dout = torch.randn_like(q)
    dout[-3:] = float("nan")

    def each_sequence(grads):
        check_sequences_after_nan_rows(grads, q, k, v, dout, cu_q, cu_k, causal, window)

    launched = launched_backward_modules(monkeypatch)
    _, grads = run_with_grad(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), dout,
                             causal=causal, window_size=window)
    assert {(ws.name, "dkdv_dq_varlen"), (ws.name, "dq_convert_varlen")} <= set(launched), \
        launched
    each_sequence(grads)
    launched.clear()
    _, fixed = run_with_grad(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), dout,
                             causal=causal, window_size=window, deterministic=True)
    assert launched and all(role != "dkdv_dq_varlen" for _, role in launched), launched
    each_sequence(fixed)


def test_varlen_gradients_through_packed_qkv():
    """The usual training layout: one (total, 3, h, d) tensor, unbound into q, k, v."""
    from cudaflash import flash_attn_varlen_qkvpacked_func

    dtype, d = BWD_COMBOS[0]
    lens = [50, 300, 7]
    q, k, v, cu, _ = packed(lens, lens, 2, 2, d, DTYPES[dtype], seed=3)
    qkv = torch.stack([q, k, v], dim=1).requires_grad_()
    dout = torch.randn_like(q)
    flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), causal=True).backward(dout)
    check_each_sequence(qkv.grad.unbind(1), q, k, v, dout, cu, cu, True)


def test_maxima_larger_than_the_longest_sequence():
    dtype, d = BWD_COMBOS[-1]
    lens_q, lens_k = [100, 3], [60, 200]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, 2, 1, d, DTYPES[dtype], seed=4)
    dout = torch.randn_like(q)
    _, grads = run_with_grad(q, k, v, cu_q, cu_k, 1000, 5000, dout, causal=True)
    check_each_sequence(grads, q, k, v, dout, cu_q, cu_k, True)


def test_gradients_under_torch_compile():
    """No autograd formula for the varlen custom op yet: the call runs eagerly inside the
    compiled function (a graph break), with the same gradients."""
    dtype, d = BWD_COMBOS[0]
    lens = [77, 200]
    q, k, v, cu, _ = packed(lens, lens, 2, 2, d, DTYPES[dtype], seed=5)
    dout = torch.randn_like(q)

    def attention(q, k, v):
        return flash_attn_varlen_func(q, k, v, cu, cu, 200, 200, causal=True) * 2.0

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch.compile(attention)(*leaves).backward(dout)
    check_each_sequence([t.grad / 2.0 for t in leaves], q, k, v, dout, cu, cu, True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)),
                                           (False, (90, 40))],
                         ids=["noncausal", "causal", "window"])
def test_d256_varlen_takes_the_warp_specialized_kernels(dtype, causal, window, monkeypatch):
    """On Hopper a d256 packed batch without score modifiers runs the warp-specialized
    kernels, each sequence read from its first row of maps over the packed tensors (rows past
    a sequence's end are the next sequence's: masked); a refused map sends the call to the
    mma.sync module. Both within the rule per sequence."""
    import _internals as internals
    from cudaflash import _tma
    from test_gpu_backward import d256_warp_specialized_backward, launched_backward_modules

    ws = d256_warp_specialized_backward(dtype)
    lens_q, lens_k = [70, 1, 300, 129, 64], [200, 64, 300, 0, 65]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, 4, 2, 256, dtype, seed=31)
    # Spare rows after the last sequence, NaN: a tile past a sequence's end reads its
    # neighbour's rows (here the last sequence's tiles read these), which must not leak in.
    q, k, v = (torch.cat([t, torch.full_like(t[:3], float("nan"))]) for t in (q, k, v))
    dout = torch.randn_like(q)
    dout[-3:] = float("nan")

    def each_sequence(grads):
        check_sequences_after_nan_rows(grads, q, k, v, dout, cu_q, cu_k, causal, window)

    launched = launched_backward_modules(monkeypatch)
    _, grads = run_with_grad(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), dout,
                             causal=causal, window_size=window)
    gemm_modules = {name for name, role in launched if role.startswith(("dkdv", "dq"))}
    assert gemm_modules == {ws.name}, launched
    each_sequence(grads)
    internals.clear_backward_cache()
    launched.clear()
    with monkeypatch.context() as m:
        m.setattr(_tma, "backward_maps", lambda *args: None)
        _, fallback = run_with_grad(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), dout,
                                    causal=causal, window_size=window)
    internals.clear_backward_cache()
    assert launched and ws.name not in {name for name, _ in launched}, launched
    each_sequence(fallback)


def test_d256_varlen_maxima_below_a_length_stay_in_bounds():
    """max_seqlen_q/k below a sequence's real length (outside flash-attn's contract: its
    gradients are undefined) must not read or write out of bounds: the call completes and
    the other sequences' gradients are right."""
    from test_gpu_backward import d256_warp_specialized_backward

    d256_warp_specialized_backward(torch.bfloat16)
    lens = [64, 400, 30]
    q, k, v, cu_q, cu_k = packed(lens, lens, 2, 2, 256, torch.bfloat16, seed=8)
    dout = torch.randn_like(q)
    _, grads = run_with_grad(q, k, v, cu_q, cu_k, 200, 200, dout, causal=True)
    torch.cuda.synchronize()
    for b in (0, 2):
        rows = slice(cu_q[b].item(), cu_q[b + 1].item())
        check_grads([g[rows][None] for g in grads], q[rows][None], k[rows][None],
                    v[rows][None], dout[rows][None], True)
