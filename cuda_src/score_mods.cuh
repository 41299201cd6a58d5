// What the *_scoremod entries do to a score beyond softmax_scale, each switched on at run time
// by its Params/BwdParams fields: softcapping (softcap_pre != 0: the forward's
// OnlineSoftmax::softcap, the backward's softcap_slope) and ALiBi (alibi_slopes != null).
//
// ALiBi in the kernels' units: a kernel holds raw scores s (or their tanh when softcapping)
// and exponentiates s * scale_log2 (base 2), so flash-attn's bias -slope * |offset| on the
// scaled score (offset = key - (row + len_k - len_q), the key's distance from its row's
// diagonal) is added to s as -coefficient * |offset|, coefficient = slope * alibi_scale
// (= slope * log2(e) / scale_log2, set by the host). One FADD (the offset, a float: exact
// below 2^24 keys) and one FFMA (|offset| is an operand modifier) per score.
#pragma once
#include <cstdint>

namespace cudaflash {

// The ALiBi coefficient of query head `head` of batch entry `batch`, or 0 without ALiBi
// (Params or BwdParams: alibi_slopes, alibi_batch_stride, alibi_scale).
template <class P>
__device__ __forceinline__ float alibi_coefficient(const P& p, int batch, int head) {
    if (p.alibi_slopes == nullptr) return 0.f;
    return p.alibi_slopes[int64_t(batch) * p.alibi_batch_stride + head] * p.alibi_scale;
}

// The ALiBi bias of a score whose key is `offset` keys from its row's diagonal.
__device__ __forceinline__ float alibi_bias(float coefficient, float offset) {
    return -coefficient * fabsf(offset);
}

}  // namespace cudaflash
