// BwdParams: the one argument of every cudaflash backward kernel (cuda_src/flash_bwd.cu),
// passed by value as `const __grid_constant__ BwdParams` (64-byte aligned for its tensor
// maps, so the host launches through kernelParams, not `extra`: _driver.PackedArgs).
// Mirrored field for field by cudaflash/_params.py (BwdParams); the size is checked on both
// sides.
#pragma once
#include <cstddef>
#include <cstdint>

namespace cudaflash {

// The strides of a (batch, seqlen, nheads, d_head) tensor, in elements.
struct Strides {
    int64_t batch, seq, head;
};

// Element (batch, row, head, 0) of such a tensor.
template <class T>
__device__ __forceinline__ T* row_of(T* base, const Strides& s, int batch, int row, int head) {
    return base + batch * s.batch + int64_t(row) * s.seq + head * s.head;
}

struct BwdParams {
    // Pointers. q, o, dout, dq: (batch, seqlen_q, n_heads, d_head); k, v, dk, dv: (batch,
    // seqlen_k, n_heads_k, d_head); lse (the forward's, natural log) and delta (written by
    // cudaflash_bwd_preprocess: rowsum(dout * o)): float32 at lse_batch_stride /
    // lse_head_stride / 1 per (batch, head, row).
    const void* q;
    const void* k;
    const void* v;
    const void* o;
    const void* dout;
    const float* lse;
    float* delta;
    void* dq;
    void* dk;
    void* dv;
    // The atomic scheme's float32 dQ accumulator, d_head floats per query row at lse's
    // (batch, head, row) index (row-major (batch, n_heads, seqlen_q, d_head)); null in the
    // deterministic scheme.
    float* dq_accum;

    // Strides in elements (the last dimension is contiguous).
    Strides q_strides, k_strides, v_strides, o_strides, do_strides;
    Strides dq_strides, dk_strides, dv_strides;
    int64_t lse_batch_stride, lse_head_stride;

    // Sizes, as in Params.
    int32_t batch;
    int32_t n_heads;
    int32_t n_heads_k;
    int32_t seqlen_q;
    int32_t seqlen_k;
    int32_t is_causal;

    float softmax_scale;
    float scale_log2;  // softmax_scale * log2(e); cap * log2(e) when softcapping (below)

    // Packed (varlen) batches, else null: as Params::cu_seqlens_q/k (params.cuh). Tensors are
    // then (total, n_heads, d_head) with batch strides 0, lse, delta (n_heads, total_q) and
    // dq_accum (n_heads, total_q, d_head); seqlen_q/seqlen_k are the longest lengths (the
    // grid's extent) and total_q/total_k the packed rows every offset is clamped into.
    const int32_t* cu_seqlens_q;
    const int32_t* cu_seqlens_k;
    int32_t total_q;
    int32_t total_k;

    // The keys query row i sees, as in Params (params.cuh): [i + shift - window_left, i +
    // shift + window_right], shift = seqlen_k - seqlen_q, a side unbounded when negative.
    // Causal calls have window_right = 0: the kernels mask by the window alone, and
    // is_causal only orders the dQ kernel's CTAs.
    int32_t window_left;
    int32_t window_right;

    // Softcapping, as Params::softcap_pre (params.cuh): softmax_scale / cap, with scale_log2 =
    // cap * log2(e); read only by the *_scoremod entries. The gradient of cap * tanh(s *
    // softcap_pre) by s is softmax_scale * (1 - tanh^2): dS carries the (1 - tanh^2),
    // softmax_scale is applied where it always is (dQ and dK at the end).
    float softcap_pre;
    // ALiBi, as Params' alibi_scale, alibi_slopes and alibi_batch_stride (params.cuh): the
    // *_scoremod entries add the same bias to the recomputed scores (the slopes get no
    // gradient, as in flash-attn).
    float alibi_scale;
    const float* alibi_slopes;
    int32_t alibi_batch_stride;
    // Dropout, as Params' (params.cuh): dropout_threshold 0 means none; the *_scoremod
    // entries rebuild the forward's keep mask from the seed.
    uint32_t dropout_threshold;
    const uint64_t* dropout_seed;
    float dropout_scale;
    int32_t reserved;  // the struct's size a multiple of 8 without implicit padding

    // The warp-specialized kernels' inputs (bwd_warp_specialized.cuh and its d256 form; null
    // and unread for the other kernels). Their query tiles' row statistics, (batch, n_heads,
    // dq_accum_rows) float32 written by cudaflash_bwd_preprocess (and _varlen): lse in log2
    // units (+inf past seqlen_q, so those rows' P is 0) and delta (0 past seqlen_q); padded
    // per head to whole tiles so that a tile's statistics are one aligned bulk copy. With
    // dropout (dropout_threshold != 0) delta_tiles hold (1 - p) delta: the only kernel that
    // reads them with dropout, the fused kernel's dropout entry, computes (1 - p) dS (one
    // multiply per score fewer) and scales dK by 1 / (1 - p), and dq_convert scales dQ's
    // accumulator by it.
    float* lse_log2_tiles;
    float* delta_tiles;
    unsigned char maps_pad[32];  // the maps at a multiple of 64 bytes, as alignas places them
    // The TMA tensor maps (CUtensorMap, encoded on the host: cudaflash/_tma.py) of q, k, v and
    // dout, each (64 columns, row, slab, head, batch) with a box of the kernel's tile rows and
    // the 128-byte swizzle: one copy lands a tile in the slab layout (smem_layout.cuh), rows
    // past the sequence as zeros.
    alignas(64) unsigned char tma_q[128];
    alignas(64) unsigned char tma_k[128];
    alignas(64) unsigned char tma_v[128];
    alignas(64) unsigned char tma_do[128];
};

constexpr int kBwdParamsBytes = 960;
static_assert(sizeof(BwdParams) == kBwdParamsBytes,
              "BwdParams layout changed: update cudaflash/_params.py");
static_assert(offsetof(BwdParams, tma_q) == 448,
              "the maps moved: update _params.BwdParams (maps_pad, BWD_PARAMS_MAPS_OFFSET)");

}  // namespace cudaflash
