"""The only module that calls the CUDA driver (``cuda.bindings.driver`` from cuda-python):
modules, launches, and the TMA tensor maps' encoding (``tensor_map_encoder``, for _tma.py).

cuda.bindings is imported on first use, so importing cudaflash needs neither a GPU nor a
driver. Every driver call goes through ``check``. Kernels run in torch's context: the primary
context of the device, made current on the calling thread if that thread has none yet.
Modules are loaded once per (device, context, kernel) and stay loaded for the life of the
context: a captured CUDA graph may still launch their functions.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import hashlib
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Protocol

from ._env import log
from .driver_compat import cuda_version_text, describe_driver, driver_branch
from ._params import (PARAMS_FIXED_FORMAT, PARAMS_MAPS_OFFSET, PARAMS_POINTERS_BYTES,
                      PARAMS_POINTERS_FORMAT, PARAMS_WORKSPACE_FORMAT, PARAMS_WORKSPACE_OFFSET,
                      Params)


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the CUDA error."""


class UnsupportedDriverError(CudaError):
    """The NVIDIA driver cannot run cudaflash's kernels: it is older than they need, or it
    refused a kernel image (CUDA_ERROR_NO_BINARY_FOR_GPU, CUDA_ERROR_UNSUPPORTED_PTX_VERSION).
    The message names the driver found, the driver needed, the GPU and what to do."""


def check(result: tuple, call_name: str):
    """Unpack a cuda-python ``(CUresult, *values)`` tuple: the value(s), or raise CudaError."""
    err = result[0]
    if err:  # CUresult is an int enum; CUDA_SUCCESS is 0
        raise CudaError(f"{call_name} failed: {_error_text(err)}")
    return result[1] if len(result) == 2 else result[1:]


def _error_text(err) -> str:
    from cuda.bindings import driver

    name_err, name = driver.cuGetErrorName(err)
    text_err, text = driver.cuGetErrorString(err)
    name = name.decode() if not name_err else getattr(err, "name", str(err))
    return f"{name}: {text.decode()}" if not text_err else name


@functools.cache
def _cu():
    """The driver bindings, with cuInit done (a no-op if torch already initialised CUDA)."""
    from cuda.bindings import driver

    check(driver.cuInit(0), "cuInit")
    return driver


def bindings_version():
    """cuda-bindings' version string, or None when it cannot be imported."""
    try:
        from cuda.bindings import __version__
    except ImportError:
        return None
    return __version__


def driver_version_number() -> int:
    """The CUDA version the driver supports, as cuDriverGetVersion says (12020 = CUDA 12.2)."""
    return check(_cu().cuDriverGetVersion(), "cuDriverGetVersion")


def driver_version() -> str:
    return cuda_version_text(driver_version_number())


def kernel_module_version() -> str | None:
    """The NVIDIA kernel module's version ('580.95.05') on Linux, None where unknown: the
    number people know their driver by, which the CUDA driver API does not report."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            m = re.search(r"Kernel Module\s+(?:for \S+\s+)?(\d+\.\d+(?:\.\d+)?)", f.read())
    except OSError:
        return None
    return m.group(1) if m else None


# ---- devices and contexts --------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    index: int  # the CUDA ordinal, as torch numbers devices
    name: str
    arch: int  # compute capability, major*10+minor
    smem_optin: int  # largest dynamic shared memory one block may opt into, bytes
    sm_count: int  # streaming multiprocessors


@functools.cache
def _device_handle(index: int):
    """The driver's CUdevice of cuda:``index`` (fixed for the process: looked up once)."""
    return check(_cu().cuDeviceGet(index), f"cuDeviceGet({index})")


@functools.cache
def device(index: int) -> Device:
    cu = _cu()
    dev = _device_handle(index)
    attr = cu.CUdevice_attribute

    def get(a) -> int:
        return check(cu.cuDeviceGetAttribute(a, dev), f"cuDeviceGetAttribute({a.name})")

    raw_name = check(cu.cuDeviceGetName(256, dev), "cuDeviceGetName")
    return Device(
        index=index,
        name=raw_name.split(b"\0", 1)[0].decode(),
        arch=10 * get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        + get(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
        smem_optin=get(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN),
        sm_count=get(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
    )


@functools.cache
def _primary_context(index: int):
    # Retained for the life of the process, like torch does; never released.
    return check(_cu().cuDevicePrimaryCtxRetain(_device_handle(index)),
                 f"cuDevicePrimaryCtxRetain({index})")


def current_context(index: int) -> int:
    """Handle of the context the calling thread runs cuda:``index``'s kernels in: its current
    context when that belongs to cuda:``index``, else the device's primary context (the one
    torch uses), made current, as Triton's launcher does for a thread without one.

    The callers have made ``index`` torch's current device, which normally leaves a context of
    that device current. Not always: a thread that has not touched CUDA yet has none, and
    torch can report a device current while the driver still holds another device's context
    (torch defers the switch into a device that had no context yet). Loading or launching in
    another device's context would fail (or load the module into the wrong device), so the
    context's device is checked, not assumed.
    """
    return _bind_context(index)[0]


def _bind_context(index: int) -> tuple[int, bool]:
    """(the context of cuda:``index`` that is current on this thread, whether it was made
    current here): the current one if it is that device's, else the primary context."""
    cu = _cu()
    ctx = check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if int(ctx) and (int(check(cu.cuCtxGetDevice(), "cuCtxGetDevice"))
                     == int(_device_handle(index))):
        return int(ctx), False
    ctx = _primary_context(index)
    check(cu.cuCtxSetCurrent(ctx), f"cuCtxSetCurrent(primary context of device {index})")
    return int(ctx), True


# ---- modules ---------------------------------------------------------------------------------

class KernelModule(Protocol):
    """What loading a kernel module takes (manifest.KernelEntry and BackwardEntry have it;
    this module knows no manifest): the file, its checksum and driver floor, names for
    messages, and the entries to resolve, role -> (extern "C" symbol, dynamic smem bytes)."""

    name: str  # for messages and the debug log
    path: Path  # the cubin or PTX file
    kind: str  # "cubin" or "ptx"
    arch: int
    sha256: str
    min_driver: int  # cuDriverGetVersion units
    ptxas_version: str
    ptx_isa: str
    entries: Mapping[str, tuple[str, int]]


@functools.lru_cache(maxsize=None)
def _functions_type(roles: tuple[str, ...]) -> type:
    """The type of a loaded module's functions: a named tuple with one CUfunction per role
    (``fns.forward``), resolved once at load: no lookup by role per launch."""
    return collections.namedtuple("Functions", roles)


_functions: dict[tuple[int, int, str], tuple] = {}
_functions_lock = threading.Lock()


def get_functions(module: KernelModule, device_index: int, ctx: int) -> tuple:
    """The functions of ``module`` in context ``ctx`` (which must be current), loaded once:
    a named tuple with the CUfunction of each of its roles, by role."""
    key = (device_index, ctx, module.name)
    with _functions_lock:
        fns = _functions.get(key)
        if fns is None:
            fns = _functions[key] = _load(module, device_index)
    return fns


def max_active_ctas(fn, threads: int, smem: int, label: str) -> int:
    """How many CTAs of ``fn`` (``threads`` per block, ``smem`` dynamic bytes) fit on one SM,
    as the driver counts them."""
    return check(_cu().cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, threads, smem),
                 f"cuOccupancyMaxActiveBlocksPerMultiprocessor({label})")


def clear_cache() -> None:
    """Forget loaded functions (the modules stay loaded: see the module docstring) and stream
    objects."""
    with _functions_lock:
        _functions.clear()
    _stream_objects.clear()


def _describe_file(module: KernelModule) -> str:
    if module.kind == "cubin":
        return (f"a cubin for sm_{module.arch} assembled by ptxas {module.ptxas_version}, "
                f"{module.path.name}")
    return f"PTX ISA {module.ptx_isa} for compute_{module.arch}, {module.path.name}"


def _describe_driver_found(version: int) -> str:
    module = kernel_module_version()
    return f"CUDA {cuda_version_text(version)}" + (f", driver {module}" if module else "")


def require_driver(module: KernelModule, device_index: int) -> None:
    """Raise UnsupportedDriverError unless the driver is at least as new as ``module``'s file
    needs (the manifest's min_driver): checked before the first load, so that an old driver
    gets an answer instead of CUDA_ERROR_NO_BINARY_FOR_GPU."""
    have = driver_version_number()
    if have >= module.min_driver:
        return
    dev = device(device_index)
    raise UnsupportedDriverError(
        f"the NVIDIA driver is too old for cudaflash on {dev.name} (sm_{dev.arch}, cuda:"
        f"{device_index}): it supports {_describe_driver_found(have)}, and cudaflash's kernel "
        f"{module.name} ({_describe_file(module)}) needs {describe_driver(module.min_driver)}. "
        f"Update the NVIDIA driver to {driver_branch(module.min_driver)} or newer (the README "
        "lists the driver each GPU generation needs).")


def _load_refused(module: KernelModule, device_index: int, err) -> str | None:
    """The message for a cuModuleLoadData failure that means "this driver cannot run this
    file", or None for any other error."""
    cu = _cu()
    codes = cu.CUresult
    if err == codes.CUDA_ERROR_NO_BINARY_FOR_GPU:
        why = ("it does not know this kernel's format or GPU target. The file needs "
               f"{describe_driver(module.min_driver)}; if the driver is that new, the kernel "
               "files do not match this GPU or are damaged: reinstall cudaflash or rebuild "
               "them with `python build_cubins.py`")
    elif err in (codes.CUDA_ERROR_UNSUPPORTED_PTX_VERSION, codes.CUDA_ERROR_INVALID_PTX):
        why = (f"its PTX compiler does not accept PTX ISA {module.ptx_isa}, which needs "
               f"{describe_driver(module.min_driver)}: update the NVIDIA driver to "
               f"{driver_branch(module.min_driver)} or newer")
    else:
        return None
    dev = device(device_index)
    return (f"the NVIDIA driver ({_describe_driver_found(driver_version_number())}) refused "
            f"cudaflash's kernel {module.name} ({_describe_file(module)}) on {dev.name} "
            f"(sm_{dev.arch}, cuda:{device_index}) with {_error_text(err)}: {why}.")


def load_image(module: KernelModule, device_index: int, image: bytes):
    """cuModuleLoadData of ``image`` (``module``'s file), a refusal by the driver turned into
    UnsupportedDriverError."""
    result = _cu().cuModuleLoadData(image)
    if result[0]:
        refused = _load_refused(module, device_index, result[0])
        if refused:
            raise UnsupportedDriverError(refused)
    return check(result, f"cuModuleLoadData({module.path})")


def _load(module: KernelModule, device_index: int):
    cu = _cu()
    require_driver(module, device_index)
    try:
        image = module.path.read_bytes()
    except FileNotFoundError:
        raise RuntimeError(
            f"kernel file {module.path} of {module.name} is missing although the manifest lists "
            "it: reinstall cudaflash or rebuild the kernels with `python build_cubins.py`"
        ) from None
    digest = hashlib.sha256(image).hexdigest()
    if digest != module.sha256:
        raise RuntimeError(
            f"kernel file {module.path} is corrupt or from another build: its sha256 is "
            f"{digest}, the manifest says {module.sha256}; reinstall cudaflash or rebuild the "
            "kernels with `python build_cubins.py`")
    if module.kind == "ptx":
        image += b"\0"  # the driver reads PTX as a C string
    cu_module = load_image(module, device_index, image)

    def function(symbol: str, smem: int):
        fn = check(cu.cuModuleGetFunction(cu_module, symbol.encode()),
                   f"cuModuleGetFunction({symbol!r} in {module.path})")
        if smem:
            # Above 48 KiB, dynamic shared memory needs an explicit opt-in per function and
            # context.
            check(cu.cuFuncSetAttribute(
                fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem), f"cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={smem}, {symbol} of "
                       f"{module.name})")
        return fn

    fns = _functions_type(tuple(module.entries))(
        *(function(symbol, smem) for symbol, smem in module.entries.values()))
    log.debug("loaded %s (%s sm_%d) from %s", module.name, module.kind, module.arch,
              module.path)
    return fns


# ---- tensor maps -----------------------------------------------------------------------------


def tensor_map_encoder(dtype: str, dims: tuple, strides: tuple, box: tuple):
    """A function (pointer, destination address) that encodes the TMA tensor map of a tensor
    at ``pointer`` with this layout (innermost dimension first: ``dims``, the byte
    ``strides`` of dims 1.., the ``box``; 128-byte swizzle, zeros past the tensor) and copies
    its 128 bytes to the destination; raises CudaError if the driver refuses it. ``dtype``:
    a CUtensorMapDataType member name. Layouts and their use: _tma.py."""
    cu = _cu()
    data_type = getattr(cu.CUtensorMapDataType, dtype)
    dims_arg = [cu.cuuint64_t(x) for x in dims]
    strides_arg = [cu.cuuint64_t(x) for x in strides]
    box_arg = [cu.cuuint32_t(x) for x in box]
    element_strides = [cu.cuuint32_t(1)] * len(dims)
    interleave = cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE
    swizzle = cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B
    promotion = cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B
    fill = cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE  # zeros
    encode_tiled = cu.cuTensorMapEncodeTiled

    def encode(pointer: int, destination: int) -> None:
        tensor_map = check(encode_tiled(data_type, len(dims), pointer, dims_arg, strides_arg,
                                        box_arg, element_strides, interleave, swizzle,
                                        promotion, fill),
                           f"cuTensorMapEncodeTiled(address {pointer:#x}, dims {dims}, "
                           f"byte strides {strides}, box {box})")
        ctypes.memmove(destination, tensor_map.getPtr(), 128)

    return encode


# ---- launch ----------------------------------------------------------------------------------


class _ArgBuffer(threading.local):
    """Per thread: one Params struct and the one-element ``kernelParams`` array that hands it
    to cuLaunchKernel (PackedArgs does the same for the backward's and the append's structs).
    Not ``extra``'s packed buffer: the driver copies that to the start of the parameter
    space, while a kernel whose parameter is aligned to more than the space's base (Params is
    64-byte aligned for its tensor maps) reads it at the next aligned offset, so every field
    came out shifted (compute-sanitizer: a load at k + 0x200 with k read as 0). kernelParams
    lets the driver place the struct where the kernel reads it; the two cost the same (-0.3
    and +0.2 us on the H100 host, noise).

    cuLaunchKernel copies the parameters before it returns (also into a graph node under
    stream capture), so every launch of a thread reuses the same buffers; per thread,
    because another thread could refill a shared buffer between our pack and our launch.
    """

    def __init__(self) -> None:
        # The ctypes objects must live as long as the thread: the driver reads them by address.
        self.params = Params()
        self.kernel_params = (ctypes.c_void_p * 1)(ctypes.addressof(self.params))
        # What a launch reads, as one attribute (each read of a threading.local attribute
        # costs a lookup of the thread's state): a byte view of params for struct.pack_into,
        # the address of the kernelParams array, and where in params the tensor maps go.
        self.pack_target = (memoryview(self.params).cast("B"),
                            ctypes.addressof(self.kernel_params),
                            ctypes.addressof(self.params) + PARAMS_MAPS_OFFSET)


_arg_buffer = _ArgBuffer()
# One pack per call: the five pointers, then the fixed fields, already packed, as one string
# (a single pack_into is cheaper than packing the pointers and copying the rest).
# The workspace pointers at the end (split-KV's, the persistent kernel's tile counter) are not
# part of it: launch_with_workspace packs them first, and the other launches never read them
# (they may see a previous call's).
_pack_params = struct.Struct(
    f"{PARAMS_POINTERS_FORMAT}{PARAMS_WORKSPACE_OFFSET - PARAMS_POINTERS_BYTES}s").pack_into
_pack_fixed = struct.Struct(PARAMS_FIXED_FORMAT).pack
_pack_workspace = struct.Struct(PARAMS_WORKSPACE_FORMAT).pack_into

# CUstream objects by raw handle: cuLaunchKernel converts an int stream argument to a
# CUstream on every call (about 1.3 us on the H100 host); a process uses few streams.
_stream_objects: dict[int, object] = {}


def _new_stream_object(stream: int):
    if len(_stream_objects) > 1024:  # handles of destroyed streams are never looked up
        _stream_objects.clear()
    obj = _stream_objects[stream] = _cu().CUstream(stream)
    return obj


class Launcher:
    """One kernel launch with everything but the data pointers and the stream fixed: the
    function, grid, block, dynamic smem and the Params fields after the pointers (strides,
    sizes, scales), packed once here. ``label`` names the kernel in errors.

    flash_attn_func keeps one per call signature, so a repeat call packs five pointers instead
    of all 25 fields. ``launch`` is the per-call path: each attribute read and call in it is
    paid on every attention call (a method, not ``__call__``, which costs ~0.1 us more).

    With ``synchronize`` (CUDAFLASH_DEBUG) the stream is synchronized and checked after the
    launch, so a fault is reported here, except while the stream is being captured into a
    graph, where synchronizing is illegal.
    """

    __slots__ = ("fn", "label", "grid", "threads", "smem", "synchronize", "device_index",
                 "_fixed", "_maps", "_cuLaunchKernel")

    def __init__(self, fn, label: str, grid: tuple[int, int, int], threads: int, smem: int,
                 synchronize: bool, fixed_params: tuple, device_index: int,
                 maps=None) -> None:
        self.fn, self.label, self.grid = fn, label, grid
        self.threads, self.smem, self.synchronize = threads, smem, synchronize
        # fn's device: a failed launch checks that the thread's context is this device's
        self.device_index = device_index
        # The Params fields between the pointers and the workspace pointers, in order.
        self._fixed = _pack_fixed(*fixed_params)
        # _tma.TensorMaps when fixed_params set tma_loads: each launch writes its pointers' maps
        self._maps = maps
        self._cuLaunchKernel = _cu().cuLaunchKernel  # one attribute lookup less per call

    def launch(self, stream: int, q: int, k: int, v: int, o: int, lse: int, cu_seqlens_q: int,
               cu_seqlens_k: int) -> None:
        """Launch on ``stream`` (a raw CUstream handle, 0 for the legacy default stream) with
        these data pointers (``lse`` 0: the kernel writes no lse; ``cu_seqlens_*`` 0: not a
        packed batch)."""
        params_bytes, kernel_params, maps_address = _arg_buffer.pack_target
        _pack_params(params_bytes, 0, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, self._fixed)
        if self._maps is not None:
            self._maps.write(maps_address, q, k, v)
        stream_obj = _stream_objects.get(stream)
        if stream_obj is None:
            stream_obj = _new_stream_object(stream)
        gx, gy, gz = self.grid
        # The cheapest argument types for cuda.bindings: a CUfunction and a CUstream object
        # (an int is converted through a new object on each call), the kernelParams array as
        # an int address (taken as-is), extra 0 (None raises here), plain ints for the geometry.
        result = self._cuLaunchKernel(self.fn, gx, gy, gz, self.threads, 1, 1, self.smem,
                                      stream_obj, kernel_params, 0)
        if result[0]:  # check() inline: this is the per-call path
            # A repeat call's launch skips current_context (its cost is per call), so on a
            # thread whose first CUDA work is such a call (a new thread: no context yet) the
            # driver refuses it. Then bind the device's context and launch again: a launch
            # that fails enqueues nothing. Any failure in the right context raises.
            if not _bind_context(self.device_index)[1]:
                check(result, self.label)
            check(self._cuLaunchKernel(self.fn, gx, gy, gz, self.threads, 1, 1, self.smem,
                                       stream_obj, kernel_params, 0), self.label)
        if self.synchronize:
            _synchronize_unless_capturing(stream, self.label)

    def launch_with_workspace(self, stream: int, q: int, k: int, v: int, o: int, lse: int,
                              cu_seqlens_q: int, cu_seqlens_k: int, o_accum: int,
                              lse_accum: int, tile_counter: int = 0) -> None:
        """``launch`` with the workspace pointers set: split-KV's (split and combine kernels)
        and the persistent kernel's tile counter (0: none)."""
        _pack_workspace(_arg_buffer.pack_target[0], PARAMS_WORKSPACE_OFFSET, o_accum,
                        lse_accum, tile_counter)
        self.launch(stream, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k)


def _synchronize_unless_capturing(stream: int, label: str) -> None:
    """CUDAFLASH_DEBUG: wait for the stream and raise here if the launch ``label`` faulted;
    skipped while the stream is captured into a graph, where synchronizing is illegal."""
    cu = _cu()
    status = check(cu.cuStreamIsCapturing(stream), "cuStreamIsCapturing")
    if status == cu.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE:
        check(cu.cuStreamSynchronize(stream), f"cuStreamSynchronize after {label}")


class PackedArgs:
    """An already packed kernel argument struct and the one-element ``kernelParams`` array
    that hands it to cuLaunchKernel, for launches outside the Launcher's per-call economies
    (the backward's: three heavy launches per step share one; the kvcache append's). Keep it
    alive until the launches return. kernelParams, not ``extra``'s packed buffer: BwdParams
    is 64-byte aligned for its tensor maps, which only kernelParams places right (_ArgBuffer).
    ``address`` is the struct's, for writing its tensor maps in place."""

    def __init__(self, params: bytes) -> None:
        self.buffer = ctypes.create_string_buffer(params, len(params))
        self.address = ctypes.addressof(self.buffer)
        self.kernel_params = (ctypes.c_void_p * 1)(self.address)


def launch_packed(fn, label: str, grid: tuple[int, int, int], threads: int, smem: int,
                  stream: int, args: PackedArgs, synchronize: bool) -> None:
    """One launch of ``fn`` with ``args``; ``synchronize`` as in Launcher."""
    stream_obj = _stream_objects.get(stream)
    if stream_obj is None:
        stream_obj = _new_stream_object(stream)
    # The driver copies the parameters before cuLaunchKernel returns.
    check(_cu().cuLaunchKernel(fn, *grid, threads, 1, 1, smem, stream_obj,
                               ctypes.addressof(args.kernel_params), 0), label)
    if synchronize:
        _synchronize_unless_capturing(stream, label)
