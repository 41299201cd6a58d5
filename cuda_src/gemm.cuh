// Warp-level GEMMs of the forward pass on mma.sync m16n8k16 (fp32 accumulators):
//   S = Q K^T   (rows_per_warp, B_c), reduction over d_head
//   O += P V    (rows_per_warp, d_head), reduction over B_c, P taken straight from S's registers
// Operands move shared -> registers with ldmatrix, either whole (*_FRAGS = 0) or in groups of
// k16 slices interleaved with the mma (optionally double-buffered: group g+1 is requested before
// the mma of group g, so the ldmatrix latency hides behind tensor-core work).
#pragma once
#include "kernel_config.cuh"
#include "ptx.cuh"
#include "smem_layout.cuh"

namespace cudaflash {

// The k-slice group pipeline shared by both GEMMs: compute(g, buf) for every group g, with
// load(g, buf) moving group g's fragments into register buffer buf. With two buffers, group
// g + 1 is requested before group g is computed, so its ldmatrix latency hides behind the mma.
template <int kGroups, int kBufs, class Load, class Compute>
__device__ __forceinline__ void pipelined_groups(Load&& load, Compute&& compute) {
    static_assert(kBufs == 1 || kBufs == 2, "one or two register buffers");
    if constexpr (kBufs == 2) load(0, 0);
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
        const int buf = kBufs == 2 ? g % 2 : 0;
        if constexpr (kBufs == 1) {
            load(g, 0);
        } else if (g + 1 < kGroups) {
            load(g + 1, (g + 1) % 2);
        }
        compute(g, buf);
    }
}

template <class C>
struct WarpGemm {
    static constexpr int kM = C::kMTiles;
    static constexpr int kRowBytes = C::kRowPitchBytes;  // row to row in a shared tile
    static constexpr int kQSlabBytes = C::slab_pitch_bytes(C::kBr);  // a row's slab to the next
    static constexpr int kKvSlabBytes = C::slab_pitch_bytes(C::kBc);
    // Q_FRAGS = 0: the warp's whole Q slice stays in registers for the CTA's lifetime.
    static constexpr bool kQInRegisters = C::kQFrags == 0;

    // Per-lane shared addresses of the first fragment each operand's ldmatrix reads.
    uint32_t q_lane;  // Q: rows warp*rows_per_warp + (lane % 8) + 8 * (lane / 8 % 2)
    uint32_t k_lane;  // K: rows (lane % 8) + 8 * (lane / 16)
    uint32_t v_lane;  // V: rows (lane % 8) + 8 * (lane / 8 % 2)
    SliceOffsets<C> hi_by_lane16;  // column half = lane / 16 (Q and V)
    SliceOffsets<C> hi_by_lane8;   // column half = lane / 8 % 2 (K)
    uint32_t q_whole[kQInRegisters ? kM : 1][kQInRegisters ? C::kDSlices : 1][4];

    __device__ __forceinline__ WarpGemm(const void* sQ, const void* sK, const void* sV, int warp,
                                        int lane)
        : hi_by_lane16(lane / 16, lane % 8), hi_by_lane8(lane / 8 % 2, lane % 8) {
        const int qv_row = lane % 8 + 8 * (lane / 8 % 2);
        q_lane = smem_addr(sQ) + (warp * C::kRowsPerWarp + qv_row) * kRowBytes;
        k_lane = smem_addr(sK) + (lane % 8 + 8 * (lane / 16)) * kRowBytes;
        v_lane = smem_addr(sV) + qv_row * kRowBytes;
    }

    // A fragment of Q for m16 tile mi and k16 slice ks.
    __device__ __forceinline__ void load_q(uint32_t (&a)[4], int mi, int ks) const {
        ldmatrix_x4(a, q_lane + mi * 16 * kRowBytes + (ks / 4) * kQSlabBytes +
                           hi_by_lane16.bytes[ks % 4]);
    }
    // B fragments of K^T for n8 tiles 2*nj2 and 2*nj2+1 of slice ks: {b0, b1} of each.
    __device__ __forceinline__ void load_k(uint32_t (&b)[4], int nj2, int ks) const {
        ldmatrix_x4(b, k_lane + nj2 * 16 * kRowBytes + (ks / 4) * kKvSlabBytes +
                           hi_by_lane8.bytes[ks % 4]);
    }
    // B fragments of V for key slice kk and head-dim n8 tiles 2*nd2 and 2*nd2+1.
    __device__ __forceinline__ void load_v(uint32_t (&b)[4], int kk, int nd2) const {
        ldmatrix_x4_trans(b, v_lane + kk * 16 * kRowBytes + (nd2 / 4) * kKvSlabBytes +
                                 hi_by_lane16.bytes[nd2 % 4]);
    }

    // The warp's whole Q slice into registers (kQInRegisters), once Q has landed.
    __device__ __forceinline__ void load_q_whole() {
#pragma unroll
        for (int mi = 0; mi < kM; ++mi)
#pragma unroll
            for (int ks = 0; ks < C::kDSlices; ++ks) load_q(q_whole[mi][ks], mi, ks);
    }

    // S (kM, B_c / 8, 4) = Q K^T.
    __device__ __forceinline__ void qk(float (&S)[kM][C::kSTiles][4]) const {
        constexpr int kG = C::kKGroup;
        constexpr int kGroups = C::kDSlices / kG;
        constexpr int kBufs = (C::kDoubleBuffer && kGroups > 1) ? 2 : 1;
        constexpr bool kQSliced = C::kQFrags != 0;
        uint32_t kf[kBufs][kG][C::kSTiles / 2][4];
        uint32_t qf[kBufs][kQSliced ? kM : 1][kG][4];

        auto load_group = [&](int g, int buf) {
#pragma unroll
            for (int s = 0; s < kG; ++s) {
#pragma unroll
                for (int nj2 = 0; nj2 < C::kSTiles / 2; ++nj2) load_k(kf[buf][s][nj2], nj2, g * kG + s);
                if constexpr (kQSliced) {
#pragma unroll
                    for (int mi = 0; mi < kM; ++mi) load_q(qf[buf][mi][s], mi, g * kG + s);
                }
            }
        };

#pragma unroll
        for (int mi = 0; mi < kM; ++mi)
#pragma unroll
            for (int nj = 0; nj < C::kSTiles; ++nj)
#pragma unroll
                for (int e = 0; e < 4; ++e) S[mi][nj][e] = 0.f;

        auto compute_group = [&](int g, int buf) {
#pragma unroll
            for (int s = 0; s < kG; ++s) {
#pragma unroll
                for (int mi = 0; mi < kM; ++mi) {
                    const uint32_t(&a)[4] = q_fragment(qf[buf], mi, g * kG + s, s);
#pragma unroll
                    for (int nj = 0; nj < C::kSTiles; ++nj)
                        mma_m16n8k16<C::kBf16>(S[mi][nj], a, kf[buf][s][nj / 2][(nj % 2) * 2],
                                               kf[buf][s][nj / 2][(nj % 2) * 2 + 1]);
                }
            }
        };
        pipelined_groups<kGroups, kBufs>(load_group, compute_group);
    }

    // The A fragment of Q for (m16 tile mi, slice ks): from the sliced buffer (slot s of the
    // current group) or from the registers holding the whole Q slice.
    template <int kRowsQf, int kG>
    __device__ __forceinline__ const uint32_t (&q_fragment(const uint32_t (&qf)[kRowsQf][kG][4],
                                                           int mi, int ks, int s) const)[4] {
        if constexpr (kQInRegisters) {
            return q_whole[mi][ks];
        } else {
            return qf[mi][s];
        }
    }

    // O (kM, d_head / 8, 4) += P V, with P the softmax numerators still in S's registers.
    __device__ __forceinline__ void pv(float (&O)[kM][C::kOTiles][4],
                                       const float (&P)[kM][C::kSTiles][4]) const {
        uint32_t pf[kM][C::kKvSlices][4];
        pack_a_fragments<C::kBf16>(pf, P);
        pv_packed(O, pf);
    }

    // The same with P already rounded to 16 bits and packed as A fragments.
    __device__ __forceinline__ void pv_packed(float (&O)[kM][C::kOTiles][4],
                                              const uint32_t (&pf)[kM][C::kKvSlices][4]) const {
        constexpr int kG = C::kVGroup;
        constexpr int kGroups = C::kKvSlices / kG;
        constexpr int kBufs = (C::kDoubleBuffer && kGroups > 1) ? 2 : 1;

        uint32_t vf[kBufs][kG][C::kOTiles / 2][4];
        auto load_group = [&](int g, int buf) {
#pragma unroll
            for (int s = 0; s < kG; ++s)
#pragma unroll
                for (int nd2 = 0; nd2 < C::kOTiles / 2; ++nd2) load_v(vf[buf][s][nd2], g * kG + s, nd2);
        };

        auto compute_group = [&](int g, int buf) {
#pragma unroll
            for (int s = 0; s < kG; ++s)
#pragma unroll
                for (int mi = 0; mi < kM; ++mi)
#pragma unroll
                    for (int nd = 0; nd < C::kOTiles; ++nd)
                        mma_m16n8k16<C::kBf16>(O[mi][nd], pf[mi][g * kG + s],
                                               vf[buf][s][nd / 2][(nd % 2) * 2],
                                               vf[buf][s][nd / 2][(nd % 2) * 2 + 1]);
        };
        pipelined_groups<kGroups, kBufs>(load_group, compute_group);
    }
};

}  // namespace cudaflash
