// Dropout's random numbers: Philox4x32 with kPhiloxRounds = 7 rounds (Salmon et al., SC
// 2011; below, why 7), counter-based, so the backward regenerates the forward's keep mask
// from the call's seed instead of storing it.
//
// One call gives 16 random bytes, one per score of a 4 x 4 "quad" of a 16 x 16 block:
// queries {2a, 2a+1, 2a+8, 2a+9} x keys {2c, 2c+1, 2c+8, 2c+9} (a, c in 0..3). Score (query i,
// key j) of head h of batch entry b takes
//   counter (i / 16, j / 16, b * n_heads + h, 4 * (i % 8 / 2) + j % 8 / 2),
//   byte 4 * qi + kj with qi = i % 2 + 2 * (i % 16 / 8), kj = j % 2 + 2 * (j % 16 / 8)
// (bytes little-endian within the four 32-bit words; tests/_dropout_reference.py and
// cudaflash/_dropout.py compute the same on the host; docs/design-notes.md, "Dropout").
//
// Why quads: in the m16n8 accumulator layout a thread holds 8 scores of a 16 x 16 block (rows
// lane/4 + {0, 8}, columns 2 (lane%4) + {0, 1, 8, 9}), and in the dK/dV kernel's transposed
// layout (rows: keys) 8 scores of the same quad shape with queries and keys swapped. Either
// way lanes l and l ^ 4 hold the two halves of one quad. So for a pair of blocks each of the
// two lanes computes one call (one block's quad) and they swap the halves the other needs with
// two shuffles: one Philox call per 16 scores in every kernel, no call repeated by a partner.
// A score is kept when its byte is >= the threshold round(dropout_p * 256) (dropout_p
// quantized to 1/256 as flash-attn's kernels do; O and dV are scaled by 1 / (1 - dropout_p),
// as flash-attn scales them).
#pragma once
#include <cstdint>

namespace cudaflash {

struct Philox4 {
    uint32_t x[4];
};

// Seven rounds, not the paper's default of ten: seven is the fewest rounds with which the
// paper's authors found Philox4x32 passing all of TestU01's BigCrush (ten is their margin on
// top), and it is the count flash-attn 2's kernels (and PyTorch's copy of them, SDPA's flash
// backend) draw dropout with. So users get the generator quality they get there, for 30%
// fewer of the multiplies and XORs that bound the dropout kernels (docs/perf-log.md, "The
// dropout forward's cost, profiled"). The host mirrors (cudaflash/_dropout.py,
// tests/_dropout_reference.py) must use the same count.
constexpr int kPhiloxRounds = 7;
constexpr uint32_t kPhiloxM0 = 0xD2511F53u, kPhiloxM1 = 0xCD9E8D57u;  // round multipliers
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u, kPhiloxW1 = 0xBB67AE85u;  // key bumps

// One Philox round on (c0, c1, c2, c3) with round key (k0, k1), where kM0 and kM1 name the
// round multipliers. Spelled once for philox4x32 and philox4x32_row's last rounds; a macro
// because an inline function in its place gave every dropout kernel other register
// allocation (docs/perf-log.md, thirty-third session), and this keeps their machine code.
#define CUDAFLASH_PHILOX_ROUND(c0, c1, c2, c3, k0, k1)              \
    {                                                               \
        const uint32_t hi0 = __umulhi(kM0, c0), lo0 = kM0 * c0;     \
        const uint32_t hi1 = __umulhi(kM1, c2), lo1 = kM1 * c2;     \
        c0 = hi1 ^ c1 ^ k0;                                         \
        c1 = lo1;                                                   \
        c2 = hi0 ^ c3 ^ k1;                                         \
        c3 = lo0;                                                   \
    }

// kRolled: the rounds as a loop (fewer live values for kernels with no registers to spare).
template <bool kRolled = false>
__device__ __forceinline__ Philox4 philox4x32(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3,
                                              uint32_t k0, uint32_t k1) {
    constexpr uint32_t kM0 = kPhiloxM0, kM1 = kPhiloxM1, kW0 = kPhiloxW0, kW1 = kPhiloxW1;
    // The key is bumped after every round, the last bump unused: the same outputs as bumping
    // only between rounds, as Random123's reference and flash-attn's kernels do.
#pragma unroll (kRolled ? 1 : kPhiloxRounds)
    for (int round = 0; round < kPhiloxRounds; ++round) {
        CUDAFLASH_PHILOX_ROUND(c0, c1, c2, c3, k0, k1)
        k0 += kW0;
        k1 += kW1;
    }
    return {{c0, c1, c2, c3}};
}

// A thread's 8 random bytes of one 16 x 16 block, as two words: byte 4 * rr + 2 * n + cc (rr
// in word rr, byte 2 * n + cc) is the score of accumulator row half rr (lane/4 + 8 rr),
// column half n and column parity cc (2 (lane%4) + 8 n + cc), in either layout.
struct KeepBytes {
    uint32_t w[2];
};

// The bytes of the thread's half of a quad, out of the call's 4 words. Forward layout (rows:
// queries): row r = lane/4 takes words r%2 and r%2 + 2 whole. Transposed layout (rows: keys
// b = lane/4): byte b%2 + 2 rr of each word, gathered so that word rr holds them in word
// order. `half` is the lane's parity bit (lane / 4) % 2; the partner asks for the other.
template <bool kTransposed>
__device__ __forceinline__ KeepBytes quad_half(const Philox4& r, int half) {
    if constexpr (!kTransposed) {
        return {{half ? r.x[1] : r.x[0], half ? r.x[3] : r.x[2]}};
    } else {
        // u01 = [w0.s, w1.s, w0.s+2, w1.s+2], u23 likewise (prmt selectors: byte indices of
        // the 8-byte pair {b, a}: 0-3 from the first operand, 4-7 from the second).
        const uint32_t s = uint32_t(half);
        const uint32_t pick = s | ((s + 4) << 4) | ((s + 2) << 8) | ((s + 6) << 12);
        const uint32_t u01 = __byte_perm(r.x[0], r.x[1], pick);
        const uint32_t u23 = __byte_perm(r.x[2], r.x[3], pick);
        return {{__byte_perm(u01, u23, 0x5410), __byte_perm(u01, u23, 0x7632)}};
    }
}

// The random bytes of the thread's 8 scores in each of kN 16 x 16 blocks, block i's call
// being draw(i) (a Philox4, the block's quad). Blocks go in pairs: lane l draws the first
// block of a pair when its `half` = (l / 4) % 2 is 0, the second otherwise, and the two
// lanes swap halves.
template <bool kTransposed, int kN, class Draw>
__device__ __forceinline__ void quad_bytes(KeepBytes (&out)[kN], int half, Draw draw) {
#pragma unroll
    for (int i = 0; i + 1 < kN; i += 2) {
        const Philox4 r = draw(i + half);  // the block this lane draws
        const KeepBytes own = quad_half<kTransposed>(r, half);
        const KeepBytes give = quad_half<kTransposed>(r, half ^ 1);
        KeepBytes got;
        got.w[0] = __shfl_xor_sync(0xFFFFFFFFu, give.w[0], 4);
        got.w[1] = __shfl_xor_sync(0xFFFFFFFFu, give.w[1], 4);
#pragma unroll
        for (int w = 0; w < 2; ++w) {
            out[i].w[w] = half ? got.w[w] : own.w[w];
            out[i + 1].w[w] = half ? own.w[w] : got.w[w];
        }
    }
    if constexpr (kN % 2 == 1)  // an unpaired last block: both lanes draw it
        out[kN - 1] = quad_half<kTransposed>(draw(kN - 1), half);
}

// The quad (counter word 3) of this lane: (i % 8 / 2, j % 8 / 2) = (lane/4 / 2, lane%4)
// forward, (lane%4, lane/4 / 2) transposed.
template <bool kTransposed>
__device__ __forceinline__ uint32_t lane_quad(int lane) {
    return kTransposed ? 4 * (lane & 3) + (lane >> 3) : 4 * (lane >> 3) + (lane & 3);
}

// The random bytes of the thread's 8 scores in each of kN 16 x 16 blocks, block i at (query
// block q16 + i * dq, key block k16 + i * dk) (quad_bytes' pairs).
// kLeanKeys: the key schedule is recomputed in each call (two adds a round) instead of
// being hoisted out of the kernel's loop by the compiler (two registers a round, held
// throughout), for kernels with no registers to spare.
template <bool kTransposed, int kN, bool kLeanKeys = false>
__device__ __forceinline__ void dropout_bytes(KeepBytes (&out)[kN], uint64_t seed, int q16,
                                              int k16, int dq, int dk, int head_index,
                                              int lane) {
    const int half = (lane >> 2) & 1;
    const uint32_t quad = lane_quad<kTransposed>(lane);
    uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
    if constexpr (kLeanKeys) {  // opaque to the compiler: nothing derived from it is hoisted
        asm volatile("mov.b32 %0, %0;" : "+r"(k0));
        asm volatile("mov.b32 %0, %0;" : "+r"(k1));
    }
    quad_bytes<kTransposed>(out, half, [&](int i) {
        return philox4x32<kLeanKeys>(uint32_t(q16 + i * dq), uint32_t(k16 + i * dk),
                                     uint32_t(head_index), quad, k0, k1);
    });
}

// Philox4x32 for calls whose counter words 0, 2 and 3 are fixed and word 1 varies: the
// forward's calls over one warp's 16 query rows (word 0 the query block, 2 the head, 3 the
// lane's quad; word 1 the key block). Of the first four rounds' 8 multiplies and 8 XORs,
// 4 multiplies (round 1's two, round 2's M1 product, round 3's M0 product) and 2 XORs
// (round 1's out2, round 2's out0) do not depend on word 1: `PhiloxRow` holds what they
// leave, computed once per tile, and each call does 22 of the 28 multiplies and XORs, for
// the same outputs (tests/test_gpu_dropout.py checks the kernels' masks against the host's
// full Philox).
struct PhiloxRow {
    uint32_t f0, f2, f4, f5, f7;
};

__device__ __forceinline__ PhiloxRow philox_row(uint32_t c0, uint32_t c2, uint32_t c3,
                                                uint32_t k0, uint32_t k1) {
    constexpr uint32_t kM0 = kPhiloxM0, kM1 = kPhiloxM1, kW0 = kPhiloxW0, kW1 = kPhiloxW1;
    static_assert(kPhiloxRounds >= 4, "philox_row folds the first four rounds");
    PhiloxRow f;
    // Round 1 (key k): out0 = hi(M1 c2) ^ c1 ^ k0 (f0 ^ c1), out1 = lo(M1 c2),
    // out2 = hi(M0 c0) ^ c3 ^ k1, out3 = lo(M0 c0): all but out0 fixed.
    f.f0 = __umulhi(kM1, c2) ^ k0;
    const uint32_t a1 = kM1 * c2, a2 = __umulhi(kM0, c0) ^ c3 ^ k1, a3 = kM0 * c0;
    // Round 2 (key k + W): out0 = hi(M1 a2) ^ a1 ^ k0 and out1 = lo(M1 a2) fixed;
    // out2 = hi(M0 out0') ^ (a3 ^ k1): f2 = a3 ^ k1.
    k0 += kW0;
    k1 += kW1;
    const uint32_t b0 = __umulhi(kM1, a2) ^ a1 ^ k0, b1 = kM1 * a2;
    f.f2 = a3 ^ k1;
    // Round 3 (key k + 2W): out0 = hi(M1 b2) ^ (b1 ^ k0): f4; out2 = (hi(M0 b0) ^ k1) ^ b3:
    // f5; out3 = lo(M0 b0), fixed.
    k0 += kW0;
    k1 += kW1;
    f.f4 = b1 ^ k0;
    f.f5 = __umulhi(kM0, b0) ^ k1;
    const uint32_t c3r = kM0 * b0;
    // Round 4 (key k + 3W): out2 = hi(M0 x0) ^ (c3r ^ k1): f7.
    k1 += kW1;
    f.f7 = c3r ^ k1;
    return f;
}

// philox4x32(c0, c1, c2, c3, k0, k1) from philox_row(c0, c2, c3, k0, k1) and c1. Rounds 5 to
// kPhiloxRounds run here, not as a philox4x32 that starts at round 5 (a kFirstRound template
// argument): that gave the same bytes but other machine code in the two-consumer forwards'
// dropout entries, which ran 2-6% slower at d128 (H200, docs/perf-log.md, thirty-third
// session).
__device__ __forceinline__ Philox4 philox4x32_row(const PhiloxRow& f, uint32_t c1, uint32_t k0,
                                                  uint32_t k1) {
    constexpr uint32_t kM0 = kPhiloxM0, kM1 = kPhiloxM1, kW0 = kPhiloxW0, kW1 = kPhiloxW1;
    const uint32_t a0 = f.f0 ^ c1;                                        // round 1
    const uint32_t b2 = __umulhi(kM0, a0) ^ f.f2, b3 = kM0 * a0;          // round 2
    const uint32_t x0 = __umulhi(kM1, b2) ^ f.f4, x1 = kM1 * b2, x2 = f.f5 ^ b3;  // round 3
    k0 += 3 * kW0;                                                        // round 4
    k1 += 3 * kW1;
    uint32_t c0 = __umulhi(kM1, x2) ^ x1 ^ k0, c1o = kM1 * x2;
    uint32_t c2 = __umulhi(kM0, x0) ^ f.f7, c3 = kM0 * x0;
#pragma unroll
    for (int round = 4; round < kPhiloxRounds; ++round) {
        k0 += kW0;
        k1 += kW1;
        CUDAFLASH_PHILOX_ROUND(c0, c1o, c2, c3, k0, k1)
    }
    return {{c0, c1o, c2, c3}};
}

#undef CUDAFLASH_PHILOX_ROUND

// The forward layout's draws over one warp's 16 query rows (query block q16) of one head:
// philox_row's fixed part, made once per tile, and the call's key. dropout_bytes<false>
// with dq = 0, dk = 1 gives the same bytes.
struct DropoutRow {
    PhiloxRow fixed;
    uint32_t k0, k1;
    DropoutRow() = default;
    __device__ __forceinline__ DropoutRow(uint64_t seed, int q16, int head_index, int lane)
        : fixed(philox_row(uint32_t(q16), uint32_t(head_index), lane_quad<false>(lane),
                           uint32_t(seed), uint32_t(seed >> 32))),
          k0(uint32_t(seed)), k1(uint32_t(seed >> 32)) {}
    // The bytes of key blocks k16, k16 + 1, ..., k16 + kN - 1 (dropout_bytes' layout).
    template <int kN>
    __device__ __forceinline__ void bytes(KeepBytes (&out)[kN], int k16, int lane) const {
        quad_bytes<false>(out, (lane >> 2) & 1, [&](int i) {
            return philox4x32_row(fixed, uint32_t(k16 + i), k0, k1);
        });
    }
};

// The 8-bit threshold at each byte position of a word, so that a byte's test is one AND and
// one compare: kept(byte k of w) = (w & (0xFF << 8 k)) >= (threshold << 8 k).
// `pair`: the threshold in both 16-bit halves, for keep_pair_mask.
struct KeepThreshold {
    uint32_t at[4];
    uint32_t pair;
    __device__ __forceinline__ explicit KeepThreshold(uint32_t threshold) {
#pragma unroll
        for (int k = 0; k < 4; ++k) at[k] = threshold << (8 * k);
        pair = threshold * 0x00010001u;
    }
};

// Whether element (nj, e) of an m16n8 accumulator tile is kept, given the bytes of its 16 x 16
// blocks (bytes[nj / 2]; row half e / 2, column half nj % 2, column parity e % 2).
template <int kBlocks>
__device__ __forceinline__ bool kept(const KeepBytes (&bytes)[kBlocks], const KeepThreshold& t,
                                     int nj, int e) {
    const int k = 2 * (nj % 2) + e % 2;
    return (bytes[nj / 2].w[e / 2] & (0xFFu << (8 * k))) >= t.at[k];
}

// The keep mask of a 16-bit pair whose bytes are bytes 2 n (low half) and 2 n + 1 (high half)
// of `word`, 0xFFFF per kept half. Each byte goes to the low byte of its half (prmt), where,
// read as an fp16 bit pattern, it is a non-negative subnormal ordered as the byte; one packed
// fp16 compare with the threshold in the same form (t.pair) then tests both scores: three
// instructions per two scores with the caller's AND, where a compare and a select took three
// per score. (set without .ftz: the subnormals must compare as themselves.)
__device__ __forceinline__ uint32_t keep_pair_mask(uint32_t word, int n, const KeepThreshold& t) {
    const uint32_t pair = __byte_perm(word, 0u, n ? 0x4342u : 0x4140u);  // [b 2n, 0, b 2n+1, 0]
    uint32_t mask;
    asm("set.ge.u32.f16x2 %0, %1, %2;" : "=r"(mask) : "r"(pair), "r"(t.pair));
    return mask;
}

// P's 16-bit A fragments (pack_a_fragments' layout: register 2 n + rr of slice j holds
// columns 8 n + {0, 1} of row half rr of 16 x 16 block j, low half first) with the dropped
// scores' halves zeroed, for kernels that apply the mask to the packed P (`out` may be `in`).
// Two scores per keep_pair_mask; kPerScore: a test and a select per score instead (kernels
// with no registers to spare: the pair compare's temporaries spilled 4 bytes in an mma.sync
// module at 255 registers).
template <bool kPerScore = false, int kSlices>
__device__ __forceinline__ void keep_packed(uint32_t (&out)[kSlices][4],
                                            const uint32_t (&in)[kSlices][4],
                                            const KeepBytes (&bytes)[kSlices],
                                            const KeepThreshold& t) {
#pragma unroll
    for (int j = 0; j < kSlices; ++j)
#pragma unroll
        for (int reg = 0; reg < 4; ++reg) {  // register 2 n + rr: word rr, bytes 2 n, 2 n + 1
            if constexpr (kPerScore) {
                const int nj = 2 * j + reg / 2, e = 2 * (reg % 2);  // (nj, e), (nj, e + 1)
                const uint32_t low = kept(bytes, t, nj, e) ? 0x0000FFFFu : 0u;
                const uint32_t high = kept(bytes, t, nj, e + 1) ? 0xFFFF0000u : 0u;
                out[j][reg] = in[j][reg] & (low | high);
            } else {
                out[j][reg] = in[j][reg] & keep_pair_mask(bytes[j].w[reg % 2], reg / 2, t);
            }
        }
}

}  // namespace cudaflash
