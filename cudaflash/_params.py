"""ctypes mirror of ``cuda_src/params.cuh``: the kernel's single by-value argument.

Field order, types and padding must match the CUDA struct exactly. The ctypes classes are the
one Python definition of each layout: the sizes (``PARAMS_BYTES``, ``BWD_PARAMS_BYTES``), the
offsets and the ``struct`` formats the launchers pack with all derive from them. The sizes are
``static_assert``ed on the CUDA side (kParamsBytes, kBwdParamsBytes), recorded in the manifest by
the build and checked against it at load; the tests compare the fields with the CUDA source.
"""

from __future__ import annotations

import ctypes
import math
import re

_LOG2E = math.log2(math.e)
_FLOAT32_MAX = 3.4028234663852886e38

class Params(ctypes.Structure):
    _fields_ = [
        # pointers
        ("q", ctypes.c_void_p),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("o", ctypes.c_void_p),
        ("lse", ctypes.c_void_p),
        ("cu_seqlens_q", ctypes.c_void_p),  # varlen only, else null
        ("cu_seqlens_k", ctypes.c_void_p),  # varlen offsets, or a padded batch's key counts
        # strides, in elements
        ("q_batch_stride", ctypes.c_int64),
        ("q_seq_stride", ctypes.c_int64),
        ("q_head_stride", ctypes.c_int64),
        ("k_batch_stride", ctypes.c_int64),
        ("k_seq_stride", ctypes.c_int64),
        ("k_head_stride", ctypes.c_int64),
        ("v_batch_stride", ctypes.c_int64),
        ("v_seq_stride", ctypes.c_int64),
        ("v_head_stride", ctypes.c_int64),
        ("o_batch_stride", ctypes.c_int64),
        ("o_seq_stride", ctypes.c_int64),
        ("o_head_stride", ctypes.c_int64),
        ("lse_batch_stride", ctypes.c_int64),
        ("lse_head_stride", ctypes.c_int64),
        # sizes
        ("batch", ctypes.c_int32),
        ("n_heads", ctypes.c_int32),
        ("n_heads_k", ctypes.c_int32),
        ("seqlen_q", ctypes.c_int32),
        ("seqlen_k", ctypes.c_int32),
        ("is_causal", ctypes.c_int32),
        ("total_q", ctypes.c_int32),  # varlen only
        ("total_k", ctypes.c_int32),
        ("window_left", ctypes.c_int32),  # sliding window; < 0: unbounded
        ("window_right", ctypes.c_int32),  # 0 when causal
        # scales
        ("softmax_scale", ctypes.c_float),
        ("scale_log2", ctypes.c_float),  # softcap * log2(e) when softcapping
        ("softcap_pre", ctypes.c_float),  # softmax_scale / softcap; 0: no softcapping
        ("alibi_scale", ctypes.c_float),  # log2(e) / scale_log2: a slope in score units
        # split-KV (cudaflash_fwd_split, cudaflash_combine)
        ("n_splits", ctypes.c_int32),
        ("kv_blocks_per_split", ctypes.c_int32),
        # flash_attn_with_kvcache's cache addressing (paged K/V, cache_batch_idx,
        # cache_leftpad), each 0 when unused; packed with the fixed fields
        ("block_table", ctypes.c_void_p),
        ("cache_batch_idx", ctypes.c_void_p),
        ("cache_leftpad", ctypes.c_void_p),
        ("block_table_stride", ctypes.c_int32),
        ("page_shift", ctypes.c_int32),  # log2 of the page size
        ("n_cache_entries", ctypes.c_int32),
        ("paged_keys", ctypes.c_int32),  # the keys a table row addresses
        # ALiBi (the *_alibi and *_softcap entries): float32 slopes, 0 when unused; packed
        # with the fixed fields
        ("alibi_slopes", ctypes.c_void_p),
        ("alibi_batch_stride", ctypes.c_int32),  # 0: one slope per head for every batch entry
        # ALiBi's band (fwd_range.cuh): a float32 device scalar bounding every scaled score's
        # magnitude, 0 for none (launch.alibi_score_bound)
        ("alibi_score_bound", ctypes.c_void_p),
        # dropout (the *_dropout entries): threshold round(p * 256), 0 when unused; the
        # seed tensor's pointer; 1 / (1 - p)
        ("dropout_threshold", ctypes.c_uint32),
        ("dropout_seed", ctypes.c_void_p),
        ("dropout_scale", ctypes.c_float),
        # 1: the sm_90a kernels load through the tensor maps below (_tma.py)
        ("tma_loads", ctypes.c_int32),
        ("o_accum", ctypes.c_void_p),
        ("lse_accum", ctypes.c_void_p),
        # persistent causal calls: the zeroed int32 the CTAs take their tiles from, else 0
        ("tile_counter", ctypes.c_void_p),
        # the maps at a multiple of 64 bytes, as alignas places them in the C struct
        ("maps_pad", ctypes.c_ubyte * 40),
        # the tensor maps of q, k and v (CUtensorMap, 64-byte aligned in the CUDA struct:
        # the fields before them end at a multiple of 64); written per call by _tma.py, never
        # packed through the struct formats below
        ("tma_q", ctypes.c_ubyte * 128),
        ("tma_k", ctypes.c_ubyte * 128),
        ("tma_v", ctypes.c_ubyte * 128),
    ]


PARAMS_BYTES = ctypes.sizeof(Params)


def struct_format(cls: type, first: str | None = None, last: str | None = None) -> str:
    """The ``struct`` format (standard sizes, no implicit padding: ``=``) of the fields
    ``first`` to ``last`` (inclusive; default: the whole struct) of the ctypes structure
    ``cls``, with nested structures flattened and C padding written out as ``x`` bytes, so
    that ``struct.pack`` lays the values out exactly as the C struct (ctypes' offsets).
    Byte arrays (Params' tensor maps) are padding too: nothing packs them, _tma.py copies
    them in."""
    names = [name for name, _ in cls._fields_]
    lo = names.index(first) if first else 0
    hi = names.index(last) + 1 if last else len(names)
    start = getattr(cls, names[lo]).offset
    end = (getattr(cls, names[hi]).offset if hi < len(names) else ctypes.sizeof(cls))
    codes: list[str] = []
    at = start
    for name, ctype in cls._fields_[lo:hi]:
        offset = getattr(cls, name).offset
        codes += ["x"] * (offset - at)
        if issubclass(ctype, ctypes.Structure):
            codes += _counted(struct_format(ctype)[1:])
        elif issubclass(ctype, ctypes.Array):  # Params' tensor maps: written by _tma.py
            codes += ["x"] * ctypes.sizeof(ctype)
        else:
            codes.append(_STRUCT_CODES[ctype])
        at = offset + ctypes.sizeof(ctype)
    codes += ["x"] * (end - at)
    return "=" + _runs(codes)


# The struct code of each C type the kernel structs use (standard sizes under "=").
_STRUCT_CODES = {ctypes.c_void_p: "Q", ctypes.c_int64: "q", ctypes.c_int32: "i",
                 ctypes.c_uint32: "I", ctypes.c_float: "f"}


def _counted(fmt: str) -> list[str]:
    """"3Q2i" -> ["Q", "Q", "Q", "i", "i"]."""
    return [code for count, code in re.findall(r"(\d*)(\D)", fmt)
            for _ in range(int(count or 1))]


def _runs(codes: list[str]) -> str:
    """["Q", "Q", "i"] -> "2Qi"."""
    out = []
    for code in codes:
        if out and out[-1][1] == code:
            out[-1][0] += 1
        else:
            out.append([1, code])
    return "".join(f"{n if n > 1 else ''}{code}" for n, code in out)


# The struct formats the launcher packs Params with, derived from the class above: it fills a
# reusable buffer without building a ctypes object per call. Split in three: the pointers
# change on every call; the middle (strides, sizes, scales, split counts, the K/V cache
# addressing) is fixed for a call signature and packed once per plan (a call with a block
# table, cache_batch_idx or cache_leftpad makes no plan: it packs its own); the split-KV
# workspace pointers at the end change per call of a split launch and are 0 otherwise.
PARAMS_POINTERS_FORMAT = struct_format(Params, "q", "cu_seqlens_k")
PARAMS_FIXED_FORMAT = struct_format(Params, "q_batch_stride", "tma_loads")
# The fixed fields' tail when no cache addressing is used: block_table to paged_keys.
NO_CACHE_ADDRESSING = (0, 0, 0, 0, 0, 0, 0)
# ... and when no ALiBi and no dropout are: alibi_slopes to dropout_scale.
NO_ALIBI = (0, 0)
NO_DROPOUT = (0, 0, 1.0)
# (o_accum, lse_accum, tile_counter, then maps_pad's zeros)
PARAMS_WORKSPACE_FORMAT = struct_format(Params, "o_accum", "maps_pad")
PARAMS_MAPS_OFFSET = Params.tma_q.offset  # the three tensor maps, to the struct's end
PARAMS_POINTERS_BYTES = Params.q_batch_stride.offset
PARAMS_WORKSPACE_OFFSET = Params.o_accum.offset
PARAMS_STRUCT_FORMAT = struct_format(Params)


class AppendParams(ctypes.Structure):
    """Mirror of ``cudaflash::AppendParams`` (params.cuh): cudaflash_append_kv's argument."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in ("k_new", "v_new", "k_cache", "v_cache", "cache_seqlens",
                     "cache_batch_idx", "block_table")
    ] + [
        (f"{tensor}_{dim}_stride", ctypes.c_int64)
        for tensor in ("k_new", "v_new", "k", "v") for dim in ("batch", "seq", "head")
    ] + [
        (name, ctypes.c_int32)
        for name in ("batch", "seqlen_new", "n_heads_k", "seqlen_cache", "block_table_stride",
                     "page_size", "n_cache_entries", "reserved")
    ]


APPEND_PARAMS_BYTES = ctypes.sizeof(AppendParams)
APPEND_PARAMS_FORMAT = struct_format(AppendParams)


class Strides(ctypes.Structure):
    """``cudaflash::Strides``: a (batch, seqlen, nheads, d_head) tensor's strides."""

    _fields_ = [("batch", ctypes.c_int64), ("seq", ctypes.c_int64), ("head", ctypes.c_int64)]


class BwdParams(ctypes.Structure):
    """Mirror of ``cuda_src/bwd_params.cuh``: the backward kernels' single argument."""

    _fields_ = [
        (name, ctypes.c_void_p)
        for name in ("q", "k", "v", "o", "dout", "lse", "delta", "dq", "dk", "dv",
                     "dq_accum")
    ] + [
        (f"{tensor}_strides", Strides)
        for tensor in ("q", "k", "v", "o", "do", "dq", "dk", "dv")
    ] + [
        ("lse_batch_stride", ctypes.c_int64),
        ("lse_head_stride", ctypes.c_int64),
    ] + [
        (name, ctypes.c_int32)
        for name in ("batch", "n_heads", "n_heads_k", "seqlen_q", "seqlen_k", "is_causal")
    ] + [
        ("softmax_scale", ctypes.c_float),
        ("scale_log2", ctypes.c_float),
        ("cu_seqlens_q", ctypes.c_void_p),  # packed (varlen) batches only, else null
        ("cu_seqlens_k", ctypes.c_void_p),
        ("total_q", ctypes.c_int32),
        ("total_k", ctypes.c_int32),
        ("window_left", ctypes.c_int32),  # -1: unbounded; causal is window_right = 0
        ("window_right", ctypes.c_int32),
        ("softcap_pre", ctypes.c_float),  # as Params.softcap_pre; scale_log2 then carries the cap
        ("alibi_scale", ctypes.c_float),  # as Params.alibi_scale
        ("alibi_slopes", ctypes.c_void_p),  # as Params.alibi_slopes: 0 without ALiBi
        ("alibi_batch_stride", ctypes.c_int32),
        ("dropout_threshold", ctypes.c_uint32),  # as Params': 0 without dropout
        ("dropout_seed", ctypes.c_void_p),
        ("dropout_scale", ctypes.c_float),
        ("reserved", ctypes.c_int32),
        # the warp-specialized kernel's padded row statistics (lse in log2 units, delta),
        # 0 for other kernels; then the tensor maps of q, k, v and dout (64-byte aligned in
        # the CUDA struct: maps_pad brings the fields before them to 448 bytes), written per
        # call by _tma.py, never packed through BWD_PARAMS_FORMAT
        ("lse_log2_tiles", ctypes.c_void_p),
        ("delta_tiles", ctypes.c_void_p),
        ("maps_pad", ctypes.c_ubyte * 32),
        ("tma_q", ctypes.c_ubyte * 128),
        ("tma_k", ctypes.c_ubyte * 128),
        ("tma_v", ctypes.c_ubyte * 128),
        ("tma_do", ctypes.c_ubyte * 128),
    ]


BWD_PARAMS_BYTES = ctypes.sizeof(BwdParams)
BWD_PARAMS_MAPS_OFFSET = BwdParams.tma_q.offset  # q, k, v, dout maps, to the struct's end
# backward.run packs all of BwdParams at once: 11 pointers, 8 x 3 tensor strides + 2 lse
# strides, 6 sizes, 2 scales, the packed batch's 2 offset pointers and 2 totals, the window's
# 2 sides, softcap_pre, alibi_scale, ALiBi's slopes and batch stride, dropout's three fields,
# the reserved int, the two statistics pointers (the maps after them: padding to the format).
BWD_PARAMS_FORMAT = struct_format(BwdParams)


def score_scales(scale: float, softcap: float) -> tuple[float, float, float, float]:
    """softmax_scale, scale_log2, softcap_pre and alibi_scale, the four floats Params and
    BwdParams share, so that the backward recomputes P exactly as the forward's softmax
    took it. exp(s * scale) = exp2(s * scale * log2(e)); with a cap (softcap > 0) the
    kernels take t = tanh(s * scale / cap) and exp(cap * t) = exp2(t * cap * log2(e)).
    ALiBi's bias b on the scaled score is b * log2(e) / scale_log2 on the kernels' s (or t):
    alibi_scale = 1 / scale, or 1 / cap. The quotients are clamped to float32's largest value:
    a scale or cap below 2^-128, which the checks accept, must still pack (the struct formats
    raise on overflow)."""
    if softcap:
        return (scale, softcap * _LOG2E, min(scale / softcap, _FLOAT32_MAX),
                min(1.0 / softcap, _FLOAT32_MAX))
    return scale, scale * _LOG2E, 0.0, min(1.0 / scale, _FLOAT32_MAX)


def alibi_params(alibi_slopes) -> tuple[int, int]:
    """Params' (and BwdParams') alibi_slopes and alibi_batch_stride fields for checked slopes
    (_checks.check_alibi_slopes) or None: one slope per head for every batch entry is a batch
    stride of 0."""
    if alibi_slopes is None:
        return NO_ALIBI
    batched = alibi_slopes.dim() == 2 and alibi_slopes.shape[0] > 1
    return alibi_slopes.data_ptr(), alibi_slopes.stride(0) if batched else 0


def dropout_params(dropout) -> tuple:
    """Params' (and BwdParams') dropout_threshold, dropout_seed and dropout_scale fields for
    a ``Dropout`` (_dropout.py) or None."""
    if dropout is None:
        return NO_DROPOUT
    return dropout.threshold, dropout.seed.data_ptr(), dropout.scale
