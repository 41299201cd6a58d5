"""cudaflash/_tma.py without a GPU: the tensor maps' layouts (what cuTensorMapEncodeTiled is
given, through _driver.tensor_map_encoder), the caches of layouts and of encoded maps, the
fallbacks to cp.async and the size rule. The maps' effect on the kernel is
tests/test_gpu_tma.py's."""

import ctypes
from types import SimpleNamespace

import pytest
import torch
from cuda.bindings import driver as real_driver

from cudaflash import _driver, _tma
from cudaflash._params import PARAMS_BYTES


class FakeEncoder:
    """cuda.bindings.driver's cuTensorMapEncodeTiled and enums: records each call and returns
    a map whose 128 bytes start with the call's number and the global address."""

    CUtensorMapDataType = real_driver.CUtensorMapDataType
    CUtensorMapInterleave = real_driver.CUtensorMapInterleave
    CUtensorMapSwizzle = real_driver.CUtensorMapSwizzle
    CUtensorMapL2promotion = real_driver.CUtensorMapL2promotion
    CUtensorMapFloatOOBfill = real_driver.CUtensorMapFloatOOBfill
    CUresult = real_driver.CUresult
    cuuint64_t = real_driver.cuuint64_t
    cuuint32_t = real_driver.cuuint32_t

    def __init__(self, result=real_driver.CUresult.CUDA_SUCCESS):
        self.calls = []
        self.result = result

    def cuTensorMapEncodeTiled(self, dtype, rank, address, dims, strides, box, element_strides,
                               interleave, swizzle, promotion, fill):
        self.calls.append(SimpleNamespace(
            dtype=dtype, rank=rank, address=address, dims=[int(x) for x in dims],
            strides=[int(x) for x in strides], box=[int(x) for x in box], swizzle=swizzle,
            fill=fill))
        tensor_map = real_driver.CUtensorMap()
        tag = bytes([len(self.calls)]) + address.to_bytes(8, "little")
        ctypes.memmove(tensor_map.getPtr(), tag, len(tag))
        return self.result, tensor_map


@pytest.fixture
def cu(monkeypatch):
    """A fresh FakeEncoder as the driver, and empty layout tables."""
    fake = FakeEncoder()
    monkeypatch.setattr(_driver, "_cu", lambda: fake)
    monkeypatch.setattr(_driver, "_error_text", lambda err: f"CUresult {int(err)}")
    monkeypatch.setattr(_tma, "_layouts", {})
    monkeypatch.setattr(_tma, "_backward_layouts", {})
    return fake


def bshd(batch, seqlen, heads, d=128, dtype=torch.bfloat16):
    return torch.zeros(batch, seqlen, heads, d, dtype=dtype)


def test_map_layout_is_slab_major_5d(cu):
    """(64 columns, position, slab, head, batch entry), byte strides of dims 1.., a box of
    (64, tile rows, every slab, 1, 1), the 128-byte swizzle and zero fill."""
    q, k = bshd(2, 1000, 8), bshd(2, 700, 2)
    maps = _tma.tensor_maps(q, k, k, 128, 64)
    assert maps is not None
    qc, kc, vc = cu.calls  # the trial encodes, one per tensor
    assert qc.rank == 5 and qc.dims == [64, 1000, 2, 8, 2]
    assert qc.strides == [8 * 128 * 2, 128, 128 * 2, 1000 * 8 * 128 * 2]
    assert qc.box == [64, 128, 2, 1, 1] and kc.box == [64, 64, 2, 1, 1]
    assert kc.dims == [64, 700, 2, 2, 2] and qc.address == q.data_ptr()
    assert qc.dtype == real_driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
    assert qc.swizzle == real_driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B
    assert qc.fill == real_driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE


def test_strided_views_keep_their_strides(cu):
    """q of a packed (batch, seqlen, 3, heads, d) tensor: the maps take its strides as given."""
    qkv = torch.zeros(2, 100, 3, 4, 128, dtype=torch.float16)
    q, k, v = qkv.unbind(2)
    assert _tma.tensor_maps(q, k, v, 128, 128) is not None
    assert cu.calls[0].strides == [3 * 4 * 128 * 2, 128, 128 * 2, 100 * 3 * 4 * 128 * 2]
    assert cu.calls[0].dtype == real_driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16


def test_unit_dimension_strides_may_be_anything(cu):
    """A batch of one with a batch stride TMA cannot take (here 0, an expanded view) still
    gets maps: a dimension of one position is never stepped."""
    q = bshd(1, 256, 4)
    k = torch.zeros(256, 4, 128, dtype=torch.bfloat16).as_strided((1, 256, 4, 128),
                                                                   (0, 512, 128, 1))
    assert _tma.tensor_maps(q, k, k, 128, 128) is not None
    assert cu.calls[1].strides[3] == 16


def test_undescribable_layouts_keep_cp_async(cu):
    """A sequence stride TMA cannot take, a head dim that is not whole slabs, fp32, or a
    layout the driver refuses: no maps (the kernel loads with cp.async)."""
    q = bshd(2, 64, 2)
    odd = torch.zeros(2, 64, 2, 136, dtype=torch.bfloat16)[..., :128]  # seq stride 272 B: fine
    assert _tma.tensor_maps(q, odd, odd, 128, 128) is not None
    bad = torch.zeros(2, 64, 1, 128 + 4, dtype=torch.bfloat16)[..., :128]  # 264 B: not x16
    assert _tma.tensor_maps(q, bad, bad, 128, 128) is None
    assert _tma.tensor_maps(bshd(2, 64, 2, d=96), bshd(2, 64, 2, d=96),
                            bshd(2, 64, 2, d=96), 128, 128) is None
    f32 = torch.zeros(2, 64, 2, 128)
    assert _tma.tensor_maps(f32, f32, f32, 128, 128) is None
    cu.result = real_driver.CUresult.CUDA_ERROR_INVALID_VALUE
    refused = bshd(3, 64, 2)
    assert _tma.tensor_maps(refused, refused, refused, 128, 128) is None
    calls = len(cu.calls)
    assert _tma.tensor_maps(refused, refused, refused, 128, 128) is None
    assert len(cu.calls) == calls  # the layout's refusal is remembered


def test_a_layout_is_encoded_once_and_shared(cu):
    """Calls of one layout (dtype, shapes, strides, tile rows) share one TensorMaps, whose
    cache starts with the first call's maps (the trial encode): the checked path that
    autograd's forward takes on every call encodes nothing after the first. Another layout,
    or other tile rows, gets its own."""
    q, k, v = bshd(2, 256, 4), bshd(2, 256, 4), bshd(2, 256, 4)
    maps = _tma.tensor_maps(q, k, v, 128, 128)
    assert len(cu.calls) == 3
    buf = ctypes.create_string_buffer(PARAMS_BYTES)
    maps.write(ctypes.addressof(buf) + _tma.MAPS_OFFSET, q.data_ptr(), k.data_ptr(), v.data_ptr())
    assert _tma.tensor_maps(q, k, v, 128, 128) is maps and len(cu.calls) == 3
    tags = buf.raw[_tma.MAPS_OFFSET::128][:3]
    assert list(tags) == [1, 2, 3]  # the trial encodes' maps, from the cache
    q2, k2, v2 = bshd(2, 256, 4), bshd(2, 256, 4), bshd(2, 256, 4)
    assert _tma.tensor_maps(q2, k2, v2, 128, 128) is maps  # same layout, new tensors
    assert _tma.tensor_maps(q, k, v, 128, 64) is not maps
    view = torch.zeros(2, 256, 8, 128, dtype=torch.bfloat16)[:, :, :4]  # other strides
    assert _tma.tensor_maps(view, k, v, 128, 128) is not maps


def test_layout_table_is_bounded(cu, monkeypatch):
    monkeypatch.setattr(_tma, "MAX_LAYOUTS", 2)
    for seqlen in (128, 256, 384, 512):
        t = bshd(1, seqlen, 2)
        _tma.tensor_maps(t, t, t, 128, 128)
    assert len(_tma._layouts) <= 2


def test_write_encodes_each_pointer_triple_once(cu):
    """write() puts the three maps where it is told (Params' maps); a triple seen before is
    copied from the cache, a new one encoded; the cache starts over when full."""
    q = bshd(1, 128, 2)
    maps = _tma.tensor_maps(q, q, q, 128, 128)
    trial = len(cu.calls)
    buf = ctypes.create_string_buffer(PARAMS_BYTES)
    at = ctypes.addressof(buf) + _tma.MAPS_OFFSET

    def written():
        raw = buf.raw[_tma.MAPS_OFFSET:]
        return [int.from_bytes(raw[i * 128 + 1:i * 128 + 9], "little") for i in range(3)]

    maps.write(at, 0x1000, 0x2000, 0x3000)
    assert written() == [0x1000, 0x2000, 0x3000] and len(cu.calls) == trial + 3
    maps.write(at, 0x4000, 0x5000, 0x6000)
    maps.write(at, 0x1000, 0x2000, 0x3000)
    assert written() == [0x1000, 0x2000, 0x3000] and len(cu.calls) == trial + 6
    assert len(buf.raw) == _tma.MAPS_OFFSET + 3 * _tma.MAP_BYTES


def test_cache_is_bounded(cu, monkeypatch):
    monkeypatch.setattr(_tma, "MAX_CACHED", 2)
    q = bshd(1, 128, 2)
    maps = _tma.tensor_maps(q, q, q, 128, 128)
    buf = ctypes.create_string_buffer(PARAMS_BYTES)
    for i in range(5):
        maps.write(ctypes.addressof(buf) + _tma.MAPS_OFFSET, 0x1000 * i, 1, 2)
    assert len(maps._cache) <= 2


@pytest.mark.parametrize("rows,seqlen_k,heads,batch,causal,want", [
    (1024, 1024, 16, 16, False, True),
    (512, 512, 16, 32, False, True),  # 512 keys a CTA
    (512, 512, 16, 32, True, False),  # causal: 256 on average
    (1024, 1024, 16, 16, True, True),
    (128, 128, 1, 1, False, False),  # tiny: the host's encode would not hide
    (1, 65536, 32, 8, False, True),  # one query row over a long sequence, many heads
])
def test_worth_maps(rows, seqlen_k, heads, batch, causal, want):
    assert _tma.worth_maps(rows, seqlen_k, heads, batch, causal) is want


def test_backward_maps_are_q_k_v_dout_at_bwd_params_maps(cu):
    """The warp-specialized backward's four maps: q and dout with boxes of its step's query
    rows, k and v of its CTA's keys; written at BwdParams' maps, cached by the four pointers,
    a layout of its own beside the forward's."""
    from cudaflash._params import BWD_PARAMS_BYTES

    q, k = bshd(2, 300, 8, d=64), bshd(2, 500, 2, d=64)
    dout = torch.zeros(2, 300, 16, 64, dtype=torch.bfloat16)[:, :, 4:12]  # strided
    maps = _tma.backward_maps(q, k, k, dout, 128, 128)
    assert maps is not None and len(cu.calls) == 4
    qc, kc, vc, dc = cu.calls
    assert qc.box == [64, 128, 1, 1, 1] and kc.box == [64, 128, 1, 1, 1]
    assert dc.dims == [64, 300, 1, 8, 2] and dc.strides[0] == 16 * 64 * 2
    assert dc.address == dout.data_ptr()
    assert _tma.backward_maps(q, k, k, dout, 128, 128) is maps  # shared per layout
    assert _tma.tensor_maps(q, k, k, 128, 128) is not maps  # the forward's: three maps

    buf = ctypes.create_string_buffer(BWD_PARAMS_BYTES)
    at = ctypes.addressof(buf) + _tma.BWD_MAPS_OFFSET
    calls = len(cu.calls)
    maps.write(at, q.data_ptr(), k.data_ptr(), k.data_ptr(), dout.data_ptr())
    assert len(cu.calls) == calls  # the trial encodes' maps, from the cache
    raw = buf.raw[_tma.BWD_MAPS_OFFSET:]
    assert [raw[i * 128] for i in range(4)] == [1, 2, 3, 4]
    assert len(raw) == 4 * _tma.MAP_BYTES


def test_backward_maps_refuse_what_tma_cannot_describe(cu):
    q = bshd(1, 64, 2, d=64)
    assert _tma.backward_maps(q, q, q, q.float(), 64, 128) is None  # dout's dtype
    odd = torch.zeros(1, 64, 2, 68, dtype=torch.bfloat16)[..., :64]  # 136-byte head stride
    assert _tma.backward_maps(q, q, q, odd, 64, 128) is None


def test_backward_maps_encode_new_pointers_of_a_cached_layout(cu):
    """A layout seen before with new tensors (a training loop's next layer): the four maps of
    the new pointers are encoded into the given buffer, and the layout's own table is not
    the forward's."""
    q = bshd(1, 256, 2, d=64)
    maps = _tma.backward_maps(q, q, q, q, 128, 128)
    assert len(_tma._backward_layouts) == 1 and not _tma._layouts
    buf = ctypes.create_string_buffer(4 * _tma.MAP_BYTES)
    calls = len(cu.calls)
    maps.write(ctypes.addressof(buf), 0x1000, 0x2000, 0x3000, 0x4000)
    assert [c.address for c in cu.calls[calls:]] == [0x1000, 0x2000, 0x3000, 0x4000]
    raw = buf.raw
    assert [int.from_bytes(raw[i * 128 + 1:i * 128 + 9], "little") for i in range(4)] == \
        [0x1000, 0x2000, 0x3000, 0x4000]


def test_worth_maps_for_persistent_kernels_skips_the_keys_rule():
    """A persistent kernel fetches its maps once per SM: short CTAs (causal S = 512, 256 keys
    each) still take them when the call is big enough on the host's side."""
    assert not _tma.worth_maps(512, 512, 16, 32, True)
    assert _tma.worth_maps(512, 512, 16, 32, True, persistent=True)
    assert not _tma.worth_maps(512, 512, 1, 1, True, persistent=True)  # MIN_SCORES still
