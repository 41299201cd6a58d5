"""The host side of a launch, without a GPU: kernel selection and its cache, module loading
(sha256 checks), the packed Params, the launch geometry and empty inputs.

A fake ``cuda.bindings.driver`` records the calls, and CPU tensors stand in for CUDA ones:
``launch.run`` (what runs after the argument checks and the device switch) is called directly.
The same paths on a real GPU are covered by test_gpu_correctness.py.
"""

import ast
import ctypes
import logging
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cuda.bindings import driver as real_driver

import _internals as internals
from conftest import BWD_D64, D64, D64_WIDE, D128, D256_BIG
from cudaflash import _driver, api, manifest
from cudaflash._params import PARAMS_BYTES, Params

OK = real_driver.CUresult.CUDA_SUCCESS
CTX = 0x5000  # the thread's current context: cuda:0's unless a test says otherwise


class FakeDriver:
    """The subset of cuda.bindings.driver that cudaflash calls, recording what it is given."""

    CUfunction_attribute = real_driver.CUfunction_attribute
    CUstreamCaptureStatus = real_driver.CUstreamCaptureStatus
    CUstream = real_driver.CUstream
    CUresult = real_driver.CUresult

    def __init__(self):
        self.loaded = []  # images given to cuModuleLoadData
        self.attributes = []
        self.launches = []
        self.synchronized = []
        self.capturing = False
        self.launch_result = OK
        self.ctas_per_sm = 2
        self.driver_version = 13000  # cuDriverGetVersion: CUDA 13.0
        self.load_result = OK
        self.launch_results = []  # cuLaunchKernel's next answers, before launch_result
        self.context = CTX  # cuCtxGetCurrent's answer (0: the thread has none)
        self.device_of = {CTX: 0}  # cuCtxGetDevice's answer, by context
        self.made_current = []  # cuCtxSetCurrent's arguments

    def cuCtxGetCurrent(self):
        return OK, self.context

    def cuCtxGetDevice(self):
        return OK, self.device_of[self.context]

    def cuDeviceGet(self, index):
        return OK, index

    def cuCtxSetCurrent(self, ctx):
        self.made_current.append(ctx)
        self.context = ctx
        return (OK,)

    def cuDriverGetVersion(self):
        return OK, self.driver_version

    def cuModuleLoadData(self, image):
        self.loaded.append(bytes(image))
        if self.load_result != OK:
            return self.load_result, None
        return OK, f"module{len(self.loaded)}"

    def cuModuleGetFunction(self, module, name):
        return OK, (module, name)

    def cuFuncSetAttribute(self, fn, attribute, value):
        self.attributes.append((fn, attribute, value))
        return (OK,)

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(self, fn, threads, smem):
        return OK, self.ctas_per_sm

    def cuLaunchKernel(self, fn, gx, gy, gz, bx, by, bz, smem, stream, kernel_params, extra):
        # The forward's Params: kernelParams is the address of a one-element array holding
        # &Params, no extra (which would misplace the 64-byte aligned struct: _ArgBuffer).
        assert isinstance(kernel_params, int) and not extra
        (params_address,) = (ctypes.c_void_p * 1).from_address(kernel_params)
        params = Params.from_buffer_copy(ctypes.string_at(params_address, PARAMS_BYTES))
        self.launches.append(SimpleNamespace(fn=fn, grid=(gx, gy, gz), block=(bx, by, bz),
                                             smem=smem, stream=stream, params=params))
        return (self.launch_results.pop(0) if self.launch_results else self.launch_result,)

    def cuStreamIsCapturing(self, stream):
        status = self.CUstreamCaptureStatus
        return OK, (status.CU_STREAM_CAPTURE_STATUS_ACTIVE if self.capturing
                    else status.CU_STREAM_CAPTURE_STATUS_NONE)

    def cuStreamSynchronize(self, stream):
        self.synchronized.append(stream)
        return (OK,)


@pytest.fixture
def fake(fake_kernel_dir, monkeypatch):
    drv = FakeDriver()
    monkeypatch.setattr(_driver, "_cu", lambda: drv)
    monkeypatch.setattr(_driver, "device",
                        lambda index: _driver.Device(index, "Fake A100", 80, 166912, 1))
    monkeypatch.setattr(_driver, "_error_text",
                        lambda err: f"{err.name}: (error text of the real driver)")
    internals.fake_stream(monkeypatch, 0x77)
    return drv


def qkv(b=2, sq=100, sk=300, h=4, hk=2, d=64, dtype=torch.float16):
    return (torch.randn(b, sq, h, d).to(dtype), torch.randn(b, sk, hk, d).to(dtype),
            torch.randn(b, sk, hk, d).to(dtype))


def run(q, k, v, causal=False, scale=0.125, config=None, out=None, want_lse=True):
    return internals.run(config, 0, q, k, v, out, scale, causal, want_lse)


def test_launch_packs_params_and_geometry(fake):
    q, k, v = qkv()
    v = v.transpose(1, 2).contiguous().transpose(1, 2)  # BHSD memory seen as BSHD
    out, lse = run(q, k, v, causal=True, scale=0.3)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    assert lse.shape == (2, 4, 100) and lse.dtype == torch.float32 and lse.is_contiguous()

    (launch,) = fake.launches
    # seqlen_q 100 <= 256 with fp16 d64: rule 0 picks the 128x128, 8-warp config.
    assert launch.grid == (1, 4, 2) and launch.block == (256, 1, 1)
    assert launch.smem == D64_WIDE.smem_bytes
    assert isinstance(launch.stream, real_driver.CUstream) and int(launch.stream) == 0x77
    p = launch.params
    assert (p.q, p.k, p.v, p.o, p.lse) == (q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                           out.data_ptr(), lse.data_ptr())
    assert (p.q_batch_stride, p.q_seq_stride, p.q_head_stride) == q.stride()[:3]
    assert (p.k_batch_stride, p.k_seq_stride, p.k_head_stride) == k.stride()[:3]
    assert (p.v_batch_stride, p.v_seq_stride, p.v_head_stride) == (300 * 128, 64, 300 * 64)
    assert (p.o_batch_stride, p.o_seq_stride, p.o_head_stride) == out.stride()[:3]
    assert (p.batch, p.n_heads, p.n_heads_k, p.seqlen_q, p.seqlen_k, p.is_causal) == \
        (2, 4, 2, 100, 300, 1)
    assert p.softmax_scale == pytest.approx(0.3)
    assert p.scale_log2 == pytest.approx(0.3 * math.log2(math.e))


def test_no_lse_unless_wanted(fake):
    """flash_attn_func without return_attn_probs allocates no lse: the kernel gets null."""
    q, k, v = qkv()
    out, lse = run(q, k, v, want_lse=False)
    assert lse is None
    (launch,) = fake.launches
    assert launch.params.lse is None and launch.params.o == out.data_ptr()


def test_repeat_call_takes_the_plan(fake, monkeypatch):
    """flash_attn_func's per-call path: a plan recorded by the checked path is found with the
    key flash_attn_func builds inline, launches with the new pointers and the first call's
    fixed fields, and hands back to the checked path whatever the key does not fix."""
    internals.fake_current_device(monkeypatch, 0)
    q, k, v = qkv()
    internals.run(None, 0, q, k, v, None, 0.125, True, False,
                  plan_key=internals.plan_key(q, k, v, None, True, False))
    checked = []  # calls that fell back to the checked path

    def checked_path(config, q, k, v, out, softmax_scale, causal, want_lse):
        checked.append((softmax_scale, want_lse))
        return "checked", "lse"

    internals.replace_checked_forward(monkeypatch, checked_path)
    q2, k2, v2 = qkv()
    out = api.flash_attn_func(q2, k2, v2, causal=True)
    assert not checked and out.shape == q2.shape and out.stride() == q2.stride()
    first, second = fake.launches
    p = second.params
    assert (p.q, p.k, p.v, p.o, p.lse) == (q2.data_ptr(), k2.data_ptr(), v2.data_ptr(),
                                           out.data_ptr(), None)
    fixed = [name for name, ctype in Params._fields_[5:]  # not the per-call tensor maps
             if not issubclass(ctype, ctypes.Array)]
    assert [getattr(p, f) for f in fixed] == [getattr(first.params, f) for f in fixed]
    assert (second.fn, second.grid, second.block, second.smem, int(second.stream)) == \
        (first.fn, first.grid, first.block, first.smem, 0x77)

    def falls_back(*args, **kwargs) -> bool:
        before = len(checked)
        api.flash_attn_func(*args, **kwargs)
        return len(checked) == before + 1

    assert falls_back(q2, k2, v2, causal=True, return_attn_probs=True)  # with lse: other key
    assert falls_back(q2, k2, v2, causal=True, softmax_scale=0.125)  # other scale
    assert falls_back(q2, k2, v2, causal=True, softmax_scale=[0.1])  # unhashable
    assert falls_back("q", k2, v2, causal=True)  # not a tensor
    shifted = torch.empty(q.numel() + 1, dtype=q.dtype)[1:].view(q.shape)
    assert falls_back(shifted, k2, v2, causal=True)  # misaligned
    # Gradients wanted: the autograd function, never the plan's launch.
    to_autograd = []
    internals.replace_autograd_apply(monkeypatch,
                                     lambda *args: to_autograd.append(args) or ("out", "lse"))
    assert api.flash_attn_func(q2.requires_grad_(), k2, v2, causal=True) == "out"
    assert [a[3:] for a in to_autograd] == [(None, True, False)]  # scale, causal, deterministic
    with torch.no_grad():
        assert not falls_back(q2, k2, v2, causal=True)
    internals.fake_current_device(monkeypatch, 1)
    assert falls_back(k2, k2, v2, causal=True)  # not a known shape
    assert falls_back(q, k, v, causal=True)  # another device current
    assert len(fake.launches) == 3


def _empty_strided(shape, stride, dtype):
    """A CPU stand-in for torch's private _empty_strided_cuda (same arguments)."""
    return torch.empty_strided(shape, stride, dtype=dtype)


def test_fast_allocator_keeps_only_what_empty_like_would_give():
    like = torch.empty_like(qkv()[0].transpose(1, 2))  # non-contiguous, dense
    allocate = internals.fast_allocator(like, _empty_strided)
    made = allocate()
    assert (made.shape, made.stride(), made.dtype, made.device) == \
        (like.shape, like.stride(), like.dtype, like.device)
    assert made.data_ptr() != allocate().data_ptr()  # a new tensor per call
    # Any difference, or a function that takes other arguments: public allocation instead.
    assert internals.fast_allocator(like, lambda *a: torch.empty(like.shape, dtype=like.dtype)) \
        is None  # contiguous strides
    assert internals.fast_allocator(like, lambda *a: torch.empty_like(like, dtype=torch.float32)) \
        is None
    assert internals.fast_allocator(like, lambda shape, stride: None) is None
    assert internals.fast_allocator(like, lambda *a: like.numpy()) is None  # not a tensor


def test_fast_allocator_missing_from_torch(monkeypatch):
    internals.fake_empty_strided_cuda(monkeypatch, None)
    assert internals.fast_allocator(torch.empty(2, 3)) is None


def test_repeat_call_allocates_through_the_plan(fake, monkeypatch):
    """A plan whose fast allocator checked out allocates out and lse through it, with
    torch.empty_like's layout (here q's transposed one); without one, through torch's
    public functions."""
    made = []

    def empty_strided(shape, stride, dtype):
        made.append((shape, stride, dtype))
        return _empty_strided(shape, stride, dtype)

    internals.fake_current_device(monkeypatch, 0)
    internals.fake_empty_strided_cuda(monkeypatch, empty_strided)
    q, k, v = qkv()
    q = q.transpose(1, 2).contiguous().transpose(1, 2)
    internals.run(None, 0, q, k, v, None, 0.125, False, True,
                  plan_key=internals.plan_key(q, k, v, None, False, True))
    made.clear()  # the plan's own check
    out, lse, _ = api.flash_attn_func(q, k, v, return_attn_probs=True)
    assert out.stride() == torch.empty_like(q).stride() == q.stride()
    assert made == [(tuple(q.shape), q.stride(), q.dtype), ((2, 4, 100), (400, 100, 1),
                                                            torch.float32)]
    assert fake.launches[-1].params.o == out.data_ptr()
    assert fake.launches[-1].params.lse == lse.data_ptr()

    api.clear_caches()
    internals.fake_empty_strided_cuda(monkeypatch, None)
    internals.run(None, 0, q, k, v, None, 0.125, False, True,
                  plan_key=internals.plan_key(q, k, v, None, False, True))
    made.clear()
    out, lse, _ = api.flash_attn_func(q, k, v, return_attn_probs=True)
    assert not made and out.stride() == q.stride() and lse.shape == (2, 4, 100)
    assert fake.launches[-1].params.o == out.data_ptr()


def test_module_loaded_once_with_its_smem_attribute(fake, fake_kernel_dir):
    q, k, v = qkv(sq=1000)
    run(q, k, v)
    run(q, k, v)
    run(*qkv(sq=2000))  # same rule bucket (seqlen_q > 256)
    entry = manifest.load_manifest().usable(80, 166912)[D64["fp16"].name]
    assert (entry.kind, entry.arch) == ("cubin", 80)
    assert fake.loaded == [entry.path.read_bytes()]
    # The twelve forwards (plain, softcapped and ALiBi, whole and split, with and without
    # the kvcache's cache addressing)
    # opt into their dynamic smem; the combine and append kernels use none.
    assert sorted(fn for fn, _, _ in fake.attributes) == sorted(
        ("module1", name.encode()) for name in (
            "cudaflash_fwd", "cudaflash_fwd_softcap", "cudaflash_fwd_split",
            "cudaflash_fwd_split_softcap", "cudaflash_fwd_alibi", "cudaflash_fwd_split_alibi",
            "cudaflash_fwd_kvcache", "cudaflash_fwd_softcap_kvcache",
            "cudaflash_fwd_split_kvcache", "cudaflash_fwd_split_softcap_kvcache",
            "cudaflash_fwd_alibi_kvcache", "cudaflash_fwd_split_alibi_kvcache",
            "cudaflash_fwd_dropout", "cudaflash_fwd_dropout_alibi"))
    for _, attribute, value in fake.attributes:
        assert attribute.name == "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES"
        assert value == entry.smem_bytes
    assert [x.fn for x in fake.launches] == [("module1", b"cudaflash_fwd")] * 3
    assert [x.grid for x in fake.launches] == [(8, 4, 2), (8, 4, 2), (16, 4, 2)]


def test_backward_module_loads_every_role_with_its_smem(fake, fake_kernel_dir):
    """_driver resolves each role of the manifest's table once, opting into the role's smem."""
    entry = manifest.load_manifest().usable_backward(80, 166912)[BWD_D64.name]
    fns = _driver.get_functions(entry, 0, CTX)
    assert fns._fields == tuple(role.name for role in BWD_D64.ROLES)
    assert fns.dkdv_varlen_scoremod == ("module1", b"cudaflash_bwd_dkdv_varlen_scoremod")
    assert _driver.get_functions(entry, 0, CTX) is fns
    smem = {fn[1].decode(): value for fn, _, value in fake.attributes}
    assert smem == {role.symbol: role.smem_bytes(BWD_D64) for role in BWD_D64.ROLES
                    if role.smem}
    assert len(smem) == len(fake.attributes) == 12  # preprocess(_varlen), dq_convert(_varlen): none


def test_dropouts_atomic_backward_takes_a_module_whose_fused_kernel_applies_it(
        tmp_path, monkeypatch):
    """find_backward_entry(..., dropout=True): on Hopper the first atomic module whose fused
    kernel has dropout (BackwardConfig.fused_dropout: the warp-specialized ones), past a
    module before it that plain calls take; where none has it (sm_80 here), None, so that
    backward.run takes the deterministic kernels."""
    from conftest import write_fake_kernel_dir
    from cudaflash import dispatch
    from cudaflash.backward_config import BackwardConfig

    hopper = dict(dtype="fp16", d_head=64, B_r=64, B_c=64, n_warps=8, wgmma=True)
    wgmma, ws = BackwardConfig(**hopper), BackwardConfig(**hopper, warp_specialized=True,
                                                         ws_query_rows=128)
    assert not wgmma.fused_dropout and ws.fused_dropout and not BWD_D64.fused_dropout
    root = write_fake_kernel_dir(tmp_path / "kernels", backward_kernels=[
        (wgmma, "cubin", 90), (ws, "cubin", 90), (BWD_D64, "cubin", 80)])
    monkeypatch.setenv("CUDAFLASH_KERNEL_DIR", str(root))
    api.clear_caches()
    try:
        for arch, smem in ((90, 232448), (80, 166912)):
            monkeypatch.setattr(_driver, "device",
                                lambda index: _driver.Device(index, "Fake", arch, smem, 132))
            dispatch.clear_backward_cache()
            plain = dispatch.find_backward_entry(0, torch.float16, 64, "atomic")
            dropout = dispatch.find_backward_entry(0, torch.float16, 64, "atomic",
                                                   dropout=True)
            if arch == 90:
                assert (plain.name, dropout.name) == (wgmma.name, ws.name)
            else:
                assert plain.name == BWD_D64.name and dropout is None
    finally:
        api.clear_caches()


def test_driver_knows_no_manifest():
    """_driver loads what it is given (name, file, checksum, role table): no manifest import."""
    tree = ast.parse(Path(_driver.__file__).read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "manifest" not in imported


def test_seqlen_buckets_follow_the_rules(fake):
    """Rule 0 holds for seqlen_q <= 256: 256 and 257 must land in different cache entries."""
    for sq in (1, 256, 257, 1000, 256):
        run(*qkv(sq=sq))
    threads = [x.block[0] for x in fake.launches]
    assert threads == [256, 256, 128, 128, 256]
    assert len(fake.loaded) == 2


def test_ptx_is_nul_terminated(fake, fake_kernel_dir, monkeypatch):
    monkeypatch.setattr(_driver, "device", lambda i: _driver.Device(i, "Fake H100", 90, 232448, 1))
    run(*qkv(dtype=torch.bfloat16))  # bf16 d64 has only sm_80 SASS: the sm_90 device JITs PTX
    ptx = (fake_kernel_dir / f"ptx/compute_90/{D64['bf16'].name}.ptx").read_bytes()
    assert fake.loaded == [ptx + b"\0"]


def test_explicit_config(fake):
    q, k, v = qkv(d=256, h=2, hk=2)
    out = torch.full_like(q, math.nan)
    out2, _ = run(q, k, v, config=D256_BIG, out=out)
    assert out2 is out
    assert fake.launches[0].params.o == out.data_ptr()
    assert fake.launches[0].grid == (1, 2, 2) and fake.launches[0].smem == 131072
    message = (f"config {D128.name} is not built for cuda:0 (Fake A100, sm_80, 166912 bytes "
               f"of shared memory); configs built for it: ['{D64['fp16'].name}', ")
    with pytest.raises(ValueError, match=re.escape(message)):
        run(*qkv(d=128), config=D128)


def test_head_dim_not_built_for_this_gpu(fake):
    with pytest.raises(ValueError, match=r"no bf16 kernel with head dim 128 runs on cuda:0 .*; "
                                         r"bf16 head dims built for it: \[64\]"):
        run(*qkv(d=128, dtype=torch.bfloat16))


def test_old_gpu(fake, monkeypatch):
    monkeypatch.setattr(_driver, "device", lambda i: _driver.Device(i, "Tesla T4", 75, 65536, 40))
    with pytest.raises(RuntimeError, match=r"cuda:0 \(Tesla T4\) is sm_75; cudaflash needs "
                                           r"sm_80 \(Ampere\) or newer"):
        run(*qkv())


@pytest.mark.parametrize("b, sq, sk", [(0, 5, 5), (2, 0, 5), (0, 0, 0)])
def test_empty_inputs_launch_nothing(fake, b, sq, sk):
    out, lse = run(*qkv(b=b, sq=sq, sk=sk))
    assert out.shape == (b, sq, 4, 64) and lse.shape == (b, 4, sq)
    assert fake.launches == []


def test_no_keys_gives_zeros_and_minus_inf(fake):
    q, k, v = qkv(sq=7, sk=0)
    out, lse = run(q, k, v, causal=True, out=torch.full_like(q, math.nan))
    assert torch.equal(out, torch.zeros_like(q))
    assert torch.equal(lse, torch.full((2, 4, 7), -math.inf))
    assert fake.launches == []


def test_driver_older_than_the_kernels_is_refused_before_loading(fake):
    fake.driver_version = 11080  # CUDA 11.8 (R520); the fake cubins need CUDA 12.0
    with pytest.raises(_driver.UnsupportedDriverError,
                       match=r"on Fake A100 \(sm_80, cuda:0\): it supports CUDA 11\.8.* needs "
                             r"CUDA 12\.0 \(R525\+\)\. Update the NVIDIA driver to R525"):
        run(*qkv())
    assert fake.loaded == [] and fake.launches == []
    fake.driver_version = 12000
    run(*qkv())
    assert len(fake.loaded) == 1 and len(fake.launches) == 1


@pytest.mark.parametrize("code, says", [
    ("CUDA_ERROR_NO_BINARY_FOR_GPU", "does not know this kernel's format or GPU target"),
    ("CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "does not accept PTX ISA 8.3"),
    ("CUDA_ERROR_INVALID_PTX", "does not accept PTX ISA 8.3"),
])
def test_kernel_image_refused_by_the_driver(fake, code, says):
    fake.load_result = getattr(real_driver.CUresult, code)
    with pytest.raises(_driver.UnsupportedDriverError) as exc:
        run(*qkv())
    message = str(exc.value)
    assert "refused cudaflash's kernel" in message and code in message and says in message
    assert "Fake A100 (sm_80, cuda:0)" in message and fake.launches == []


def test_other_load_errors_stay_cuda_errors(fake):
    fake.load_result = real_driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(_driver.CudaError, match="cuModuleLoadData.*CUDA_ERROR_OUT_OF_MEMORY") as exc:
        run(*qkv())
    assert not isinstance(exc.value, _driver.UnsupportedDriverError)


def test_corrupt_and_missing_kernel_files(fake, fake_kernel_dir):
    path = fake_kernel_dir / f"sm_80/{D64['fp16'].name}.cubin"
    path.write_bytes(path.read_bytes() + b"!")
    with pytest.raises(RuntimeError, match=f"kernel file {path} is corrupt or from another "
                                           "build: its sha256 is [0-9a-f]{64}, the manifest "
                                           "says [0-9a-f]{64}"):
        run(*qkv(sq=1000))
    path.unlink()
    with pytest.raises(RuntimeError, match=f"kernel file {path} of {D64['fp16'].name} is "
                                           "missing"):
        run(*qkv(sq=1000))
    assert fake.launches == []


def test_launch_error_names_the_kernel(fake):
    fake.launch_result = real_driver.CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(_driver.CudaError, match=f"cuLaunchKernel\\({D64_WIDE.name}\\) failed: "
                                                "CUDA_ERROR_INVALID_VALUE"):
        run(*qkv())


def primary_contexts(fake, monkeypatch):
    """Each device's primary context in the fake: 0x6000 + its index."""
    monkeypatch.setattr(_driver, "_primary_context", lambda index: 0x6000 + index)
    fake.device_of.update({0x6000 + i: i for i in range(4)})


def test_kernels_load_in_a_context_of_the_tensors_device(fake, monkeypatch):
    """The thread's current context belongs to cuda:1 while the call runs on cuda:0 (torch
    can report a device current before it switched the driver's context): the module must
    load in, and the launch run from, cuda:0's primary context, not the current one."""
    primary_contexts(fake, monkeypatch)
    fake.context = 0x6001
    run(*qkv())
    assert fake.made_current == [0x6000]
    assert {key[:2] for key in _driver._functions} == {(0, 0x6000)}
    run(*qkv())  # now current: nothing to switch
    assert fake.made_current == [0x6000]


def test_a_planned_launch_on_a_thread_without_a_context_binds_the_device(fake, monkeypatch):
    """A repeat call's launch skips the context lookup; on a thread with no context the
    driver refuses it (CUDA_ERROR_INVALID_CONTEXT): the launcher makes the device's primary
    context current and launches again, once."""
    primary_contexts(fake, monkeypatch)
    q, k, v = qkv()
    table = {}
    internals.run(None, 1, q, k, v, None, 0.125, False, True, plan_key="signature",
                  plans=table)
    fake.context = 0  # a new thread
    fake.launch_results = [real_driver.CUresult.CUDA_ERROR_INVALID_CONTEXT]
    out, lse = torch.empty_like(q), torch.empty(2, 4, 100)
    table["signature"].launch(0x77, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                              lse.data_ptr(), 0, 0)
    assert fake.made_current[-1] == 0x6001  # cuda:1's
    assert len(fake.launches) == 3  # the first call's, the refused one, the retry
    assert fake.launches[-1].params.o == out.data_ptr()

    # A failure in the right context is the kernel's own: raised, not retried.
    fake.launch_results = [real_driver.CUresult.CUDA_ERROR_INVALID_VALUE]
    with pytest.raises(_driver.CudaError, match="CUDA_ERROR_INVALID_VALUE"):
        table["signature"].launch(0x77, q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                  out.data_ptr(), lse.data_ptr(), 0, 0)
    assert len(fake.launches) == 4


def test_user_rules_come_first(fake, tmp_path, monkeypatch):
    rules = tmp_path / "rules.yaml"
    rules.write_text(f"selection:\n  - {{causal: true, config: {D64['fp16'].name}}}\n")
    monkeypatch.setenv("CUDAFLASH_CONFIG", str(rules))
    api.clear_caches()
    run(*qkv(), causal=True)  # the user rule
    run(*qkv(), causal=False)  # falls through to the shipped rule 0
    assert [x.block[0] for x in fake.launches] == [128, 256]


def test_debug_logs_and_synchronizes(fake, monkeypatch, caplog):
    monkeypatch.setenv("CUDAFLASH_DEBUG", "1")
    api.clear_caches()
    with caplog.at_level(logging.DEBUG, logger="cudaflash"):
        run(*qkv(), causal=True)
        fake.capturing = True
        run(*qkv(), causal=True)  # synchronizing a capturing stream is illegal
    assert fake.synchronized == [0x77]
    text = caplog.text
    assert (f"cuda:0 fp16 d_head=64 causal=True seqlen_q=100 seqlen_k=300 -> {D64_WIDE.name} "
            f"(rule 0 of manifest.json)") in text
    assert f"loaded {D64_WIDE.name} (cubin sm_80)" in text


def test_no_debug_no_sync(fake):
    run(*qkv())
    assert fake.synchronized == []


def test_check_unpacks_cuda_python_results(monkeypatch):
    assert _driver.check((OK,), "cuFoo") == ()
    assert _driver.check((OK, 5), "cuFoo") == 5
    assert _driver.check((OK, 5, 6), "cuFoo") == (5, 6)
    monkeypatch.setattr(_driver, "_error_text", lambda err: f"{err.name}: invalid argument")
    with pytest.raises(_driver.CudaError, match=r"^cuFoo\(x\) failed: CUDA_ERROR_INVALID_VALUE: "
                                                "invalid argument$"):
        _driver.check((real_driver.CUresult.CUDA_ERROR_INVALID_VALUE, None), "cuFoo(x)")


# ---- split-KV and GQA decoding -----------------------------------------------------------------


@pytest.mark.parametrize("ctas, slots, most, expected", [
    (432, 432, 32, 1),  # the grid fills the GPU
    (346, 432, 32, 1),  # >= 80% of the slots: not worth a second kernel
    (345, 432, 32, 5),  # < 80%: 5 x 345 = 1725 CTAs, 4 waves of 432 at 99.8%
    (32, 396, 32, 11),  # 352 of 396 slots: within 15% of 12 splits' 384, one split less
    (32, 396, 5, 5),
    (32, 396, 1, 1),
    (8, 396, 128, 43),  # decoding: 43 x 8 = 344 of 396 slots
    (1, 4, 128, 4),
])
def test_split_count(ctas, slots, most, expected):
    assert internals.split_count(ctas, slots, most) == expected


@pytest.mark.parametrize("keys, kv_blocks, rows, batch, expected", [
    (32768, 512, 1, 1, 128),  # decoding: capped at 128
    (1000, 8, 1, 1, 4),  # two KV blocks per split
    (16384, 256, 64, 1, 16),  # 64-row CTAs: 1024 keys per split
    (1024, 16, 64, 1, 1),  # a 1024-token prefill: not worth splitting
    (4096, 64, 4, 40000, 1),  # grid.z = batch * splits would pass 65535
])
def test_max_splits(keys, kv_blocks, rows, batch, expected):
    assert internals.max_splits(keys, kv_blocks, rows, batch) == expected


def test_split_count_only_splits_to_fill_the_gpu_better():
    def fill(ctas, splits):  # busy fraction of 396 CTA slots over the waves
        waves = ctas * splits / 396
        return waves / math.ceil(waves)

    for ctas in range(1, 400, 7):
        for most in (1, 2, 8, 17, 128):
            splits = internals.split_count(ctas, 396, most)
            assert 1 <= splits <= most
            if splits > 1:
                assert ctas < 0.8 * 396 and fill(ctas, splits) > fill(ctas, 1) / 0.85


@pytest.fixture
def many_sms(fake, monkeypatch):
    """A device with enough SMs that the small test grids get split."""
    monkeypatch.setattr(_driver, "device",
                        lambda index: _driver.Device(index, "Fake A100", 80, 166912, 108))
    return fake


def test_split_launches_split_forward_then_combine(many_sms):
    fake = many_sms
    q, k, v = qkv(b=2, sq=100, sk=8000, h=4, hk=2)
    out, lse = run(q, k, v, causal=True)
    split, combine = fake.launches
    # 100 rows <= 256: the 128x128 8-warp config. 2 x 4 x 1 = 8 CTAs on 108 x 2 slots;
    # 8000 keys for 100 rows: at most 8000 // (16 * 100) = 5 splits, of 13 KV blocks.
    assert split.fn == ("module1", b"cudaflash_fwd_split")
    assert split.grid == (1, 4, 2 * 5) and split.block == (256, 1, 1)
    assert split.smem == D64_WIDE.smem_bytes
    assert combine.fn == ("module1", b"cudaflash_combine")
    assert combine.grid == (25, 4, 2) and combine.block == (128, 1, 1) and combine.smem == 0
    for launch in (split, combine):
        p = launch.params
        assert (p.n_splits, p.kv_blocks_per_split) == (5, 13)
        assert (p.q, p.o, p.lse) == (q.data_ptr(), out.data_ptr(), lse.data_ptr())
        assert (p.seqlen_q, p.seqlen_k, p.n_heads, p.is_causal) == (100, 8000, 4, 1)
        assert p.o_accum and p.lse_accum
    assert (split.params.o_accum, split.params.lse_accum) == \
        (combine.params.o_accum, combine.params.lse_accum)


def test_forced_split_counts(fake):
    q, k, v = qkv(b=1, sq=100, sk=1000, h=2, hk=2)
    d64 = D64_WIDE  # B_c 128: 8 KV blocks
    for asked, splits, per_split in ((1, 1, 8), (2, 2, 4), (3, 3, 3), (5, 4, 2), (8, 8, 1),
                                     (100, 8, 1)):
        fake.launches.clear()
        internals.run(d64, 0, q, k, v, None, 0.125, False, True, num_splits=asked)
        if splits == 1:
            (launch,) = fake.launches
            assert launch.fn[1] == b"cudaflash_fwd"
            continue
        split, combine = fake.launches
        assert (split.params.n_splits, split.params.kv_blocks_per_split) == (splits, per_split)
        assert split.grid[2] == splits


def test_gqa_decoding_packs_the_query_heads_of_a_kv_head(fake):
    """seqlen_q = 1 with GQA: the 4 query heads of each K/V head run as 4 rows of one head."""
    q, k, v = qkv(b=3, sq=1, sk=500, h=8, hk=2)
    out, lse = run(q, k, v, causal=True)
    (launch,) = fake.launches
    p = launch.params
    assert (p.batch, p.n_heads, p.n_heads_k, p.seqlen_q, p.seqlen_k) == (3, 2, 2, 4, 500)
    assert p.is_causal == 0  # one query row sees every key
    qs, os_ = q.stride(), out.stride()
    assert (p.q_batch_stride, p.q_seq_stride, p.q_head_stride) == (qs[0], qs[2], 4 * qs[2])
    assert (p.o_batch_stride, p.o_seq_stride, p.o_head_stride) == (os_[0], os_[2], 4 * os_[2])
    assert launch.grid == (1, 2, 3)
    assert lse.shape == (3, 8, 1) and lse.is_contiguous()  # written as (3, 2, 4): same memory


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_num_splits_is_checked(fake, bad):
    q, k, v = qkv()
    with pytest.raises(ValueError, match=f"num_splits={bad!r}; it must be None or an int >= 1"):
        api.forward(D64["fp16"], q, k, v, num_splits=bad)


def test_plan_key_takes_contiguity_for_strides(fake, monkeypatch):
    """A contiguous tensor's key holds True instead of its strides: same-shape contiguous
    tensors share a plan even when a size-1 dim's stride differs (never multiplied by a
    non-zero index), and a non-contiguous one of the same shape gets its own."""
    internals.fake_current_device(monkeypatch, 0)
    q, k, v = qkv(b=1, sq=100, sk=300, h=4, hk=2)
    internals.run(None, 0, q, k, v, None, 0.125, False, False,
                  plan_key=internals.plan_key(q, k, v, None, False, False))
    # Batch dim of size 1 with another stride: still contiguous, the same plan.
    odd = torch.empty(q.numel() + 8, dtype=q.dtype)[8:].as_strided(q.shape, (3,) + q.stride()[1:])
    assert odd.is_contiguous() and odd.stride() != q.stride()
    assert internals.plan_key(odd, k, v, None, False, False) == \
        internals.plan_key(q, k, v, None, False, False)
    out = api.flash_attn_func(odd, k, v)
    assert len(fake.launches) == 2 and fake.launches[1].params.q == odd.data_ptr()
    assert out.shape == q.shape
    # The same shape laid out as (b, h, s, d): not contiguous, so a key of its own.
    bhsd = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not bhsd.is_contiguous()
    assert internals.plan_key(bhsd, k, v, None, False, False) != \
        internals.plan_key(q, k, v, None, False, False)


def test_selected_config_sees_the_packed_problem(fake, monkeypatch):
    """selected_config reports what the runtime runs: for GQA decoding, the packed rows
    (4 query heads per K/V head -> 4 rows, not causal)."""
    picked = []

    def select(rules, usable, **call):
        picked.append(call)
        return "cfg", "rule"

    internals.replace_select(monkeypatch, select)
    internals.selected_config(0, "fp16", 64, True, 1, 5000, n_heads=8, n_heads_k=2)
    internals.selected_config(0, "fp16", 64, True, 1, 5000)  # MHA: unchanged
    assert [(c["seqlen_q"], c["causal"]) for c in picked] == [(4, False), (1, True)]


def test_forwards_tell_the_rules_whether_they_drop_scores(fake, monkeypatch):
    """launch.run and launch.run_varlen select with dropout=True exactly when the call
    carries a Dropout (the rules may give dropout calls another config)."""
    from cudaflash import _dropout, launch
    seen = []

    def stand_in(*args, dropout=False, **kwargs):
        seen.append(dropout)
        raise LookupError("selection seen")

    internals.replace_auto_kernel(monkeypatch, stand_in)
    drop = _dropout.Dropout(0.1, 26, 1 / 0.9, torch.zeros(1, dtype=torch.int64))
    q, k, v = qkv(b=1)
    cu = torch.tensor([0, 100], dtype=torch.int32)
    cu_k = torch.tensor([0, 300], dtype=torch.int32)
    for dropout in (None, drop):
        with pytest.raises(LookupError, match="selection seen"):
            internals.run(None, 0, q, k, v, None, 0.125, False, True, dropout=dropout)
        with pytest.raises(LookupError, match="selection seen"):
            launch.run_varlen(0, q[0], k[0], v[0], cu, cu_k, 100, 300, 0.125, False, True,
                              dropout=dropout)
    assert seen == [False, False, True, True]


def test_selected_config_decides_tensor_maps_from_the_batch(fake, monkeypatch):
    """Given the batch, selected_config decides whether the call loads through tensor maps as
    the forward does (_tma.selects_with_maps): a small call without them, a big one with
    them, GQA decoding's folded rows never; without a batch, ``maps`` as given. ``dropout`` is
    passed on, and keeps GQA decoding's query heads apart (its random numbers depend on the
    query head), so those rows are not folded."""
    from cudaflash import _tma, dispatch
    seen = []
    monkeypatch.setattr(dispatch, "_select",
                        lambda dk, r, dtype, d, causal, rows, keys, maps, dropout=False:
                        seen.append((rows, maps, dropout)) or ("cfg", "r"))
    internals.selected_config(0, "bf16", 64, False, 128, 128, batch=1)
    internals.selected_config(0, "bf16", 64, False, 8192, 8192, n_heads=32, batch=2)
    internals.selected_config(0, "bf16", 64, False, 1, 8192, n_heads=32, n_heads_k=8, batch=64)
    internals.selected_config(0, "bf16", 64, False, 128, 128)
    internals.selected_config(0, "bf16", 64, False, 8192, 8192, maps=False)
    internals.selected_config(0, "bf16", 64, False, 1, 8192, n_heads=32, n_heads_k=8, batch=64,
                              dropout=True)
    assert seen == [(128, False, False), (8192, True, False), (4, False, False),
                    (128, True, False), (8192, False, False), (1, True, True)]
    assert not _tma.selects_with_maps(128, 128, 1, 1, (-1, -1))
    assert _tma.selects_with_maps(8192, 8192, 32, 2, (-1, -1))


@pytest.mark.parametrize("role", ["forward", "split"])
@pytest.mark.parametrize("mods", ["", "_softcap", "_alibi"])
@pytest.mark.parametrize("cache", [None, "addressing"])
def test_each_call_kind_launches_its_own_entry(role, mods, cache):
    """Softcapping, ALiBi and flash_attn_with_kvcache's cache addressing each pick the
    entries built for them (config.KernelConfig.ROLES), and launch with those entries' own
    shared memory; a plain call never runs a *_softcap, *_alibi or *_kvcache entry."""
    from cudaflash.config import KernelConfig

    symbols = {r.name: r.symbol for r in KernelConfig.ROLES}
    picked = internals.entry_role(role, mods, cache)
    assert symbols[picked] == {(r, m, c): f"cudaflash_fwd{'_split' if r == 'split' else ''}"
                      f"{m}{'' if c is None else '_kvcache'}"
                      for r in ("forward", "split") for m in ("", "_softcap", "_alibi")
                      for c in (None, "addressing")}[(role, mods, cache)]


def test_gqa_decoding_is_packed_as_rows_only_without_alibi():
    """A decoding step's query heads of one K/V head run as rows of one head, unless the call
    has ALiBi slopes: a slope per query head and a bias per query position (rows packed
    from several heads would take one head's slope and distances)."""
    # (rows per head, heads, causal, kernel window)
    assert internals.kernel_problem(1, 32, 8, 4096, True) == (4, 8, False, (-1, -1))
    assert internals.kernel_problem(1, 32, 8, 4096, True, alibi=True) == (1, 32, True, (-1, 0))
    assert internals.kernel_problem(1, 8, 8, 4096, False, alibi=True) == (1, 8, False, (-1, -1))


def test_backward_reads_out_only_kernel_ready():
    """The preprocess kernel reads out with 16-byte loads: an out view that is not
    16-byte aligned (storage offset of 2 elements) or has strides that are not multiples of
    8 elements reaches the kernels as an aligned copy; a ready one as itself."""
    from cudaflash.backward import _kernel_layout
    base = torch.randn(2 * 64 * 4 * 64 + 2, dtype=torch.bfloat16)
    shifted = base[2:].view(2, 64, 4, 64)  # data pointer 4 bytes past an aligned one
    ready = torch.randn(2, 64, 4, 64, dtype=torch.bfloat16)
    odd_stride = torch.randn(2, 64, 4, 66, dtype=torch.bfloat16)[..., :64]  # row stride 66
    for t in (shifted, odd_stride):
        if t.data_ptr() % 16 == 0 and not any(s % 8 for s in t.stride()[:-1]):
            pytest.skip("the allocator placed the test tensor where it is already ready")
        copy = _kernel_layout(t)
        assert copy.data_ptr() % 16 == 0 and not any(s % 8 for s in copy.stride()[:-1])
        assert torch.equal(copy, t)
    assert _kernel_layout(ready) is ready


def test_warp_specialized_alibi_entries_get_their_own_smem(fake, tmp_path, monkeypatch):
    """A warp-specialized module's ALiBi entries opt into, and launch with, B_c * 16 bytes more
    dynamic smem than its other entries (the key-column table of ALiBi's slice of Q K^T,
    KernelConfig.alibi_smem_bytes); every other entry keeps smem_bytes, and the module fits an
    arch by its largest entry."""
    from conftest import write_fake_kernel_dir
    from cudaflash import dispatch
    from cudaflash.config import KernelConfig

    # configs.yaml's d128 warp-specialized config
    ws = KernelConfig.from_name("fwd_bf16_d128_br128_bc128_w8_async1_eager1_swz1_q0k0v0_dbuf0"
                                "_osm1_ctas1_wgmma1_ws").validate()
    root = write_fake_kernel_dir(tmp_path / "ws", kernels=[(ws, "cubin", 90)],
                                 selection=[{"d_head": 128, "config": ws.name}])
    monkeypatch.setenv("CUDAFLASH_KERNEL_DIR", str(root))
    api.clear_caches()
    entry = manifest.load_manifest().usable(90, 232448)[ws.name]
    assert entry.smem_bytes == ws.alibi_smem_bytes == ws.module_smem_bytes
    assert manifest.load_manifest().usable(90, ws.alibi_smem_bytes - 1) == {}

    _driver.get_functions(entry, 0, CTX)
    smem = {fn[1].decode(): value for fn, _, value in fake.attributes}
    alibi = {"cudaflash_fwd_alibi", "cudaflash_fwd_split_alibi", "cudaflash_fwd_alibi_kvcache",
             "cudaflash_fwd_split_alibi_kvcache", "cudaflash_fwd_dropout_alibi"}
    assert {s for s, v in smem.items() if v == ws.alibi_smem_bytes} == alibi
    assert {s for s, v in smem.items() if v == ws.smem_bytes} == set(smem) - alibi
    assert ws.alibi_smem_bytes == ws.smem_bytes + ws.B_c * 16

    monkeypatch.setattr(_driver, "device",
                        lambda index: _driver.Device(index, "Fake H100", 90, 232448, 1))
    kernel = dispatch._make_kernel(dispatch.device_kernels(0), entry, CTX)
    assert kernel.smem_of("forward_alibi") == kernel.smem_of("split_alibi") == ws.alibi_smem_bytes
    assert kernel.smem_of("forward") == kernel.smem_of("forward_dropout") == ws.smem_bytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_alibi_score_bound_holds_every_score(dtype):
    """ALiBi's band (fwd_range.cuh) skips keys by launch.alibi_score_bound: it must be a float32
    device scalar at least every scaled score's magnitude, for every query head against every
    key head (a superset of GQA's pairs), and not loose (the band's width grows with it).
    A non-finite input gives a bound that is not finite, which the kernels read as no band."""
    from cudaflash import launch

    g = torch.Generator().manual_seed(5)
    q = (torch.randn(2, 300, 4, 64, generator=g) * 3).to(dtype)
    k = torch.randn(2, 280, 2, 64, generator=g).to(dtype)
    q[1, 17, 3] *= 40  # one row far above the rest decides the bound
    k[0, 5, 1] = k[0, 5, 1].abs() + 2  # and a key aligned with nothing in particular
    scale = 0.125
    bound = launch.alibi_score_bound(q, k, scale)
    assert bound.dtype == torch.float32 and bound.dim() == 0
    qd, kd = q.double(), k.double()
    scores = scale * torch.einsum("bihd,bjgd->bhgij", qd, kd)
    most = scale * (torch.linalg.vector_norm(qd, dim=-1).amax()
                    * torch.linalg.vector_norm(kd, dim=-1).amax())
    assert scores.abs().max() <= most <= bound.double() <= most * 1.05

    q[0, 0, 0, 0] = math.inf
    assert not math.isfinite(launch.alibi_score_bound(q, k, scale).item())
    if dtype == torch.float16:  # norms past fp16's 65504 (float32 norms: still a bound)
        big = torch.full((1, 4, 1, 64), 20000.0, dtype=dtype)
        assert launch.alibi_score_bound(big, big, scale).item() >= scale * 64 * 20000.0**2


def test_alibi_band_where_the_h100_measured_it_pays():
    """heuristics.alibi_band_pays against the thirty-seventh session's H100 A/B (perf log):
    the band (with its pass over q and k) was slower at non-causal 2k and causal 4k, faster
    at non-causal 4k and causal 8k and beyond; GQA's smaller k makes the pass cheaper; a
    narrow window leaves too few scores to pay for it."""
    from cudaflash import heuristics

    def pays(s, causal, heads_k=32, window=(-1, -1), seqlen_q=None):
        kernel_window = heuristics.kernel_window(window, s, causal)
        return heuristics.alibi_band_pays(seqlen_q or s, s, 32, heads_k, kernel_window)

    assert not pays(1024, False) and not pays(2048, False) and not pays(4096, True)
    assert pays(4096, False) and pays(8192, True) and pays(16384, True) and pays(16384, False)
    assert pays(3072, False, heads_k=4) and not pays(3072, False)
    assert not pays(16384, True, window=(512, 0))
    assert heuristics.visible_keys_per_row(4096, 4096, (-1, 0)) == pytest.approx(2048, rel=1e-3)
    assert heuristics.visible_keys_per_row(100, 1000, (-1, -1)) == 1000
    assert heuristics.visible_keys_per_row(1000, 100, (-1, 0)) == 25  # (0 + 2 * 0 + 100) / 4


def test_which_alibi_calls_take_the_band(fake, monkeypatch):
    """launch.run passes the band's bound (Params.alibi_score_bound, a pointer) only for an
    ALiBi call that asks for it (alibi_band: flash_attn_func and forward) where
    heuristics.alibi_band_pays; never with dropout (its entries have no band: fwd_range.cuh's
    entry_band), softcap or without ALiBi. A banded call records no plan."""
    from cudaflash import _dropout, heuristics

    q, k, v = qkv(b=2, sq=300, sk=300, h=4, hk=2)
    slopes = torch.rand(4) + 0.1
    drop = _dropout.Dropout(0.1, 26, 1 / 0.9, torch.zeros(1, dtype=torch.int64))

    def bound_of(**kwargs):
        fake.launches.clear()
        internals.run(None, 0, q, k, v, None, 0.125, False, True, **kwargs)
        return [x.params.alibi_score_bound for x in fake.launches]

    monkeypatch.setattr(heuristics, "ALIBI_BAND_MIN_SCORES_PER_ROW", 0)
    assert all(bound_of(alibi=slopes, alibi_band=True))
    assert not any(bound_of(alibi=slopes))  # not asked: the kvcache and varlen paths
    assert not any(bound_of(alibi=slopes, alibi_band=True, dropout=drop))
    assert not any(bound_of(alibi=slopes, alibi_band=True, softcap=30.0))
    assert not any(bound_of(alibi_band=True))
    plans = {}
    internals.run(None, 0, q, k, v, None, 0.125, False, True, ("banded",), plans=plans,
                  alibi=slopes, alibi_band=True)
    assert plans == {}
    monkeypatch.setattr(heuristics, "ALIBI_BAND_MIN_SCORES_PER_ROW", 10**9)
    assert not any(bound_of(alibi=slopes, alibi_band=True))  # too few scores per row read
    internals.run(None, 0, q, k, v, None, 0.125, False, True, ("full",), plans=plans,
                  alibi=slopes, alibi_band=True)
    assert list(plans) == [("full",)]
