"""flash_attn_func's backward on a GPU: dq, dk, dv against autograd through the attention
math in PyTorch, with FlashAttention's accuracy rule (test_gpu_correctness): the error
against the float32 math at most twice that of the same math in q's dtype, plus 1e-5. Both
schemes: atomic dq accumulation (deterministic=False, the default) and deterministic."""

import pytest
import torch

from cudaflash import _driver, _tma, flash_attn_func
from cudaflash import backward as backward_module
from cudaflash.backward_config import BWD_D_HEADS
from test_gpu_correctness import (COMBOS, DTYPES, _assert_within, _combo_id, attention_ref,
                                  check_attention, fp32_reference_without_tf32,  # noqa: F401
                                  make_qkv)

import _internals as internals

pytestmark = pytest.mark.requires_gpu

BWD_COMBOS = [c for c in COMBOS if c[1] in BWD_D_HEADS]


def force_atomic_kernels(monkeypatch):
    """Small calls run the deterministic kernels in either scheme (effective_scheme); these
    tests want the atomic kernels on every shape."""
    internals.force_atomic_kernels(monkeypatch)


def reference_grads(q, k, v, dout, causal, scale, upcast):
    """(dq, dk, dv) of attention_ref by autograd, in float32 (upcast) or in q's dtype."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, _ = attention_ref(*leaves, causal, scale, upcast)
    out.backward(dout.float() if upcast else dout)
    return [t.grad for t in leaves]


def check_grads(grads, q, k, v, dout, causal, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    assert_grads_within(grads, reference_grads(q, k, v, dout, causal, scale, True),
                        reference_grads(q, k, v, dout, causal, scale, False), (q, k, v))


def assert_grads_within(grads, ref, lowp, inputs):
    """(dq, dk, dv) computed, finite, shaped and typed as ``inputs`` and within the accuracy
    rule of the float32 reference ``ref`` and the low-precision one ``lowp``."""
    for name, ours, r, lp, t in zip(("dq", "dk", "dv"), grads, ref, lowp, inputs):
        assert ours is not None, f"{name} was not computed"
        assert ours.shape == t.shape and ours.dtype == t.dtype, name
        bad = (~torch.isfinite(ours)).sum().item()
        assert bad == 0, f"{name} has {bad} NaN/inf elements"
        _assert_within(name, ours, r, lp)


def run_with_grad(q, k, v, dout, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = flash_attn_func(*leaves, **kwargs)
    assert out.grad_fn is not None
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves]


def assert_compiled_matches_eager(q, k, v, dout, **kwargs):
    """flash_attn_func(**kwargs) compiled with fullgraph=True gives eager's out and gradients,
    bitwise (pass deterministic=True: the atomic scheme's dq varies from run to run)."""
    eager_out, eager_grads = run_with_grad(q, k, v, dout, **kwargs)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, **kwargs), fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = compiled(*leaves)
    out.backward(dout)
    assert torch.equal(out, eager_out)
    for ours, ref in zip((t.grad for t in leaves), eager_grads):
        assert torch.equal(ours, ref)


# (batch, seqlen_q, seqlen_k, nheads, nheads_k)
SHAPES = [
    (2, 113, 113, 3, 3),  # tails of both sequences, odd head count
    (1, 17, 1000, 4, 2),  # seqlen_q < seqlen_k, GQA
    (1, 1000, 17, 2, 1),  # seqlen_q > seqlen_k: causal rows that see no key; MQA
    (2, 1, 300, 2, 2),  # one query row
    (1, 1000, 2049, 2, 2),
    (1, 512, 512, 2, 2),  # whole tiles only
]


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "b{}_q{}_k{}_h{}_hk{}".format(*s))
@pytest.mark.parametrize("combo", BWD_COMBOS, ids=_combo_id)
def test_gradients(combo, shape, causal, deterministic, monkeypatch):
    force_atomic_kernels(monkeypatch)
    dtype, d = combo
    b, sq, sk, h, hk = shape
    q, k, v = make_qkv(b, sq, sk, h, hk, d, DTYPES[dtype], seed=sq + sk)
    dout = torch.randn_like(q)
    out, grads = run_with_grad(q, k, v, dout, causal=causal, deterministic=deterministic)
    check_attention(out, None, q, k, v, causal)  # the forward under autograd is the same
    check_grads(grads, q, k, v, dout, causal)


@pytest.mark.parametrize("combo", BWD_COMBOS, ids=_combo_id)
def test_gradients_with_softmax_scale_and_lse(combo):
    dtype, d = combo
    q, k, v = make_qkv(2, 200, 300, 4, 1, d, DTYPES[dtype], seed=3)
    dout = torch.randn_like(q)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = flash_attn_func(*leaves, softmax_scale=0.3, causal=True,
                                  return_attn_probs=True)
    assert not lse.requires_grad  # the lse is not differentiable, as in flash-attn
    out.backward(dout)
    check_grads([t.grad for t in leaves], q, k, v, dout, True, scale=0.3)


def test_gradients_of_views_reach_their_base():
    """Packed qkv (b, s, 3, h, d) unbound into strided views, and (b, h, s, d) tensors seen
    through transpose(1, 2): the kernels read the strides, autograd sums into the bases."""
    dtype, d = BWD_COMBOS[0]
    b, s, h = 2, 300, 4
    g = torch.Generator(device="cuda").manual_seed(5)
    qkv = torch.randn((b, s, 3, h, d), generator=g, device="cuda", dtype=DTYPES[dtype])
    dout = torch.randn((b, s, h, d), generator=g, device="cuda", dtype=DTYPES[dtype])
    packed = qkv.clone().requires_grad_()
    flash_attn_func(*packed.unbind(2), causal=True, deterministic=True).backward(dout)
    grads = packed.grad.unbind(2)
    check_grads(grads, *qkv.unbind(2), dout, True)

    bhsd = [t.transpose(1, 2).contiguous().requires_grad_() for t in qkv.unbind(2)]
    flash_attn_func(*[t.transpose(1, 2) for t in bhsd], causal=True,
                    deterministic=True).backward(dout)
    for ours, ref in zip(bhsd, grads):
        assert torch.equal(ours.grad.transpose(1, 2), ref), "strides change the gradient"


def test_expanded_output_gradient():
    """out.sum() hands the backward an expanded dout (all strides 0): copied, not misread."""
    dtype, d = BWD_COMBOS[-1]
    q, k, v = make_qkv(1, 100, 100, 2, 2, d, DTYPES[dtype], seed=7)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    flash_attn_func(*leaves).sum().backward()
    check_grads([t.grad for t in leaves], q, k, v, torch.ones_like(q), False)


def test_only_some_inputs_require_grad():
    dtype, d = BWD_COMBOS[0]
    q, k, v = make_qkv(1, 64, 64, 2, 2, d, DTYPES[dtype], seed=8)
    dout = torch.randn_like(q)
    kk = k.clone().requires_grad_()
    flash_attn_func(q, kk, v, causal=True).backward(dout)
    ref = reference_grads(q, k, v, dout, True, d ** -0.5, True)
    lowp = reference_grads(q, k, v, dout, True, d ** -0.5, False)
    _assert_within("dk", kk.grad, ref[1], lowp[1])


def test_repeat_training_calls_replay_the_forward_plan(monkeypatch):
    """The forward of a training call replays its signature's plan as an inference call
    does (the checked path costs a training step at 1k tokens ~10% on the H100: its host
    time delays the backward's launches); new tensors, same signature: right out and
    gradients, and the checked path never runs."""
    dtype, d = ("bf16", 128) if ("bf16", 128) in BWD_COMBOS else BWD_COMBOS[0]
    q, k, v = make_qkv(2, 300, 300, 4, 2, d, DTYPES[dtype], seed=41)
    dout = torch.randn_like(q)
    run_with_grad(q, k, v, dout, causal=True)  # records the plan
    q2, k2, v2 = make_qkv(2, 300, 300, 4, 2, d, DTYPES[dtype], seed=42)

    def refuse(*args, **kwargs):
        raise AssertionError("the repeat training call took the checked path")

    with monkeypatch.context() as m:
        internals.replace_checked_forward(m, refuse)
        out, grads = run_with_grad(q2, k2, v2, dout, causal=True)
    check_attention(out, None, q2, k2, v2, True)
    check_grads(grads, q2, k2, v2, dout, True)


def test_repeat_backward_calls_take_their_plan(monkeypatch):
    """The backward of a signature seen before replays its plan (module, maps layout,
    launches and fixed BwdParams: backward._Plan) on the new tensors, with right gradients;
    deterministic=True is another signature, bitwise reproducible through its own plan."""
    dtype, d = ("bf16", 128) if ("bf16", 128) in BWD_COMBOS else BWD_COMBOS[0]
    internals.fresh_backward_plans(monkeypatch)
    q, k, v = make_qkv(2, 700, 700, 4, 2, d, DTYPES[dtype], seed=43)
    dout = torch.randn_like(q)
    run_with_grad(q, k, v, dout, causal=True)
    assert len(backward_module._plans) == 1
    q2, k2, v2 = make_qkv(2, 700, 700, 4, 2, d, DTYPES[dtype], seed=44)

    def refuse(*args, **kwargs):
        raise AssertionError("the repeat backward call made a new plan")

    with monkeypatch.context() as m:
        m.setattr(backward_module, "_new_plan", refuse)
        _, grads = run_with_grad(q2, k2, v2, dout, causal=True)
    check_grads(grads, q2, k2, v2, dout, True)
    fixed = [run_with_grad(q2, k2, v2, dout, causal=True, deterministic=True)[1]
             for _ in range(2)]
    assert len(backward_module._plans) == 2
    for a, b in zip(*fixed):
        assert torch.equal(a, b)
    check_grads(fixed[0], q2, k2, v2, dout, True)


def test_deterministic_backward_is_bitwise_reproducible():
    dtype, d = BWD_COMBOS[-1]
    q, k, v = make_qkv(2, 777, 1500, 8, 2, d, DTYPES[dtype], seed=9)
    dout = torch.randn_like(q)
    first = run_with_grad(q, k, v, dout, causal=True, deterministic=True)[1]
    second = run_with_grad(q, k, v, dout, causal=True, deterministic=True)[1]
    for a, b in zip(first, second):
        assert torch.equal(a, b), "two backward passes differ"
    # torch's global switch picks the same scheme without the argument.
    torch.use_deterministic_algorithms(True)
    try:
        third = run_with_grad(q, k, v, dout, causal=True)[1]
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip(first, third):
        assert torch.equal(a, b), "use_deterministic_algorithms did not pick the scheme"


@pytest.mark.parametrize("combo", BWD_COMBOS, ids=_combo_id)
def test_atomic_scheme_differs_from_deterministic_only_in_dq_rounding(combo, monkeypatch):
    """Where one module serves both schemes, dk and dv come from the same arithmetic
    (bitwise equal); dq is summed in another order, so it may differ in its last bits. Both
    are within the rule whichever modules serve them."""
    force_atomic_kernels(monkeypatch)
    dtype, d = combo
    q, k, v = make_qkv(2, 600, 900, 8, 2, d, DTYPES[dtype], seed=13)
    dout = torch.randn_like(q)
    atomic = run_with_grad(q, k, v, dout, causal=True, deterministic=False)[1]
    fixed = run_with_grad(q, k, v, dout, causal=True, deterministic=True)[1]
    index = torch.cuda.current_device()
    same_module = (internals.find_backward_entry(index, q.dtype, d, "atomic")
                   is internals.find_backward_entry(index, q.dtype, d, "deterministic"))
    if same_module:
        assert torch.equal(atomic[1], fixed[1]) and torch.equal(atomic[2], fixed[2])
    check_grads(atomic, q, k, v, dout, True)
    check_grads(fixed, q, k, v, dout, True)
    scale = (fixed[0].float().abs().max() + 1e-6)
    assert (atomic[0].float() - fixed[0].float()).abs().max() / scale < 1e-2


def for_each_backward_module(monkeypatch, body, plain=True):
    """body(entry) for each shipped backward module this GPU can run, not only the one the
    selection picks, as the one every backward call finds; a failure names the module.
    ``plain``: body's calls are padded batches without score modifiers; False leaves out the
    modules that serve only those (BackwardConfig.plain_calls_only: their other entries are
    traps)."""
    entries = [e for e in internals.usable_backward_entries(torch.cuda.current_device())
               if plain or not e.config.plain_calls_only]
    assert entries, "no backward module runs on this GPU"
    for entry in entries:
        with monkeypatch.context() as m:
            internals.force_backward_module(m, entry)
            try:
                body(entry)
            except AssertionError as e:
                raise AssertionError(f"{entry.name}: {e}") from None
            finally:
                internals.clear_backward_cache()


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_every_backward_module_that_runs_here(causal, monkeypatch):
    """Each shipped backward module this GPU can run, not only the one the selection picks
    (the others serve other GPUs), in each scheme
    it serves, on a shape with tails, GQA and more than one query tile per step."""
    force_atomic_kernels(monkeypatch)

    def body(entry):
        cfg = entry.config
        q, k, v = make_qkv(2, 333, 517, 4, 2, cfg.d_head, DTYPES[cfg.dtype], seed=21)
        dout = torch.randn_like(q)
        for scheme in entry.schemes:
            _, grads = run_with_grad(q, k, v, dout, causal=causal,
                                     deterministic=scheme == "deterministic")
            try:
                check_grads(grads, q, k, v, dout, causal)
            except AssertionError as e:
                raise AssertionError(f"({scheme}) {e}") from None

    for_each_backward_module(monkeypatch, body)


def test_key_tail_with_very_negative_scores_gives_finite_gradients(monkeypatch):
    """Every score -100 (lse about -96) and 65 keys: the dK/dV kernels' last key tile holds
    zero-filled keys past seqlen_k whose score is 0, so unmasked their P = exp(-lse)
    overflows, and the fused kernels' dQ (dS times K's zero rows) became NaN. Each module
    this GPU runs, each scheme it serves."""
    force_atomic_kernels(monkeypatch)

    def body(entry):
        cfg = entry.config
        d, dtype = cfg.d_head, DTYPES[cfg.dtype]
        a = (100.0 * d ** 0.5) ** 0.5  # q.k * d^-0.5 = -100 for every (query, key)
        u = torch.zeros(d, device="cuda")
        u[0] = 1.0
        k = (a * u).expand(1, 65, 2, d).to(dtype).contiguous()
        q = (-a * u).expand(1, 256, 4, d).to(dtype).contiguous()
        v = torch.randn(1, 65, 2, d, device="cuda", dtype=dtype)
        dout = torch.randn(1, 256, 4, d, device="cuda", dtype=dtype)
        for scheme in entry.schemes:
            _, grads = run_with_grad(q, k, v, dout, causal=False,
                                     deterministic=scheme == "deterministic")
            try:
                check_grads(grads, q, k, v, dout, False)
            except AssertionError as e:
                raise AssertionError(f"({scheme}) {e}") from None

    for_each_backward_module(monkeypatch, body)


class PoisonedTorch:
    """torch as cudaflash/backward.py sees it, except that torch.empty fills floating-point
    tensors with NaN: a kernel reading a buffer element nobody wrote then gives NaN."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        t = torch.empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t


def warp_specialized_backward(dtype, d):
    """The atomic scheme's module for (dtype, d) when it is the warp-specialized one (sm_90),
    else skip: only that kernel loads through tensor maps."""
    entry = internals.find_backward_entry(torch.cuda.current_device(), dtype, d, "atomic")
    if entry is None or not entry.config.warp_specialized:
        pytest.skip("the warp-specialized backward (tensor-map loads) runs on sm_90 only")
    return entry


# (d256 has no atomic-scheme module: its warp-specialized kernels have tests of their own)
@pytest.mark.parametrize("combo", [c for c in BWD_COMBOS if c[1] != 256], ids=_combo_id)
@pytest.mark.parametrize("b,sq,sk,h,hk,causal", [
    (2, 333, 517, 4, 2, False),  # query and key tails (zero fill), GQA
    (1, 700, 300, 2, 1, True),  # MQA, more query rows than keys, bottom-right causal
    (3, 129, 1000, 2, 2, True),  # one row past a query tile: the padded statistics
])
def test_warp_specialized_backward_loads_through_maps(combo, b, sq, sk, h, hk, causal,
                                                      monkeypatch):
    """The warp-specialized backward's loader takes q, k, v and dout through tensor maps
    (written into BwdParams on every call) and each tile's lse and delta from the padded
    statistics: gradients within the rule, rows and keys past the ends included. The
    backward's float buffers start as NaN (PoisonedTorch), so a padded statistic the
    preprocess kernel failed to write (past seqlen_q: lse +inf, delta 0) shows as NaN."""
    force_atomic_kernels(monkeypatch)
    dtype, d = combo
    warp_specialized_backward(DTYPES[dtype], d)
    monkeypatch.setattr(backward_module, "torch", PoisonedTorch())
    writes = []
    write = _tma.TensorMaps.write
    monkeypatch.setattr(_tma.TensorMaps, "write",
                        lambda maps, at, *ptrs: writes.append(len(ptrs)) or
                        write(maps, at, *ptrs))
    q, k, v = make_qkv(b, sq, sk, h, hk, d, DTYPES[dtype], seed=sq + sk)
    dout = torch.randn_like(q)
    _, grads = run_with_grad(q, k, v, dout, causal=causal)
    assert 4 in writes, f"the backward wrote no maps of q, k, v, dout (writes: {writes})"
    check_grads(grads, q, k, v, dout, causal)


def test_warp_specialized_backward_reads_strided_dout_and_qkv(monkeypatch):
    """Maps of strided views: q, k, v slices of one packed qkv tensor (autograd hands the
    backward those views, not copies) and a dout view of a wider tensor (kernel-ready
    strides, not contiguous)."""
    force_atomic_kernels(monkeypatch)
    dtype, d = "bf16", 128  # a head dim the warp-specialized kernel serves
    warp_specialized_backward(DTYPES[dtype], d)
    qkv = torch.randn(2, 300, 3, 4, d, dtype=DTYPES[dtype], device="cuda")
    wide = torch.randn(2, 300, 6, d, dtype=DTYPES[dtype], device="cuda")
    dout = wide[:, :, 1:5]
    assert not dout.is_contiguous()
    seen = []
    maps = _tma.backward_maps
    monkeypatch.setattr(_tma, "backward_maps",
                        lambda q, k, v, do, *rows: seen.append((q.stride(), do.stride())) or
                        maps(q, k, v, do, *rows))
    packed = qkv.clone().requires_grad_()
    flash_attn_func(*packed.unbind(2), causal=True).backward(dout)
    assert len(seen) == 1 and seen[0][0] == qkv[:, :, 0].stride(), seen  # q as the view
    check_grads(packed.grad.unbind(2), *qkv.unbind(2), dout.contiguous(), True)


@pytest.mark.parametrize("refused", ["layout", "pointers"])
def test_backward_without_maps_takes_the_deterministic_kernels(refused, monkeypatch):
    """Should the driver refuse a map (of the layout: backward_maps gives None; or of these
    pointers: the encode raises CudaError), the call runs the deterministic kernels: bit for
    bit what deterministic=True gives."""
    force_atomic_kernels(monkeypatch)
    dtype, d = "bf16", 128  # a head dim the warp-specialized kernel serves
    warp_specialized_backward(DTYPES[dtype], d)
    q, k, v = make_qkv(2, 400, 400, 4, 2, d, DTYPES[dtype], seed=5)
    dout = torch.randn_like(q)
    fixed = run_with_grad(q, k, v, dout, causal=True, deterministic=True)[1]
    if refused == "layout":
        monkeypatch.setattr(_tma, "backward_maps", lambda *args: None)
    else:
        def refuse(*args):
            raise _driver.CudaError("cuTensorMapEncodeTiled refused (test)")

        monkeypatch.setattr(_tma.TensorMaps, "write", refuse)
    fallback = run_with_grad(q, k, v, dout, causal=True)[1]
    for a, b in zip(fallback, fixed):
        assert torch.equal(a, b)


def d256_backward(dtype):
    """The d256 backward module this GPU runs, or skip (it is built for sm_80 and sm_90)."""
    entry = internals.find_backward_entry(torch.cuda.current_device(), DTYPES[dtype], 256,
                                          "deterministic")
    if entry is None:
        pytest.skip("no d256 backward module runs on this GPU")
    return entry


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_d256_backward_runs_the_deterministic_kernels_in_either_scheme(dtype, deterministic,
                                                                       monkeypatch):
    """Head dim 256 has no fused kernel: a call that leaves the atomic scheme allowed runs
    the two-pass deterministic kernels, bit for bit what deterministic=True gives, and both
    are within the rule (tails, GQA, causal)."""
    force_atomic_kernels(monkeypatch)
    entry = d256_backward(dtype)
    assert not entry.config.fuses_dq
    assert internals.find_backward_entry(torch.cuda.current_device(), DTYPES[dtype], 256,
                                         "atomic") is None
    q, k, v = make_qkv(2, 333, 517, 4, 2, 256, DTYPES[dtype], seed=17)
    dout = torch.randn_like(q)
    grads = run_with_grad(q, k, v, dout, causal=True, deterministic=deterministic)[1]
    fixed = run_with_grad(q, k, v, dout, causal=True, deterministic=True)[1]
    for a, b in zip(grads, fixed):
        assert torch.equal(a, b)
    check_grads(grads, q, k, v, dout, True)


def launched_backward_modules(monkeypatch) -> list:
    """A list that collects (module name, role) of every backward kernel launched from now on
    (backward._launch_step)."""
    launched = []
    launch = backward_module._launch_step

    def spy(kernel, role, *args):
        launched.append((kernel.entry.name, role))
        return launch(kernel, role, *args)

    monkeypatch.setattr(backward_module, "_launch_step", spy)
    return launched


def d256_warp_specialized_backward(dtype):
    """The d256 warp-specialized module on Hopper (asserted present there), else skip."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the d256 warp-specialized backward runs on sm_90 only")
    entry = internals.find_backward_entry(torch.cuda.current_device(), dtype, 256,
                                          "deterministic", True)
    assert entry is not None and entry.config.dkdv_warp_specialized, entry
    return entry


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("b,sq,sk,h,hk,causal", [
    (2, 333, 517, 4, 2, False),  # query and key tails (zero fill), GQA
    (1, 700, 300, 2, 1, True),  # MQA, more query rows than keys, bottom-right causal
    (2, 64, 64, 8, 8, True),  # one key tile per CTA, one query tile
    (1, 1000, 1000, 2, 2, False),  # many query tiles per step loop (ring wrap-around)
])
def test_d256_warp_specialized_dkdv_and_its_fallback(dtype, b, sq, sk, h, hk, causal,
                                                      monkeypatch):
    """On Hopper a padded d256 call without score modifiers takes the warp-specialized dK/dV
    and dQ kernels (two warpgroups on the same 64 keys or query rows, P and dS handed over in
    shared memory): within
    the rule, and bitwise reproducible. When its tensor maps are refused the call runs on
    the mma.sync module, within the rule too."""
    ws = d256_warp_specialized_backward(DTYPES[dtype])
    fallback_entry = internals.find_backward_entry(torch.cuda.current_device(), DTYPES[dtype],
                                                   256, "deterministic")
    assert fallback_entry is not None and not fallback_entry.config.plain_calls_only
    q, k, v = make_qkv(b, sq, sk, h, hk, 256, DTYPES[dtype], seed=sq + sk)
    dout = torch.randn_like(q)
    launched = launched_backward_modules(monkeypatch)
    out, grads = run_with_grad(q, k, v, dout, causal=causal, deterministic=False)
    assert {name for name, role in launched if role in ("dkdv", "dq")} == {ws.name}, launched
    check_grads(grads, q, k, v, dout, causal)
    again = run_with_grad(q, k, v, dout, causal=causal, deterministic=True)[1]
    for a, c in zip(grads, again):  # (either scheme runs these deterministic kernels)
        assert torch.equal(a, c), "the deterministic kernels are not bitwise reproducible"
    internals.clear_backward_cache()
    launched.clear()
    with monkeypatch.context() as m:
        m.setattr(_tma, "backward_maps", lambda *args: None)
        fallback = run_with_grad(q, k, v, dout, causal=causal, deterministic=True)[1]
    internals.clear_backward_cache()
    assert {name for name, role in launched if role in ("dkdv", "dq")} == {fallback_entry.name}
    check_grads(fallback, q, k, v, dout, causal)


@pytest.mark.parametrize("d", [160, 192, 255])
def test_head_dims_padded_to_256_have_gradients(d):
    """Head dims 129-255 run padded to 256, gradients included (they come back at the
    caller's head dim)."""
    d256_backward("bf16")
    q, k, v = make_qkv(2, 200, 300, 4, 2, d, torch.bfloat16, seed=d)
    dout = torch.randn_like(q)
    out, grads = run_with_grad(q, k, v, dout, causal=False)
    assert out.shape == q.shape and all(g.shape == t.shape for g, t in zip(grads, (q, k, v)))
    check_grads(grads, q, k, v, dout, False)


def test_empty_sequences_give_zero_gradients():
    dtype, d = BWD_COMBOS[0]
    for sq, sk in ((0, 10), (10, 0)):
        q, k, v = make_qkv(1, sq, sk, 2, 2, d, DTYPES[dtype])
        out, grads = run_with_grad(q, k, v, torch.randn_like(q), causal=True)
        for g, t in zip(grads, (q, k, v)):
            assert g.shape == t.shape and not g.any()


def test_unsupported_head_dim_fails_at_the_forward():
    dtype = BWD_COMBOS[0][0]
    unsupported = [d for dt, d in COMBOS if dt == dtype and d not in BWD_D_HEADS]
    if not unsupported:
        pytest.skip("no forward kernel with a head dim the backward lacks is built")
    q, k, v = make_qkv(1, 64, 64, 2, 2, unsupported[0], DTYPES[dtype])
    with pytest.raises(NotImplementedError, match=r"no backward kernel .* head dim "
                                                  rf"{unsupported[0]}.*torch.no_grad"):
        flash_attn_func(q.requires_grad_(), k, v)
    with torch.no_grad():
        flash_attn_func(q, k, v)  # inference still works


def test_torch_compile_backward_matches_eager():
    dtype, d = BWD_COMBOS[-1]
    q, k, v = make_qkv(2, 256, 256, 4, 2, d, DTYPES[dtype], seed=11)
    dout = torch.randn_like(q)
    eager = run_with_grad(q, k, v, dout, causal=True, deterministic=True)[1]
    torch._dynamo.reset()
    # (No arithmetic around the call: dout / 2 * 2 is not exact for fp16 subnormals.)
    compiled = torch.compile(
        lambda q, k, v: flash_attn_func(q, k, v, causal=True, deterministic=True),
        fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled(*leaves).backward(dout)
    for ours, ref in zip((t.grad for t in leaves), eager):
        assert torch.equal(ours, ref)


def test_debug_mode_synchronizes_and_passes(monkeypatch):
    monkeypatch.setenv("CUDAFLASH_DEBUG", "1")
    internals.clear_caches()
    try:
        dtype, d = BWD_COMBOS[0]
        q, k, v = make_qkv(1, 100, 100, 2, 2, d, DTYPES[dtype], seed=12)
        dout = torch.randn_like(q)
        _, grads = run_with_grad(q, k, v, dout)
        check_grads(grads, q, k, v, dout, False)
    finally:
        monkeypatch.delenv("CUDAFLASH_DEBUG")
        internals.clear_caches()
