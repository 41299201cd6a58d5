"""Tensor maps (TMA) for the warp-specialized forward's producer (Params.tma_q/k/v).

On Hopper the copy engine loads a whole tile from one instruction, given a CUtensorMap: 128
opaque bytes that the driver encodes on the host (cuTensorMapEncodeTiled) and that hold the
tensor's address, sizes, strides and the tile ("box") shape. The kernel reads the maps from
its Params argument (params.cuh). A map holds the data pointer, so a call with new tensors
needs new maps; encoding three costs ~10 us of host time on the H100 host
(docs/bench/h100-s20-tensormap-cost.log), several times a tiny call's whole host budget. So:

- only calls big enough for that cost to hide behind the GPU's work, and whose CTAs visit
  enough keys to hide a map's fetch, use maps at all (``worth_maps``); smaller ones keep
  the cp.async producer (Params.tma_loads = 0);
- a launcher (one per call signature) keeps the maps of the pointer triples it has seen, so
  the steady state of a training loop or a benchmark, where the allocator hands the same
  addresses back each step, copies 384 cached bytes instead of encoding.

Each map is 5-D, innermost first: (64 columns of a slab, sequence position, slab, head,
batch entry), box (64, tile rows, all slabs, 1, 1), 128-byte swizzle, so that one copy lands
a tile in the kernel's slab-major swizzled layout (smem_layout.cuh) and positions past the
sequence as zeros.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Optional

import torch

from ._params import PARAMS_MAPS_OFFSET

SLAB_COLUMNS = 64  # a 128-byte swizzle row holds 64 16-bit elements
MAPS_OFFSET = PARAMS_MAPS_OFFSET  # q, k, v maps follow each other in Params
MAP_BYTES = 128
# Maps kept per launcher: a model's layers share one call signature, each with its own
# tensors (3 x layers triples per step): room for the layers of large models.
MAX_CACHED = 512
# The smallest call (query rows x keys x heads x batch) that takes maps: ~2^24 scores is
# ~50 us of GPU work at d 128, five times an encode's cost.
MIN_SCORES = 1 << 24
# The fewest keys a CTA visits (on average: half the keys under a causal mask) for maps to pay
# off on the GPU too: a CTA's first copy waits for its maps to be fetched, which short CTAs
# do not hide. Measured on the H100 (perf log "TMA loads"): causal S = 512 (256 keys a CTA)
# ran 0.72x cp.async, 512 keys 0.95-1.10x, from 1024 keys 1.02-1.16x.
MIN_KEYS = 512

log = logging.getLogger("cudaflash")

_DTYPES = {torch.bfloat16: "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16",
           torch.float16: "CU_TENSOR_MAP_DATA_TYPE_FLOAT16"}


def worth_maps(rows: int, seqlen_k: int, heads: int, batch: int, causal: bool) -> bool:
    """Whether a call is big enough to pay for its maps: on the host (MIN_SCORES) and on the
    GPU (MIN_KEYS). ``seqlen_k``: the keys a CTA can visit (a window's span at most)."""
    visited = seqlen_k // 2 if causal else seqlen_k
    return visited >= MIN_KEYS and rows * seqlen_k * heads * batch >= MIN_SCORES


def _layout(shape: tuple, strides: tuple, element_size: int, box_rows: int):
    """(dims, byte strides of dims 1.., box) of a (batch, seqlen, heads, d_head) tensor's map,
    innermost first, or None where TMA cannot describe it (a stride that is not a positive
    multiple of 16 bytes on a dimension of more than one position)."""
    batch, seqlen, heads, d_head = shape
    dims = (SLAB_COLUMNS, seqlen, d_head // SLAB_COLUMNS, heads, batch)
    byte_strides = [strides[1] * element_size, SLAB_COLUMNS * element_size,
                    strides[2] * element_size, strides[0] * element_size]
    for i, n in enumerate(dims[1:]):
        if byte_strides[i] <= 0 or byte_strides[i] % 16 or byte_strides[i] >= 1 << 40:
            if n > 1:
                return None
            byte_strides[i] = 16  # never stepped: any valid value describes it
    box = (SLAB_COLUMNS, box_rows, d_head // SLAB_COLUMNS, 1, 1)
    return dims, tuple(byte_strides), box


class TensorMaps:
    """The maps of one launch signature: ``write(q, k, v)`` puts the maps of those data
    pointers into the Params buffer at ``address``, from the cache or freshly encoded."""

    __slots__ = ("_encoders", "_cache")

    def __init__(self, encoders: list) -> None:
        self._encoders = encoders  # q, k, v: functions (pointer, destination address) -> None
        self._cache: dict[tuple[int, int, int], bytes] = {}

    def write(self, address: int, q: int, k: int, v: int) -> None:
        key = (q, k, v)
        maps = self._cache.get(key)
        if maps is not None:
            ctypes.memmove(address + MAPS_OFFSET, maps, 3 * MAP_BYTES)
            return
        for i, (encode, pointer) in enumerate(zip(self._encoders, key)):
            encode(pointer, address + MAPS_OFFSET + i * MAP_BYTES)
        if len(self._cache) >= MAX_CACHED:
            self._cache.clear()
        self._cache[key] = ctypes.string_at(address + MAPS_OFFSET, 3 * MAP_BYTES)


def tensor_maps(cu, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_rows: int,
                kv_rows: int) -> Optional[TensorMaps]:
    """The maps of a call on q, k, v (batch, seqlen, heads, d_head; their shapes, strides and
    dtype, not their pointers), with boxes of ``q_rows`` query rows (B_r) and ``kv_rows``
    keys (B_c), or None where TMA cannot describe one of them (then the kernel keeps
    cp.async). ``cu``: cuda.bindings.driver."""
    if q.dtype not in _DTYPES or q.shape[3] % SLAB_COLUMNS:
        return None
    dtype = getattr(cu.CUtensorMapDataType, _DTYPES[q.dtype])
    encoders = []
    scratch = ctypes.create_string_buffer(MAP_BYTES)
    for name, t, rows in (("q", q, q_rows), ("k", k, kv_rows), ("v", v, kv_rows)):
        layout = _layout(tuple(t.shape), t.stride(), t.element_size(), rows)
        if layout is None:
            return None
        encode = _encoder(cu, dtype, *layout)
        # Once with this call's pointer: a layout the driver refuses keeps cp.async, rather
        # than failing a later call (the pointers of later calls are aligned alike: _checks).
        try:
            encode(t.data_ptr(), ctypes.addressof(scratch))
        except RuntimeError as e:
            log.debug("no tensor map for %s (cp.async loads): %s", name, e)
            return None
        encoders.append(encode)
    return TensorMaps(encoders)


def _encoder(cu, dtype, dims: tuple, strides: tuple, box: tuple):
    """A function (pointer, destination address) that encodes this layout's map for the
    pointer and copies its 128 bytes to the destination."""
    dims_arg = [cu.cuuint64_t(x) for x in dims]
    strides_arg = [cu.cuuint64_t(x) for x in strides]
    box_arg = [cu.cuuint32_t(x) for x in box]
    element_strides = [cu.cuuint32_t(1)] * len(dims)
    interleave = cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE
    swizzle = cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B
    promotion = cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B
    fill = cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE  # zeros
    success = cu.CUresult.CUDA_SUCCESS

    def encode(pointer: int, destination: int) -> None:
        err, tensor_map = cu.cuTensorMapEncodeTiled(
            dtype, len(dims), pointer, dims_arg, strides_arg, box_arg, element_strides,
            interleave, swizzle, promotion, fill)
        if err != success:
            raise RuntimeError(
                f"cuTensorMapEncodeTiled failed ({err}) for a tensor at {pointer:#x}, dims "
                f"{dims}, byte strides {strides}, box {box}: a cudaflash bug, please report it")
        ctypes.memmove(destination, tensor_map.getPtr(), MAP_BYTES)

    return encode
