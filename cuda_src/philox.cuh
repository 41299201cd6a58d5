// Dropout's random numbers: Philox4x32-10 (Salmon et al., SC 2011), counter-based, so the
// backward regenerates the forward's keep mask from the call's seed instead of storing it.
// The counter of score (query i, key j) of head h of batch entry b: (i / 16, j / 16,
// b * n_heads + h, 4 * (i % 8) + (j % 8) / 2); of the call's eight 16-bit halves (low half of
// word 0 first) it takes the one at 4 * (i % 16 / 8) + 2 * (j % 16 / 8) + j % 2
// (docs/design-notes.md, "Dropout"; tests/_dropout_reference.py computes the same on the host).
// In the m16n8 accumulator layout a thread's 8 scores of a 16 x 16 block share one counter,
// whose last word is the thread's lane; the dK/dV kernel's transposed layout needs two.
#pragma once
#include <cstdint>

namespace cudaflash {

struct Philox4 {
    uint32_t x[4];
};

__device__ __forceinline__ Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2,
                                                 uint32_t c3, uint32_t k0, uint32_t k1) {
    constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // round multipliers
    constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // key bumps
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        const uint32_t hi0 = __umulhi(kM0, c0), lo0 = kM0 * c0;
        const uint32_t hi1 = __umulhi(kM1, c2), lo1 = kM1 * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += kW0;
        k1 += kW1;
    }
    return {{c0, c1, c2, c3}};
}

// Half `half` (0..7) of a Philox call's output, as a 16-bit number.
__device__ __forceinline__ uint32_t philox_half(const Philox4& r, int half) {
    const uint32_t word = r.x[half / 2];
    return half % 2 ? word >> 16 : word & 0xFFFFu;
}

// The keep bits of a thread's 8 scores of the 16 x 16 block (query block q16, key block k16)
// in the m16n8 accumulator layout: bit 4 * r + 2 * n + c is the score of row lane / 4 + 8 * r
// and column 2 * (lane % 4) + 8 * n + c of the block; a score is kept when its number is at
// least `threshold` (round(dropout_p * 65536)).
__device__ __forceinline__ uint32_t dropout_keep_bits(uint64_t seed, int q16, int k16,
                                                      int head_index, int lane,
                                                      uint32_t threshold) {
    const Philox4 r = philox4x32_10(uint32_t(q16), uint32_t(k16), uint32_t(head_index),
                                    uint32_t(lane), uint32_t(seed), uint32_t(seed >> 32));
    uint32_t bits = 0;
#pragma unroll
    for (int half = 0; half < 8; ++half) bits |= uint32_t(philox_half(r, half) >= threshold) << half;
    return bits;
}

// The same for the dK/dV kernel's transposed layout (rows: keys, columns: queries): bit
// 4 * r + 2 * n + c is the score of key lane / 4 + 8 * r and query 2 * (lane % 4) + 8 * n + c
// of the block. Its 8 scores come from two counters (query % 8 = 2 * (lane % 4) + c), half
// of each call used.
__device__ __forceinline__ uint32_t dropout_keep_bits_transposed(uint64_t seed, int q16, int k16,
                                                                 int head_index, int lane,
                                                                 uint32_t threshold) {
    const int a = lane / 4, b = lane % 4;
    uint32_t bits = 0;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
        const Philox4 r = philox4x32_10(uint32_t(q16), uint32_t(k16), uint32_t(head_index),
                                        uint32_t(4 * (2 * b + c) + a / 2), uint32_t(seed),
                                        uint32_t(seed >> 32));
#pragma unroll
        for (int n = 0; n < 2; ++n)
#pragma unroll
            for (int row = 0; row < 2; ++row)
                bits |= uint32_t(philox_half(r, 4 * n + 2 * row + (a & 1)) >= threshold)
                        << (4 * row + 2 * n + c);
    }
    return bits;
}

// Whether element (nj, e) of an m16n8 accumulator tile is kept, given the keep bits of its
// 16 x 16 blocks (keep[nj / 2]; bit 4 * (e / 2) + 2 * (nj % 2) + e % 2).
template <int kBlocks>
__device__ __forceinline__ bool kept(const uint32_t (&keep)[kBlocks], int nj, int e) {
    return (keep[nj / 2] >> (4 * (e / 2) + 2 * (nj % 2) + e % 2)) & 1u;
}

}  // namespace cudaflash
