// cudaflash forward: O = softmax(scale * Q K^T + mask) V, FlashAttention-2 style.
//
// q: (batch, seqlen_q, n_heads, d_head), k/v: (batch, seqlen_k, n_heads_k, d_head), any strides
// with a contiguous last dim; o like q; lse (batch, n_heads, seqlen_q) float32. Or a packed
// batch of sequences of different lengths (Params::cu_seqlens_q), each one batch entry here.
// One CTA computes B_r query rows of one (batch, head): grid (ceil(seqlen_q / B_r), n_heads,
// batch). It streams K/V blocks of B_c keys through shared memory (last block first unless
// the config says otherwise: kv_reverse), keeping S,
// P and the O accumulator in registers. Tails of both sequences are masked here; causal masking
// is bottom-right aligned (query i sees keys j <= i + seqlen_k - seqlen_q), a sliding window
// bounds the keys of each row on both sides (Params::window_left/right), and blocks no row of
// the CTA sees are never loaded.
//
// Split-KV, for grids too small to fill the GPU (decoding, one long sequence): the module also
// exports cudaflash_fwd_split, the same kernel over one run of a query block's KV blocks per
// CTA (grid.z = batch * n_splits), writing float32 partial results, and cudaflash_combine,
// which merges them (params.cuh). Separate entries, so the plain kernel pays nothing for it.
// Likewise the score modifiers (score_mods.cuh): flash-attn's softcap, scores squashed to
// cap * tanh(score / cap) (cudaflash_fwd_softcap and cudaflash_fwd_split_softcap, which also
// add ALiBi's distance bias when Params::alibi_slopes is set), and ALiBi alone
// (cudaflash_fwd_alibi, cudaflash_fwd_split_alibi).
//
// The config (tile sizes, copy/load strategies) comes from -D macros: kernel_config.cuh. A
// warp_specialized config runs fwd_warp_specialized.cuh's kernel in both forward entries.
#include "copy.cuh"
#include "fwd_epilogue.cuh"
#include "fwd_range.cuh"
#include "fwd_warp_specialized.cuh"
#include "gemm.cuh"
#include "kernel_config.cuh"
#include "params.cuh"
#include "softmax.cuh"
#include "warpgroup_gemm.cuh"

#include <type_traits>

namespace cudaflash {

template <class C, bool kSplit, bool kSoftcap, bool kAlibi, bool kKvcache,
          bool kDropout = false>
__device__ __forceinline__ void flash_fwd(const Params& p) {
    using elem_t = typename C::elem_t;
    constexpr int kM = C::kMTiles;

    // wgmma applies the 128-byte swizzle to absolute shared addresses, so its tiles must start
    // on the swizzle period, 1024 bytes (every tile below is a multiple of 1024 bytes long).
    extern __shared__ __align__(C::kWgmma ? 1024 : 128) unsigned char smem[];
    elem_t* sQ = reinterpret_cast<elem_t*>(smem);  // (B_r, d_head); holds O at the end
    elem_t* sK = sQ + C::kBr * C::kDHead;          // (B_c, d_head)
    elem_t* sV = sK + C::kBc * C::kDHead;          // (B_c, d_head)
    // TMA loads (Params::tma_loads; wgmma configs with eager loads, whole calls without cache
    // addressing): thread 0 issues one copy per tile, whose bytes complete the tile's mbarrier
    // (after the tiles: the config's barrier bytes), and every thread waits on it where the
    // cp.async path waits for its own copies. The CTA barriers stay: they say every warp is
    // done with a buffer before it is refilled.
    constexpr bool kTmaCapable = C::kWgmma && C::kEagerLoad && !kSplit && !kKvcache;
    const bool tma = kTmaCapable && p.tma_loads != 0;
    uint64_t* tile_full = reinterpret_cast<uint64_t*>(sV + C::kBc * C::kDHead);  // q, k, v
    static_assert(3 * sizeof(uint64_t) <= kWsBarrierBytes, "the barriers fit their room");
    uint32_t k_phase = 0, v_phase = 0;  // parity of each barrier's next completion

    const CtaPlace at = cta_place<kSplit>(p);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;

    const Sequence seq = sequence<kKvcache>(p, at.batch);
    const int q_row0 = at.q_block * C::kBr;
    // Only in a packed batch: this sequence is shorter than the longest (the grid's extent).
    if (q_row0 >= seq.len_q) return;
    const int q_rows = min(C::kBr, seq.len_q - q_row0);
    const HeadTiles<C> tiles = head_tiles<C, kKvcache>(p, at, seq, q_row0);
    const elem_t *q = tiles.q, *k = tiles.k, *v = tiles.v;
    const int band = entry_band<kSoftcap, kAlibi, kDropout>(p, at.batch, at.head);
    const KvRange range = kv_range<C, kSplit>(p, seq, q_row0, q_rows, at.split, band);
    const int kv_begin = range.begin, n_blocks = range.end;
    const int mask_from = range.mask_from, below_keys = range.below_keys;
    const float alibi = kAlibi ? alibi_coefficient(p, at.batch, at.head) : 0.f;
    const uint64_t seed = kDropout ? *p.dropout_seed : 0;

    using QCopy = TileCopy<C, C::kBr>;
    using KvCopy = TileCopy<C, C::kBc>;
    auto load_kv = [&](elem_t* dst, const elem_t* head_base, int64_t seq_stride,
                       int64_t page_stride, int block) {
        if (kTmaCapable && tma) {
            // (Two calls, not one on `is_k ? p.tma_k : p.tma_v`: nvcc 13.0 segfaulted on
            // that form.)
            constexpr uint32_t kTileBytes = C::kBc * C::kDHead * sizeof(elem_t);
            if (threadIdx.x == 0 && dst == sK) {
                mbarrier_arrive_expect_tx(&tile_full[1], kTileBytes);
                tma_load_5d(smem_addr(dst), p.tma_k, &tile_full[1], 0, block * C::kBc, 0,
                            at.head_k, at.batch);
            } else if (threadIdx.x == 0) {
                mbarrier_arrive_expect_tx(&tile_full[2], kTileBytes);
                tma_load_5d(smem_addr(dst), p.tma_v, &tile_full[2], 0, block * C::kBc, 0,
                            at.head_k, at.batch);
            }
        } else if (kKvcache && p.block_table != nullptr) {
            // This batch entry's row of the block table (formed here, not held across the loop:
            // the 255-register configs have no room for it).
            const int32_t* pages = p.block_table + int64_t(at.batch) * p.block_table_stride;
            KvCopy::load_paged(dst, head_base, seq_stride, page_stride, pages, block * C::kBc,
                               p.page_shift, p.n_cache_entries, seq.len_k - block * C::kBc);
        } else {
            KvCopy::load(dst, head_base + int64_t(block) * C::kBc * seq_stride, seq_stride,
                         seq.len_k - block * C::kBc);
        }
    };

    if (kTmaCapable && tma) {
        if (threadIdx.x == 0) {
            tma_prefetch_map(p.tma_q);  // the maps' fetch overlaps the setup
            tma_prefetch_map(p.tma_k);
            tma_prefetch_map(p.tma_v);
            for (int i = 0; i < 3; ++i) mbarrier_init(&tile_full[i], 1);
            fence_proxy_async_shared();  // the copy engine completes on them: see them set
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            mbarrier_arrive_expect_tx(&tile_full[0], C::kBr * C::kDHead * sizeof(elem_t));
            tma_load_5d(smem_addr(sQ), p.tma_q, &tile_full[0], 0, q_row0, 0, at.head, at.batch);
        }
    } else {
        QCopy::load(sQ, q, p.q_seq_stride, q_rows);
        copy_commit<C>();
    }
    // The tile waits: TMA's barriers, or this thread's cp.async groups.
    auto wait_q = [&] {
        if (kTmaCapable && tma) mbarrier_wait(&tile_full[0], 0);  // completes once: parity 0
        else copy_wait_all<C>();
    };
    // K (tile 1) and V (tile 2) complete once per block: each wait flips its parity.
    auto wait_kv = [&](int tile, uint32_t& phase) {
        if (kTmaCapable && tma) {
            mbarrier_wait(&tile_full[tile], phase);
            phase ^= 1;
        } else {
            copy_wait_all<C>();
        }
    };
    // With a specialised first iteration (optimized_softmax), the first block's V is loaded
    // here too: the first QK^T is too short to hide a V load from global memory, while every
    // later V load overlaps the previous block's softmax and PV.
    constexpr bool kPrefetchFirstV = C::kEagerLoad && C::kOptimizedSoftmax;
    // The KV blocks run last to first (kv_reverse, the seed's step 13: the masked ones, tail
    // and diagonal, come first) or first to last.
    if constexpr (C::kEagerLoad) {
        if (n_blocks > kv_begin) {
            const int first_block = C::kKvReverse ? n_blocks - 1 : kv_begin;
            load_kv(sK, k, p.k_seq_stride, p.k_batch_stride, first_block);
            if constexpr (kPrefetchFirstV) {
                load_kv(sV, v, p.v_seq_stride, p.v_batch_stride, first_block);
            }
        }
        copy_commit<C>();
    }

    using Gemm = std::conditional_t<C::kWgmma, WarpgroupGemm<C>, WarpGemm<C>>;
    Gemm gemm(sQ, sK, sV, warp, lane);
    if constexpr (Gemm::kQInRegisters) {
        wait_q();
        __syncthreads();
        gemm.load_q_whole();
    } else if (kTmaCapable && tma) {
        wait_q();  // (cp.async: the first K wait below covers Q's group too)
    }

    float O[kM][C::kOTiles][4];
#pragma unroll
    for (int mi = 0; mi < kM; ++mi)
#pragma unroll
        for (int nd = 0; nd < C::kOTiles; ++nd)
#pragma unroll
            for (int e = 0; e < 4; ++e) O[mi][nd][e] = 0.f;
    OnlineSoftmax<C> softmax;
    float S[kM][C::kSTiles][4];

    auto iteration = [&](int block, auto first_tag) {
        constexpr bool kFirst = decltype(first_tag)::value;
        if constexpr (C::kEagerLoad) {
            // K_block has landed; every warp is done with the previous V.
            wait_kv(1, k_phase);
            __syncthreads();
            if constexpr (!(kPrefetchFirstV && kFirst)) {
                load_kv(sV, v, p.v_seq_stride, p.v_batch_stride, block);  // overlaps QK^T
            }
            copy_commit<C>();
            gemm.qk(S);
            // V_block has landed; every warp is done reading K.
            wait_kv(2, v_phase);
            __syncthreads();
            // The next block's K overlaps softmax + PV.
            if constexpr (C::kKvReverse) {
                if (block > kv_begin) {
                    load_kv(sK, k, p.k_seq_stride, p.k_batch_stride, block - 1);
                }
            } else {
                if (block + 1 < n_blocks) {
                    load_kv(sK, k, p.k_seq_stride, p.k_batch_stride, block + 1);
                }
            }
            copy_commit<C>();
        } else {
            load_kv(sK, k, p.k_seq_stride, p.k_batch_stride, block);
            copy_commit<C>();
            copy_wait_all<C>();
            __syncthreads();
            gemm.qk(S);
            load_kv(sV, v, p.v_seq_stride, p.v_batch_stride, block);
            copy_commit<C>();
            copy_wait_all<C>();
            __syncthreads();
        }
        if constexpr (kSoftcap) OnlineSoftmax<C>::softcap(S, p.softcap_pre);
        float row_terms[kM][2];  // ALiBi's row parts (read only with kAlibi)
        if constexpr (kAlibi) {
            if (!kSoftcap || alibi != 0.f) {  // the *_alibi entries always; softcap's if given
                OnlineSoftmax<C>::alibi(S, row_terms, alibi, block * C::kBc,
                                        q_row0 + warp * C::kRowsPerWarp, seq.len_k - seq.len_q,
                                        p.window_right == 0, lane);
            } else {
                OnlineSoftmax<C>::zero_row_terms(row_terms);
            }
        }
        if (block >= mask_from || block * C::kBc < below_keys)
            OnlineSoftmax<C>::mask(S, block * C::kBc, q_row0 + warp * C::kRowsPerWarp,
                                   seq.len_q, seq.len_k, p.window_left, p.window_right, lane);
        softmax.template update<kFirst, kAlibi>(S, O, OnlineSoftmax<C>::score_scale(p.scale_log2),
                                                row_terms);
        if constexpr (kDropout) {
            // The mask on P packed to 16 bits (dropout_packed): fewer instructions per score,
            // and half the registers of the float P beside the random numbers (the mma.sync
            // configs hold ~255: kStarved).
            uint32_t pf[kM][C::kKvSlices][4];
            pack_a_fragments<C::kBf16>(pf, S);
            OnlineSoftmax<C>::template dropout_packed<!C::kWgmma>(
                pf, seed, (q_row0 + warp * C::kRowsPerWarp) / 16, block * C::kBc / 16,
                at.batch * p.n_heads + at.head, p.dropout_threshold, lane);
            gemm.pv_packed(O, pf);
        } else {
            gemm.pv(O, S);
        }
    };

    if constexpr (C::kKvReverse) {
        int block = n_blocks - 1;
        if constexpr (C::kOptimizedSoftmax) {
            if (block >= kv_begin) iteration(block--, std::true_type{});
        }
        for (; block >= kv_begin; --block) iteration(block, std::false_type{});
    } else {
        int block = kv_begin;
        if constexpr (C::kOptimizedSoftmax) {
            if (block < n_blocks) iteration(block++, std::true_type{});
        }
        for (; block < n_blocks; ++block) iteration(block, std::false_type{});
    }

    float lse[kM][2];
    softmax.finalize(O, lse);
    if constexpr (kDropout) OnlineSoftmax<C>::scale_o(O, p.dropout_scale);
    const int warp_row0 = warp * C::kRowsPerWarp;
    if constexpr (kSplit) {
        copy_wait_all<C>();  // with no KV block here, the Q copy may still be in flight
        store_split_partials<C>(p, O, lse, at, seq, q_row0, warp_row0, lane);
        return;
    }
    store_lse<C>(p, lse, at, seq, q_row0, warp_row0, lane);

    // O goes registers -> shared (over Q) -> global, so the global stores are 16-byte and
    // coalesced. Wait for every copy first: with no visible KV block the Q copy may still fly.
    wait_q();
    __syncthreads();
    o_to_smem<C>(sQ, O, warp_row0, lane);
    __syncthreads();
    elem_t* o = static_cast<elem_t*>(p.o) + at.batch * p.o_batch_stride +
                at.head * p.o_head_stride + int64_t(seq.start_q + q_row0) * p.o_seq_stride;
    QCopy::template store<C::kOStoreCache>(o, sQ, p.o_seq_stride, q_rows);
}

// cudaflash_combine: one warp per query row, grid (ceil(seqlen_q / kCombineRows), n_heads,
// batch). lse = log(sum_s exp(lse_s)); o = sum_s exp(lse_s - lse) * o_s. A row no split saw
// a key for (every lse_s = -inf) gets o = 0 and lse = -inf, as in the unsplit kernel.
constexpr int kCombineRows = 4;
constexpr int kCombineThreads = 32 * kCombineRows;

template <class C>
__device__ __forceinline__ void combine_splits(const Params& p) {
    using elem_t = typename C::elem_t;
    constexpr int kPerLane = C::kDHead / 32;  // 2, 4 or 8 columns per lane
    const int lane = threadIdx.x % 32;
    const int row = blockIdx.x * kCombineRows + threadIdx.x / 32;
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const Sequence seq = sequence(p, batch);
    if (row >= seq.len_q || row >= p.seqlen_q) return;  // seqlen_q: the workspace's rows

    const int64_t split_stride = int64_t(p.batch) * p.n_heads * p.seqlen_q;  // rows per split
    const int64_t row_index = (int64_t(batch) * p.n_heads + head) * p.seqlen_q + row;
    float max_lse = -INFINITY;
    for (int s = 0; s < p.n_splits; ++s)
        max_lse = fmaxf(max_lse, p.lse_accum[s * split_stride + row_index]);
    float sum = 0.f;
    if (max_lse != -INFINITY)
        for (int s = 0; s < p.n_splits; ++s)
            sum += __expf(p.lse_accum[s * split_stride + row_index] - max_lse);
    const float lse = max_lse == -INFINITY ? -INFINITY : max_lse + __logf(sum);

    float acc[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) acc[i] = 0.f;
    if (lse != -INFINITY) {
        for (int s = 0; s < p.n_splits; ++s) {
            const float w = __expf(p.lse_accum[s * split_stride + row_index] - lse);
            if (w == 0.f) continue;  // also the splits that saw no key (lse_s = -inf)
            const float* o_s =
                p.o_accum + (s * split_stride + row_index) * C::kDHead + lane * kPerLane;
#pragma unroll
            for (int i = 0; i < kPerLane; i += 2) {
                const float2 x = *reinterpret_cast<const float2*>(o_s + i);
                acc[i] += w * x.x;
                acc[i + 1] += w * x.y;
            }
        }
    }
    elem_t* o = static_cast<elem_t*>(p.o) + batch * p.o_batch_stride + head * p.o_head_stride +
                int64_t(seq.start_q + row) * p.o_seq_stride + lane * kPerLane;
#pragma unroll
    for (int i = 0; i < kPerLane; i += 2)
        *reinterpret_cast<uint32_t*>(o + i) = pack_2<C::kBf16>(acc[i], acc[i + 1]);
    if (p.lse != nullptr && lane == 0)
        p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + seq.start_q + row] = lse;
}

// cudaflash_append_kv: grid (seqlen_new, n_heads_k, batch), kAppendThreads threads; each
// block copies one new row of k and of v (d_head elements each, 16 bytes per thread and step)
// to its place in the caches, or nowhere when that place is outside them (AppendParams).
constexpr int kAppendThreads = 64;

template <class C>
__device__ __forceinline__ void append_kv(const AppendParams& p) {
    using elem_t = typename C::elem_t;
    constexpr int kChunks = C::kDHead * int(sizeof(elem_t)) / 16;  // 16-byte pieces per row
    const int i = blockIdx.x, head = blockIdx.y, batch = blockIdx.z;
    const int position = p.cache_seqlens[batch] + i;
    if (position < 0 || position >= p.seqlen_cache) return;
    int64_t entry = batch, row = position;
    if (p.block_table != nullptr) {
        entry = p.block_table[int64_t(batch) * p.block_table_stride + position / p.page_size];
        row = position % p.page_size;
    } else if (p.cache_batch_idx != nullptr) {
        entry = p.cache_batch_idx[batch];
    }
    if (entry < 0 || entry >= p.n_cache_entries) return;
    const elem_t* k_src = static_cast<const elem_t*>(p.k_new) + batch * p.k_new_batch_stride +
                          i * p.k_new_seq_stride + head * p.k_new_head_stride;
    const elem_t* v_src = static_cast<const elem_t*>(p.v_new) + batch * p.v_new_batch_stride +
                          i * p.v_new_seq_stride + head * p.v_new_head_stride;
    elem_t* k_dst = static_cast<elem_t*>(p.k_cache) + entry * p.k_batch_stride +
                    row * p.k_seq_stride + head * p.k_head_stride;
    elem_t* v_dst = static_cast<elem_t*>(p.v_cache) + entry * p.v_batch_stride +
                    row * p.v_seq_stride + head * p.v_head_stride;
    for (int c = threadIdx.x; c < 2 * kChunks; c += kAppendThreads) {
        const bool is_k = c < kChunks;
        const int at = (is_k ? c : c - kChunks) * 8;
        const uint4 x = *reinterpret_cast<const uint4*>((is_k ? k_src : v_src) + at);
        *reinterpret_cast<uint4*>((is_k ? k_dst : v_dst) + at) = x;
    }
}

// The forward entries' body: the plain or warp-specialized kernel of this module's config.
template <bool kSplit, bool kSoftcap, bool kAlibi, bool kKvcache, bool kDropout = false>
__device__ __forceinline__ void forward_body(const Params& p) {
    if constexpr (KernelConfig::kWarpSpecialized) {
        flash_fwd_ws<KernelConfig, kSplit, kSoftcap, kAlibi, kKvcache, kDropout>(p);
    } else {
        flash_fwd<KernelConfig, kSplit, kSoftcap, kAlibi, kKvcache, kDropout>(p);
    }
}

// The score modifiers each entry applies: kSoftcap (the *_softcap entries: the tanh, and
// ALiBi when alibi_slopes is given, a warp-uniform branch) or kAlibi alone (the *_alibi
// entries, whose calls always have slopes: no branch). Each is a compile-time choice: as
// runtime branches in the KV loop they made the 255-register kvcache entries spill (8-128
// bytes, also with both bodies behind one branch at the top).
enum class Mods { kNone, kSoftcap, kAlibi };

template <bool kSplit, Mods kMods, bool kKvcache>
__device__ __forceinline__ void forward_entry(const Params& p) {
    if constexpr (kKvcache && !KernelConfig::kServesKvcache) {
        __trap();  // not compiled for this config (kernel_config.cuh, kServesKvcache)
    } else {
        forward_body<kSplit, kMods == Mods::kSoftcap, kMods != Mods::kNone, kKvcache>(p);
    }
}

}  // namespace cudaflash

// The score modifiers (softcapping, ALiBi) have entries of their own (the *_softcap and
// *_alibi ones), so the others carry no trace of them: softcapping as a runtime branch in the
// plain KV loop raised registers (d64 wgmma kernels by up to 56) and made two shipped configs
// spill (docs/perf-log.md, "Softcapping"). flash_attn_with_kvcache's
// cache addressing likewise (the *_kvcache entries: paged K/V, cache_batch_idx, cache_leftpad,
// Params::block_table and the fields after it; in the plain entries their checks alone made
// a 168-register config spill).
// The *_kvcache, *_softcap and *_alibi entries of a config compiled for 3 or more CTAs per
// SM are compiled for 2: their paged copies and score modifiers need a few more registers
// than the 168 that 3 CTAs leave (the d128 ctas3 config's softcapped kvcache entries spilled
// 24 bytes, its softcap entries with ALiBi 8-24).
namespace cudaflash {
constexpr int kRoomyMinCtasPerSm =
    KernelConfig::kMinCtasPerSm < 2 ? KernelConfig::kMinCtasPerSm : 2;
}  // namespace cudaflash

#define CUDAFLASH_FORWARD_ENTRY(name, split, mods, kvcache)                          \
    extern "C" __global__ void __launch_bounds__(                                   \
        cudaflash::KernelConfig::kThreads,                                          \
        kvcache || cudaflash::Mods::mods != cudaflash::Mods::kNone                  \
            ? cudaflash::kRoomyMinCtasPerSm                                         \
            : cudaflash::KernelConfig::kMinCtasPerSm)                               \
        name(const __grid_constant__ cudaflash::Params p) {                         \
        cudaflash::forward_entry<split, cudaflash::Mods::mods, kvcache>(p);          \
    }

CUDAFLASH_FORWARD_ENTRY(cudaflash_fwd, false, kNone, false)
CUDAFLASH_FORWARD_ENTRY(cudaflash_fwd_split, true, kNone, false)
CUDAFLASH_FORWARD_ENTRY(cudaflash_fwd_softcap, false, kSoftcap, false)
CUDAFLASH_FORWARD_ENTRY(cudaflash_fwd_split_softcap, true, kSoftcap, false)
CUDAFLASH_FORWARD_ENTRY(cudaflash_fwd_alibi, false, kAlibi, false)
CUDAFLASH_FORWARD_ENTRY(cudaflash_fwd_split_alibi, true, kAlibi, false)
CUDAFLASH_FORWARD_ENTRY(cudaflash_fwd_kvcache, false, kNone, true)
CUDAFLASH_FORWARD_ENTRY(cudaflash_fwd_split_kvcache, true, kNone, true)
CUDAFLASH_FORWARD_ENTRY(cudaflash_fwd_softcap_kvcache, false, kSoftcap, true)
CUDAFLASH_FORWARD_ENTRY(cudaflash_fwd_split_softcap_kvcache, true, kSoftcap, true)
CUDAFLASH_FORWARD_ENTRY(cudaflash_fwd_alibi_kvcache, false, kAlibi, true)
CUDAFLASH_FORWARD_ENTRY(cudaflash_fwd_split_alibi_kvcache, true, kAlibi, true)

// Dropout (Params::dropout_*): training calls only, so no split or kvcache form; compiled as
// the score-modifier entries are (2 CTAs per SM for ctas >= 3 configs).
extern "C" __global__ void __launch_bounds__(cudaflash::KernelConfig::kThreads,
                                             cudaflash::kRoomyMinCtasPerSm)
    cudaflash_fwd_dropout(const __grid_constant__ cudaflash::Params p) {
    cudaflash::forward_body<false, false, false, false, true>(p);
}

// Dropout with ALiBi (flash-attn combines them; softcapping with dropout it refuses).
extern "C" __global__ void __launch_bounds__(cudaflash::KernelConfig::kThreads,
                                             cudaflash::kRoomyMinCtasPerSm)
    cudaflash_fwd_dropout_alibi(const __grid_constant__ cudaflash::Params p) {
    cudaflash::forward_body<false, false, true, false, true>(p);
}

extern "C" __global__ void __launch_bounds__(cudaflash::kCombineThreads)
    cudaflash_combine(const __grid_constant__ cudaflash::Params p) {
    cudaflash::combine_splits<cudaflash::KernelConfig>(p);
}

extern "C" __global__ void __launch_bounds__(cudaflash::kAppendThreads)
    cudaflash_append_kv(const __grid_constant__ cudaflash::AppendParams p) {
    cudaflash::append_kv<cudaflash::KernelConfig>(p);
}
