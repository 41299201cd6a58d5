"""Host cost of TMA tensor maps per call (issue "Faster than cuDNN and FlashAttention-3", the
forward's TMA producer, step 1 of the plan in docs/design-notes.md, "Open questions"): a TMA
copy reads its global address from a tensor map, so a call with new q, k, v pointers needs
three maps encoded on the host (or patched on the device). This times encoding the three
maps of one flash_attn_func call, through cuda-bindings and through ctypes straight into a
preallocated 128-byte buffer (what a Params struct would hold), against the tiny-call host
budget (~9 us per call today, `python -m cudaflash bench` prints it).

    python3 tools/tensormap_cost.py [--iters 2000]

Needs a CUDA GPU of compute capability 9.0 (tensor maps); prints microseconds per call.
"""

import argparse
import ctypes
import statistics
import sys
import time

import torch
from cuda.bindings import driver as cu

BOX_COLS = 64  # 64 bf16 columns = 128 bytes: the 128-byte swizzle's row (the wgmma slab)
BOX_ROWS = 128  # B_c / B_r of the warp-specialized d128 config


def layout(t: torch.Tensor):
    """(dims, byte strides of dims 1.., box) of a (batch, seqlen, heads, d) tensor, innermost
    dim first, as cuTensorMapEncodeTiled takes them."""
    batch, seqlen, heads, d = t.shape
    size = t.element_size()
    dims = [d, heads, seqlen, batch]
    strides = [t.stride(2) * size, t.stride(1) * size, t.stride(0) * size]
    box = [BOX_COLS, 1, BOX_ROWS, 1]
    return dims, strides, box


def encode_bindings(tensors) -> None:
    dtype = cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
    for t in tensors:
        dims, strides, box = layout(t)
        err, _ = cu.cuTensorMapEncodeTiled(
            dtype, 4, t.data_ptr(), [cu.cuuint64_t(x) for x in dims],
            [cu.cuuint64_t(x) for x in strides], [cu.cuuint32_t(x) for x in box],
            [cu.cuuint32_t(1)] * 4,
            cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuTensorMapEncodeTiled (cuda-bindings): {err}")


class CtypesEncoder:
    """cuTensorMapEncodeTiled through ctypes into one 64-byte aligned buffer of three maps,
    the argument arrays preallocated: only the address and the shape change per call."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        self.fn = lib.cuTensorMapEncodeTiled
        self.fn.restype = ctypes.c_int
        self.raw = ctypes.create_string_buffer(3 * 128 + 64)
        base = ctypes.addressof(self.raw)
        self.maps = [base + (-base % 64) + 128 * i for i in range(3)]
        self.dims = (ctypes.c_uint64 * 4)()
        self.strides = (ctypes.c_uint64 * 3)()
        self.box = (ctypes.c_uint32 * 4)(BOX_COLS, 1, BOX_ROWS, 1)
        self.element_strides = (ctypes.c_uint32 * 4)(1, 1, 1, 1)
        self.dtype = int(cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16)
        self.swizzle = int(cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B)
        self.l2 = int(cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B)

    def __call__(self, tensors) -> None:
        for at, t in zip(self.maps, tensors):
            dims, strides, _ = layout(t)
            self.dims[:] = dims
            self.strides[:] = strides
            err = self.fn(ctypes.c_void_p(at), self.dtype, 4, ctypes.c_void_p(t.data_ptr()),
                          self.dims, self.strides, self.box, self.element_strides, 0,
                          self.swizzle, self.l2, 0)
            if err:
                raise RuntimeError(f"cuTensorMapEncodeTiled (ctypes): CUresult {err}")


def time_us(fn, iters: int) -> float:
    """Median microseconds of fn() over ``iters`` calls, in 10 rounds."""
    rounds = []
    for _ in range(10):
        start = time.perf_counter()
        for _ in range(iters // 10):
            fn()
        rounds.append((time.perf_counter() - start) / (iters // 10) * 1e6)
    return statistics.median(rounds)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=2000)
    args = p.parse_args()
    if torch.cuda.get_device_capability() < (9, 0):
        print("tensor maps need compute capability 9.0", file=sys.stderr)
        return 1
    q, k, v = (torch.randn(2, 1024, 16, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    encoder = CtypesEncoder()
    for name, fn in (("cuda-bindings", lambda: encode_bindings((q, k, v))),
                     ("ctypes", lambda: encoder((q, k, v)))):
        fn()  # warm up (and fail loudly on a bad argument)
        print(f"{name}: {time_us(fn, args.iters):.2f} us per call (3 maps)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
