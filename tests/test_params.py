"""The Params and BwdParams structs: one layout each in cuda_src/params.cuh and
bwd_params.cuh, cudaflash/_params.py (ctypes), the launchers' struct formats and the
manifest."""

import ctypes
import json
import math
import re
import struct
from pathlib import Path

import pytest

from cudaflash import backward, manifest
from cudaflash._params import (APPEND_PARAMS_BYTES, APPEND_PARAMS_FORMAT, AppendParams,
                               BWD_PARAMS_BYTES, BWD_PARAMS_MAPS_OFFSET, PARAMS_BYTES,
                               PARAMS_FIXED_FORMAT, PARAMS_MAPS_OFFSET, PARAMS_POINTERS_BYTES, PARAMS_POINTERS_FORMAT,
                               PARAMS_STRUCT_FORMAT,
                               PARAMS_WORKSPACE_FORMAT, PARAMS_WORKSPACE_OFFSET, BwdParams, Params,
                               Strides, struct_format)

PARAMS_CUH = Path(__file__).resolve().parents[1] / "cuda_src" / "params.cuh"
_CUDA_TYPES = {"const void*": ctypes.c_void_p, "void*": ctypes.c_void_p,
               "const uint64_t*": ctypes.c_void_p, "uint32_t": ctypes.c_uint32,
               "float*": ctypes.c_void_p, "const float*": ctypes.c_void_p,
               "const int32_t*": ctypes.c_void_p, "int32_t*": ctypes.c_void_p,
               "int64_t": ctypes.c_int64, "int32_t": ctypes.c_int32,
               "float": ctypes.c_float, "unsigned char": ctypes.c_ubyte}


def test_sizes_agree():
    assert ctypes.sizeof(Params) == PARAMS_BYTES == 768
    # alignas(64) maps in the CUDA struct: maps_pad brings the fields before them to 384
    assert Params.tma_q.offset == PARAMS_MAPS_OFFSET == 384
    assert ctypes.sizeof(BwdParams) == BWD_PARAMS_BYTES == 960
    # alignas(64) maps in the CUDA struct: maps_pad brings the fields before them to 448
    assert BwdParams.tma_q.offset == BWD_PARAMS_MAPS_OFFSET == 448
    assert BWD_PARAMS_MAPS_OFFSET + 4 * 128 == BWD_PARAMS_BYTES
    assert struct.calcsize(PARAMS_STRUCT_FORMAT) == PARAMS_BYTES


def test_struct_format_fills_every_field_in_order():
    """Distinct values packed with the launcher's format read back field by field."""
    packed = [(name, ctype) for name, ctype in Params._fields_
              if not issubclass(ctype, ctypes.Array)]  # the maps and their pad: padding
    assert [name for name, _ in Params._fields_[len(packed):]] == ["maps_pad", "tma_q", "tma_k",
                                                                   "tma_v"]
    values = []
    for i, (name, ctype) in enumerate(packed):
        values.append(float(i) + 0.5 if ctype is ctypes.c_float else 1000 + i)
    p = Params()
    struct.pack_into(PARAMS_STRUCT_FORMAT, p, 0, *values)
    assert [getattr(p, name) for name, _ in packed] == values


def test_pointers_fixed_fields_and_workspace_split_the_struct():
    """The launcher packs the pointers per call, the middle once per plan and the split-KV
    workspace pointers per split call: the three formats must cover the struct, back to back,
    in field order."""
    assert struct.calcsize(PARAMS_POINTERS_FORMAT) == PARAMS_POINTERS_BYTES
    assert PARAMS_POINTERS_BYTES == Params.cu_seqlens_k.offset + Params.cu_seqlens_k.size == \
        Params.q_batch_stride.offset
    assert PARAMS_POINTERS_BYTES + struct.calcsize(PARAMS_FIXED_FORMAT) == \
        PARAMS_WORKSPACE_OFFSET == Params.o_accum.offset
    assert PARAMS_WORKSPACE_OFFSET + struct.calcsize(PARAMS_WORKSPACE_FORMAT) == \
        PARAMS_MAPS_OFFSET == Params.tma_q.offset
    assert PARAMS_MAPS_OFFSET + 3 * 128 == PARAMS_BYTES
    assert PARAMS_WORKSPACE_FORMAT == "=3Q40x"  # o_accum, lse_accum, tile_counter; the pad
    assert PARAMS_STRUCT_FORMAT == (PARAMS_POINTERS_FORMAT + PARAMS_FIXED_FORMAT[1:]
                                    + "3Q424x")  # the pad and the maps: one run of padding


def test_struct_format_writes_c_padding_out():
    """struct_format follows ctypes' C layout: padding before an aligned field, nested
    structures flattened, tail padding to the struct's alignment."""
    class Padded(ctypes.Structure):
        _fields_ = [("a", ctypes.c_int32), ("b", ctypes.c_int64), ("s", Strides),
                    ("c", ctypes.c_float)]

    assert struct_format(Padded) == "=i4x4qf4x"
    assert struct.calcsize(struct_format(Padded)) == ctypes.sizeof(Padded)
    assert struct_format(Padded, "b", "s") == "=4q"
    assert struct_format(BwdParams) == backward._PACK.format


def cuda_struct_fields(text: str, struct_name: str) -> list:
    """(name, ctypes type) of each field of ``struct_name``, in order, parsed from CUDA
    source (a ``Strides`` field as the Strides structure)."""
    body = re.search(rf"struct {struct_name} \{{(.*?)\n\}};", text, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    fields = []
    for decl in body.split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        decl = re.sub(r"^alignas\(\d+\) ", "", decl)
        m = re.fullmatch(r"((?:const |unsigned )?\w+\*?) (.+)", decl)
        ctype = Strides if m.group(1) == "Strides" else _CUDA_TYPES[m.group(1)]
        for name in m.group(2).split(","):
            array = re.fullmatch(r"(\w+)\[(\d+)\]", name.strip())
            fields.append((array.group(1), ctype * int(array.group(2))) if array
                          else (name.strip(), ctype))
    return fields


def test_fields_match_params_cuh():
    """Field names and types, in order, parsed from the CUDA struct."""
    text = PARAMS_CUH.read_text()
    assert cuda_struct_fields(text, "Params") == Params._fields_
    assert f"constexpr int kParamsBytes = {PARAMS_BYTES};" in text


def test_append_params_match_params_cuh():
    """cudaflash_append_kv's argument: fields in order, size, and the launcher's format
    fills every field."""
    text = PARAMS_CUH.read_text()
    assert cuda_struct_fields(text, "AppendParams") == AppendParams._fields_
    assert f"constexpr int kAppendParamsBytes = {APPEND_PARAMS_BYTES};" in text
    values = [1000 + i for i in range(len(AppendParams._fields_))]
    p = AppendParams()
    struct.pack_into(APPEND_PARAMS_FORMAT, p, 0, *values)
    assert [getattr(p, name) for name, _ in AppendParams._fields_] == values


def test_append_geometry_matches_the_kernel():
    from cudaflash import launch

    source = (PARAMS_CUH.parent / "flash_fwd.cu").read_text()
    assert f"constexpr int kAppendThreads = {launch._APPEND_THREADS};" in source


def test_manifest_records_the_same_size():
    try:
        m = manifest.load_manifest()
    except RuntimeError as e:
        pytest.skip(f"no kernels built: {e}")
    # load_manifest rejects a manifest whose params_bytes differs; check the value it read too.
    data = json.loads(m.path.read_text())
    assert data["params_bytes"] == PARAMS_BYTES


def test_combine_geometry_matches_the_kernel():
    """launch.py launches cudaflash_combine with one warp per row, COMBINE_ROWS rows per CTA:
    the kernel's kCombineRows must agree."""
    import _internals as internals

    source = (PARAMS_CUH.parent / "flash_fwd.cu").read_text()
    assert f"constexpr int kCombineRows = {internals.COMBINE_ROWS};" in source
    assert internals.COMBINE_THREADS == 32 * internals.COMBINE_ROWS


# ---- BwdParams (cuda_src/bwd_params.cuh): the backward's argument ----------------------------

BWD_PARAMS_CUH = PARAMS_CUH.with_name("bwd_params.cuh")


def _bwd_flat_fields():
    """(name, ctype) of every scalar of BwdParams in order, each Strides as its 3 int64s (the
    byte arrays, padding and tensor maps, are not packed: _tma.py writes the maps)."""
    flat = []
    for name, ctype in BwdParams._fields_:
        if issubclass(ctype, ctypes.Array):
            continue
        if ctype is Strides:
            flat += [(f"{name}.{sub}", c) for sub, c in Strides._fields_]
        else:
            flat.append((name, ctype))
    return flat


def test_bwd_fields_match_bwd_params_cuh():
    text = BWD_PARAMS_CUH.read_text()
    assert cuda_struct_fields(text, "BwdParams") == BwdParams._fields_
    assert ctypes.sizeof(BwdParams) == BWD_PARAMS_BYTES
    assert f"constexpr int kBwdParamsBytes = {BWD_PARAMS_BYTES};" in text


def test_backward_pack_fills_every_field_in_order():
    """backward.run packs BwdParams with one struct format: distinct values read back field
    by field (the window's two sides, softcap_pre, alibi_scale, ALiBi's slopes and batch
    stride, dropout's fields, the reserved int and the two statistics pointers, last)."""
    flat = _bwd_flat_fields()
    values = [float(i) + 0.5 if c is ctypes.c_float else 1000 + i
              for i, (_, c) in enumerate(flat)]
    p = BwdParams()
    struct.pack_into(backward._PACK.format, p, 0, *values)
    read = []
    for name, _ in flat:
        obj = p
        for part in name.split("."):
            obj = getattr(obj, part)
        read.append(obj)
    assert read == values
    assert flat[-12:] == [("window_left", ctypes.c_int32), ("window_right", ctypes.c_int32),
                          ("softcap_pre", ctypes.c_float), ("alibi_scale", ctypes.c_float),
                          ("alibi_slopes", ctypes.c_void_p),
                          ("alibi_batch_stride", ctypes.c_int32),
                          ("dropout_threshold", ctypes.c_uint32),
                          ("dropout_seed", ctypes.c_void_p), ("dropout_scale", ctypes.c_float),
                          ("reserved", ctypes.c_int32), ("lse_log2_tiles", ctypes.c_void_p),
                          ("delta_tiles", ctypes.c_void_p)]
    assert [name for name, _ in BwdParams._fields_[-5:]] == ["maps_pad", "tma_q", "tma_k",
                                                            "tma_v", "tma_do"]


def test_score_scales_turn_a_slope_into_score_units():
    """alibi_scale = log2(e) / scale_log2: the factor that turns ALiBi's bias on the scaled
    score into the units of the scores the kernels hold (raw q.k, or tanh values under a
    cap), for which the exponent is score * scale_log2."""
    from cudaflash._params import score_scales

    log2e = 1.4426950408889634
    for scale, cap in ((0.125, 0.0), (0.088, 30.0)):
        softmax_scale, scale_log2, softcap_pre, alibi_scale = score_scales(scale, cap)
        assert math.isclose(alibi_scale * scale_log2, log2e)
        assert softmax_scale == scale and (softcap_pre == 0.0) == (cap == 0.0)


def test_alibi_params_pack_pointer_and_batch_stride():
    """Params' alibi_slopes, alibi_batch_stride and reserved: 0s without slopes; one slope per
    head (or a batch of one) is a batch stride of 0, so every entry reads row 0."""
    import torch

    from cudaflash._params import NO_ALIBI, alibi_params

    assert alibi_params(None) == NO_ALIBI == (0, 0)
    per_head = torch.rand(8)
    assert alibi_params(per_head) == (per_head.data_ptr(), 0)
    per_entry = torch.rand(3, 16)[:, :8]  # a view: batch stride 16
    assert alibi_params(per_entry) == (per_entry.data_ptr(), 16)
    one_entry = torch.rand(1, 8)
    assert alibi_params(one_entry) == (one_entry.data_ptr(), 0)


def test_score_scales_pack_for_any_scale_the_checks_accept():
    """A softmax_scale or cap below 2^-128 (finite and > 0: accepted) still packs with the
    launchers' standard-size formats, which raise on overflow: the quotients (alibi_scale,
    softcap_pre) are clamped to float32's largest value."""
    from cudaflash._params import score_scales

    for scale, cap in ((1e-39, 0.0), (1e-45, 0.0), (0.1, 1e-40), (1e-39, 1e-39)):
        struct.pack("=4f", *score_scales(scale, cap))
