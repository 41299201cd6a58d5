"""ctypes mirror of ``cuda_src/params.cuh``: the kernel's single by-value argument.

Field order, types and padding must match the CUDA struct exactly; ``PARAMS_BYTES`` is
``static_assert``ed on the CUDA side, recorded in the manifest by the build, and compared
with ``ctypes.sizeof(Params)`` by the tests.
"""

import ctypes
import math

_LOG2E = math.log2(math.e)

PARAMS_BYTES = 248


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
        ("reserved", ctypes.c_float),
        # split-KV (cudaflash_fwd_split, cudaflash_combine)
        ("n_splits", ctypes.c_int32),
        ("kv_blocks_per_split", ctypes.c_int32),
        ("o_accum", ctypes.c_void_p),
        ("lse_accum", ctypes.c_void_p),
    ]


# struct.pack formats of the same layout (native alignment matches: every field is naturally
# aligned and the total is a multiple of 8), used by the launcher to fill a reusable buffer
# without building a ctypes object per call. Split in three: the pointers change on every
# call; the middle (strides, sizes, scales, split counts) is fixed for a call signature and
# packed once per plan; the split-KV workspace pointers at the end change per call of a
# split launch and are 0 otherwise.
PARAMS_POINTERS_FORMAT = "=7Q"  # q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k
PARAMS_FIXED_FORMAT = "=14q10i4f2i"  # strides, sizes, window, scales, softcap, split counts
PARAMS_WORKSPACE_FORMAT = "=2Q"  # o_accum, lse_accum
PARAMS_POINTERS_BYTES = 56
PARAMS_WORKSPACE_OFFSET = 232
PARAMS_STRUCT_FORMAT = (PARAMS_POINTERS_FORMAT + PARAMS_FIXED_FORMAT[1:]
                        + PARAMS_WORKSPACE_FORMAT[1:])


BWD_PARAMS_BYTES = 368


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
        ("reserved", ctypes.c_float),
    ]


def score_scales(scale: float, softcap: float) -> tuple[float, float, float, float]:
    """softmax_scale, scale_log2, softcap_pre and reserved, the four floats Params and
    BwdParams share, so that the backward recomputes P exactly as the forward's softmax
    took it. exp(s * scale) = exp2(s * scale * log2(e)); with a cap (softcap > 0) the
    kernels take t = tanh(s * scale / cap) and exp(cap * t) = exp2(t * cap * log2(e))."""
    if softcap:
        return scale, softcap * _LOG2E, scale / softcap, 0.0
    return scale, scale * _LOG2E, 0.0, 0.0
