// Params: the one argument of every cudaflash forward kernel, passed by value as
// `const __grid_constant__ Params` (no copy to local memory, read through the constant bank).
// Mirrored field for field by cudaflash/_params.py (ctypes); the size is checked on both sides.
#pragma once
#include <cstdint>

namespace cudaflash {

struct Params {
    // Pointers. q: (batch, seqlen_q, n_heads, d_head); k, v: (batch, seqlen_k, n_heads_k, d_head);
    // o: like q; lse: float32 at lse_batch_stride / lse_head_stride / 1 per (batch, head, row),
    // or null when the caller does not want it (flash_attn_func without return_attn_probs: one
    // allocation less).
    const void* q;
    const void* k;
    const void* v;
    void* o;
    float* lse;
    // Variable-length batches (flash_attn_varlen_func), else null: sequence b is rows
    // [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q and o (packed along the seq dimension, batch
    // strides 0) and keys [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k and v; seqlen_q and
    // seqlen_k below are then the longest lengths (the grid's extent), and the offsets are
    // clamped into [0, total_q] and [0, total_k], so no value can address memory outside q, k,
    // v, o. Without cu_seqlens_q (a padded batch), cu_seqlens_k is null or holds batch key
    // counts: batch entry b uses keys [0, cu_seqlens_k[b]) of its seqlen_k (the cache_seqlens
    // of flash_attn_with_kvcache), clamped into [0, seqlen_k].
    const int32_t* cu_seqlens_q;
    const int32_t* cu_seqlens_k;

    // Strides in elements (the last dimension is contiguous). 64-bit: a 131072-token sequence
    // of 16 heads x 128 already needs 2^28 elements per batch entry.
    int64_t q_batch_stride, q_seq_stride, q_head_stride;
    int64_t k_batch_stride, k_seq_stride, k_head_stride;
    int64_t v_batch_stride, v_seq_stride, v_head_stride;
    int64_t o_batch_stride, o_seq_stride, o_head_stride;
    int64_t lse_batch_stride, lse_head_stride;  // (batch, n_heads, seqlen_q) or (n_heads, total_q)

    // Sizes. Heads h of q read K/V head h / (n_heads / n_heads_k) (GQA/MQA).
    int32_t batch;
    int32_t n_heads;
    int32_t n_heads_k;
    int32_t seqlen_q;
    int32_t seqlen_k;
    int32_t is_causal;  // 0 or 1; causal mask aligned bottom-right (flash-attn >= 2.1)
    int32_t total_q;    // varlen: rows of q and o, keys of k and v (unused otherwise)
    int32_t total_k;
    // The keys query row i sees: [i + shift - window_left, i + shift + window_right] with
    // shift = seqlen_k - seqlen_q (per sequence), each side unbounded when negative. Causal
    // calls have window_right = 0 (flash-attn's sliding window, causal = a right bound of 0);
    // is_causal itself only orders the CTAs.
    int32_t window_left;
    int32_t window_right;

    // Scales. softmax_scale multiplies q.k; scale_log2 = softmax_scale * log2(e) is folded into
    // one FFMA before exp2.
    float softmax_scale;
    float scale_log2;
    // Softcapping (flash-attn's softcap > 0: Gemma 2, Grok): the softmax sees
    // cap * tanh(softmax_scale * q.k / cap). The kernel turns a raw score s into
    // tanh(s * softcap_pre) with softcap_pre = softmax_scale / cap, and the host sets
    // scale_log2 = cap * log2(e), the factor of those tanh values in the exponent.
    // Read only by the *_softcap entries (flash_fwd.cu).
    float softcap_pre;
    // ALiBi's factor: log2(e) / scale_log2 (1 / softmax_scale, or 1 / cap when softcapping),
    // which turns a slope into the units of the scores the kernel holds (alibi_slopes below).
    float alibi_scale;

    // Split-KV (cudaflash_fwd_split + cudaflash_combine; ignored by cudaflash_fwd): the KV
    // blocks of a query block are cut into n_splits runs of kv_blocks_per_split blocks, one
    // CTA each (grid.z = batch * n_splits). Each writes its rows' O, normalised by its own
    // softmax sum, to o_accum (n_splits, batch, n_heads, seqlen_q, d_head) and their log-sum-exp
    // to lse_accum (n_splits, batch, n_heads, seqlen_q), both float32 and contiguous; the
    // combine kernel weights the splits by exp(lse_split - lse) into o and lse.
    int32_t n_splits;
    int32_t kv_blocks_per_split;

    // flash_attn_with_kvcache's cache addressing, each null when unused (a padded batch only;
    // every index is clamped, so no value can address memory outside the caches):
    // Read by the *_kvcache entries only.
    // - block_table (paged K/V): k and v are pages
    //   (n_cache_entries, 2^page_shift, n_heads_k, d_head) at k/v_batch_stride, and key j of
    //   batch entry b is row j % 2^page_shift of page block_table[b * block_table_stride +
    //   (j >> page_shift)]. Pages hold a power of two >= 16 of positions (a tile of <= 512 keys
    //   then spans <= 32 pages: one per lane, tile_page). A packed batch (cu_seqlens_q) takes
    //   each sequence's key count from cu_seqlens_k, clamped to paged_keys.
    // - cache_batch_idx: batch entry b reads the caches' entry cache_batch_idx[b] (of
    //   n_cache_entries) instead of entry b.
    // - cache_leftpad: batch entry b's keys start at cache position cache_leftpad[b] (clamped
    //   into [0, its key count]); it sees keys [cache_leftpad[b], cu_seqlens_k[b]).
    const int32_t* block_table;
    const int32_t* cache_batch_idx;
    const int32_t* cache_leftpad;
    int32_t block_table_stride;
    int32_t page_shift;
    int32_t n_cache_entries;
    int32_t paged_keys;  // paged: keys a table row addresses (its columns x the page size)

    // ALiBi (flash-attn's alibi_slopes), else null: float32 slopes at
    // alibi_slopes[batch * alibi_batch_stride + head] (stride 0 for one slope per head). Query
    // row i of a sequence adds -slope * |i + len_k - len_q - j| to its scaled score of key j
    // (after softcapping). Read by the *_alibi and *_softcap entries only.
    const float* alibi_slopes;
    int32_t alibi_batch_stride;
    // ALiBi's band (fwd_range.cuh, alibi_band; the forward's *_alibi entries only), else
    // null: a float32 device scalar bounding every scaled score's magnitude.
    const float* alibi_score_bound;

    // Dropout (the *_dropout entries): a score is kept when its random byte (philox.cuh,
    // from the 64-bit seed at dropout_seed, a device tensor drawn per call by torch) is at
    // least dropout_threshold = round(dropout_p * 256) (<= 255); O is scaled by
    // dropout_scale = 1 / (1 - dropout_p). The lse is the undropped scores'.
    uint32_t dropout_threshold;
    const uint64_t* dropout_seed;
    float dropout_scale;
    // 1: the sm_90a kernels (the warp-specialized producer, the wgmma kernel's thread 0)
    // load Q, K and V through the tensor maps below (TMA) instead of cp.async. The host sets it only for calls the maps describe
    // whole: a padded batch without cache addressing, one query row per position (no GQA
    // decoding rows), 16-byte aligned pointers and strides (cudaflash/_tma.py).
    int32_t tma_loads;

    float* o_accum;
    float* lse_accum;
    // Persistent warp-specialized calls with a causal mask (KernelConfig.persistent): an
    // int32 the host zeroes per call, from which each CTA takes its next tile (gridDim.x +
    // atomicAdd) once its first (blockIdx.x) is loaded, so that CTAs given short tiles take
    // more of them. Null: the CTAs walk blockIdx.x + k gridDim.x (every tile equally long).
    int32_t* tile_counter;
    unsigned char maps_pad[40];  // the maps at a multiple of 64 bytes, as alignas places them

    // The tensor maps (CUtensorMap, 128 opaque bytes each, encoded by the driver on the host
    // per call: cudaflash/_tma.py) of q, k and v when tma_loads is 1, else not read. Each
    // map is 5-D, innermost first: (64 columns of a 64-column slab, sequence position, slab,
    // head, batch entry); its box is (64, rows of a tile, all slabs, 1, 1) with the 128-byte
    // swizzle, so that one copy writes a whole tile in SmemTile's slab-major swizzled layout
    // (smem_layout.cuh: the wgmma descriptors'), positions past the sequence as zeros.
    alignas(64) unsigned char tma_q[128];
    alignas(64) unsigned char tma_k[128];
    alignas(64) unsigned char tma_v[128];
};

constexpr int kParamsBytes = 768;
static_assert(sizeof(Params) == kParamsBytes, "Params layout changed: update cudaflash/_params.py");
static_assert(offsetof(Params, tma_q) == 384,
              "the maps moved: update _params.Params (maps_pad, PARAMS_MAPS_OFFSET)");

// AppendParams: the argument of cudaflash_append_kv, which writes flash_attn_with_kvcache's new
// keys and values (k_new, v_new: (batch, seqlen_new, n_heads_k, d_head)) into the caches at
// each sequence's position cache_seqlens[b] + i, on the GPU, so that a decoding step with an
// append reads nothing on the host (one CUDA graph). A position outside [0, seqlen_cache), or
// a page outside the cache, is not written: no value can address memory outside the caches.
// Cache addressing as Params' (block_table, cache_batch_idx, n_cache_entries); strides in
// elements. Mirrored by cudaflash/_params.py.
struct AppendParams {
    const void* k_new;
    const void* v_new;
    void* k_cache;
    void* v_cache;
    const int32_t* cache_seqlens;
    const int32_t* cache_batch_idx;
    const int32_t* block_table;
    int64_t k_new_batch_stride, k_new_seq_stride, k_new_head_stride;
    int64_t v_new_batch_stride, v_new_seq_stride, v_new_head_stride;
    int64_t k_batch_stride, k_seq_stride, k_head_stride;
    int64_t v_batch_stride, v_seq_stride, v_head_stride;
    int32_t batch;
    int32_t seqlen_new;
    int32_t n_heads_k;
    int32_t seqlen_cache;  // positions per sequence (paged: pages per table row x page_size)
    int32_t block_table_stride;
    int32_t page_size;
    int32_t n_cache_entries;  // the caches' batch entries, or pages
    int32_t reserved;
};

constexpr int kAppendParamsBytes = 184;
static_assert(sizeof(AppendParams) == kAppendParamsBytes,
              "AppendParams layout changed: update cudaflash/_params.py");

}  // namespace cudaflash
