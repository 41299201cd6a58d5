// The forward kernels' writes of their results from the accumulator registers: the lse, the
// split-KV partial results, and O into the shared tile it leaves through. Thread (warp, lane)
// holds rows warp_row0 + 16 * mi + lane / 4 + 8 * r of the CTA's tile (mma's C layout, also
// wgmma's per warp); shared by flash_fwd.cu and fwd_warp_specialized.cuh.
#pragma once
#include "fwd_range.cuh"
#include "kernel_config.cuh"
#include "params.cuh"
#include "ptx.cuh"
#include "smem_layout.cuh"

namespace cudaflash {

// The CTA row of accumulator element (mi, r).
__device__ __forceinline__ int acc_row(int warp_row0, int lane, int mi, int r) {
    return warp_row0 + mi * 16 + lane / 4 + 8 * r;
}

// The logsumexp of this thread's rows below the sequence's end (one lane per quad writes).
template <class C, int kM>
__device__ __forceinline__ void store_lse(const Params& p, const float (&lse)[kM][2],
                                          const CtaPlace& at, const Sequence& seq, int q_row0,
                                          int warp_row0, int lane) {
    if (p.lse == nullptr || lane % 4 != 0) return;
    float* lse_row = p.lse + at.batch * p.lse_batch_stride + at.head * p.lse_head_stride +
                     seq.start_q;
#pragma unroll
    for (int mi = 0; mi < kM; ++mi)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = q_row0 + acc_row(warp_row0, lane, mi, r);
            if (row < seq.len_q) lse_row[row] = lse[mi][r];
        }
}

// Split-KV partial results straight from registers, float32: each quad writes 8 consecutive
// floats of a row per n8 tile. Rows past the sequence are not written, nor rows past
// seqlen_q, the workspace's rows per head (a packed sequence longer than the max_seqlen_q the
// caller gave).
template <class C, int kM>
__device__ __forceinline__ void store_split_partials(const Params& p,
                                                     const float (&O)[kM][C::kOTiles][4],
                                                     const float (&lse)[kM][2],
                                                     const CtaPlace& at, const Sequence& seq,
                                                     int q_row0, int warp_row0, int lane) {
    const int64_t split_row0 =
        ((int64_t(at.split) * p.batch + at.batch) * p.n_heads + at.head) * p.seqlen_q;
    const int rows_written = min(seq.len_q, p.seqlen_q);
#pragma unroll
    for (int mi = 0; mi < kM; ++mi)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = q_row0 + acc_row(warp_row0, lane, mi, r);
            if (row >= rows_written) continue;
            if (lane % 4 == 0) p.lse_accum[split_row0 + row] = lse[mi][r];
            float* o_row = p.o_accum + (split_row0 + row) * C::kDHead + 2 * (lane % 4);
#pragma unroll
            for (int nd = 0; nd < C::kOTiles; ++nd)
                *reinterpret_cast<float2*>(o_row + nd * 8) =
                    make_float2(O[mi][nd][2 * r], O[mi][nd][2 * r + 1]);
        }
}

// O rounded to 16 bits into the CTA's (B_r, d_head) shared tile sQ, for coalesced global
// stores after a barrier.
template <class C, int kM>
__device__ __forceinline__ void o_to_smem(typename C::elem_t* sQ,
                                          const float (&O)[kM][C::kOTiles][4], int warp_row0,
                                          int lane) {
#pragma unroll
    for (int mi = 0; mi < kM; ++mi)
#pragma unroll
        for (int nd = 0; nd < C::kOTiles; ++nd)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                typename C::elem_t* dst =
                    sQ + SmemTile<C>::template offset<C::kBr>(acc_row(warp_row0, lane, mi, r), nd) +
                    2 * (lane % 4);
                *reinterpret_cast<uint32_t*>(dst) =
                    pack_2<C::kBf16>(O[mi][nd][2 * r], O[mi][nd][2 * r + 1]);
            }
}

}  // namespace cudaflash
