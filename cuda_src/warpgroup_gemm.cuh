// Warpgroup-level GEMMs of the forward pass on Hopper's wgmma (sm_90a), the drop-in for
// WarpGemm when the config sets wgmma:
//   S = Q K^T   (64 rows of the warpgroup, B_c): Q and K both read from shared memory
//   O += P V    (64 rows, d_head): P from S's registers, V from shared memory
// Each warpgroup (4 warps) owns 64 query rows; warp w of it holds rows 16w..16w+15 in the same
// register layout as the mma.sync path (kMTiles = 1), so the softmax, masking and epilogue are
// shared with WarpGemm's kernel. No ldmatrix: the tensor cores read shared memory themselves,
// through descriptors of the 128-byte-swizzled (rows, 64) slabs that TileCopy writes.
#pragma once
#include "kernel_config.cuh"
#include "ptx.cuh"
#include "wgmma.cuh"

namespace cudaflash {

template <class C>
struct WarpgroupGemm {
    static_assert(C::kRowsPerWarp == 16 && C::kWarps % 4 == 0,
                  "wgmma: each warpgroup of 4 warps owns 64 query rows");
    static constexpr int kSlabRowBytes = C::kSlabRowBytes;  // one swizzle row
    static constexpr int kSwizzleAtomBytes = 8 * kSlabRowBytes;  // 8 rows: the swizzle period
    static constexpr bool kQInRegisters = false;  // the tensor cores read Q from shared memory

    uint32_t q_base;  // this warpgroup's first Q row, slab 0
    uint32_t k_base;
    uint32_t v_base;

    __device__ __forceinline__ WarpgroupGemm(const void* sQ, const void* sK, const void* sV,
                                             int warp, int /*lane*/) {
        q_base = smem_addr(sQ) + (warp / 4) * 64 * kSlabRowBytes;
        k_base = smem_addr(sK);
        v_base = smem_addr(sV);
    }

    // S (this thread's part of the warpgroup's 64 x B_c tile) = Q K^T. Both operands are
    // K-major (d_head contiguous): k16 slice ks is 32 bytes into slab ks / 4, and the
    // descriptor's stride is one 8-row swizzle atom (the leading offset is unused).
    __device__ __forceinline__ void qk(float (&S)[1][C::kSTiles][4]) const {
        float(&s)[C::kSTiles * 4] = reinterpret_cast<float(&)[C::kSTiles * 4]>(S);
        wgmma_fence_operands(s);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < C::kDSlices; ++ks) {
            const uint32_t slice = (ks % 4) * 32;
            const uint64_t a = make_smem_desc(
                q_base + (ks / 4) * C::kBr * kSlabRowBytes + slice, 16, kSwizzleAtomBytes);
            const uint64_t b = make_smem_desc(
                k_base + (ks / 4) * C::kBc * kSlabRowBytes + slice, 16, kSwizzleAtomBytes);
            wgmma_ss<C::kBc, C::kBf16>(s, a, b, ks > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(s);
    }

    // O += P V with P = S rounded to 16 bits. V is (B_c, d_head) with d_head contiguous: for
    // O's N = d_head that is MN-major, read transposed. k16 slice ks is rows 16ks..16ks+15
    // (two swizzle atoms); the leading offset steps between 64-column slabs, the stride
    // between 8-row atoms.
    __device__ __forceinline__ void pv(float (&O)[1][C::kOTiles][4],
                                       const float (&S)[1][C::kSTiles][4]) const {
        float(&o)[C::kOTiles * 4] = reinterpret_cast<float(&)[C::kOTiles * 4]>(O);
        uint32_t p[1][C::kKvSlices][4];
        pack_a_fragments<C::kBf16>(p, S);
        wgmma_fence_operands(o);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < C::kKvSlices; ++ks) {
            const uint64_t b = make_smem_desc(v_base + ks * 16 * kSlabRowBytes,
                                              C::kBc * kSlabRowBytes, kSwizzleAtomBytes);
            wgmma_rs<C::kDHead, C::kBf16>(o, p[0][ks], b, 1);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(o);
    }
};

}  // namespace cudaflash
