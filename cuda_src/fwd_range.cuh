// Which rows and KV blocks one forward CTA works on: its place in the grid, the batch entry's
// sequence (padded or packed batch), where its tiles start in q/k/v, and the range of KV
// blocks its rows can see. Shared by both forward kernels (flash_fwd.cu and
// fwd_warp_specialized.cuh).
#pragma once
#include "params.cuh"

namespace cudaflash {

// The CTA's place in the grid (ceil(seqlen_q / B_r), n_heads, batch [* n_splits]): its query
// block, head, batch entry and split, and the K/V head its query head reads (GQA/MQA).
struct CtaPlace {
    int q_block, head, batch, split, head_k;
};

template <bool kSplit>
__device__ __forceinline__ CtaPlace cta_place(const Params& p) {
    // Causal CTAs with more KV blocks start first (the last query blocks do the most work).
    const int q_block = p.is_causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int head = blockIdx.y;
    const int batch = kSplit ? blockIdx.z / p.n_splits : blockIdx.z;
    const int split = kSplit ? blockIdx.z % p.n_splits : 0;
    return {q_block, head, batch, split, head / (p.n_heads / p.n_heads_k)};
}

// One batch entry's sequence: its query rows and keys, and where they start along the seq
// dimension of q/o and k/v (0 unless the batch is packed: Params::cu_seqlens_q). A padded
// batch may give each entry's key count (Params::cu_seqlens_k without cu_seqlens_q).
struct Sequence {
    int len_q, len_k;
    int start_q, start_k;
};

// The *_kvcache entries also read Params' cache addressing (block_table, cache_batch_idx,
// cache_leftpad: kvcache_sequence, head_tiles<C, true>); the other entries keep the code that
// never looks at it (its checks alone raised the registers of the tightest configs until they
// spilled, and changed their machine code).
__device__ __forceinline__ Sequence plain_sequence(const Params& p, int batch) {
    if (p.cu_seqlens_q == nullptr) {
        if (p.cu_seqlens_k == nullptr) return {p.seqlen_q, p.seqlen_k, 0, 0};
        return {p.seqlen_q, min(max(p.cu_seqlens_k[batch], 0), p.seqlen_k), 0, 0};
    }
    const int q0 = min(max(p.cu_seqlens_q[batch], 0), p.total_q);
    const int q1 = min(max(p.cu_seqlens_q[batch + 1], q0), p.total_q);
    const int k0 = min(max(p.cu_seqlens_k[batch], 0), p.total_k);
    const int k1 = min(max(p.cu_seqlens_k[batch + 1], k0), p.total_k);
    return {q1 - q0, k1 - k0, q0, k0};
}

__device__ __forceinline__ Sequence kvcache_sequence(const Params& p, int batch) {
    if (p.cu_seqlens_q == nullptr) {
        if (p.cu_seqlens_k == nullptr) return {p.seqlen_q, p.seqlen_k, 0, 0};
        const int used = min(max(p.cu_seqlens_k[batch], 0), p.seqlen_k);
        // flash_attn_with_kvcache's cache_leftpad: the keys before it are padding.
        const int start =
            p.cache_leftpad == nullptr ? 0 : min(max(p.cache_leftpad[batch], 0), used);
        return {p.seqlen_q, used - start, 0, start};
    }
    const int q0 = min(max(p.cu_seqlens_q[batch], 0), p.total_q);
    const int q1 = min(max(p.cu_seqlens_q[batch + 1], q0), p.total_q);
    const int k0 = min(max(p.cu_seqlens_k[batch], 0), p.total_k);
    const int k1 = min(max(p.cu_seqlens_k[batch + 1], k0), p.total_k);
    // Paged K/V: the offsets give the lengths only; the keys are in the sequence's pages,
    // of which its table row holds paged_keys' worth.
    if (p.block_table != nullptr) return {q1 - q0, min(k1 - k0, p.paged_keys), q0, 0};
    return {q1 - q0, k1 - k0, q0, k0};
}

template <bool kKvcache = false>
__device__ __forceinline__ Sequence sequence(const Params& p, int batch) {
    if constexpr (kKvcache) {
        return kvcache_sequence(p, batch);
    } else {
        return plain_sequence(p, batch);
    }
}

// The KV blocks one CTA (query rows [q_row0, q_row0 + q_rows) of a sequence) works on:
// [begin, end). Blocks >= mask_from and blocks starting before key below_keys hold a key that
// some row must not see (the seqlen_k tail, keys right of the causal diagonal or of the
// window, keys left of it), so their scores are masked.
struct KvRange {
    int begin, end, mask_from, below_keys;
};

// ALiBi's band (the *_alibi entries, where the host gives alibi_score_bound): with every
// scaled score within +-B (B = *alibi_score_bound, softmax_scale max|q| max|k|, a bound by
// Cauchy-Schwarz), a key more than (2 B + kAlibiBandMargin) / slope keys from a row's
// diagonal weighs under e^-kAlibiBandMargin of the row's largest weight, so skipping it
// moves out and lse by under seqlen_k e^-40 relative, below float32's resolution. The band's
// half-width in keys, or INT_MAX for none (no bound, a slope that is not > 0, a NaN, or a
// band wider than any sequence).
constexpr float kAlibiBandMargin = 40.f;

__device__ __forceinline__ int alibi_band(const Params& p, int batch, int head) {
    if (p.alibi_score_bound == nullptr || p.alibi_slopes == nullptr) return INT_MAX;
    const float slope = p.alibi_slopes[int64_t(batch) * p.alibi_batch_stride + head];
    const float width = (2.f * *p.alibi_score_bound + kAlibiBandMargin) / slope;
    return width > 0.f && width < 1e9f ? int(ceilf(width)) : INT_MAX;
}

// The band an entry takes: the *_alibi entries without softcap or dropout (the dropout entry
// with ALiBi spilled 16 bytes on sm_80/86 with it, and launch.run bands no dropout call);
// INT_MAX, folded away, in every other entry, whose code stays as without the band.
template <bool kSoftcap, bool kAlibi, bool kDropout>
__device__ __forceinline__ int entry_band(const Params& p, int batch, int head) {
    if constexpr (kAlibi && !kSoftcap && !kDropout) {
        return alibi_band(p, batch, head);
    } else {
        return INT_MAX;
    }
}

template <class C, bool kSplit>
__device__ __forceinline__ KvRange kv_range(const Params& p, const Sequence& seq, int q_row0,
                                            int q_rows, int split, int band = INT_MAX) {
    // Blocks [kv_lo, n_blocks) are visible to some row of this CTA.
    const int causal_shift = seq.len_k - seq.len_q;
    const int n_kv = (seq.len_k + C::kBc - 1) / C::kBc;
    int n_blocks = n_kv;
    int mask_from = seq.len_k % C::kBc ? n_kv - 1 : n_kv;
    if (p.window_right >= 0) {  // causal: window_right = 0
        const int last_key = q_row0 + q_rows - 1 + causal_shift + p.window_right;  // last row's
        n_blocks = last_key < 0 ? 0 : min(n_kv, last_key / C::kBc + 1);
        const int first_row_keys = q_row0 + causal_shift + p.window_right + 1;  // [0, this)
        mask_from = min(mask_from, max(first_row_keys, 0) / C::kBc);
    }
    // With a left bound, blocks before the first row's first key are not loaded, and blocks
    // that start before the last row's first key (below_keys) are masked.
    int kv_lo = 0, below_keys = 0;
    if (p.window_left >= 0) {
        const int first_key = q_row0 + causal_shift - p.window_left;  // the first row's first
        kv_lo = max(first_key, 0) / C::kBc;
        below_keys = first_key + q_rows - 1;
    }
    // ALiBi's band (alibi_band) around the first and the last row's diagonals, each clamped
    // into the keys: a row whose diagonal lies outside them weighs its nearest key most. No
    // mask changes: the keys outside are skipped, the blocks the band's edges cut computed
    // whole.
    if (band != INT_MAX && seq.len_k > 0) {
        const int first = min(max(q_row0 + causal_shift, 0), seq.len_k - 1);
        const int last = min(max(q_row0 + q_rows - 1 + causal_shift, 0), seq.len_k - 1);
        kv_lo = max(kv_lo, max(first - band, 0) / C::kBc);
        n_blocks = min(n_blocks, int((int64_t(last) + band) / C::kBc) + 1);
    }
    // This CTA's KV blocks: [kv_begin, n_blocks). A split past the causal diagonal (or the
    // end of a short sequence, or before the window) gets none and writes O = 0, lse = -inf,
    // which the combine weights by zero. The last split takes every block left, so a packed
    // sequence longer than the seqlen_k the splits were sized for still sees all of its keys.
    int kv_begin = kv_lo;
    if constexpr (kSplit) {
        // The runs cover the CTA's blocks from kv_lo (the host sizes them over the window).
        const int split_begin = kv_lo + split * p.kv_blocks_per_split;
        kv_begin = split_begin;
        if (split < p.n_splits - 1) n_blocks = min(n_blocks, split_begin + p.kv_blocks_per_split);
    }
    return {kv_begin, n_blocks, mask_from, below_keys};
}

// Where the CTA's tiles start: q at its first query row, k and v at the sequence's first key.
template <class C>
struct HeadTiles {
    const typename C::elem_t *q, *k, *v;
};

template <class C, bool kKvcache = false>
__device__ __forceinline__ HeadTiles<C> head_tiles(const Params& p, const CtaPlace& at,
                                                   const Sequence& seq, int q_row0) {
    using elem_t = typename C::elem_t;
    // The caches' entry: the batch entry's own, or (kvcache entries) cache_batch_idx's, or
    // none (paged K/V: k and v at their head in page 0; paged_row (copy.cuh) adds each
    // row's page).
    int64_t kv_entry = at.batch;
    if constexpr (kKvcache) {
        if (p.block_table != nullptr) {
            kv_entry = 0;
        } else if (p.cache_batch_idx != nullptr) {
            kv_entry = min(max(p.cache_batch_idx[at.batch], 0), p.n_cache_entries - 1);
        }
    }
    return {static_cast<const elem_t*>(p.q) + at.batch * p.q_batch_stride +
                at.head * p.q_head_stride + int64_t(seq.start_q + q_row0) * p.q_seq_stride,
            static_cast<const elem_t*>(p.k) + kv_entry * p.k_batch_stride +
                at.head_k * p.k_head_stride + int64_t(seq.start_k) * p.k_seq_stride,
            static_cast<const elem_t*>(p.v) + kv_entry * p.v_batch_stride +
                at.head_k * p.v_head_stride + int64_t(seq.start_k) * p.v_seq_stride};
}

}  // namespace cudaflash
