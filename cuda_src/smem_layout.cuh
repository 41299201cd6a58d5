// Shared-memory layout of a (rows, d_head) tile: d_head / 64 slabs of (rows, 64) elements, so
// every slab row is 128 bytes = 8 chunks of 16 bytes (C::kDHeadTiled, the seed's step 15), or
// plain rows of d_head elements, each slab's 128 bytes side by side. With swizzling, chunk c
// of a row's slab is stored at chunk c ^ (row % 8) of that slab: the 8 rows an ldmatrix or a
// 16-byte copy touches at once then fall into 8 different bank groups instead of one (8-way
// conflict without it). The XOR stays inside the slab, so both layouts are conflict-free; the
// slabs make every row pitch 128 bytes (wgmma's swizzle atoms need that).
#pragma once

namespace cudaflash {

template <class C>
struct SmemTile {
    // Element offset of (row, chunk) where chunk = column / 8 within the whole d_head.
    template <int kRows>
    __device__ __forceinline__ static int offset(int row, int chunk) {
        const int slab = chunk / 8;
        const int c = chunk % 8;
        const int swz = C::kSwizzled ? (row % 8) : 0;
        if constexpr (C::kDHeadTiled) {
            return slab * kRows * C::kSlab + row * C::kSlab + (c ^ swz) * 8;
        } else {
            return row * C::kDHead + slab * C::kSlab + (c ^ swz) * 8;
        }
    }
};

// Byte offsets, relative to a lane's base address, of the four 16-column k-slices that share
// one 64-column slab: slice s (mod 4) sits at chunk (2s + hi) ^ (row % 8), where hi is the
// lane's half within the slice. Precomputed once per lane so the loops add a register and an
// immediate instead of recomputing the XOR.
template <class C>
struct SliceOffsets {
    uint32_t bytes[4];
    __device__ __forceinline__ SliceOffsets(int hi, int row_mod8) {
        const int x = hi ^ (C::kSwizzled ? row_mod8 : 0);
#pragma unroll
        for (int s = 0; s < 4; ++s) bytes[s] = ((2 * s) ^ x) * 16;
    }
};

}  // namespace cudaflash
