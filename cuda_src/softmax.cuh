// Online softmax over the KV blocks of one warp's rows. With C::kExp2Softmax (the seed's step
// 6) in base-2 units: scores are scaled by softmax_scale * log2(e) inside one FFMA before
// MUFU.EX2. Without it in natural units: exp(x) is ex2(x * log2(e)), one FMUL more per score.
// Each thread holds 2 rows per m16 tile (lane / 4 and lane / 4 + 8); a row's 4 owners are the
// lanes of one quad, so row reductions are two xor-shuffles.
#pragma once
#include <climits>
#include <cmath>
#include "kernel_config.cuh"
#include "params.cuh"
#include "philox.cuh"
#include "ptx.cuh"
#include "score_mods.cuh"

namespace cudaflash {

template <class C>
struct OnlineSoftmax {
    static constexpr int kM = C::kMTiles;
    // Exponentials are taken against a per-row reference max, raised only when a tile's max
    // exceeds it by more than this many powers of two. P then stays <= 2^8 (exact in fp32,
    // representable in fp16/bf16) and the O rescale, kOTiles * 4 FMULs per row pair, is skipped
    // in most iterations. The result is exact: O, the row sum and the lse all use the same max.
    static constexpr float kLn2 = 0.6931471805599453f;
    static constexpr float kRescaleThreshold = C::kExp2Softmax ? 8.f : 8.f * kLn2;

    // The multiplier of the raw scores (update's `scale`) for p.scale_log2 =
    // softmax_scale * log2(e): the units ref_max and the exponentials work in.
    __device__ __forceinline__ static float score_scale(float scale_log2) {
        return C::kExp2Softmax ? scale_log2 : scale_log2 * kLn2;
    }
    // e^x in the softmax's units: 2^x (base 2) or e^x (natural).
    __device__ __forceinline__ static float exp_units(float x) {
        if constexpr (C::kExp2Softmax) {
            return ex2(x);
        } else {
            return __expf(x);
        }
    }

    struct Max {
        __device__ __forceinline__ static float op(float a, float b) { return fmaxf(a, b); }
    };
    struct Sum {
        __device__ __forceinline__ static float op(float a, float b) { return a + b; }
    };

    // Reduces this thread's 2 * kSTiles values of row pair half r of one m16 tile as a tree:
    // depth log2(2 * kSTiles) instead of a chain of 2 * kSTiles dependent instructions, which
    // matters with only two warps per scheduler to hide latencies.
    template <class Op>
    __device__ __forceinline__ static float row_reduce(const float (&tile)[C::kSTiles][4], int r) {
        float v[C::kSTiles];
#pragma unroll
        for (int nj = 0; nj < C::kSTiles; ++nj) v[nj] = Op::op(tile[nj][2 * r], tile[nj][2 * r + 1]);
        fold<Op, C::kSTiles / 2>(v);
        return v[0];
    }

    // v[i] = op(v[i], v[i + width]) for width = kWidth, kWidth / 2, ..., 1. Recursion rather
    // than a halving loop: nvcc left the loop rolled for 16 tiles (B_c = 128), which put v in
    // local memory.
    template <class Op, int kWidth>
    __device__ __forceinline__ static void fold(float (&v)[C::kSTiles]) {
        if constexpr (kWidth > 0) {
#pragma unroll
            for (int i = 0; i < kWidth; ++i) v[i] = Op::op(v[i], v[i + kWidth]);
            fold<Op, kWidth / 2>(v);
        }
    }

    float ref_max[kM][2];  // in the units of score * score_scale; -inf until a key is visible
    float row_sum[kM][2];  // this thread's partial sum; the quad reduction waits for the end

    __device__ __forceinline__ OnlineSoftmax() {
#pragma unroll
        for (int mi = 0; mi < kM; ++mi)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                ref_max[mi][r] = -INFINITY;
                row_sum[mi][r] = 0.f;
            }
    }

    // Scores of keys a row must not see become -inf: keys >= seqlen_k (the tail) and keys
    // outside the row's window [row + shift - left, row + shift + right] (params.cuh; a
    // negative side is unbounded; causal is right = 0). `row0` is the warp's first query row.
    __device__ __forceinline__ static void mask(float (&S)[kM][C::kSTiles][4], int kv0, int row0,
                                                int seqlen_q, int seqlen_k, int window_left,
                                                int window_right, int lane) {
        // An unbounded side becomes INT_MAX, which no offset (key - diagonal) exceeds for any
        // sequence that fits in a GPU's memory.
        const int right = window_right >= 0 ? window_right : INT_MAX;
        const int left = window_left >= 0 ? window_left : INT_MAX;
#pragma unroll
        for (int mi = 0; mi < kM; ++mi)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = row0 + mi * 16 + lane / 4 + 8 * r;
                const int diagonal = row + seqlen_k - seqlen_q;
#pragma unroll
                for (int nj = 0; nj < C::kSTiles; ++nj)
#pragma unroll
                    for (int e = 2 * r; e < 2 * r + 2; ++e) {
                        const int key = kv0 + nj * 8 + 2 * (lane % 4) + e % 2;
                        const int offset = key - diagonal;  // from the row's diagonal
                        if (key >= seqlen_k || offset > right || offset < -left)
                            S[mi][nj][e] = -INFINITY;
                    }
            }
    }

    // Softcapping (params.cuh, softcap_pre): raw scores -> tanh(score * pre), before the mask
    // (a masked -inf must stay -inf). update's `scale` then carries the cap (scale_log2 =
    // cap * log2(e)), so the softmax itself is unchanged.
    __device__ __forceinline__ static void softcap(float (&S)[kM][C::kSTiles][4], float pre) {
#pragma unroll
        for (int mi = 0; mi < kM; ++mi)
#pragma unroll
            for (int nj = 0; nj < C::kSTiles; ++nj)
#pragma unroll
                for (int e = 0; e < 4; ++e) S[mi][nj][e] = tanh_approx(S[mi][nj][e] * pre);
    }

    // ALiBi (score_mods.cuh): S += -coefficient * |key - (row + shift)|, shift = len_k - len_q;
    // `row0` is the warp's first query row, `kv0` the tile's first key. After softcap, before
    // the mask (a masked -inf stays -inf). Where every score of the warp's rows that the mask
    // keeps lies on one side of its row's diagonal (alibi_side), |offset| is a signed offset,
    // so the bias splits into a column part, one FFMA with an immediate per score, and a row
    // part returned in row_terms for update() to fold into the row's maximum and exponent
    // offset. Else (a tile across the diagonal, a head too steep for that form:
    // `one_sided` false, alibi_one_sided_fits, or a kernel other than the warp-specialized
    // one) two ops per score and row_terms 0.
    __device__ __forceinline__ static void alibi(float (&S)[kM][C::kSTiles][4],
                                                 float (&row_terms)[kM][2], float coefficient,
                                                 int kv0, int row0, int shift, bool keys_left,
                                                 int lane, bool one_sided = true) {
        const int side = one_sided ? alibi_side(kv0, row0, shift, keys_left) : 0;
        // Only in the warp-specialized kernel (224 registers per consumer thread): the
        // mma.sync configs at 255 registers spilled 4-32 bytes with both forms, and the d64
        // wgmma kernel rose from 167 to 225 registers (3 CTAs per SM to 2) and ran slower
        // (perf log, "ALiBi").
        if (C::kWarpSpecialized && side != 0) {
            const float sided = side > 0 ? coefficient : -coefficient;  // -c|x| = c x or -c x
            alibi_row_terms(row_terms, sided, kv0, row0, shift, lane, true);
#pragma unroll
            for (int mi = 0; mi < kM; ++mi)
#pragma unroll
                for (int nj = 0; nj < C::kSTiles; ++nj)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        S[mi][nj][e] = fmaf(sided, float(nj * 8 + e % 2), S[mi][nj][e]);
            return;
        }
        alibi_per_score(S, row_terms, coefficient, kv0, row0, shift, lane);
    }

    // ALiBi where the GEMM already added the column part of a one-sided tile (the warp-
    // specialized kernel's column slice of Q K^T: S holds q k + sided * j for the tile's key
    // column j, where side != 0): only the row part remains, in row_terms, and no op per
    // score. A tile across the diagonal (side 0, where the slice added nothing) takes the two
    // ops per score.
    __device__ __forceinline__ static void alibi_rows(float (&S)[kM][C::kSTiles][4],
                                                      float (&row_terms)[kM][2],
                                                      float coefficient, int side, int kv0,
                                                      int row0, int shift, int lane) {
        // `side` is the warp's (its rows' diagonals): the vote tells ptxas so, which spares
        // the step a divergent branch's reconvergence (BSSY/BSYNC).
        if (__all_sync(0xffffffffu, side != 0)) {
            alibi_row_terms(row_terms, side > 0 ? coefficient : -coefficient, kv0, row0, shift,
                            lane, false);
            return;
        }
        alibi_per_score(S, row_terms, coefficient, kv0, row0, shift, lane);
    }

    // Whether the one-sided forms (alibi's FFMA, alibi_rows) may serve a head of ALiBi
    // coefficient `coefficient` (update's `scale`): they split the bias into a column part and
    // a row part that cancel near the diagonal, and the row's exponent offset then rounds at
    // the row part's size, about |bias per key| * B_c in the exponent's units (OnlineSoftmax::
    // exponentiate: fmaf(-row_terms, scale, ref_max)). Within kAlibiOneSidedSpan = 256 (log2
    // units: slopes up to 2 / (B_c log2 e), 1.39 at B_c = 128, every slope of the ALiBi paper)
    // that rounding stays below 2^-16 of a probability; steeper heads, whose rows attend to a
    // few keys (the error would show in those keys' weights), take the bias per score, exact
    // at the diagonal.
    static constexpr float kAlibiOneSidedSpan = 256.f;
    __device__ __forceinline__ static bool alibi_one_sided_fits(float coefficient, float scale) {
        return fabsf(coefficient * scale) * C::kBc <= kAlibiOneSidedSpan;
    }

    // Which side of its row's diagonal each key of the tile that the mask keeps lies on, for
    // all of the warp's rows: +1 left (keys_left: the caller knows no visible key is right of
    // it, e.g. causal), -1 right, 0 across (the tile holds keys of both sides for some row).
    // (The warp-specialized kernel's column slice makes the same test as per-tile block
    // bounds: fwd_warp_specialized.cuh, alibi_left_end and alibi_right_begin.)
    __device__ __forceinline__ static int alibi_side(int kv0, int row0, int shift,
                                                     bool keys_left) {
        // The offsets of the warp's extreme rows from the tile's first and last keys.
        const int first_diagonal = row0 + shift, last_diagonal = row0 + kM * 16 - 1 + shift;
        const bool left = keys_left || kv0 + C::kBc - 1 <= first_diagonal;
        const bool right = kv0 >= last_diagonal;
        return int(left) - int(!left && right);
    }

    // A one-sided tile's row parts, sided * (kv0 - (row + shift)), plus the thread's first
    // column (2 (lane % 4)) when the column part added to S leaves it out (alibi's FFMA form).
    __device__ __forceinline__ static void alibi_row_terms(float (&row_terms)[kM][2],
                                                           float sided, int kv0, int row0,
                                                           int shift, int lane,
                                                           bool lane_column) {
        const int column = lane_column ? 2 * (lane % 4) : 0;
#pragma unroll
        for (int mi = 0; mi < kM; ++mi)
#pragma unroll
            for (int r = 0; r < 2; ++r)
                row_terms[mi][r] =
                    sided * float(kv0 + column - (row0 + mi * 16 + lane / 4 + 8 * r + shift));
    }

    // The bias added score by score (a tile across the diagonal): row_terms 0.
    __device__ __forceinline__ static void alibi_per_score(float (&S)[kM][C::kSTiles][4],
                                                           float (&row_terms)[kM][2],
                                                           float coefficient, int kv0,
                                                           int row0, int shift, int lane) {
#pragma unroll
        for (int mi = 0; mi < kM; ++mi)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                row_terms[mi][r] = 0.f;
                // The offset of the thread's first column of the tile; the others add constants.
                const float offset0 =
                    float(kv0 + 2 * (lane % 4) - (row0 + mi * 16 + lane / 4 + 8 * r + shift));
#pragma unroll
                for (int nj = 0; nj < C::kSTiles; ++nj)
#pragma unroll
                    for (int e = 2 * r; e < 2 * r + 2; ++e)
                        S[mi][nj][e] += alibi_bias(coefficient, offset0 + float(nj * 8 + e % 2));
            }
    }

    // Dropout (params.cuh, philox.cuh), on P packed as A fragments: dropped scores' halves
    // become 0, after update() took the row sums (the softmax's denominator is the undropped
    // one; O is scaled by 1 / (1 - p) at the end). `q16` is the warp's first query row / 16
    // (within its sequence), `k16` the tile's first key / 16, `head_index` = batch * n_heads +
    // head. On the packed P (keep_packed) two scores take a prmt, a compare and an AND (the
    // float P took a test and a select per score), and the float P need not live beside the
    // random numbers. kStarved: for kernels with no registers to spare (the mma.sync configs
    // at ~255): the key schedule recomputed per call (dropout_bytes' kLeanKeys) and the mask
    // per score (keep_packed's kPerScore).
    template <bool kStarved>
    __device__ __forceinline__ static void dropout_packed(uint32_t (&pf)[kM][C::kKvSlices][4],
                                                          uint64_t seed, int q16, int k16,
                                                          int head_index, uint32_t threshold,
                                                          int lane) {
        const KeepThreshold t(threshold);
#pragma unroll
        for (int mi = 0; mi < kM; ++mi) {
            KeepBytes bytes[C::kKvSlices];
            dropout_bytes<false, C::kKvSlices, kStarved>(bytes, seed, q16 + mi, k16, 0, 1,
                                                         head_index, lane);
            keep_packed<kStarved>(pf[mi], pf[mi], bytes, t);
        }
    }

    __device__ __forceinline__ static void scale_o(float (&O)[kM][C::kOTiles][4], float scale) {
#pragma unroll
        for (int mi = 0; mi < kM; ++mi)
#pragma unroll
            for (int nd = 0; nd < C::kOTiles; ++nd)
#pragma unroll
                for (int e = 0; e < 4; ++e) O[mi][nd][e] *= scale;
    }

    __device__ __forceinline__ static void zero_row_terms(float (&row_terms)[kM][2]) {
#pragma unroll
        for (int mi = 0; mi < kM; ++mi) row_terms[mi][0] = row_terms[mi][1] = 0.f;
    }

    // Turns S into P = exp_units(S * scale - ref_max), raising ref_max (and rescaling O and the
    // row sums by exp_units(old - new)) where the tile demands it; scale = score_scale(...).
    // kFirst (optimized_softmax): nothing is accumulated yet, so ref_max starts at the tile's
    // max with no rescale.
    // kRowTerms: the thread's scores of row (mi, r) also carry row_terms[mi][r] (alibi's row
    // part), added to its maximum and folded into its exponent offset; without, row_terms is
    // not read.
    template <bool kFirst, bool kRowTerms = false>
    __device__ __forceinline__ void update(float (&S)[kM][C::kSTiles][4],
                                           float (&O)[kM][C::kOTiles][4], float scale,
                                           const float (&row_terms)[kM][2]) {
        float tile_max[kM][2];
        const bool raise = row_maxima<kRowTerms>(S, scale, tile_max, row_terms);
        if constexpr (kFirst) {
            set_max(tile_max);
        } else if (__any_sync(0xffffffffu, raise)) {  // warp-uniform: skip the whole rescale
#pragma unroll
            for (int mi = 0; mi < kM; ++mi)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const float alpha = raise_row(tile_max, mi, r);
#pragma unroll
                    for (int nd = 0; nd < C::kOTiles; ++nd) {
                        O[mi][nd][2 * r] *= alpha;
                        O[mi][nd][2 * r + 1] *= alpha;
                    }
                }
        }
        exponentiate<kFirst, kRowTerms>(S, scale, row_terms);
    }

    // update() in two halves, for a kernel whose tensor cores may still be adding into O
    // (fwd_warp_specialized.cuh): update_scores is update without touching O, returning
    // whether O must be scaled by `alpha` (warp-uniform), which rescale then does once O is
    // settled.
    template <bool kFirst, bool kRowTerms = false>
    __device__ __forceinline__ bool update_scores(float (&S)[kM][C::kSTiles][4], float scale,
                                                  float (&alpha)[kM][2],
                                                  const float (&row_terms)[kM][2]) {
        float tile_max[kM][2];
        const bool raise = row_maxima<kRowTerms>(S, scale, tile_max, row_terms);
        bool rescale_o = false;
        if constexpr (kFirst) {
            set_max(tile_max);
        } else if (__any_sync(0xffffffffu, raise)) {
            rescale_o = true;
#pragma unroll
            for (int mi = 0; mi < kM; ++mi)
#pragma unroll
                for (int r = 0; r < 2; ++r) alpha[mi][r] = raise_row(tile_max, mi, r);
        }
        exponentiate<kFirst, kRowTerms>(S, scale, row_terms);
        return rescale_o;
    }
    __device__ __forceinline__ static void rescale(float (&O)[kM][C::kOTiles][4],
                                                   const float (&alpha)[kM][2]) {
#pragma unroll
        for (int mi = 0; mi < kM; ++mi)
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int nd = 0; nd < C::kOTiles; ++nd) {
                    O[mi][nd][2 * r] *= alpha[mi][r];
                    O[mi][nd][2 * r + 1] *= alpha[mi][r];
                }
    }

    // The tile's scaled row maxima (quad-reduced); whether some row of this thread's exceeds
    // its ref_max by more than the threshold.
    template <bool kRowTerms>
    __device__ __forceinline__ bool row_maxima(const float (&S)[kM][C::kSTiles][4], float scale,
                                               float (&tile_max)[kM][2],
                                               const float (&row_terms)[kM][2]) const {
        bool raise = false;
#pragma unroll
        for (int mi = 0; mi < kM; ++mi)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float m = row_reduce<Max>(S[mi], r);
                // A lane's term holds its own columns' part (the quad's lanes differ): added
                // before the quad's reduction.
                if constexpr (kRowTerms) m += row_terms[mi][r];
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
                tile_max[mi][r] = m * scale;
                raise |= tile_max[mi][r] > ref_max[mi][r] + kRescaleThreshold;
            }
        return raise;
    }
    // The first tile's maxima become the references.
    __device__ __forceinline__ void set_max(const float (&tile_max)[kM][2]) {
#pragma unroll
        for (int mi = 0; mi < kM; ++mi)
#pragma unroll
            for (int r = 0; r < 2; ++r) ref_max[mi][r] = tile_max[mi][r];
    }
    // Row (mi, r)'s reference raised to its tile max if that exceeds it by more than the
    // threshold; its row sum scaled; returns the scale alpha = exp_units(old - new) of O's row.
    __device__ __forceinline__ float raise_row(const float (&tile_max)[kM][2], int mi, int r) {
        const float new_max = tile_max[mi][r] > ref_max[mi][r] + kRescaleThreshold
                                  ? tile_max[mi][r]
                                  : ref_max[mi][r];
        // -inf - -inf would be NaN: a row that has seen no key has nothing to scale.
        const float alpha = new_max == -INFINITY ? 1.f : exp_units(ref_max[mi][r] - new_max);
        ref_max[mi][r] = new_max;
        row_sum[mi][r] *= alpha;
        return alpha;
    }

    // S -> exp_units((S + row term) * scale - ref_max), each row's sum added to row_sum (set,
    // kFirst).
    template <bool kFirst, bool kRowTerms = false>
    __device__ __forceinline__ void exponentiate(float (&S)[kM][C::kSTiles][4], float scale,
                                                 const float (&row_terms)[kM][2]) {
#pragma unroll
        for (int mi = 0; mi < kM; ++mi)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                // A row with every key masked so far keeps ref_max = -inf; subtracting 0 instead
                // keeps its exponentials at exp(-inf) = 0 rather than NaN.
                float m = ref_max[mi][r] == -INFINITY ? 0.f : ref_max[mi][r];
                if constexpr (kRowTerms) m = fmaf(-row_terms[mi][r], scale, m);
#pragma unroll
                for (int nj = 0; nj < C::kSTiles; ++nj)
#pragma unroll
                    for (int e = 2 * r; e < 2 * r + 2; ++e)
                        S[mi][nj][e] = exp_units(fmaf(S[mi][nj][e], scale, -m));
                const float sum = row_reduce<Sum>(S[mi], r);
                row_sum[mi][r] = kFirst ? sum : row_sum[mi][r] + sum;
            }
    }

    // Normalises O by the row sums and returns each row's natural-log logsumexp of the scaled
    // scores (-inf and O = 0 for a row that saw no unmasked key).
    __device__ __forceinline__ void finalize(float (&O)[kM][C::kOTiles][4], float (&lse)[kM][2]) {
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
                if constexpr (C::kExp2Softmax) {
                    lse[mi][r] = l > 0.f ? (ref_max[mi][r] + __log2f(l)) * kLn2 : -INFINITY;
                } else {
                    lse[mi][r] = l > 0.f ? ref_max[mi][r] + __logf(l) : -INFINITY;
                }
            }
    }
};

}  // namespace cudaflash
