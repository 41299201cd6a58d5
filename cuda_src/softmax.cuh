// Online softmax over the KV blocks of one warp's rows, in base 2: scores are scaled by
// softmax_scale * log2(e) inside one FFMA before MUFU.EX2, and the running row max m is kept in
// raw score units. Each thread holds 2 rows per m16 tile (lane / 4 and lane / 4 + 8); a row's
// 4 owners are the lanes of one quad, so row reductions are two xor-shuffles.
#pragma once
#include <cmath>
#include "kernel_config.cuh"
#include "ptx.cuh"

namespace cudaflash {

template <class C>
struct OnlineSoftmax {
    static constexpr int kM = C::kMTiles;
    float row_max[kM][2];  // raw units, -inf until the row has seen an unmasked key
    float row_sum[kM][2];  // this thread's partial sum; the quad reduction waits for the end

    __device__ __forceinline__ OnlineSoftmax() {
#pragma unroll
        for (int mi = 0; mi < kM; ++mi)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                row_max[mi][r] = -INFINITY;
                row_sum[mi][r] = 0.f;
            }
    }

    // Scores of keys at or past a row's limit become -inf (sequence tail, causal mask).
    __device__ __forceinline__ static void mask(float (&S)[kM][C::kSTiles][4], int kv0,
                                                const int (&key_limit)[kM][2], int lane) {
#pragma unroll
        for (int mi = 0; mi < kM; ++mi)
#pragma unroll
            for (int nj = 0; nj < C::kSTiles; ++nj)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = kv0 + nj * 8 + 2 * (lane % 4) + e % 2;
                    if (key >= key_limit[mi][e / 2]) S[mi][nj][e] = -INFINITY;
                }
    }

    // Turns S into P = exp2(S * scale_log2 - m * scale_log2) and rescales O and the row sums by
    // exp2((m_old - m_new) * scale_log2). kFirst (optimized_softmax): nothing accumulated yet,
    // so the rescale is skipped and m, l start from this tile.
    template <bool kFirst>
    __device__ __forceinline__ void update(float (&S)[kM][C::kSTiles][4],
                                           float (&O)[kM][C::kOTiles][4], float scale_log2) {
#pragma unroll
        for (int mi = 0; mi < kM; ++mi)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float m = kFirst ? -INFINITY : row_max[mi][r];
#pragma unroll
                for (int nj = 0; nj < C::kSTiles; ++nj)
                    m = fmaxf(m, fmaxf(S[mi][nj][2 * r], S[mi][nj][2 * r + 1]));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
                // A row with every key masked so far keeps m = -inf; subtracting 0 instead keeps
                // its exponentials at exp2(-inf) = 0 rather than NaN.
                const float m_scaled = m == -INFINITY ? 0.f : m * scale_log2;
                if constexpr (!kFirst) {
                    const float alpha = ex2(row_max[mi][r] * scale_log2 - m_scaled);
                    row_sum[mi][r] *= alpha;
#pragma unroll
                    for (int nd = 0; nd < C::kOTiles; ++nd) {
                        O[mi][nd][2 * r] *= alpha;
                        O[mi][nd][2 * r + 1] *= alpha;
                    }
                }
                row_max[mi][r] = m;
                float sum = 0.f;
#pragma unroll
                for (int nj = 0; nj < C::kSTiles; ++nj)
#pragma unroll
                    for (int e = 2 * r; e < 2 * r + 2; ++e) {
                        S[mi][nj][e] = ex2(fmaf(S[mi][nj][e], scale_log2, -m_scaled));
                        sum += S[mi][nj][e];
                    }
                row_sum[mi][r] = kFirst ? sum : row_sum[mi][r] + sum;
            }
    }

    // Normalises O by the row sums and returns each row's natural-log logsumexp of the scaled
    // scores (-inf and O = 0 for a row that saw no unmasked key).
    __device__ __forceinline__ void finalize(float (&O)[kM][C::kOTiles][4], float scale_log2,
                                             float (&lse)[kM][2]) {
        constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
        for (int mi = 0; mi < kM; ++mi)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float l = row_sum[mi][r];
                l += __shfl_xor_sync(0xffffffffu, l, 1);
                l += __shfl_xor_sync(0xffffffffu, l, 2);
                const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
                for (int nd = 0; nd < C::kOTiles; ++nd) {
                    O[mi][nd][2 * r] *= inv;
                    O[mi][nd][2 * r + 1] *= inv;
                }
                lse[mi][r] = l > 0.f ? (row_max[mi][r] * scale_log2 + __log2f(l)) * kLn2 : -INFINITY;
            }
    }
};

}  // namespace cudaflash
