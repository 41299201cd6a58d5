"""Tensor maps (TMA) for the sm_90a kernels' loads: the forward's (Params.tma_q/k/v: the
warp-specialized kernel's producer and the wgmma (v6) kernel's thread 0) and the
warp-specialized backward's (BwdParams.tma_q/k/v/do: its loader thread).

On Hopper the copy engine loads a whole tile from one instruction, given a CUtensorMap: 128
opaque bytes that the driver encodes on the host (cuTensorMapEncodeTiled, through
_driver.tensor_map_encoder) and that hold the tensor's address, sizes, strides and the tile
("box") shape. The kernel reads the maps from its Params argument (params.cuh). A map holds
the data pointer, so a call with new tensors needs new maps; encoding three costs ~10 us of
host time on the H100 host (docs/bench/h100-s20-tensormap-cost.log @8c3a782), several times a tiny
call's whole host budget. So:

- only forward calls big enough for that cost to hide behind the GPU's work, and whose CTAs
  visit enough keys to hide a map's fetch, use maps at all (``worth_maps``); smaller ones
  keep the cp.async producer (Params.tma_loads = 0). The warp-specialized backward loads
  through maps only (``backward_maps``): three launches and a training step's other work
  stand behind its encode;
- the maps of a tensor layout (dtype, shapes, strides, tile rows) are one ``TensorMaps``,
  shared by every launch of that layout (flash_attn_func's plans, and the checked path that
  autograd's forward takes on every call), which keeps the maps of the pointer triples it
  has seen: the steady state of a training loop, where the allocator hands the same
  addresses back each step, copies the cached bytes instead of encoding.

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

from . import _driver, heuristics
from ._params import BWD_PARAMS_MAPS_OFFSET, PARAMS_MAPS_OFFSET

SLAB_COLUMNS = 64  # a 128-byte swizzle row holds 64 16-bit elements
MAPS_OFFSET = PARAMS_MAPS_OFFSET  # q, k, v maps follow each other in Params
BWD_MAPS_OFFSET = BWD_PARAMS_MAPS_OFFSET  # q, k, v, dout maps, in BwdParams
MAP_BYTES = 128
# Pointer triples kept per layout: a model's layers share one layout, each with its own
# tensors (one triple per layer and step): room for the layers of large models. Layouts
# kept: a model has a few (its attention shapes); when either table is full it starts over.
MAX_CACHED = 256
MAX_LAYOUTS = 32
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
# layout key -> TensorMaps, or None for a layout TMA cannot describe: the forward's, and the
# backward's apart (a training loop's backward layouts do not evict its forward's)
_layouts: dict = {}
_backward_layouts: dict = {}


def worth_maps(rows: int, seqlen_k: int, heads: int, batch: int, causal: bool,
               persistent: bool = False) -> bool:
    """Whether a call is big enough to pay for its maps: on the host (MIN_SCORES) and on the
    GPU (MIN_KEYS). ``seqlen_k``: the keys a CTA can visit (a window's span at most).
    ``persistent``: a kernel whose CTAs walk several tiles (KernelConfig.persistent) fetches
    its maps once per SM, not per tile, so the GPU's side does not limit it."""
    visited = seqlen_k // 2 if causal else seqlen_k
    return ((persistent or visited >= MIN_KEYS)
            and rows * seqlen_k * heads * batch >= MIN_SCORES)


# The query rows of a persistent config's tile (every one built: B_r 128). launch_function
# bounds a windowed call's keys by its kernel's B_r (heuristics.visited_keys); the prediction
# below, made before the kernel is chosen, bounds them by this.
PERSISTENT_TILE_ROWS = 128


def selects_with_maps(rows: int, seqlen_k: int, heads: int, batch: int,
                      window: tuple[int, int], num_splits=None) -> bool:
    """Whether a forward whose tensors maps can describe (launch.run: a padded batch, no cache
    addressing or key counts, not GQA decoding's folded rows) selects its kernel as one that
    loads through tensor maps: big enough for a persistent kernel's (worth_maps), over the
    keys its CTAs can visit (a left window bounds them, as launch_function bounds them), and
    not split on request (``num_splits`` > 1: split calls load without maps). ``rows``,
    ``heads``, ``window``: the kernel's problem (heuristics.kernel_problem)."""
    if num_splits is not None and num_splits > 1:
        return False
    seqlen_k = heuristics.visited_keys(seqlen_k, rows, PERSISTENT_TILE_ROWS, window)
    return worth_maps(rows, seqlen_k, heads, batch, causal=window[1] == 0 and window[0] < 0,
                      persistent=True)


def _layout(shape: tuple, strides: tuple, element_size: int, box_rows: int):
    """(dims, byte strides of dims 1.., box) of a (batch, seqlen, heads, d_head) tensor's map,
    innermost first, or None where TMA cannot describe it (a stride that is not a positive
    multiple of 16 bytes on a dimension of more than one position, or columns that are not
    contiguous)."""
    batch, seqlen, heads, d_head = shape
    if strides[3] != 1:
        return None
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
    """The maps of one tensor layout: ``write(address, *pointers)`` puts the maps of those
    data pointers (q, k, v for the forward; q, k, v, dout for the backward) at ``address``
    (the maps' offset in a Params or BwdParams buffer), from the cache or freshly encoded."""

    __slots__ = ("_encoders", "_cache")

    def __init__(self, encoders: list) -> None:
        self._encoders = encoders  # per tensor: function (pointer, destination address) -> None
        self._cache: dict[tuple, bytes] = {}

    def write(self, address: int, *pointers: int) -> None:
        maps = self._cache.get(pointers)
        if maps is not None:
            ctypes.memmove(address, maps, len(maps))
            return
        for i, (encode, pointer) in enumerate(zip(self._encoders, pointers)):
            encode(pointer, address + i * MAP_BYTES)
        self.remember(pointers, ctypes.string_at(address, len(pointers) * MAP_BYTES))

    def remember(self, key: tuple, maps: bytes) -> None:
        if len(self._cache) >= MAX_CACHED:
            self._cache.clear()
        self._cache[key] = maps


def tensor_maps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_rows: int,
                kv_rows: int) -> Optional[TensorMaps]:
    """The forward's maps of a call on q, k, v (batch, seqlen, heads, d_head), with boxes of
    ``q_rows`` query rows (B_r) and ``kv_rows`` keys (B_c): the layout's shared TensorMaps, or
    None where TMA cannot describe one of the tensors (then the kernel keeps cp.async)."""
    return _shared_maps(((q, q_rows), (k, kv_rows), (v, kv_rows)), _layouts)


def backward_maps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor,
                  q_rows: int, kv_rows: int) -> Optional[TensorMaps]:
    """The warp-specialized backward's maps of q, k, v and dout (BwdParams.tma_*): boxes of
    ``q_rows`` query rows (the kernel's step) for q and dout and ``kv_rows`` keys (its CTA's
    tile) for k and v; None where TMA cannot describe a tensor (backward.run then takes the
    deterministic kernels)."""
    return _shared_maps(((q, q_rows), (k, kv_rows), (v, kv_rows), (dout, q_rows)),
                        _backward_layouts)


def _shared_maps(tensors: tuple, table: dict) -> Optional[TensorMaps]:
    """The TensorMaps of a layout, given its (tensor, box rows) pairs: the shared one in
    ``table``, or a new one (or None) remembered there for the next call of that layout."""
    key = tuple((t.dtype, t.shape, t.stride(), rows) for t, rows in tensors)
    try:
        return table[key]
    except KeyError:
        pass
    maps = _new_maps(tensors)
    if len(table) >= MAX_LAYOUTS:
        table.clear()
    table[key] = maps
    return maps


def _new_maps(tensors: tuple) -> Optional[TensorMaps]:
    """A layout's TensorMaps, its cache seeded with this call's maps (encoded once here, so
    that a layout the driver refuses keeps cp.async rather than failing a call), or None."""
    dtype = tensors[0][0].dtype
    if dtype not in _DTYPES or any(t.dtype != dtype or t.shape[3] % SLAB_COLUMNS
                                   for t, _ in tensors):
        return None
    encoders = []
    scratch = ctypes.create_string_buffer(len(tensors) * MAP_BYTES)
    for i, (t, rows) in enumerate(tensors):
        layout = _layout(tuple(t.shape), t.stride(), t.element_size(), rows)
        if layout is None:
            return None
        encode = _driver.tensor_map_encoder(_DTYPES[dtype], *layout)
        try:
            encode(t.data_ptr(), ctypes.addressof(scratch) + i * MAP_BYTES)
        except _driver.CudaError as e:
            log.debug("no tensor map for tensor %d of %s (cp.async loads): %s", i,
                      tuple(t.shape), e)
            return None
        encoders.append(encode)
    maps = TensorMaps(encoders)
    maps.remember(tuple(t.data_ptr() for t, _ in tensors), scratch.raw)
    return maps
