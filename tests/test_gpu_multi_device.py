"""Several GPUs in one process: calls on cuda:1 while cuda:0 is current (every public entry,
the split-KV workspace, the plans), the current stream of the tensors' device, gradients and
CUDA graphs on the second GPU, two threads on two GPUs at once, and arguments on different
devices refused with their names and devices. Needs two GPUs; skipped with the reason
otherwise.

Where both GPUs are the same model the same call gives bitwise the same result on each (the
forward and the deterministic backward are deterministic, and the kernel choice depends only
on the GPU), so results on cuda:1 are compared with cuda:0's exactly; otherwise with
FlashAttention's accuracy rule (test_gpu_correctness)."""

import threading
import traceback

import pytest
import torch

from cudaflash import (flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache,
                       forward)
from cudaflash.backward_config import BWD_D_HEADS
from cudaflash.distributed import ring_flash_attn_func
from test_gpu_backward import check_grads
from test_gpu_correctness import COMBOS, DTYPES, check_attention

import _internals as internals

pytestmark = [
    pytest.mark.requires_gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason=f"needs 2 CUDA GPUs; torch sees "
                              f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}"),
]


def combo():
    """(dtype, head dim) with a backward: bf16 d128 where built."""
    for wanted in (("bf16", 128), ("fp16", 64)):
        if wanted in COMBOS:
            return DTYPES[wanted[0]], wanted[1]
    pytest.skip(f"no bf16 d128 or fp16 d64 kernels for this GPU (built: {COMBOS})")


DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def same_gpus() -> bool:
    a, b = (torch.cuda.get_device_properties(i) for i in (0, 1))
    return (a.name, a.major, a.minor, a.multi_processor_count) == \
        (b.name, b.major, b.minor, b.multi_processor_count)


def randn(device, *shape, dtype, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device, dtype=dtype)


def qkv_on(device, b, sq, sk, h, hk, seed=0):
    dtype, d = combo()
    return (randn(device, b, sq, h, d, dtype=dtype, seed=seed),
            randn(device, b, sk, hk, d, dtype=dtype, seed=seed + 1),
            randn(device, b, sk, hk, d, dtype=dtype, seed=seed + 2))


def assert_same(what, ours, theirs):
    """``ours`` (from cuda:1) equals ``theirs`` (cuda:0), element for element."""
    ours, theirs = ours.cpu(), theirs.cpu()
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, what
    diff = (ours.float() - theirs.float()).abs().max().item() if ours.numel() else 0.0
    assert torch.equal(ours, theirs), f"{what}: cuda:1 differs from cuda:0 by up to {diff:.3g}"


# ---- every entry on cuda:1 while cuda:0 is current --------------------------------------------


def _plain(q, k, v):
    return flash_attn_func(q, k, v, causal=True, return_attn_probs=True)[:2]


def _decode_split(q, k, v):  # one query row, 4096 keys: split-KV, a workspace on q's device
    k, v = k.repeat(1, 16, 1, 1), v.repeat(1, 16, 1, 1)
    return flash_attn_func(q[:, :1], k, v, causal=True, return_attn_probs=True)[:2]


def _window(q, k, v):
    return flash_attn_func(q, k, v, causal=True, window_size=(100, 0), return_attn_probs=True)[:2]


def _varlen(q, k, v):
    cu = torch.tensor([0, 100, 230, 512], dtype=torch.int32, device=q.device)
    return flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu,
                                  282, 282, causal=True, return_attn_probs=True)[:2]


def _kvcache(q, k, v):
    k_cache, v_cache = k.clone(), v.clone()
    lengths = torch.tensor([100, 200], dtype=torch.int32, device=q.device)
    out, lse = flash_attn_with_kvcache(q[:, :3], k_cache, v_cache, k=q[:, :2, :k.shape[2]],
                                       v=q[:, 2:4, :k.shape[2]], cache_seqlens=lengths,
                                       causal=True, return_softmax_lse=True)
    return out, lse, k_cache  # the append went into the cache on q's device


def config_for(q, k, causal):
    """The config flash_attn_func would run for q, k (a name)."""
    return internals.selected_config(q.get_device(), DTYPE_NAMES[q.dtype], q.shape[3], causal,
                                     q.shape[1], k.shape[1], q.shape[2], k.shape[2])[0]


def _explicit_config(q, k, v):
    return forward(config_for(q, k, True), q, k, v, causal=True, num_splits=2)


CALLS = [_plain, _decode_split, _window, _varlen, _kvcache, _explicit_config]


@pytest.mark.parametrize("call", CALLS, ids=lambda c: c.__name__.strip("_"))
def test_call_on_the_second_gpu_while_the_first_is_current(call):
    inputs0 = qkv_on("cuda:0", 2, 256, 256, 4, 2, seed=3)
    inputs1 = tuple(t.to("cuda:1") for t in inputs0)
    with torch.cuda.device(0):
        expected = call(*inputs0)
        for repeat in range(2):  # the second call finds a plan it cannot use here
            got = call(*inputs1)
            assert torch.cuda.current_device() == 0, "the call changed the current device"
            for i, (ours, theirs) in enumerate(zip(got, expected)):
                assert ours.device == torch.device("cuda:1"), f"result {i} on {ours.device}"
                what = f"{call.__name__} result {i}, call {repeat}"
                if same_gpus():
                    assert_same(what, ours, theirs)
                else:  # other kernels may run there: close, not equal
                    assert torch.allclose(ours.cpu().float(), theirs.cpu().float(), atol=2e-2,
                                          rtol=2e-2), f"{what}: cuda:1 far from cuda:0"
    if call is _plain:
        q, k, v = inputs1
        check_attention(got[0], got[1], q, k, v, causal=True)


def test_plans_are_kept_per_device(monkeypatch):
    """The same signature on two devices: two plans, each replayed on its own device when
    that device is current (no checked call), each launching there."""
    checked = []

    def counting(*args, **kwargs):
        checked.append(args[1].device)  # q's
        return internals.checked_forward(*args, **kwargs)

    internals.clear_caches()
    internals.replace_checked_forward(monkeypatch, counting)
    inputs = {i: qkv_on(f"cuda:{i}", 1, 300, 300, 4, 4, seed=5) for i in (0, 1)}
    outs = {}
    for i in (0, 1):
        with torch.cuda.device(i):
            first = flash_attn_func(*inputs[i])
            outs[i] = flash_attn_func(*inputs[i])  # the plan
            assert torch.equal(first, outs[i])
            assert outs[i].device == torch.device(f"cuda:{i}")
    assert checked == [torch.device("cuda:0"), torch.device("cuda:1")]
    devices = sorted(key[9] for key in internals.plans)  # plan_key: q.get_device()
    assert devices == [0, 1]
    q, k, v = inputs[1]
    check_attention(outs[1], None, q, k, v, causal=False)


def test_the_launch_uses_the_current_stream_of_the_tensors_device():
    """Device 1's current stream is a side stream that is busy (a sleep, then q is
    rewritten); the call runs while cuda:0 is current. On device 1's side stream it sees the
    new q; on any other stream it would race the rewrite and see the old one."""
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep is missing in this torch build")
    q, k, v = qkv_on("cuda:1", 1, 512, 512, 4, 4, seed=7)
    fresh = randn("cuda:1", *q.shape, dtype=q.dtype, seed=99)
    torch.cuda.synchronize(1)
    side = torch.cuda.Stream(device=1)
    with torch.cuda.stream(side):  # device 1 current, its current stream `side`
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the rewrite
        q.copy_(fresh)
        with torch.cuda.device(0):
            out = flash_attn_func(q, k, v)
    side.synchronize()
    check_attention(out, None, fresh, k, v, causal=False)


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic"])
def test_gradients_on_the_second_gpu(deterministic):
    dtype, d = combo()
    if d not in BWD_D_HEADS:
        pytest.skip(f"no backward for head dim {d}")
    inputs0 = qkv_on("cuda:0", 2, 300, 300, 4, 2, seed=11)
    dout0 = randn("cuda:0", 2, 300, 4, d, dtype=dtype, seed=12)
    grads = {}
    with torch.cuda.device(0):
        for device in ("cuda:0", "cuda:1"):
            # detach: after the first device's pass the inputs require grad, and .to() would
            # give non-leaf tensors whose .grad stays None
            leaves = [t.detach().to(device).requires_grad_() for t in inputs0]
            out = flash_attn_func(*leaves, causal=True, deterministic=deterministic)
            out.backward(dout0.to(device))
            assert torch.cuda.current_device() == 0
            grads[device] = [t.grad for t in leaves]
            assert all(g.device == torch.device(device) for g in grads[device])
    check_grads(grads["cuda:1"], *(t.to("cuda:1") for t in inputs0), dout0.to("cuda:1"),
                causal=True)
    if deterministic and same_gpus():
        for name, ours, theirs in zip(("dq", "dk", "dv"), grads["cuda:1"], grads["cuda:0"]):
            assert_same(name, ours, theirs)


def test_cuda_graph_on_the_second_gpu():
    """Capture on cuda:1 (warm-up first, as torch asks; a capture stream of cuda:1: torch's
    default capture stream belongs to whichever device made the first graph), replay with
    new inputs while cuda:0 is current."""
    q, k, v = qkv_on("cuda:1", 2, 300, 300, 4, 2, seed=13)
    with torch.cuda.device(1):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            flash_attn_func(q, k, v, causal=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
            static_out = flash_attn_func(q, k, v, causal=True)
    with torch.cuda.device(0):
        for seed in (21, 22):
            for t, fresh in zip((q, k, v), qkv_on("cuda:1", 2, 300, 300, 4, 2, seed=seed)):
                t.copy_(fresh)
            graph.replay()
            torch.cuda.synchronize(1)
            check_attention(static_out, None, q, k, v, causal=True)


def test_forward_and_backward_in_one_graph_on_the_second_gpu():
    """A training step's attention (forward and backward) captured in one graph on cuda:1
    (torch's whole-network capture), replayed on new inputs while cuda:0 is current: the
    gradients of an eager step on the same inputs, bitwise (deterministic scheme)."""
    dtype, d = combo()
    if d not in BWD_D_HEADS:
        pytest.skip(f"no backward for head dim {d}")
    q, k, v = (t.requires_grad_() for t in qkv_on("cuda:1", 1, 256, 256, 4, 2, seed=17))
    dout = randn("cuda:1", 1, 256, 4, d, dtype=dtype, seed=18)

    def step(q, k, v):
        for t in (q, k, v):
            t.grad = None
        flash_attn_func(q, k, v, causal=True, deterministic=True).backward(dout)
        return [t.grad for t in (q, k, v)]

    with torch.cuda.device(1):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # module loads and kernel choice before the capture
                step(q, k, v)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
            static_grads = step(q, k, v)
    with torch.cuda.device(0):
        for seed in (23, 24):
            fresh = qkv_on("cuda:1", 1, 256, 256, 4, 2, seed=seed)
            with torch.no_grad():
                for t, new in zip((q, k, v), fresh):
                    t.copy_(new)
            graph.replay()
            torch.cuda.synchronize(1)
            eager = step(*(t.clone().requires_grad_() for t in fresh))
            for name, ours, theirs in zip(("dq", "dk", "dv"), static_grads, eager):
                assert torch.equal(ours, theirs), f"replayed {name} differs from eager"


def test_two_threads_on_two_gpus_at_once():
    """One thread per GPU, started together, each running its GPU's calls (forward with
    plans, a new shape, a backward): the same results as the calls run one by one. The
    threads are new: their first CUDA work is a repeat call, whose launch must bind the
    device's context itself."""
    dtype, d = combo()
    shapes = [(2, 256, 256, 4, 2), (1, 300, 700, 4, 4)]
    inputs = {i: [qkv_on(f"cuda:{i}", *s, seed=30 + n) for n, s in enumerate(shapes)]
              for i in (0, 1)}
    dout = {i: randn(f"cuda:{i}", 2, 256, 4, d, dtype=dtype, seed=40) for i in (0, 1)}

    def work(i):
        outs = [flash_attn_func(*qkv, causal=True) for qkv in inputs[i] for _ in range(3)]
        outs.append(flash_attn_func(*inputs[i][0], window_size=(50, 50)))  # a new signature
        grads = []
        if d in BWD_D_HEADS:
            leaves = [t.clone().requires_grad_() for t in inputs[i][0]]
            flash_attn_func(*leaves, causal=True, deterministic=True).backward(dout[i])
            grads = [t.grad for t in leaves]
        torch.cuda.synchronize(i)
        return outs, grads

    with torch.cuda.device(0):
        # One by one: the reference, and the plans the threads will find.
        expected = {i: work(i) for i in (0, 1)}
    results, errors = {}, []
    start = threading.Barrier(2)

    def thread(i):
        try:
            start.wait(timeout=60)
            results[i] = work(i)
        except BaseException:
            errors.append(f"thread of cuda:{i}:\n{traceback.format_exc()}")

    threads = [threading.Thread(target=thread, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread did not finish in 300 s"
    assert not errors, "\n".join(errors)
    for i in (0, 1):
        outs, grads = results[i]
        ref_outs, ref_grads = expected[i]
        for n, (ours, theirs) in enumerate(zip(outs + grads, ref_outs + ref_grads)):
            assert ours.device == torch.device(f"cuda:{i}")
            assert torch.equal(ours, theirs), f"cuda:{i}, result {n}: differs from the " \
                                              "same call run alone"


# ---- arguments on different devices -------------------------------------------------------------


def test_mixed_devices_are_refused_naming_the_arguments():
    q, k, v = qkv_on("cuda:0", 1, 128, 128, 2, 2)
    k1, v1 = k.to("cuda:1"), v.to("cuda:1")
    flash_attn_func(q, k, v)  # a plan for these shapes on cuda:0
    with pytest.raises(ValueError, match=r"q, k, v are on cuda:0, cuda:1, cuda:0; they must be "
                                         r"on the same device"):
        flash_attn_func(q, k1, v)
    with pytest.raises(ValueError, match=r"q, k, v are on cuda:0, cuda:1, cuda:1"):
        flash_attn_func(q.requires_grad_(), k1, v1)
    q = q.detach()
    cu0 = torch.tensor([0, 128], dtype=torch.int32, device="cuda:0")
    with pytest.raises(ValueError, match=r"cu_seqlens_k is on cuda:1 but q is on cuda:0"):
        flash_attn_varlen_func(q[0], k[0], v[0], cu0, cu0.to("cuda:1"), 128, 128)
    with pytest.raises(ValueError, match=r"q, k_cache, v_cache are on cuda:0, cuda:1, cuda:1"):
        flash_attn_with_kvcache(q, k1, v1)
    lengths = torch.tensor([64], dtype=torch.int32, device="cuda:1")
    with pytest.raises(ValueError, match=r"cache_seqlens is on cuda:1 but q is on cuda:0"):
        flash_attn_with_kvcache(q, k.clone(), v.clone(), cache_seqlens=lengths)
    with pytest.raises(ValueError, match=r"k is torch\.\w+ on cuda:1; it must be k_cache's "
                                         r"torch\.\w+ on cuda:0"):
        flash_attn_with_kvcache(q, k.clone(), v.clone(), k=k1[:, :1], v=v1[:, :1],
                                cache_seqlens=3)
    with pytest.raises(ValueError, match=r"out is a .* tensor on cuda:1; it must be like q: .* on "
                                         r"cuda:0"):
        forward(config_for(q, k, False), q, k, v, out=torch.empty_like(q, device="cuda:1"))
    with pytest.raises(ValueError, match=r"q, k, v are on cuda:0, cuda:1, cuda:1"):
        ring_flash_attn_func(q, k1, v1)  # checked before it looks for a process group
