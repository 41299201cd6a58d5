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

    // Every descriptor field but the start address, fixed per operand. Q and K are K-major
    // (d_head contiguous): the stride is one 8-row swizzle atom, the leading offset is unused.
    // V, read as O's (B_c, d_head) B operand, is MN-major: the leading offset steps between
    // 64-column slabs, the stride between 8-row atoms.
    static_assert(kSwizzleAtomBytes == 1024, "the wgmma.cuh descriptor fields assume it");
    static constexpr uint64_t kQkFields = kSmemDescKMajor;
    static constexpr uint64_t kVFields = smem_desc_mn_major(C::kBc);

    // Start addresses >> 4, the descriptors' start field, of each operand's first k16 slice
    // (Q: this warpgroup's first row). One register each; a slice adds its offset >> 4.
    uint32_t q_start, k_start, v_start;

    __device__ __forceinline__ WarpgroupGemm(const void* sQ, const void* sK, const void* sV,
                                             int warp, int /*lane*/)
        : q_start((smem_addr(sQ) + (warp / 4) * 64 * kSlabRowBytes) >> 4),
          k_start(smem_addr(sK) >> 4),
          v_start(smem_addr(sV) >> 4) {}

    // The descriptor `bytes` past `start`: shared addresses stay below 256 KiB, so the sum
    // fits the 14-bit start field.
    __device__ __forceinline__ static uint64_t desc(uint64_t fields, uint32_t start,
                                                    uint32_t bytes) {
        return fields | (start + (bytes >> 4));
    }

    // S (this thread's part of the warpgroup's 64 x B_c tile) = Q K^T: k16 slice ks is 32
    // bytes into slab ks / 4 of Q and of K.
    __device__ __forceinline__ void qk(float (&S)[1][C::kSTiles][4]) const {
        float(&s)[C::kSTiles * 4] = reinterpret_cast<float(&)[C::kSTiles * 4]>(S);
        wgmma_fence_operands(s);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < C::kDSlices; ++ks) {
            const uint32_t slice = (ks % 4) * 32;
            wgmma_ss<C::kBc, C::kBf16>(
                s, desc(kQkFields, q_start, (ks / 4) * C::kBr * kSlabRowBytes + slice),
                desc(kQkFields, k_start, (ks / 4) * C::kBc * kSlabRowBytes + slice), ks > 0);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(s);
    }

    // The warp-specialized kernel's halves of qk and pv: issue a GEMM without waiting for it,
    // on the K or V stage `stage_bytes` past the first (its K/V ring). The caller commits,
    // waits (wgmma_commit, wgmma_wait) and fences the accumulators; P (packed once by the
    // caller) must stay untouched until then.
    __device__ __forceinline__ void qk_issue(float (&s)[C::kSTiles * 4],
                                             uint32_t stage_bytes) const {
#pragma unroll
        for (int ks = 0; ks < C::kDSlices; ++ks) {
            const uint32_t slice = (ks % 4) * 32;
            wgmma_ss<C::kBc, C::kBf16>(
                s, desc(kQkFields, q_start, (ks / 4) * C::kBr * kSlabRowBytes + slice),
                desc(kQkFields, k_start,
                     stage_bytes + (ks / 4) * C::kBc * kSlabRowBytes + slice),
                ks > 0);
        }
    }
    // One more k16 slice of Q K^T, issued after qk_issue (it accumulates): A from registers
    // (`a`, each warp's rows), B the (B_c, 8) table of key columns at shared address
    // `table` (fwd_warp_specialized.cuh's ALiBi table), K-major without swizzle: row j's 16
    // bytes hold k 0..7, row groups 128 bytes apart, and k 8..15 read the same core matrix
    // (leading offset 0), which A's zero columns 8..15 multiply away.
    static constexpr uint64_t kColumnFields = make_smem_desc_unswizzled(0, 128);
    __device__ __forceinline__ static void column_issue(float (&s)[C::kSTiles * 4],
                                                        const uint32_t (&a)[4], uint32_t table) {
        wgmma_rs_k<C::kBc, C::kBf16>(s, a, smem_desc_at(kColumnFields, table), 1);
    }

    __device__ __forceinline__ void pv_issue(float (&o)[C::kOTiles * 4],
                                             const uint32_t (&p)[C::kKvSlices][4],
                                             uint32_t stage_bytes) const {
#pragma unroll
        for (int ks = 0; ks < C::kKvSlices; ++ks) {
            wgmma_rs<C::kDHead, C::kBf16>(
                o, p[ks], desc(kVFields, v_start, stage_bytes + ks * 16 * kSlabRowBytes), 1);
        }
    }

    // O += P V with P = S rounded to 16 bits. k16 slice ks of V is rows 16ks..16ks+15 (two
    // swizzle atoms), read transposed (MN-major).
    __device__ __forceinline__ void pv(float (&O)[1][C::kOTiles][4],
                                       const float (&S)[1][C::kSTiles][4]) const {
        uint32_t p[1][C::kKvSlices][4];
        pack_a_fragments<C::kBf16>(p, S);
        pv_packed(O, p);
    }

    // The same with P already rounded to 16 bits and packed as A fragments.
    __device__ __forceinline__ void pv_packed(float (&O)[1][C::kOTiles][4],
                                              const uint32_t (&p)[1][C::kKvSlices][4]) const {
        float(&o)[C::kOTiles * 4] = reinterpret_cast<float(&)[C::kOTiles * 4]>(O);
        wgmma_fence_operands(o);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < C::kKvSlices; ++ks) {
            wgmma_rs<C::kDHead, C::kBf16>(
                o, p[0][ks], desc(kVFields, v_start, ks * 16 * kSlabRowBytes), 1);
        }
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(o);
    }
};

}  // namespace cudaflash
