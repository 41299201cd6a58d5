// BwdParams: the one argument of every cudaflash backward kernel (cuda_src/flash_bwd.cu),
// passed by value as `const __grid_constant__ BwdParams`. Mirrored field for field by
// cudaflash/_params.py (BwdParams); the size is checked on both sides.
#pragma once
#include <cstdint>

namespace cudaflash {

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

    // Strides in elements (the last dimension is contiguous).
    int64_t q_batch_stride, q_seq_stride, q_head_stride;
    int64_t k_batch_stride, k_seq_stride, k_head_stride;
    int64_t v_batch_stride, v_seq_stride, v_head_stride;
    int64_t o_batch_stride, o_seq_stride, o_head_stride;
    int64_t do_batch_stride, do_seq_stride, do_head_stride;
    int64_t dq_batch_stride, dq_seq_stride, dq_head_stride;
    int64_t dk_batch_stride, dk_seq_stride, dk_head_stride;
    int64_t dv_batch_stride, dv_seq_stride, dv_head_stride;
    int64_t lse_batch_stride, lse_head_stride;

    // Sizes, as in Params.
    int32_t batch;
    int32_t n_heads;
    int32_t n_heads_k;
    int32_t seqlen_q;
    int32_t seqlen_k;
    int32_t is_causal;

    float softmax_scale;
    float scale_log2;  // softmax_scale * log2(e)
};

constexpr int kBwdParamsBytes = 320;
static_assert(sizeof(BwdParams) == kBwdParamsBytes,
              "BwdParams layout changed: update cudaflash/_params.py");

}  // namespace cudaflash
