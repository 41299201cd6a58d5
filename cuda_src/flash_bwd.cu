// cudaflash backward: dQ, dK, dV of O = softmax(scale * Q K^T + mask) V, FlashAttention-2's
// recomputation scheme (P is rebuilt from Q, K and the forward's log-sum-exp, never stored).
//
// Three entries per module (one module per BwdConfig: dtype, d_head, tile sizes):
//   cudaflash_bwd_preprocess  delta = rowsum(dO * O), one warp per query row.
//   cudaflash_bwd_dkdv        one CTA per (16 * n_warps keys, K/V head, batch entry); it streams
//                             the query tiles (of every query head of its GQA group) past its
//                             keys: S^T = K Q^T, P^T, dV += P^T dO, dP^T = V dO^T,
//                             dS^T = P^T (dP^T - delta), dK += dS^T Q.
//   cudaflash_bwd_dq          one CTA per (16 * n_warps query rows, head, batch entry); it
//                             streams the K/V tiles: S = Q K^T, P, dP = dO V^T, dS, dQ += dS K.
//   cudaflash_bwd_dkdv_dq     cudaflash_bwd_dkdv that also adds each step's dQ share,
//                             dS K (dS through shared memory), to a float32 accumulator with
//                             atomics: FlashAttention-2's 5 GEMMs instead of 7. Causal or
//                             full attention; cudaflash_bwd_dkdv_dq_window with a window,
//                             cudaflash_bwd_dkdv_dq_dropout with dropout (warp-specialized
//                             modules).
//   cudaflash_bwd_dq_convert  dQ = softmax_scale * accumulator, in the input dtype (times
//                             1 / (1 - p) with dropout: bwd_params.cuh, delta_tiles).
//   cudaflash_bwd_{preprocess,dkdv,dq}_varlen  the same kernels, each CTA on its sequence of
//                             a packed (varlen) batch; cudaflash_bwd_dkdv_dq_varlen and
//                             cudaflash_bwd_dq_convert_varlen the atomic scheme's, on
//                             warp-specialized modules (packed_dq_accum_row's accumulator).
// Two schemes, chosen per call (flash_attn_func's `deterministic`):
//   deterministic      preprocess, dkdv, dq: dQ in its own kernel recomputes S and dP (7
//                      GEMMs), and every gradient is written once, by one CTA, in a fixed
//                      order: bitwise reproducible, no accumulator buffer.
//   atomic (default)   preprocess (which also zeroes the accumulator), dkdv_dq, dq_convert:
//                      float32 atomics add in an order that varies from run to run.
//
// Layouts, masking and causal alignment are the forward's (flash_fwd.cu): bottom-right causal
// mask and sliding window (BwdParams::window_left/right), sequence tails masked here, query rows whose lse is -inf (they saw no key) give zero
// gradients. GEMMs are mma.sync m16n8k16 with fp32 accumulators (sm_80+), except in modules
// built with wgmma (BwdConfig::kWgmma, sm_90a), whose dK/dV kernels run Hopper's warpgroup MMA.
#include "bwd_config.cuh"
#include "bwd_params.cuh"
#include "copy.cuh"
#include "philox.cuh"
#include "ptx.cuh"
#include "score_mods.cuh"
#include "smem_layout.cuh"
#include "wgmma.cuh"

#include <climits>
#include <cmath>

namespace cudaflash {

using C = BwdConfig;
using elem_t = C::elem_t;
constexpr int kD = C::kDHead;
constexpr int kDSlices = kD / 16;  // k16 slices of a reduction over d_head
constexpr float kLog2e = 1.4426950408889634f;

// ---- fragments from swizzled (rows, d_head) shared tiles ------------------------------------
// Each ldmatrix.x4 reads four 8x8 matrices; lane l supplies the address of row l % 8 of matrix
// l / 8. Two lane patterns cover every operand here:
//   kA: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15):
//       an A fragment of a row-major tile, or (with .trans) the B fragments of two n8 tiles of
//       an operand whose k index runs along the tile's rows (V in P V).
//   kB: matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15): the B
//       fragments of two n8 tiles of an operand whose n index runs along the tile's rows (K in
//       Q K^T).
// The lane's byte offsets are computed once per kernel (row part, and the swizzled column
// part of the four k16 slices of a 64-column slab, as in the forward's SliceOffsets), so an
// address in the unrolled loops is a register plus an immediate.
struct LaneOffsets {
    uint32_t a_row, b_row;     // lane row * 128 bytes
    uint32_t a_col[4], b_col[4];  // slice s of a slab: col_bytes(s, the pattern's half)

    // Byte offset of the lane's 16-byte chunk in k16 slice `slice` (mod 4) of a slab row:
    // chunk 2 * slice + half, swizzled by the row's low bits (lane % 8: every pattern's rows
    // are 8-aligned groups plus lane % 8). a_half = lane / 16, b_half = lane / 8 % 2.
    __device__ __forceinline__ static uint32_t col_bytes(int slice, int half, int lane) {
        return ((2 * (slice % 4)) ^ half ^ (lane % 8)) * 16;
    }

    __device__ __forceinline__ LaneOffsets() {
        const int lane = threadIdx.x % 32;
        a_row = (lane % 8 + 8 * (lane / 8 % 2)) * 128;
        b_row = (lane % 8 + 8 * (lane / 16)) * 128;
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            a_col[s] = col_bytes(s, lane / 16, lane);
            b_col[s] = col_bytes(s, lane / 8 % 2, lane);
        }
    }
};

// Byte address in a (kRows, d_head) tile at `base` of 16-row group row0 (a multiple of 16) and
// k16 slice (column / 16) ks, for a lane whose row and column offsets are given.
template <int kRows>
__device__ __forceinline__ uint32_t frag_addr(uint32_t base, int row0, int ks, uint32_t row,
                                              const uint32_t (&col)[4]) {
    static_assert(C::kSwizzled, "the lane offsets assume the swizzled layout");
    return base + (ks / 4) * kRows * 128 + row0 * 128 + row + col[ks % 4];
}

// A operand (16 x 16, row-major): rows row0..row0+15, columns 16 * ks ... + 15.
template <int kRows>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const LaneOffsets& lo, uint32_t base,
                                       int row0, int ks) {
    ldmatrix_x4(a, frag_addr<kRows>(base, row0, ks, lo.a_row, lo.a_col));
}

// B operand (k16 x n8, "col") of two n8 tiles whose n index runs along the tile's rows:
// rows n0..n0+15, columns 16 * ks ... + 15. {b[0], b[1]} serve n8 tile n0 / 8, {b[2], b[3]}
// tile n0 / 8 + 1.
template <int kRows>
__device__ __forceinline__ void load_b(uint32_t (&b)[4], const LaneOffsets& lo, uint32_t base,
                                       int n0, int ks) {
    ldmatrix_x4(b, frag_addr<kRows>(base, n0, ks, lo.b_row, lo.b_col));
}

// B operand whose k index runs along the tile's rows (transposed by ldmatrix): rows
// k0..k0+15, columns 16 * nd2 ... + 15. {b[0], b[1]} serve n8 tile 2 * nd2, {b[2], b[3]} tile
// 2 * nd2 + 1.
template <int kRows>
__device__ __forceinline__ void load_b_trans(uint32_t (&b)[4], const LaneOffsets& lo,
                                             uint32_t base, int k0, int nd2) {
    ldmatrix_x4_trans(b, frag_addr<kRows>(base, k0, nd2, lo.a_row, lo.a_col));
}

// acc (16 x 8 * kN) += A (16 x d_head, warp rows row0.. of tile `a`) * B^T (B: kN * 8 rows of
// tile `b`, all d_head columns): the reduction over d_head of S = Q K^T and dP = dO V^T.
template <int kRowsA, int kRowsB, int kN>
__device__ __forceinline__ void gemm_rows_rows(float (&acc)[1][kN][4], const LaneOffsets& lo,
                                               uint32_t a_tile, int row0, uint32_t b_tile) {
#pragma unroll
    for (int nj = 0; nj < kN; ++nj)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[0][nj][e] = 0.f;
#pragma unroll
    for (int ks = 0; ks < kDSlices; ++ks) {
        uint32_t a[4];
        load_a<kRowsA>(a, lo, a_tile, row0, ks);
#pragma unroll
        for (int nj2 = 0; nj2 < kN / 2; ++nj2) {
            uint32_t b[4];
            load_b<kRowsB>(b, lo, b_tile, nj2 * 16, ks);
            mma_m16n8k16<C::kBf16>(acc[0][2 * nj2], a, b[0], b[1]);
            mma_m16n8k16<C::kBf16>(acc[0][2 * nj2 + 1], a, b[2], b[3]);
        }
    }
}

// acc (16 x d_head) += A (16 x 16 * kK, 16-bit A fragments from registers: a previous GEMM's
// accumulators, packed) * B (tile `b`: kK * 16 rows, d_head columns): dV += P^T dO,
// dK += dS^T Q, dQ += dS K.
template <int kRowsB, int kK>
__device__ __forceinline__ void gemm_packed_tile(float (&acc)[kD / 8][4],
                                                 const uint32_t (&a)[1][kK][4],
                                                 const LaneOffsets& lo, uint32_t b_tile) {
#pragma unroll
    for (int kk = 0; kk < kK; ++kk)
#pragma unroll
        for (int nd2 = 0; nd2 < kD / 16; ++nd2) {
            uint32_t b[4];
            load_b_trans<kRowsB>(b, lo, b_tile, kk * 16, nd2);
            mma_m16n8k16<C::kBf16>(acc[2 * nd2], a[0][kk], b[0], b[1]);
            mma_m16n8k16<C::kBf16>(acc[2 * nd2 + 1], a[0][kk], b[2], b[3]);
        }
}

// Dropout's P for dV: pack_a_fragments of P o keep / (1 - p) (keep: the 16 x 16 blocks' bits,
// philox.cuh), the undropped P left as it is for dS.
template <int kNTiles>
__device__ __forceinline__ void pack_dropped(uint32_t (&a)[1][kNTiles / 2][4],
                                             const float (&P)[1][kNTiles][4],
                                             const KeepBytes (&keep)[kNTiles / 2],
                                             const KeepThreshold& t, float scale) {
    auto v = [&](int nj, int e) { return kept(keep, t, nj, e) ? P[0][nj][e] * scale : 0.f; };
#pragma unroll
    for (int kk = 0; kk < kNTiles / 2; ++kk) {
        a[0][kk][0] = pack_2<C::kBf16>(v(2 * kk, 0), v(2 * kk, 1));
        a[0][kk][1] = pack_2<C::kBf16>(v(2 * kk, 2), v(2 * kk, 3));
        a[0][kk][2] = pack_2<C::kBf16>(v(2 * kk + 1, 0), v(2 * kk + 1, 1));
        a[0][kk][3] = pack_2<C::kBf16>(v(2 * kk + 1, 2), v(2 * kk + 1, 3));
    }
}

// Dropout on dP^T (the transposed layout, as P^T): the gradient of the dropped P is
// keep o dPd / (1 - p), where dPd = V dO^T (in place); then dS^T = P^T (that - delta).
template <int kNTiles>
__device__ __forceinline__ void drop_score_grads(float (&dP)[kNTiles][4],
                                                 const KeepBytes (&keep)[kNTiles / 2],
                                                 const KeepThreshold& t, float scale) {
#pragma unroll
    for (int nj = 0; nj < kNTiles; ++nj)
#pragma unroll
        for (int e = 0; e < 4; ++e) dP[nj][e] = kept(keep, t, nj, e) ? dP[nj][e] * scale : 0.f;
}

// The same with A still in float accumulators (rounded and packed here).
template <int kRowsB, int kK>
__device__ __forceinline__ void gemm_regs_tile(float (&acc)[kD / 8][4],
                                               const float (&a_acc)[1][2 * kK][4],
                                               const LaneOffsets& lo, uint32_t b_tile) {
    uint32_t a[1][kK][4];
    pack_a_fragments<C::kBf16>(a, a_acc);
    gemm_packed_tile<kRowsB, kK>(acc, a, lo, b_tile);
}

// The lse of one query row as the exponent offset in log2 units. A row that saw no key in the
// forward (lse = -inf) and rows past the sequence get +inf, so its P = exp2(s - inf) = 0.
__device__ __forceinline__ float lse_log2_of(float lse, bool valid) {
    return !valid || lse == -INFINITY ? INFINITY : lse * kLog2e;
}
__device__ __forceinline__ float lse_log2(const BwdParams& p, int64_t row_index, bool valid) {
    return valid ? lse_log2_of(p.lse[row_index], true) : INFINITY;
}

// Accumulators (16 x d_head per warp, times `scale`) -> the warp's rows of a shared tile, as
// 16-bit values, for a coalesced copy to global memory.
// Softcapping's slope (bwd_params.cuh): 1 - t^2 for the tanh value t of a score whose
// probability is P. (t + bias) * scale_log2 = log2(P) + lse (lse in log2 units; bias: the
// score's ALiBi bias, 0 without), so t comes back from P with one MUFU.LG2 instead of a second
// register array kept from the probabilities. A P of 0 (masked, or underflowed) has no
// gradient whatever its slope: 0, not lg2(0)'s -inf.
__device__ __forceinline__ float softcap_slope(float P, float lse_log2, float scale_log2,
                                               float bias) {
    const float t = __fdividef(lg2(P) + lse_log2, scale_log2) - bias;
    return P > 0.f ? 1.f - t * t : 0.f;
}

template <int kRows, int kN = kD / 8>
__device__ __forceinline__ void acc_to_tile(elem_t* tile, const float (&acc)[kN][4],
                                            float scale, int row0) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int nd = 0; nd < kN; ++nd)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int row = row0 + lane / 4 + 8 * r;
            elem_t* dst = tile + SmemTile<C>::template offset<kRows>(row, nd) + 2 * (lane % 4);
            *reinterpret_cast<uint32_t*>(dst) =
                pack_2<C::kBf16>(acc[nd][2 * r] * scale, acc[nd][2 * r + 1] * scale);
        }
}

// The atomic scheme's float32 dQ accumulator: (batch, n_heads, seqlen_q rounded up to
// kDqAccumRowAlign, d_head), so that each query tile of a head (64 or 128 rows) is one
// contiguous block that a bulk reduction can add whole (the rows past seqlen_q are never
// converted). Row order, except in warp-specialized modules: their dK/dV kernel adds each
// 64-row sub-tile (kDqTileRows) in its consumers' fragment order (dq_tile_index) and their
// dq_convert reads it back in that order.
constexpr int kDqTileRows = 64;
constexpr int kDqAccumRowAlign = 128;
__device__ __forceinline__ int dq_accum_rows(const BwdParams& p) {
    return (p.seqlen_q + kDqAccumRowAlign - 1) / kDqAccumRowAlign * kDqAccumRowAlign;
}
__device__ __forceinline__ float* dq_accum_row(const BwdParams& p, int batch, int head,
                                               int row) {
    return p.dq_accum + ((int64_t(batch) * p.n_heads + head) * dq_accum_rows(p) + row) * kD;
}
// A packed batch's accumulator: (n_heads, total_q + kDqAccumRowAlign * batch, d_head), the
// sequence b from row cu_seqlens_q[b] + kDqAccumRowAlign * b (sequence_view moves dq_accum
// there), so that its whole tiles never reach the next sequence's: a tile in fragment order
// spreads its rows over all of it. p: the sequence's view (total_q and batch are the call's).
__device__ __forceinline__ float* packed_dq_accum_row(const BwdParams& p, int head, int row) {
    const int64_t head_rows = int64_t(p.total_q) + int64_t(kDqAccumRowAlign) * p.batch;
    return p.dq_accum + (head * head_rows + row) * kD;
}
// The accumulator's row `row` of (batch, head) in either layout: a padded batch's, or (p the
// sequence's view) a packed batch's.
template <bool kPacked>
__device__ __forceinline__ float* accum_row(const BwdParams& p, int batch, int head, int row) {
    if constexpr (kPacked) return packed_dq_accum_row(p, head, row);
    else return dq_accum_row(p, batch, head, row);
}

// Where element (r, c) of a 64-row dQ tile lies in the warp-specialized kernel's order: the
// consumer warps' fragments one after another, float4 per lane per n8 block; n8 block j of a
// warp's fragments is float4 j * 32 + lane of the warp's block, holding (row, c), (row, c + 1),
// (row + 8, c), (row + 8, c + 1), row = 16 (w % 4) + lane / 4 for warp w. kWsDqOwnKeys (d64):
// both warpgroups hold the whole tile (each its keys' share, summed in shared memory), so the
// tile is one warpgroup's: warp w's block holds every column. Otherwise each warpgroup holds
// its half of the columns: warp w (warpgroup w / 4) those of half w / 4.
__device__ __forceinline__ int dq_tile_index(int r, int c) {
    constexpr int kCols = C::kWsDqOwnKeys ? kD : kD / 2;  // columns per warp's block
    const int warp = 4 * (c / kCols) + r / 16;
    const int lane = 4 * (r % 8) + (c % 8) / 2;
    const int block = warp * (kCols / 8) + (c % kCols) / 8;
    return (block * 32 + lane) * 4 + 2 * (r % 16 / 8) + c % 2;
}

// Batch entry `batch` of a packed batch (p.cu_seqlens_q non-null) as a batch of its own: its
// lengths, and every pointer moved to the sequence's first query row or key. The host passes
// batch strides of 0, so the kernels index the result exactly as a padded batch. Offsets are
// clamped into the packed tensors: no value addresses memory outside them.
__device__ __forceinline__ BwdParams sequence_view(const BwdParams& p, int batch) {
    const int q0 = min(max(p.cu_seqlens_q[batch], 0), p.total_q);
    const int q1 = min(max(p.cu_seqlens_q[batch + 1], q0), p.total_q);
    const int k0 = min(max(p.cu_seqlens_k[batch], 0), p.total_k);
    const int k1 = min(max(p.cu_seqlens_k[batch + 1], k0), p.total_k);
    BwdParams s = p;
    s.seqlen_q = q1 - q0;
    s.seqlen_k = k1 - k0;
    s.q = static_cast<const elem_t*>(p.q) + q0 * p.q_strides.seq;
    s.o = static_cast<const elem_t*>(p.o) + q0 * p.o_strides.seq;
    s.dout = static_cast<const elem_t*>(p.dout) + q0 * p.do_strides.seq;
    s.dq = static_cast<elem_t*>(p.dq) + q0 * p.dq_strides.seq;
    s.k = static_cast<const elem_t*>(p.k) + k0 * p.k_strides.seq;
    s.v = static_cast<const elem_t*>(p.v) + k0 * p.v_strides.seq;
    s.dk = static_cast<elem_t*>(p.dk) + k0 * p.dk_strides.seq;
    s.dv = static_cast<elem_t*>(p.dv) + k0 * p.dv_strides.seq;
    s.lse = p.lse + q0;
    s.delta = p.delta + q0;
    // (packed_dq_accum_row's layout: whole tiles of this sequence from there)
    if (p.dq_accum != nullptr)
        s.dq_accum = p.dq_accum + (int64_t(q0) + int64_t(kDqAccumRowAlign) * batch) * kD;
    return s;
}

// ---- the window -------------------------------------------------------------------------------

// Query row i sees key j when lo <= j - i - shift <= hi (BwdParams::window_left/right; an
// unbounded side is the int range's end). Masks test the key's offset from the row's
// diagonal with one unsigned comparison, offset - lo > hi - lo (modulo 2^32: an offset below
// lo wraps above the width): one per-element value against uniform bounds, no more registers
// than the causal test alone (two comparisons spilled the 255-register dK/dV kernels).
struct WindowBounds {
    int lo, hi;
    uint32_t width;  // hi - lo, modulo 2^32 (all ones: no bound at all)

    __device__ __forceinline__ explicit WindowBounds(const BwdParams& p)
        : lo(p.window_left >= 0 ? -p.window_left : INT_MIN),
          hi(p.window_right >= 0 ? p.window_right : INT_MAX),
          width(uint32_t(hi) - uint32_t(lo)) {}

    // Whether a key at this offset from a row's diagonal is outside its window.
    __device__ __forceinline__ bool hides(int offset) const {
        return uint32_t(offset) - uint32_t(lo) > width;
    }

    // Whether a block whose offsets span [min_offset, max_offset] has a hidden element.
    __device__ __forceinline__ bool cuts(int min_offset, int max_offset) const {
        return max_offset > hi || min_offset < lo;
    }
};

// ---- delta = rowsum(dO * O) -----------------------------------------------------------------

// 16-byte accesses: kRowLanes lanes per query row, 8 elements each (8 lanes at d64, 16 at
// d128, 32 at d256), so a warp holds whole rows. One warp per row with 4-byte accesses issued
// four times the instructions and reached half the DRAM bandwidth (ncu, twenty-third session).
constexpr int kPreprocessThreads = 128;
constexpr int kRowLanes = kD / 8;
constexpr int kPreprocessRows = kPreprocessThreads / kRowLanes;
static_assert(kD % 8 == 0 && 32 % kRowLanes == 0, "a row's lanes must tile a warp");

__device__ __forceinline__ float2 to_float2(uint32_t bits) {
    if constexpr (C::kBf16) {
        return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bits));
    } else {
        return __half22float2(*reinterpret_cast<const __half2*>(&bits));
    }
}

// Accumulator element (nj, e) of an m16n8 tile read back from its 16-bit A fragments
// (pack_a_fragments' layout: register 2 (nj % 2) + e / 2 of slice nj / 2, the low half for
// an even e), as float.
template <int kSlices>
__device__ __forceinline__ float fragment_value(const uint32_t (&a)[1][kSlices][4], int nj,
                                                int e) {
    const float2 pair = to_float2(a[0][nj / 2][2 * (nj % 2) + e / 2]);
    return e % 2 ? pair.y : pair.x;
}

// The column of accumulator element (nj, e) of an m16n8 tile in this lane, from the tile's
// first column (8 columns per nj, two per lane quad position: the fragments' layout).
__device__ __forceinline__ int fragment_column(int nj, int e) {
    const int lane = threadIdx.x % 32;
    return nj * 8 + 2 * (lane % 4) + e % 2;
}

// The lanes of the warp that share this thread's row (shuffles stay inside them: a row past
// the sequence's end leaves the kernel as a group).
__device__ __forceinline__ uint32_t row_lanes_mask() {
    if constexpr (kRowLanes == 32) {
        return 0xffffffffu;
    } else {
        const int first = threadIdx.x % 32 / kRowLanes * kRowLanes;
        return ((1u << kRowLanes) - 1) << first;
    }
}

// stats_rows: the padded statistics' rows per head (dq_accum_rows of the call; for a packed
// batch (kPacked), p is the sequence's view and stats_rows the whole batch's).
template <bool kPacked = false>
__device__ __forceinline__ void bwd_preprocess(const BwdParams& p, int stats_rows) {
    const int lane = threadIdx.x % kRowLanes;  // 8 columns from 8 * lane
    const int row = blockIdx.x * kPreprocessRows + threadIdx.x / kRowLanes;
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    if (p.dq_accum != nullptr && row < dq_accum_rows(p)) {
        // The atomic scheme: its dQ accumulator starts at zero, the tail tile's padding too
        // (the grid covers dq_accum_rows; any order of a tile's elements is zeroed alike).
        float4* accum =
            reinterpret_cast<float4*>(accum_row<kPacked>(p, batch, head, row) + 8 * lane);
        accum[0] = make_float4(0.f, 0.f, 0.f, 0.f);
        accum[1] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    // The warp-specialized kernel's padded statistics (bwd_params.cuh): the rows past
    // seqlen_q get lse +inf (P = 0) and delta 0, so its bulk copies of whole tiles read no
    // stale values.
    const int64_t tile_row = (int64_t(batch) * p.n_heads + head) * stats_rows + row;
    const bool tiles = p.lse_log2_tiles != nullptr;
    if (row >= p.seqlen_q) {
        if (tiles && row < stats_rows && lane == 0) {
            p.lse_log2_tiles[tile_row] = INFINITY;
            p.delta_tiles[tile_row] = 0.f;
        }
        return;
    }
    const uint4 o = *reinterpret_cast<const uint4*>(
        row_of(static_cast<const elem_t*>(p.o), p.o_strides, batch, row, head) + 8 * lane);
    const uint4 dout = *reinterpret_cast<const uint4*>(
        row_of(static_cast<const elem_t*>(p.dout), p.do_strides, batch, row, head) + 8 * lane);
    float sum = 0.f;
    const uint32_t xs[4] = {o.x, o.y, o.z, o.w}, ys[4] = {dout.x, dout.y, dout.z, dout.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 x = to_float2(xs[i]), y = to_float2(ys[i]);
        sum += x.x * y.x + x.y * y.y;
    }
    const uint32_t mask = row_lanes_mask();
#pragma unroll
    for (int m = kRowLanes / 2; m > 0; m /= 2) sum += __shfl_xor_sync(mask, sum, m);
    if (lane == 0) {
        const int64_t stats_row = batch * p.lse_batch_stride + head * p.lse_head_stride + row;
        p.delta[stats_row] = sum;
        if (tiles) {
            p.lse_log2_tiles[tile_row] = lse_log2_of(p.lse[stats_row], true);
            // With dropout, (1 - p) delta: the fused kernel's dropout entry folds 1 - p into
            // delta (bwd_params.cuh, delta_tiles; bwd_warp_specialized.cuh,
            // step_score_grads_dropped). The fast division (2 ulp; dropout_scale is in [1,
            // 256]) keeps IEEE division's slow path out of this kernel.
            p.delta_tiles[tile_row] =
                p.dropout_threshold != 0 ? __fdividef(sum, p.dropout_scale) : sum;
        }
    }
}

// ---- dQ = softmax_scale * accumulator (the atomic scheme) -----------------------------------

// Each thread converts 8 consecutive floats of the accumulator (two 16-byte loads), a CTA
// kPreprocessRows rows' worth, so the reads are contiguous in either layout. The host covers
// dq_accum_rows (whole tiles: a warp-specialized tile's rows are spread over all of it); a
// packed batch's (kPacked: p is the sequence's view) the longest sequence's, so CTAs past
// this sequence's tiles return.
template <bool kPacked = false>
__device__ __forceinline__ void bwd_dq_convert(const BwdParams& p) {
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    // (64-bit: a head's accumulator passes 2^31 floats at 2^24 rows of d128)
    const int64_t first = int64_t(blockIdx.x) * kPreprocessRows * kD + 8 * threadIdx.x;
    if (kPacked && first >= int64_t(dq_accum_rows(p)) * kD) return;
    const float4* accum =
        reinterpret_cast<const float4*>(accum_row<kPacked>(p, batch, head, 0) + first);
    const float4 a = accum[0], b = accum[1];
    // With dropout the accumulator holds (1 - p) dQ: the fused kernel's dropout entry, the
    // only one with dropout that accumulates dQ here, folds 1 - p into delta (bwd_params.cuh).
    const float s = p.dropout_threshold != 0 ? p.softmax_scale * p.dropout_scale : p.softmax_scale;
    if constexpr (!C::kWarpSpecialized) {
        // Row order: row first / kD, columns first % kD .. + 7.
        const int row = int(first / kD);
        if (row >= p.seqlen_q) return;
        elem_t* dq = row_of(static_cast<elem_t*>(p.dq), p.dq_strides, batch, row, head);
        *reinterpret_cast<uint4*>(dq + int(first % kD)) = make_uint4(
            pack_2<C::kBf16>(a.x * s, a.y * s), pack_2<C::kBf16>(a.z * s, a.w * s),
            pack_2<C::kBf16>(b.x * s, b.y * s), pack_2<C::kBf16>(b.z * s, b.w * s));
    } else {
        // Fragment order (dq_tile_index): a float4 holds columns c, c + 1 of rows r and r + 8;
        // the thread's two are lanes 2j, 2j + 1 of one n8 block: columns c .. c + 3.
        constexpr int kTile = kDqTileRows * kD;
        constexpr int kCols = C::kWsDqOwnKeys ? kD : kD / 2;  // columns per warp's block
        const int in_tile = int(first % kTile);
        const int block = in_tile / 128;  // 32 lanes x 4 floats
        const int lane = in_tile % 128 / 4;  // even
        const int warp = block / (kCols / 8);
        const int r = int(first / kTile) * kDqTileRows + 16 * (warp % 4) + lane / 4;
        const int c = warp / 4 * kCols + block % (kCols / 8) * 8 + 2 * (lane % 4);
        if (r < p.seqlen_q) {
            elem_t* dq = row_of(static_cast<elem_t*>(p.dq), p.dq_strides, batch, r, head);
            *reinterpret_cast<uint2*>(dq + c) =
                make_uint2(pack_2<C::kBf16>(a.x * s, a.y * s), pack_2<C::kBf16>(b.x * s, b.y * s));
        }
        if (r + 8 < p.seqlen_q) {
            elem_t* dq = row_of(static_cast<elem_t*>(p.dq), p.dq_strides, batch, r + 8, head);
            *reinterpret_cast<uint2*>(dq + c) =
                make_uint2(pack_2<C::kBf16>(a.z * s, a.w * s), pack_2<C::kBf16>(b.z * s, b.w * s));
        }
    }
}

// ---- dQ share of one dK/dV step (the atomic scheme) -------------------------------------------

// accumulator rows row0..row0+15, columns c0..c0+kCols-1 += a warp's dQ share (16 x kCols, in
// the m16n8 accumulator layout); rows past the sequence (the last query tile's tail) skipped.
template <int kCols>
__device__ __forceinline__ void add_to_dq_accum(const BwdParams& p, const float (&dQ)[kCols / 8][4],
                                                int batch, int head, int row0, int c0) {
    const int lane = threadIdx.x % 32;
#if __CUDA_ARCH__ >= 900
    // 16-byte atomics (sm_90): lanes 2j and 2j + 1 hold columns 0-1 and 2-3 of a 4-column
    // group, each in rows lane / 4 and lane / 4 + 8. They trade one row's pair, so the even
    // lane adds the group's 4 columns of the upper row and the odd lane those of the lower:
    // half the atomic operations of float2 atomics, for two shuffles.
    const bool odd = lane % 2;
    const int row = row0 + lane / 4 + 8 * odd;
    float* accum = dq_accum_row(p, batch, head, min(row, p.seqlen_q - 1)) + c0 + 4 * (lane % 4 / 2);
#pragma unroll
    for (int nd = 0; nd < kCols / 8; ++nd) {
        const float give0 = odd ? dQ[nd][0] : dQ[nd][2];  // the row the partner adds
        const float give1 = odd ? dQ[nd][1] : dQ[nd][3];
        const float got0 = __shfl_xor_sync(0xffffffffu, give0, 1);
        const float got1 = __shfl_xor_sync(0xffffffffu, give1, 1);
        const float4 sum = odd ? make_float4(got0, got1, dQ[nd][2], dQ[nd][3])
                               : make_float4(dQ[nd][0], dQ[nd][1], got0, got1);
        if (row < p.seqlen_q) atomicAdd(reinterpret_cast<float4*>(accum + nd * 8), sum);
    }
#else
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = row0 + lane / 4 + 8 * r;
        if (row >= p.seqlen_q) continue;
        float* accum = dq_accum_row(p, batch, head, row) + c0 + 2 * (lane % 4);
#pragma unroll
        for (int nd = 0; nd < kCols / 8; ++nd) {
            atomicAdd(accum + nd * 8, dQ[nd][2 * r]);
            atomicAdd(accum + nd * 8 + 1, dQ[nd][2 * r + 1]);
        }
    }
#endif
}

// accumulator rows q0.. += dS K over the CTA's kKeys keys, dS from `ds_tile` (the step's dS^T:
// rows = keys, columns = the kQ query rows) and K from `k_tile`. The warps split the (kQ,
// d_head) product: m16 row block warp % (kQ / 16), d_head columns by warp / (kQ / 16).
template <int kKeys, int kQ>
__device__ __forceinline__ void add_dq_share(const BwdParams& p, const LaneOffsets& lo,
                                             uint32_t ds_tile, uint32_t k_tile, int batch,
                                             int head, int q0) {
    static_assert(kQ == C::kBr, "BwdConfig checks the dQ split for B_r");
    constexpr int kRowBlocks = kQ / 16;
    constexpr int kCols = C::kDqCols;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int m0 = (warp % kRowBlocks) * 16;
    const int c0 = (warp / kRowBlocks) * kCols;
    // The warp's query slice (m0 / 16) and d_head slices are only known at run time: their
    // swizzled column offsets are computed here (indexing lo.b_col / lo.a_col with them
    // would put LaneOffsets in local memory).
    // A = dS (queries x keys) is the stored dS^T read transposed; the lanes' matrix order
    // (keys 0-7 / 8-15 by lane / 16, query halves by lane / 8 % 2) is the kB pattern.
    const uint32_t a_base =
        ds_tile + lo.b_row + LaneOffsets::col_bytes(m0 / 16, lane / 8 % 2, lane);
    // B = K (keys x d_head columns c0..), read transposed with the kA pattern (load_b_trans).
    constexpr int kSlices = kCols / 16;
    uint32_t b_addr[kSlices];
#pragma unroll
    for (int j = 0; j < kSlices; ++j) {
        const int slice = c0 / 16 + j;  // of d_head
        b_addr[j] = k_tile + (slice / 4) * kKeys * 128 + lo.a_row +
                    LaneOffsets::col_bytes(slice, lane / 16, lane);
    }

    float dQ[kCols / 8][4];
#pragma unroll
    for (int nd = 0; nd < kCols / 8; ++nd)
#pragma unroll
        for (int e = 0; e < 4; ++e) dQ[nd][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
        uint32_t a[4];
        ldmatrix_x4_trans(a, a_base + kk * 16 * 128);
#pragma unroll
        for (int j = 0; j < kSlices; ++j) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, b_addr[j] + kk * 16 * 128);
            mma_m16n8k16<C::kBf16>(dQ[2 * j], a, b[0], b[1]);
            mma_m16n8k16<C::kBf16>(dQ[2 * j + 1], a, b[2], b[3]);
        }
    }
    add_to_dq_accum<kCols>(p, dQ, batch, head, q0 + m0, c0);
}

// ---- warpgroup GEMMs of the dK/dV kernels (BwdConfig::kWgmma, sm_90a) ----------------------
// Warpgroup g (warps 4g..4g+3) owns keys 64g..64g+63 of the CTA; warp w holds keys 16w..16w+15
// in the mma.sync accumulator layout, so the masking and elementwise code is the mma.sync
// path's. The tensor cores read the 128-byte-swizzled (rows, 64) slabs that the copies write,
// through matrix descriptors (as the forward's WarpgroupGemm). The helpers issue; the caller
// commits, waits and fences.
namespace wg {

template <int kN>
__device__ __forceinline__ float (&flat(float (&acc)[kN][4]))[kN * 4] {
    return reinterpret_cast<float(&)[kN * 4]>(acc);
}

// acc (the warpgroup's 64 rows of tile a, starting at `a_rows`, x the kRowsB rows of tile b)
// = A B^T over d_head: S^T = K Q^T and dP^T = V dO^T.
template <int kRowsA, int kRowsB>
__device__ __forceinline__ void rows_rows(float (&acc)[kRowsB / 8][4], uint32_t a_rows,
                                          uint32_t b_tile) {
#pragma unroll
    for (int ks = 0; ks < kDSlices; ++ks) {
        const uint32_t slice = (ks % 4) * 32;  // k16 slice ks is 32 bytes into slab ks / 4
        const uint32_t a = a_rows + (ks / 4) * kRowsA * 128 + slice;
        const uint32_t b = b_tile + (ks / 4) * kRowsB * 128 + slice;
        wgmma_ss<kRowsB, C::kBf16>(flat(acc), smem_desc_at(kSmemDescKMajor, a),
                                   smem_desc_at(kSmemDescKMajor, b), ks > 0);
    }
}

// acc (64 x d_head) += A (64 x 16 kK, registers) * tile b (16 kK rows, d_head columns, read
// MN-major): dV += P^T dO and dK += dS^T Q.
template <int kRowsB, int kK>
__device__ __forceinline__ void regs_tile(float (&acc)[kD / 8][4], const uint32_t (&a)[1][kK][4],
                                          uint32_t b_tile) {
    constexpr uint64_t kFields = smem_desc_mn_major(kRowsB);
#pragma unroll
    for (int kk = 0; kk < kK; ++kk)
        wgmma_rs<kD, C::kBf16>(flat(acc), a[0][kk], smem_desc_at(kFields, b_tile + kk * 16 * 128),
                               1);
}

// dQ share (64 query rows x kCols columns) = dS K over kSumKeys keys of a kKeys-key tile: A =
// dS^T stored (keys, 64 query columns) from `ds_rows`, B = the K tile from `k_cols` (its
// first summed key's row, its first column); both MN-major. Default: the CTA's keys, the
// warpgroup's C::kDqWgCols columns; kWsDqOwnKeys: a warpgroup's own 64 keys, every column.
template <int kKeys, int kCols = C::kDqWgCols, int kSumKeys = kKeys>
__device__ __forceinline__ void ds_k(float (&acc)[kCols / 8][4], uint32_t ds_rows,
                                     uint32_t k_cols) {
    constexpr uint64_t kFields = smem_desc_mn_major(kKeys);
#pragma unroll
    for (int kk = 0; kk < kSumKeys / 16; ++kk)
        wgmma_ss_mn<kCols, C::kBf16>(flat(acc), smem_desc_at(kFields, ds_rows + kk * 16 * 128),
                                     smem_desc_at(kFields, k_cols + kk * 16 * 128), kk > 0);
}

}  // namespace wg

// ---- the dK/dV kernels' steps -----------------------------------------------------------------

// The query tiles (kQ rows each) of one query head that see some key of the CTA's keys
// key0..key0 + key_rows - 1: tiles first..first + per_head - 1. With the window: rows from the
// first whose window reaches key0 (right side) to the last whose window starts at or before
// the last key (left side). Without (kWindow false: causal or full): from the tile holding row
// key0 - shift when causal.
struct QueryTiles {
    int first, per_head;
};
template <int kQ, bool kWindow>
__device__ __forceinline__ QueryTiles query_tiles(const BwdParams& p, int key0, int key_rows) {
    const int shift = p.seqlen_k - p.seqlen_q;  // query i sees keys j <= i + shift (causal)
    const int n_q_tiles = (p.seqlen_q + kQ - 1) / kQ;
    QueryTiles t;
    if constexpr (kWindow) {
        const int first_row = p.window_right >= 0 ? max(key0 - shift - p.window_right, 0) : 0;
        const int end_row =
            p.window_left >= 0 ? min(key0 + key_rows - shift + p.window_left, p.seqlen_q)
                               : p.seqlen_q;
        t.first = min(first_row / kQ, n_q_tiles);
        t.per_head = end_row > first_row ? (end_row + kQ - 1) / kQ - t.first : 0;
    } else {
        t.first = p.is_causal ? min(max(key0 - shift, 0) / kQ, n_q_tiles) : 0;
        t.per_head = n_q_tiles - t.first;
    }
    return t;
}

// The key tiles (kKv keys each) that the dQ rows q0..q0 + q_rows - 1 see: [first, end). Tiles
// >= mask_from hold a key some row must not see (the seqlen_k tail, or keys right of the first
// row's window), as do tiles < mask_below (keys left of the last row's window).
struct KeyTiles {
    int first, end, mask_from, mask_below;
};
template <int kKv>
__device__ __forceinline__ KeyTiles key_tiles(const BwdParams& p, int q0, int q_rows) {
    const int shift = p.seqlen_k - p.seqlen_q;
    const int n_kv = (p.seqlen_k + kKv - 1) / kKv;
    KeyTiles t{0, n_kv, p.seqlen_k % kKv ? n_kv - 1 : n_kv, 0};
    if (p.window_right >= 0) {
        const int last_key = q0 + q_rows - 1 + shift + p.window_right;
        t.end = last_key < 0 ? 0 : min(n_kv, last_key / kKv + 1);
        t.mask_from = min(t.mask_from, max(q0 + shift + p.window_right + 1, 0) / kKv);
    }
    if (p.window_left >= 0) {
        t.first = min(max(q0 + shift - p.window_left, 0) / kKv, t.end);
        const int last_row_first_key = q0 + q_rows - 1 + shift - p.window_left;
        t.mask_below = last_row_first_key > 0 ? (last_row_first_key + kKv - 1) / kKv : 0;
    }
    return t;
}

// The offset key - (query + shift) of element (nj, e) of a warp's transposed tile (16 keys
// from warp_key0 down the rows, query columns from q0), as a float for ALiBi's bias.
__device__ __forceinline__ float transposed_offset(int warp_key0, int q0, int shift, int nj,
                                                   int e) {
    const int lane = threadIdx.x % 32;
    const int key = warp_key0 + lane / 4 + 8 * (e / 2);
    const int query = q0 + nj * 8 + 2 * (lane % 4) + e % 2;
    return float(key - query - shift);
}

// P^T = exp(scale * K Q^T - lse), in place of the scores: a warp's 16 keys x kQ query columns
// in the m16n8 accumulator layout (the warp's first key is warp_key0); lse and columns in log2
// units as sLse holds them. Then, only where `mask` says the step's tile is cut by the window's
// edges or the causal diagonal, or (kKeyTail) holds keys past seqlen_k, the hidden elements
// are zeroed: a second pass behind a warp-uniform branch, so an unmasked step runs the
// exponentials alone (a per-element test folded into the first pass made the compiler build
// the mask's bits before every step's GEMMs: -10% at d64, perf log "Backward: keys past
// seqlen_k").
// kKeyTail: the fused kernels' dQ reads dS of every key of the tile, and a zero-filled key past
// the sequence has score 0, so P = 2^-lse, which overflows where lse is very negative (and dS
// in 16 bits much sooner): inf * K's zero row is NaN in dQ. The other kernels never store a
// tail key's gradient. With kKeyTail `mask` may be set in a non-causal call, so the diagonal's
// test asks is_causal itself (without it, mask implies is_causal).
// kScoreMods: the scores pass through softcapping and ALiBi first (score_mods.cuh; `alibi`:
// the step's query head's coefficient, 0 without), as in the forward.
template <int kQ, bool kWindow, bool kScoreMods, bool kKeyTail = false>
__device__ __forceinline__ void step_probabilities(float (&P)[kQ / 8][4], const BwdParams& p,
                                                   const float* lse, bool mask,
                                                   const WindowBounds& window, int warp_key0,
                                                   int q0, int shift, float alibi) {
    const int lane = threadIdx.x % 32;
    if constexpr (kScoreMods) {
        if (p.softcap_pre != 0.f) {
#pragma unroll
            for (int nj = 0; nj < kQ / 8; ++nj)
#pragma unroll
                for (int e = 0; e < 4; ++e) P[nj][e] = tanh_approx(P[nj][e] * p.softcap_pre);
        }
        if (alibi != 0.f) {
#pragma unroll
            for (int nj = 0; nj < kQ / 8; ++nj)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    P[nj][e] += alibi_bias(alibi, transposed_offset(warp_key0, q0, shift, nj, e));
        }
    }
#pragma unroll
    for (int nj = 0; nj < kQ / 8; ++nj)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int col = nj * 8 + 2 * (lane % 4) + e % 2;
            P[nj][e] = ex2(fmaf(P[nj][e], p.scale_log2, -lse[col]));
        }
    if (!mask) return;
#pragma unroll
    for (int e2 = 0; e2 < 2; ++e2) {
        const int key = warp_key0 + lane / 4 + 8 * e2;
        const bool past_end = kKeyTail && key >= p.seqlen_k;
#pragma unroll
        for (int nj = 0; nj < kQ / 8; ++nj)
#pragma unroll
            for (int e1 = 0; e1 < 2; ++e1) {
                const int col = nj * 8 + 2 * (lane % 4) + e1;
                if (past_end || (kWindow ? window.hides(key - q0 - col - shift)
                                         : (!kKeyTail || p.is_causal) && key > q0 + col + shift))
                    P[nj][2 * e2 + e1] = 0.f;
            }
    }
}

// dS^T = P^T * (dP^T - delta), in place of dP^T = V dO^T (times the softcap's slope, whose
// tanh value comes back from P less the ALiBi bias: step_probabilities' arguments).
template <int kQ, bool kScoreMods>
__device__ __forceinline__ void step_score_grads(float (&dS)[kQ / 8][4],
                                                 const float (&P)[kQ / 8][4], const BwdParams& p,
                                                 const float* lse, const float* delta,
                                                 int warp_key0, int q0, int shift, float alibi,
                                                 const KeepBytes (&keep)[kQ / 16] = {},
                                                 bool dropout = false) {
    const int lane = threadIdx.x % 32;
    // Dropout: dS = P o (keep o dPd / (1 - p) - delta), dPd = V dO^T of the dropped P.
    if (kScoreMods && dropout)
        drop_score_grads<kQ / 8>(dS, keep, KeepThreshold(p.dropout_threshold), p.dropout_scale);
#pragma unroll
    for (int nj = 0; nj < kQ / 8; ++nj)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int col = nj * 8 + 2 * (lane % 4) + e % 2;
            dS[nj][e] = P[nj][e] * (dS[nj][e] - delta[col]);
        }
    if constexpr (kScoreMods) {
        if (p.softcap_pre != 0.f) {
#pragma unroll
            for (int nj = 0; nj < kQ / 8; ++nj)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int col = nj * 8 + 2 * (lane % 4) + e % 2;
                    const float bias =
                        alibi_bias(alibi, transposed_offset(warp_key0, q0, shift, nj, e));
                    dS[nj][e] *= softcap_slope(P[nj][e], lse[col], p.scale_log2, bias);
                }
        }
    }
}

// ---- dK, dV ---------------------------------------------------------------------------------

// kFuseDq: also add dQ += dS K for every step to the float32 accumulator (atomic scheme).
// kWindow: mask by the sliding window (BwdParams::window_left/right); without it only by the
// causal diagonal (is_causal), the window fields unread. The fused kernel has an entry of
// each: at 252-255 registers, the window's bounds and second comparison cost its causal and
// full calls 2-5% (perf log "Sliding window backward"). The deterministic kernels measured
// no such cost and always take the window.
// Which gradients a run of bwd_dkdv accumulates: both (every module but d256's), or, at d256,
// dV in a first pass and dK in a second over the same query tiles (kPassValues,
// kPassKeys): dK and dV of a warp's 16 keys are 128 float32 registers each at d256, which
// do not fit beside each other (the second pass recomputes P: 8 GEMMs instead of 7).
constexpr int kPassBoth = 0, kPassValues = 1, kPassKeys = 2;

template <bool kFuseDq, bool kWindow, bool kScoreMods = false, int kPass = kPassBoth>
__device__ __forceinline__ void bwd_dkdv(const BwdParams& p) {
    static_assert(kPass == kPassBoth || (!kFuseDq && !C::kWgmma),
                  "the two-pass dK/dV runs the deterministic mma.sync kernel only");
    constexpr bool kValues = kPass != kPassKeys;  // this run accumulates dV
    constexpr bool kGrads = kPass != kPassValues;  // ... and dK (dS, from dP)
    constexpr int kKeys = C::kCtaRows;
    constexpr int kQ = C::kBr;
    // wgmma applies the 128-byte swizzle to absolute shared addresses: tiles start on its
    // 1024-byte period (each tile is a multiple of it long; so is lse + delta when B_r = 64).
    extern __shared__ __align__(C::kWgmma ? 1024 : 128) unsigned char smem[];
    static_assert(!C::kWgmma || (2 * kQ * sizeof(float) * 2) % 1024 == 0, "sdS alignment");
    elem_t* sK = reinterpret_cast<elem_t*>(smem);  // (kKeys, d); holds dK at the end
    elem_t* sV = sK + kKeys * kD;                  // (kKeys, d); holds dV at the end
    elem_t* sQ = sV + kKeys * kD;                  // 2 x (kQ, d): double-buffered
    elem_t* sdO = sQ + 2 * kQ * kD;                // 2 x (kQ, d)
    float* sLse = reinterpret_cast<float*>(sdO + 2 * kQ * kD);  // 2 x kQ, log2 units
    float* sDelta = sLse + 2 * kQ;                               // 2 x kQ
    // kFuseDq: dS^T of the step, (kKeys, 64) with the kQ <= 64 query columns.
    elem_t* sdS = reinterpret_cast<elem_t*>(sDelta + 2 * kQ);
    // kBulkDq: 2 x the step's dQ share, (kQ, kD) float32, bulk-reduced into the accumulator
    // one step later (C::kBulkDq: the wgmma atomic scheme at d128; elsewhere per-lane atomics).
    constexpr bool kBulkDq = kFuseDq && C::kBulkDq;
    float* sdQ = reinterpret_cast<float*>(sdS + kKeys * 64);

    const int head_k = blockIdx.y;
    const int batch = blockIdx.z;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int key0 = blockIdx.x * kKeys;
    if (key0 >= p.seqlen_k) return;  // only in a packed batch: a sequence shorter than the grid
    const int key_rows = min(kKeys, p.seqlen_k - key0);
    const int group = p.n_heads / p.n_heads_k;
    const int shift = p.seqlen_k - p.seqlen_q;  // query i sees keys j <= i + shift (causal)
    const WindowBounds window(p);
    // Dropout (the scoremod entries; BwdParams::dropout_*): the forward's keep mask, rebuilt.
    const bool dropout = kScoreMods && p.dropout_threshold != 0;
    const uint64_t seed = dropout ? *p.dropout_seed : 0;

    const QueryTiles tiles = query_tiles<kQ, kWindow>(p, key0, key_rows);
    const int first_tile = tiles.first, tiles_per_head = tiles.per_head;
    const int n_steps = group * tiles_per_head;  // (query head, query tile) pairs, in order

    using KeyCopy = TileCopy<C, kKeys>;
    using QCopy = TileCopy<C, kQ>;
    KeyCopy::load(sK, row_of(static_cast<const elem_t*>(p.k), p.k_strides, batch, key0, head_k),
                  p.k_strides.seq, key_rows);
    KeyCopy::load(sV, row_of(static_cast<const elem_t*>(p.v), p.v_strides, batch, key0, head_k),
                  p.v_strides.seq, key_rows);

    auto load_step = [&](int step, int buf) {
        const int head = head_k * group + step / tiles_per_head;
        const int q0 = (first_tile + step % tiles_per_head) * kQ;
        const int rows = min(kQ, p.seqlen_q - q0);
        QCopy::load(sQ + buf * kQ * kD,
                    row_of(static_cast<const elem_t*>(p.q), p.q_strides, batch, q0, head),
                    p.q_strides.seq, rows);
        QCopy::load(sdO + buf * kQ * kD,
                    row_of(static_cast<const elem_t*>(p.dout), p.do_strides, batch, q0, head),
                    p.do_strides.seq, rows);
        const int64_t stats = batch * p.lse_batch_stride + head * p.lse_head_stride + q0;
        static_assert(kQ <= C::kThreads, "one thread per query row of a tile");
        const int i = threadIdx.x;
        if (i < kQ) {
            sLse[buf * kQ + i] = lse_log2(p, stats + i, i < rows);
            sDelta[buf * kQ + i] = i < rows ? p.delta[stats + i] : 0.f;
        }
    };
    if (n_steps > 0) load_step(0, 0);
    copy_commit<C>();

    float dK[kD / 8][4], dV[kD / 8][4];
#pragma unroll
    for (int nd = 0; nd < kD / 8; ++nd)
#pragma unroll
        for (int e = 0; e < 4; ++e) dK[nd][e] = dV[nd][e] = 0.f;

    const int row0 = warp * 16;  // the warp's keys within the CTA's tile
    const uint32_t k_tile = smem_addr(sK), v_tile = smem_addr(sV);
    const LaneOffsets lo;
    // wgmma: the warpgroup's 64 keys of K and V, and its columns of the step's dQ share (the
    // warpgroups split d_head), where they start in the K tile.
    const uint32_t k_rows = k_tile + (warp / 4) * 64 * 128;
    const uint32_t v_rows = v_tile + (warp / 4) * 64 * 128;
    const int dq_col0 = (warp / 4) * C::kDqWgCols;
    const uint32_t dq_k_cols = k_tile + (dq_col0 / 64) * kKeys * 128 + (dq_col0 % 64) * 2;
    // kBulkDq: step s's dQ tile (buffer s % 2), written by every warp before the barrier at
    // the top of step s + 1, is added to the accumulator after it by one bulk reduction that
    // thread 0 issues (the tile's rows are contiguous in the accumulator; the tail's rows past
    // the sequence are left out); thread 0 waits at the next top until the reduction has read
    // the tile, so step s + 2 may overwrite it. The reduction runs under the next step's
    // GEMMs and no warp issues atomics.
    auto reduce_dq_tile = [&](int s) {
        if (threadIdx.x == 0) {
            const int q0 = (first_tile + s % tiles_per_head) * kQ;
            const int rows = min(kQ, p.seqlen_q - q0);
            bulk_reduce_add_f32(dq_accum_row(p, batch, head_k * group + s / tiles_per_head, q0),
                                smem_addr(sdQ + (s % 2) * kQ * C::kDqRowFloats), rows * kD * 4);
            bulk_commit();
        }
    };
    for (int step = 0; step < n_steps; ++step) {
        const int buf = step % 2;
        // This step's tiles have landed; every warp is done with the other buffer.
        copy_wait_all<C>();
        if constexpr (kBulkDq) {
            if (threadIdx.x == 0) bulk_wait_read<0>();  // step - 2's tile is free again
        }
        __syncthreads();
        if constexpr (kBulkDq) {
            if (step > 0) reduce_dq_tile(step - 1);
        }
        if (step + 1 < n_steps) load_step(step + 1, buf ^ 1);  // overlaps this step's GEMMs
        copy_commit<C>();

        const int q0 = (first_tile + step % tiles_per_head) * kQ;
        const uint32_t q_tile = smem_addr(sQ + buf * kQ * kD);
        const uint32_t do_tile = smem_addr(sdO + buf * kQ * kD);
        const float* lse = sLse + buf * kQ;
        const float* delta = sDelta + buf * kQ;

        // P^T = exp(scale * K Q^T - lse), in place of the scores: element (key, query) of the
        // warp's 16 keys. Masked only in tiles the window's edges (or the causal diagonal)
        // cut: their offsets key - query - shift span [key0 - (q0 + kQ - 1) - shift, key0 +
        // kKeys - 1 - q0 - shift].
        const bool mask =
            (kWindow ? window.cuts(key0 - (q0 + kQ - 1) - shift, key0 + kKeys - 1 - q0 - shift)
                     : p.is_causal && q0 + shift < key0 + kKeys - 1) ||
            (kFuseDq && key_rows < kKeys);
        const int head = head_k * group + step / tiles_per_head;
        const float alibi = kScoreMods ? alibi_coefficient(p, batch, head) : 0.f;
        // Dropout's keep bits of the warp's 16 keys x kQ queries (the transposed layout).
        KeepBytes keep[kQ / 16];
        if (kScoreMods && dropout)
            dropout_bytes<true>(keep, seed, q0 / 16, (key0 + row0) / 16, 1, 0,
                                batch * p.n_heads + head, lane);
        auto probabilities = [&](float (&P)[kQ / 8][4]) {
            step_probabilities<kQ, kWindow, kScoreMods, kFuseDq>(P, p, lse, mask, window,
                                                                 key0 + row0, q0, shift, alibi);
        };
        auto score_grads = [&](float (&dS)[kQ / 8][4], const float (&P)[kQ / 8][4]) {
            step_score_grads<kQ, kScoreMods>(dS, P, p, lse, delta, key0 + row0, q0, shift,
                                             alibi, keep, dropout);
        };

        if constexpr (C::kWgmma) {
            // S^T and dP^T issued together; the softmax runs while dP^T is computed, dS^T while
            // dV is.
            float P[1][kQ / 8][4], dS[1][kQ / 8][4];
            wgmma_fence_operands(wg::flat(P[0]));
            wgmma_fence_operands(wg::flat(dS[0]));
            wgmma_fence();
            wg::rows_rows<kKeys, kQ>(P[0], k_rows, q_tile);
            wgmma_commit();
            wg::rows_rows<kKeys, kQ>(dS[0], v_rows, do_tile);
            wgmma_commit();
            wgmma_wait<1>();  // S^T
            wgmma_fence_operands(wg::flat(P[0]));
            probabilities(P[0]);
            uint32_t a[1][kQ / 16][4];
            if (kScoreMods && dropout) {
                pack_dropped<kQ / 8>(a, P, keep, KeepThreshold(p.dropout_threshold),
                                    p.dropout_scale);
            } else {
                pack_a_fragments<C::kBf16>(a, P);
            }
            wgmma_fence_operands(wg::flat(dV));
            wgmma_fence();
            wg::regs_tile<kQ, kQ / 16>(dV, a, do_tile);
            wgmma_commit();
            wgmma_wait<1>();  // dP^T (dV may still run)
            wgmma_fence_operands(wg::flat(dS[0]));
            score_grads(dS[0], P[0]);
            uint32_t ds_a[1][kQ / 16][4];
            pack_a_fragments<C::kBf16>(ds_a, dS);
            if constexpr (kFuseDq) {
                // Every warp finished the previous step's dQ reads of sdS at the loop's barrier;
                // the fence hands these generic-proxy stores to wgmma's async-proxy reads.
                acc_to_tile<kKeys, kQ / 8>(sdS, dS[0], 1.f, row0);
                fence_proxy_async_shared();
            }
            wgmma_fence_operands(wg::flat(dK));
            wgmma_fence();
            wg::regs_tile<kQ, kQ / 16>(dK, ds_a, q_tile);
            wgmma_commit();
            if constexpr (kFuseDq) {
                __syncthreads();  // every warpgroup's keys of dS^T are in sdS
                float dQ[C::kDqWgCols / 8][4];  // set by the first wgmma (accumulate 0)
                wgmma_fence_operands(wg::flat(dQ));
                wgmma_fence();
                wg::ds_k<kKeys>(dQ, smem_addr(sdS), dq_k_cols);
                wgmma_commit();
                wgmma_wait<0>();
                wgmma_fence_operands(wg::flat(dQ));
                if constexpr (kBulkDq) {
                    // Into this step's dQ tile (the accumulator layout: rows lane / 4 and
                    // lane / 4 + 8 of the warp's 16, two columns per n8 block); the next
                    // step's first barrier hands it to the bulk reduction.
                    float* tile = sdQ + (buf * kQ + (warp % 4) * 16 + lane / 4) * C::kDqRowFloats +
                                  dq_col0 + 2 * (lane % 4);
#pragma unroll
                    for (int nd = 0; nd < C::kDqWgCols / 8; ++nd) {
                        *reinterpret_cast<float2*>(tile + nd * 8) =
                            make_float2(dQ[nd][0], dQ[nd][1]);
                        *reinterpret_cast<float2*>(tile + 8 * C::kDqRowFloats + nd * 8) =
                            make_float2(dQ[nd][2], dQ[nd][3]);
                    }
                    fence_proxy_async_shared();
                } else {
                    add_to_dq_accum<C::kDqWgCols>(p, dQ, batch, head, q0 + (warp % 4) * 16,
                                                  dq_col0);
                }
            } else {
                wgmma_wait<0>();
            }
            wgmma_fence_operands(wg::flat(dK));
            wgmma_fence_operands(wg::flat(dV));
        } else {
            float P[1][kQ / 8][4];
            gemm_rows_rows<kKeys, kQ>(P, lo, k_tile, row0, q_tile);
            probabilities(P[0]);
            if constexpr (kValues && kScoreMods) {
                uint32_t a[1][kQ / 16][4];
                if (dropout) {
                    pack_dropped<kQ / 8>(a, P, keep, KeepThreshold(p.dropout_threshold),
                                    p.dropout_scale);
                } else {
                    pack_a_fragments<C::kBf16>(a, P);
                }
                gemm_packed_tile<kQ, kQ / 16>(dV, a, lo, do_tile);
            } else if constexpr (kValues) {
                gemm_regs_tile<kQ, kQ / 16>(dV, P, lo, do_tile);
            }

            if constexpr (kGrads) {
                float dS[1][kQ / 8][4];
                gemm_rows_rows<kKeys, kQ>(dS, lo, v_tile, row0, do_tile);
                score_grads(dS[0], P[0]);
                gemm_regs_tile<kQ, kQ / 16>(dK, dS, lo, q_tile);
                if constexpr (kFuseDq) {
                    // Every warp finished the previous step's dQ reads of sdS at the loop's
                    // barrier.
                    acc_to_tile<kKeys, kQ / 8>(sdS, dS[0], 1.f, row0);
                    __syncthreads();
                    add_dq_share<kKeys, kQ>(p, lo, smem_addr(sdS), k_tile, batch, head, q0);
                }
            }
        }
    }

    // dK = scale * dS^T Q; both through shared memory (over K and V) for coalesced stores.
    copy_wait_all<C>();
    __syncthreads();
    if constexpr (kBulkDq) {
        if (n_steps > 0) reduce_dq_tile(n_steps - 1);  // the last step's tile
    }
    if constexpr (kGrads) acc_to_tile<kKeys>(sK, dK, p.softmax_scale, row0);
    if constexpr (kValues) acc_to_tile<kKeys>(sV, dV, 1.f, row0);
    __syncthreads();
    if constexpr (kGrads)
        KeyCopy::store(row_of(static_cast<elem_t*>(p.dk), p.dk_strides, batch, key0, head_k),
                       sK, p.dk_strides.seq, key_rows);
    if constexpr (kValues)
        KeyCopy::store(row_of(static_cast<elem_t*>(p.dv), p.dv_strides, batch, key0, head_k),
                       sV, p.dv_strides.seq, key_rows);
    if constexpr (kBulkDq) {
        if (threadIdx.x == 0) bulk_wait<0>();  // the reduction reads shared memory until done
    }
}

}  // namespace cudaflash

// The warp-specialized dK/dV + dQ kernel (BwdConfig::kWarpSpecialized), on the helpers above.
#include "bwd_warp_specialized.cuh"
// ... and at d256 the deterministic scheme's dK/dV kernel of that structure.
#include "bwd_warp_specialized_d256.cuh"

namespace cudaflash {

// The deterministic scheme's dK/dV kernel: one run of bwd_dkdv, or at d256 a dV pass and a
// dK pass (kPassValues, kPassKeys), each loading its own K and V (the first pass's epilogue
// stages dV over V), or at d256 on Hopper the warp-specialized kernel (tensor maps: padded
// batches without score modifiers only; the host sends the other calls to the mma.sync d256
// module, so here they compile to a trap: backward_config.BackwardConfig.plain_calls_only).
template <bool kScoreMods = false>
__device__ __forceinline__ void bwd_dkdv_deterministic(const BwdParams& p) {
    if constexpr (kD == 256 && C::kWarpSpecialized) {
        if constexpr (kScoreMods) {
            __trap();
        } else {
            bwd_dkdv_ws_d256<true>(p, padded_origin(p));
        }
    } else if constexpr (kD == 256) {
        bwd_dkdv<false, true, kScoreMods, kPassValues>(p);
        __syncthreads();  // every warp's dV stores have read the staging tile
        bwd_dkdv<false, true, kScoreMods, kPassKeys>(p);
    } else {
        bwd_dkdv<false, true, kScoreMods>(p);
    }
}

// The atomic scheme's fused dK/dV + dQ kernel of this module: warp-specialized (3 warpgroups)
// or bwd_dkdv's (a template, so that only the one chosen is instantiated). d256 modules serve
// the deterministic scheme only (configs.yaml): their fused entries are never launched and
// compile to a trap, so that a launch by mistake fails loudly instead of spilling a kernel
// nobody runs.
template <bool kWindow, class Cfg = C>
__device__ __forceinline__ void bwd_dkdv_dq(const BwdParams& p) {
    if constexpr (kD == 256) {
        __trap();
    } else if constexpr (Cfg::kWarpSpecialized) {
        bwd_dkdv_dq_ws<kWindow, Cfg>(p, padded_origin(p));
    } else {
        bwd_dkdv<true, kWindow>(p);
    }
}

// ---- dQ -------------------------------------------------------------------------------------

template <bool kScoreMods = false>
__device__ __forceinline__ void bwd_dq(const BwdParams& p) {
    constexpr int kRows = C::kCtaRows;
    constexpr int kKv = C::kBc;
    // The same declaration as bwd_dkdv's (one array per translation unit, one alignment).
    extern __shared__ __align__(C::kWgmma ? 1024 : 128) unsigned char smem[];
    elem_t* sQ = reinterpret_cast<elem_t*>(smem);  // (kRows, d); holds dQ at the end
    elem_t* sdO = sQ + kRows * kD;                 // (kRows, d)
    elem_t* sK = sdO + kRows * kD;                 // 2 x (kKv, d): double-buffered
    elem_t* sV = sK + 2 * kKv * kD;                // 2 x (kKv, d)

    // Causal CTAs with more KV tiles start first, as in the forward.
    const int q_block = p.is_causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const int head_k = head / (p.n_heads / p.n_heads_k);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int q0 = q_block * kRows;
    if (q0 >= p.seqlen_q) return;  // only in a packed batch: a sequence shorter than the grid
    const int q_rows = min(kRows, p.seqlen_q - q0);
    const int shift = p.seqlen_k - p.seqlen_q;
    const float alibi = kScoreMods ? alibi_coefficient(p, batch, head) : 0.f;
    const bool dropout = kScoreMods && p.dropout_threshold != 0;
    const uint64_t seed = dropout ? *p.dropout_seed : 0;

    // KV tiles [first_tile, end_tile) are visible to some row; tiles >= mask_from hold a key
    // some row must not see (the seqlen_k tail, or keys right of the first row's window), as
    // do tiles < mask_below (keys left of the last row's window). (key_tiles computes the
    // same; inlined here because the helper moved registers: the d64 dQ kernel spilled 20
    // bytes with it.)
    const WindowBounds window(p);
    const int n_kv = (p.seqlen_k + kKv - 1) / kKv;
    int end_tile = n_kv;
    int mask_from = p.seqlen_k % kKv ? n_kv - 1 : n_kv;
    if (p.window_right >= 0) {
        const int last_key = q0 + q_rows - 1 + shift + p.window_right;
        end_tile = last_key < 0 ? 0 : min(n_kv, last_key / kKv + 1);
        mask_from = min(mask_from, max(q0 + shift + p.window_right + 1, 0) / kKv);
    }
    int first_tile = 0, mask_below = 0;
    if (p.window_left >= 0) {
        first_tile = min(max(q0 + shift - p.window_left, 0) / kKv, end_tile);
        const int last_row_first_key = q0 + q_rows - 1 + shift - p.window_left;
        mask_below = last_row_first_key > 0 ? (last_row_first_key + kKv - 1) / kKv : 0;
    }

    using RowCopy = TileCopy<C, kRows>;
    using KvCopy = TileCopy<C, kKv>;
    RowCopy::load(sQ, row_of(static_cast<const elem_t*>(p.q), p.q_strides, batch, q0, head),
                  p.q_strides.seq, q_rows);
    RowCopy::load(sdO, row_of(static_cast<const elem_t*>(p.dout), p.do_strides, batch, q0, head),
                  p.do_strides.seq, q_rows);
    const elem_t* k = row_of(static_cast<const elem_t*>(p.k), p.k_strides, batch, 0, head_k);
    const elem_t* v = row_of(static_cast<const elem_t*>(p.v), p.v_strides, batch, 0, head_k);
    auto load_tile = [&](int tile, int buf) {
        const int rows = p.seqlen_k - tile * kKv;
        KvCopy::load(sK + buf * kKv * kD, k + int64_t(tile) * kKv * p.k_strides.seq,
                     p.k_strides.seq, rows);
        KvCopy::load(sV + buf * kKv * kD, v + int64_t(tile) * kKv * p.v_strides.seq,
                     p.v_strides.seq, rows);
    };
    if (first_tile < end_tile) load_tile(first_tile, 0);
    copy_commit<C>();

    // This thread's two query rows (of each m16 tile: lane / 4 and lane / 4 + 8).
    const int row0 = warp * 16;
    float lse[2], delta[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = q0 + row0 + lane / 4 + 8 * r;
        const int64_t index = batch * p.lse_batch_stride + head * p.lse_head_stride + row;
        const bool valid = row < p.seqlen_q;
        lse[r] = lse_log2(p, index, valid);
        delta[r] = valid ? p.delta[index] : 0.f;
    }

    float dQ[kD / 8][4];
#pragma unroll
    for (int nd = 0; nd < kD / 8; ++nd)
#pragma unroll
        for (int e = 0; e < 4; ++e) dQ[nd][e] = 0.f;

    const uint32_t q_tile = smem_addr(sQ), do_tile = smem_addr(sdO);
    const LaneOffsets lo;
    for (int tile = first_tile; tile < end_tile; ++tile) {
        const int buf = (tile - first_tile) % 2;
        copy_wait_all<C>();
        __syncthreads();
        if (tile + 1 < end_tile) load_tile(tile + 1, buf ^ 1);
        copy_commit<C>();
        const uint32_t k_tile = smem_addr(sK + buf * kKv * kD);
        const uint32_t v_tile = smem_addr(sV + buf * kKv * kD);

        float P[1][kKv / 8][4];
        gemm_rows_rows<kRows, kKv>(P, lo, q_tile, row0, k_tile);
        const bool mask = tile >= mask_from || tile < mask_below;
        // The offset key - (row + shift) of element (nj, e): ALiBi's distance.
        auto offset = [&](int nj, int e) {
            return float(tile * kKv + nj * 8 + 2 * (lane % 4) + e % 2 -
                         (q0 + row0 + lane / 4 + 8 * (e / 2)) - shift);
        };
        if constexpr (kScoreMods) {
            if (p.softcap_pre != 0.f) {
#pragma unroll
                for (int nj = 0; nj < kKv / 8; ++nj)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        P[0][nj][e] = tanh_approx(P[0][nj][e] * p.softcap_pre);
            }
            if (alibi != 0.f) {
#pragma unroll
                for (int nj = 0; nj < kKv / 8; ++nj)
#pragma unroll
                    for (int e = 0; e < 4; ++e) P[0][nj][e] += alibi_bias(alibi, offset(nj, e));
            }
        }
#pragma unroll
        for (int nj = 0; nj < kKv / 8; ++nj)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = ex2(fmaf(P[0][nj][e], p.scale_log2, -lse[e / 2]));
                if (mask) {
                    const int key = tile * kKv + nj * 8 + 2 * (lane % 4) + e % 2;
                    const int row = q0 + row0 + lane / 4 + 8 * (e / 2);
                    if (key >= p.seqlen_k || window.hides(key - row - shift)) x = 0.f;
                }
                P[0][nj][e] = x;
            }

        float dS[1][kKv / 8][4];
        gemm_rows_rows<kRows, kKv>(dS, lo, do_tile, row0, v_tile);
        if (kScoreMods && dropout) {  // dS = P o (keep o dPd / (1 - p) - delta)
            KeepBytes keep[kKv / 16];
            dropout_bytes<false>(keep, seed, (q0 + row0) / 16, tile * kKv / 16, 0, 1,
                                 batch * p.n_heads + head, lane);
            const KeepThreshold t(p.dropout_threshold);
#pragma unroll
            for (int nj = 0; nj < kKv / 8; ++nj)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    dS[0][nj][e] = kept(keep, t, nj, e) ? dS[0][nj][e] * p.dropout_scale : 0.f;
        }
#pragma unroll
        for (int nj = 0; nj < kKv / 8; ++nj)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                dS[0][nj][e] = P[0][nj][e] * (dS[0][nj][e] - delta[e / 2]);
        if constexpr (kScoreMods) {
            if (p.softcap_pre != 0.f) {
#pragma unroll
                for (int nj = 0; nj < kKv / 8; ++nj)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        dS[0][nj][e] *= softcap_slope(P[0][nj][e], lse[e / 2], p.scale_log2,
                                                      alibi_bias(alibi, offset(nj, e)));
            }
        }
        gemm_regs_tile<kKv, kKv / 16>(dQ, dS, lo, k_tile);
    }

    copy_wait_all<C>();  // with no visible KV tile the Q copy may still be in flight
    __syncthreads();
    acc_to_tile<kRows>(sQ, dQ, p.softmax_scale, row0);
    __syncthreads();
    RowCopy::store(row_of(static_cast<elem_t*>(p.dq), p.dq_strides, batch, q0, head), sQ,
                   p.dq_strides.seq, q_rows);
}

// The deterministic scheme's dQ kernel: bwd_dq, or in the d256 warp-specialized module
// bwd_dq_ws_d256 (padded batches without score modifiers: its other entries are traps, as
// bwd_dkdv_deterministic's).
template <bool kScoreMods = false>
__device__ __forceinline__ void bwd_dq_deterministic(const BwdParams& p) {
    if constexpr (kD == 256 && C::kWarpSpecialized) {
        if constexpr (kScoreMods) {
            __trap();
        } else {
            bwd_dq_ws_d256<true>(p, padded_origin(p));
        }
    } else {
        bwd_dq<kScoreMods>(p);
    }
}

// The deterministic kernels on a packed (varlen) batch: each CTA on its sequence
// (sequence_view; the d256 warp-specialized kernels also take where the sequence lies in the
// tensor maps).
template <bool kScoreMods = false>
__device__ __forceinline__ void bwd_dkdv_packed(const BwdParams& p) {
    if constexpr (kD == 256 && C::kWarpSpecialized && !kScoreMods) {
        const MapOrigin origin = packed_origin(p);
        BwdParams s = sequence_view(p, blockIdx.z);
        // A sequence longer than max_seqlen_q (flash-attn: undefined gradients) walks no
        // rows past the statistics, so it reads nothing out of their bounds.
        s.seqlen_q = min(s.seqlen_q, origin.stats_rows);
        bwd_dkdv_ws_d256<true>(s, origin);
    } else {
        bwd_dkdv_deterministic<kScoreMods>(sequence_view(p, blockIdx.z));
    }
}
// The atomic scheme on a packed batch: the warp-specialized fused kernel on the CTA's
// sequence, window code included (it also masks causal calls). The other modules serve
// packed batches in the deterministic scheme only: a trap, as bwd_dkdv_dq's.
__device__ __forceinline__ void bwd_dkdv_dq_packed(const BwdParams& p) {
    if constexpr (kD != 256 && C::kWarpSpecialized) {
        const MapOrigin origin = packed_origin(p);
        BwdParams s = sequence_view(p, blockIdx.z);
        // As bwd_dkdv_packed: no rows past the statistics (a sequence beyond max_seqlen_q).
        s.seqlen_q = min(s.seqlen_q, origin.stats_rows);
        bwd_dkdv_dq_ws<true, C, true>(s, origin);
    } else {
        __trap();
    }
}
// The atomic scheme with dropout on a padded batch: the warp-specialized fused kernel, the
// forward's keep mask regenerated per step and applied to dV's packed operand, which dS^T
// then reads (bwd_dkdv_dq_ws, step_score_grads_dropped). The other modules serve dropout in
// the deterministic scheme only (the *_scoremod entries): a trap, as bwd_dkdv_dq_packed's
// (cudaflash.backward_config.BackwardConfig.fused_dropout mirrors the condition).
__device__ __forceinline__ void bwd_dkdv_dq_dropout(const BwdParams& p) {
    if constexpr (kD != 256 && C::kWarpSpecialized) {
        bwd_dkdv_dq_ws<false, C, false, true>(p, padded_origin(p));
    } else {
        __trap();
    }
}
template <bool kScoreMods = false>
__device__ __forceinline__ void bwd_dq_packed(const BwdParams& p) {
    if constexpr (kD == 256 && C::kWarpSpecialized && !kScoreMods) {
        bwd_dq_ws_d256<true>(sequence_view(p, blockIdx.z), packed_origin(p));
    } else {
        bwd_dq_deterministic<kScoreMods>(sequence_view(p, blockIdx.z));
    }
}

}  // namespace cudaflash

// The padded batch's entries; each kernel of the deterministic scheme has a second entry,
// *_varlen, that runs it on the CTA's sequence of a packed batch (sequence_view). Separate
// entries keep the padded kernels' registers as they were (ptxas sizes an entry for its
// largest path). The atomic scheme takes padded batches only: its fused kernel (255
// registers already) spilled with the per-sequence pointers.
extern "C" __global__ void __launch_bounds__(cudaflash::kPreprocessThreads)
    cudaflash_bwd_preprocess(const __grid_constant__ cudaflash::BwdParams p) {
    cudaflash::bwd_preprocess(p, cudaflash::dq_accum_rows(p));
}

// The d256 warp-specialized module's dK/dV and dQ kernels: 3 warpgroups and setmaxnreg, as
// the fused kernel below.
#if CF_WARP_SPECIALIZED && CF_D_HEAD == 256
#define CF_DETERMINISTIC_BOUNDS __launch_bounds__(cudaflash::BwdConfig::kFusedThreads, 1)
#else
#define CF_DETERMINISTIC_BOUNDS __launch_bounds__(cudaflash::BwdConfig::kThreads)
#endif
extern "C" __global__ void CF_DETERMINISTIC_BOUNDS
    cudaflash_bwd_dkdv(const __grid_constant__ cudaflash::BwdParams p) {
    cudaflash::bwd_dkdv_deterministic(p);
}

// The atomic scheme's fused kernel: causal or full attention (the window fields unread) ...
// Warp-specialized: one CTA of 3 warpgroups per SM, whose registers setmaxnreg then moves from
// the producer to the consumers. Otherwise the bounds the kernel always had (a minimum of one
// CTA per SM changes ptxas's register choices for the mma.sync and 8-warp wgmma kernels).
#if CF_WARP_SPECIALIZED
#define CF_FUSED_BOUNDS __launch_bounds__(cudaflash::BwdConfig::kFusedThreads, 1)
#else
#define CF_FUSED_BOUNDS __launch_bounds__(cudaflash::BwdConfig::kThreads)
#endif
extern "C" __global__ void CF_FUSED_BOUNDS
    cudaflash_bwd_dkdv_dq(const __grid_constant__ cudaflash::BwdParams p) {
    cudaflash::bwd_dkdv_dq<false>(p);
}

// ... and with a sliding window.
extern "C" __global__ void CF_FUSED_BOUNDS
    cudaflash_bwd_dkdv_dq_window(const __grid_constant__ cudaflash::BwdParams p) {
    cudaflash::bwd_dkdv_dq<true>(p);
}

// ... and with dropout (warp-specialized modules; elsewhere a trap).
extern "C" __global__ void CF_FUSED_BOUNDS
    cudaflash_bwd_dkdv_dq_dropout(const __grid_constant__ cudaflash::BwdParams p) {
    cudaflash::bwd_dkdv_dq_dropout(p);
}

extern "C" __global__ void __launch_bounds__(cudaflash::kPreprocessThreads)
    cudaflash_bwd_dq_convert(const __grid_constant__ cudaflash::BwdParams p) {
    cudaflash::bwd_dq_convert(p);
}

extern "C" __global__ void CF_DETERMINISTIC_BOUNDS
    cudaflash_bwd_dq(const __grid_constant__ cudaflash::BwdParams p) {
    cudaflash::bwd_dq_deterministic(p);
}

extern "C" __global__ void __launch_bounds__(cudaflash::kPreprocessThreads)
    cudaflash_bwd_preprocess_varlen(const __grid_constant__ cudaflash::BwdParams p) {
    // (the statistics' rows per head: the whole batch's, from the params before the view)
    cudaflash::bwd_preprocess<true>(cudaflash::sequence_view(p, blockIdx.z),
                                    cudaflash::dq_accum_rows(p));
}

// The atomic scheme on a packed batch (warp-specialized modules; elsewhere a trap): the fused
// kernel per sequence, then dQ from the packed accumulator.
extern "C" __global__ void CF_FUSED_BOUNDS
    cudaflash_bwd_dkdv_dq_varlen(const __grid_constant__ cudaflash::BwdParams p) {
    cudaflash::bwd_dkdv_dq_packed(p);
}

extern "C" __global__ void __launch_bounds__(cudaflash::kPreprocessThreads)
    cudaflash_bwd_dq_convert_varlen(const __grid_constant__ cudaflash::BwdParams p) {
    cudaflash::bwd_dq_convert<true>(cudaflash::sequence_view(p, blockIdx.z));
}

extern "C" __global__ void CF_DETERMINISTIC_BOUNDS
    cudaflash_bwd_dkdv_varlen(const __grid_constant__ cudaflash::BwdParams p) {
    cudaflash::bwd_dkdv_packed(p);
}

extern "C" __global__ void CF_DETERMINISTIC_BOUNDS
    cudaflash_bwd_dq_varlen(const __grid_constant__ cudaflash::BwdParams p) {
    cudaflash::bwd_dq_packed(p);
}

// The score modifiers (score_mods.cuh: softcapping, BwdParams::softcap_pre, and ALiBi,
// BwdParams::alibi_slopes, each a warp-uniform branch): the deterministic scheme's GEMM
// kernels again, as entries of their own so the ones above keep their registers (a runtime
// softcap branch made the d128 wgmma dK/dV kernel spill). The atomic scheme's fused kernel has
// none: with the tanh it spilled at d128 on wgmma, so such calls take the deterministic
// scheme.
extern "C" __global__ void __launch_bounds__(cudaflash::BwdConfig::kThreads)
    cudaflash_bwd_dkdv_scoremod(const __grid_constant__ cudaflash::BwdParams p) {
    cudaflash::bwd_dkdv_deterministic<true>(p);
}

extern "C" __global__ void __launch_bounds__(cudaflash::BwdConfig::kThreads)
    cudaflash_bwd_dq_scoremod(const __grid_constant__ cudaflash::BwdParams p) {
    cudaflash::bwd_dq_deterministic<true>(p);
}

extern "C" __global__ void __launch_bounds__(cudaflash::BwdConfig::kThreads)
    cudaflash_bwd_dkdv_varlen_scoremod(const __grid_constant__ cudaflash::BwdParams p) {
    cudaflash::bwd_dkdv_packed<true>(p);
}

extern "C" __global__ void __launch_bounds__(cudaflash::BwdConfig::kThreads)
    cudaflash_bwd_dq_varlen_scoremod(const __grid_constant__ cudaflash::BwdParams p) {
    cudaflash::bwd_dq_packed<true>(p);
}
