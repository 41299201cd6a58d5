// The warp-specialized forward kernel on Hopper (config field warp_specialized; sm_90a), the
// FlashAttention-3 structure:
//
//   warpgroup 0, the producer: loads Q, then each KV block's K and V into a ring of kKvStages
//     shared-memory stages, ahead of the consumers by up to the ring's depth, and signals a
//     "full" mbarrier per tile; it reuses a stage once its "empty" mbarrier says every
//     consumer warp is done with it. Where the host gave tensor maps (Params::tma_loads: a
//     padded batch without cache addressing) one thread issues a TMA copy per tile, whose
//     bytes complete the barrier; otherwise (packed batches, paged or indexed caches) its 128
//     threads copy with cp.async, wait for their own copies, fence them for the tensor cores
//     (async proxy) and arrive. It needs few registers and gives the rest away (setmaxnreg).
//   warpgroups 1 and 2 (and 3: n_warps = 12, for d64's short GEMMs), the consumers: 64 query
//     rows each (B_r = 128 or 192), the same softmax and epilogue as flash_fwd. Each step
//     issues Q K^T of this block and P V of the previous one; this block's softmax runs as
//     soon as Q K^T lands, under P V (O's rescale waits for it). Three consumers take turns
//     issuing (named barriers, round robin), so one's GEMMs run while the others compute
//     their softmax; two issue as they get there (kIssueTurns says why).
//
// Why: the 64-row one-warpgroup kernel re-reads each K/V block per 64 rows and spends its
// issue slots on copy addresses next to the softmax (docs/perf-log.md, "v6 profile"); here a
// block serves 128 rows and the addresses are the producer's.
#pragma once
#include "copy.cuh"
#include "fwd_epilogue.cuh"
#include "fwd_range.cuh"
#include "kernel_config.cuh"
#include "params.cuh"
#include "ptx.cuh"
#include "softmax.cuh"
#include "warpgroup_gemm.cuh"

#include <type_traits>

namespace cudaflash {

// Dynamic shared memory after the tiles for the mbarriers (KernelConfig.smem_bytes).
constexpr int kWsBarrierBytes = 128;
// The ALiBi entries (without softcapping) add ALiBi's column part to S inside the Q K^T GEMM:
// one more k16 slice whose A holds each row's signed ALiBi coefficient as three 16-bit terms
// (alibi_column_fragment) and whose B is this table, key column j of the tile in k 0..2 of row
// j ([j, j, j, 0, 0, 0, 0, 0], exact in 16 bits for j < 256), 16 bytes a row, after the
// mbarriers (KernelConfig.alibi_smem_bytes). So a tile that lies on one side of every row's
// diagonal needs no op per score: the row part folds into the row's maximum and exponent
// offset (OnlineSoftmax::alibi_rows). The slice costs 1 / (d_head / 16) more Q K^T.

// The A fragment of a warp's rows for ALiBi's column slice: row i's k 0..2 hold the three
// 16-bit terms of `coefficient` (hi + mid + lo carries it to ~24 bits, the products with the
// integer columns are exact, and the tensor cores add them in fp32), k 3..15 zero. In the
// m16k16 A layout lane t of a quad holds k 2t, 2t + 1 of its rows in registers 0 and 1 (rows
// lane / 4 and + 8; registers 2 and 3 hold k 8..15): this returns register 0 (= register 1).
template <bool kBf16>
__device__ __forceinline__ uint32_t alibi_column_fragment(float coefficient, int lane) {
    auto rounded = [](float x) {  // x rounded to the 16-bit type
        if constexpr (kBf16) {
            return __bfloat162float(__float2bfloat16_rn(x));
        } else {
            return __half2float(__float2half_rn(x));
        }
    };
    const float hi = rounded(coefficient), mid = rounded(coefficient - hi);
    const float lo = coefficient - hi - mid;
    const int t = lane % 4;
    return t == 0 ? pack_2<kBf16>(hi, mid) : t == 1 ? pack_2<kBf16>(lo, 0.f) : 0u;
}
// Whether the column slice can carry `coefficient`: for fp16, within its range with room for
// the rounding of the split (bf16 has float's range; a NaN fails the one-sided test first).
template <bool kBf16>
__device__ __forceinline__ bool alibi_columns_fit(float coefficient) {
    return kBf16 || fabsf(coefficient) < 32768.f;
}
// Registers per thread after setmaxnreg, by consumer warpgroups: two, 128 * 56 + 256 * 224 =
// 64512 of the SM's 65536 (at 40 the producer's copy addresses spilled); three, 128 * 32 +
// 384 * 160 = 65536 (the launch's 128 per thread of 512).
template <int kConsumerGroups>
constexpr int kProducerRegs = kConsumerGroups == 2 ? 56 : 32;
template <int kConsumerGroups>
constexpr int kConsumerRegs = kConsumerGroups == 2 ? 224 : 160;
// The K/V bytes a group of the persistent causal walk may keep in flight (a third of the
// H100's 50 MB L2, which the other traffic and the two L2 halves share).
constexpr int64_t kL2GroupBytes = 16ll << 20;
// Whether the consumer warpgroups take strict turns issuing their GEMMs. The turns only
// order the issue (results do not depend on them). With three (d64's 192-row tile, short
// GEMMs) the round robin keeps the tensor cores fed: without it 2k ran 3% slower. With two
// (d128, d256) each waited every step for the other's issue, a rendezvous that cost more
// than the ordering gave: without it d128 ran 1.5-3% (up to 6% at 8k) faster at 1k-8k and
// d256 the same (H100, same-run A/B; docs/perf-log.md, "Forward issue turns").
template <int kConsumerGroups>
constexpr bool kIssueTurns = kConsumerGroups == 3;
// Named barriers (0 is __syncthreads): the consumers' turns, then each one's epilogue.
constexpr int kTurnBarrier = 1;  // + consumer warpgroup (its turn: 1..groups); then per consumer
                                 // warpgroup its epilogue's (kTurnBarrier + groups + wg)
// A turn barrier's threads: its warpgroup, which waits, and the one before, which arrives.
constexpr int kTurnThreads = 256;

template <class C, bool kSplit, bool kSoftcap, bool kAlibi, bool kKvcache,
          bool kDropout = false>
__device__ __forceinline__ void flash_fwd_ws(const Params& p) {
    using elem_t = typename C::elem_t;
    static_assert(C::kWarpSpecialized && C::kWgmma && (C::kWarps == 8 || C::kWarps == 12) &&
                      C::kMTiles == 1,
                  "two or three consumer warpgroups of 64 rows on wgmma");
    constexpr int kStages = C::kKvStages;
    constexpr int kGroups = C::kWarps / 4;  // consumer warpgroups
    constexpr int kWarpgroupRows = 64;
    constexpr uint32_t kStageBytes = C::kBc * C::kDHead * sizeof(elem_t);

    extern __shared__ __align__(1024) unsigned char smem[];
    // (B_r, d_head) each; a tile's Q buffer holds its O at the end. Persistent configs have
    // two, so the next tile's Q loads while this one's epilogue reads O.
    elem_t* sQ = reinterpret_cast<elem_t*>(smem);
    elem_t* sK = sQ + C::kQBuffers * C::kBr * C::kDHead;  // kStages x (B_c, d_head)
    elem_t* sV = sK + kStages * C::kBc * C::kDHead;       // kStages x (B_c, d_head)
    // The mbarriers, after the tiles (kBarrierBytes; cudaflash.config counts them). full: the
    // producer's 128 threads arrive when their copies of the tile have landed (cp.async), or
    // its one TMA thread arrives with the tile's byte count, which the copy counts down.
    // empty: lane 0 of each consumer warp arrives when its warpgroup's GEMM has read it (a Q
    // buffer: when the tile's epilogue has read its O back).
    uint64_t* bars = reinterpret_cast<uint64_t*>(sV + kStages * C::kBc * C::kDHead);
    uint64_t* q_full = bars;       // per Q buffer
    uint64_t* q_empty = bars + 2;  // per Q buffer (persistent tiles only)
    uint64_t* k_full = bars + 4;
    uint64_t* v_full = k_full + kStages;
    uint64_t* k_empty = v_full + kStages;
    uint64_t* v_empty = k_empty + kStages;
    // Persistent causal calls (Params::tile_counter): each Q buffer's tile, written by the
    // producer before its q_full arrival (so the consumers' wait sees it); n_tiles: no more.
    int* tile_of_buffer = reinterpret_cast<int*>(v_empty + kStages);
    static_assert(8 * (4 + 4 * kStages) + (C::kPersistent ? 4 * C::kQBuffers : 0) <=
                      kWsBarrierBytes,
                  "the barriers (and the persistent kernel's tile slots) fit their bytes");

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;

    // TMA loads (Params::tma_loads): one producer thread fills each tile, so a "full"
    // barrier takes its one arrival (with the tile's bytes as the transaction count) instead
    // of the 128 cp.async threads'. The host sets them for whole, unsplit calls only; the
    // split and cache-addressing entries compile without them.
    const bool tma = !kSplit && !kKvcache && p.tma_loads != 0;
    // ALiBi's column part in the Q K^T GEMM (the table above): not with softcapping (the
    // bias adds to the capped score), nor in the three-consumer dropout entry (160
    // registers: it spilled 8 bytes).
    constexpr bool kAlibiColumns = kAlibi && !kSoftcap && !(kDropout && kGroups == 3);
    // Its table of key columns, after the mbarriers.
    elem_t* alibi_columns = reinterpret_cast<elem_t*>(reinterpret_cast<unsigned char*>(bars) +
                                                      kWsBarrierBytes);
    // The CTA's tiles: its own grid place, or with persistent CTAs (only where the host gave
    // tensor maps: a padded batch, so every tile has rows) tiles blockIdx.x, + gridDim.x, ...
    // of the batch's (query block, head, batch entry) tiles, query blocks fastest so that
    // neighbouring CTAs share K/V in L2 as the grid's do.
    const bool persistent = C::kPersistent && tma;
    // Causal persistent calls: tiles after the first from the host's counter, so that a CTA
    // that drew short tiles draws more. They come in groups of (head, batch entry) pairs
    // whose K/V fit a share of L2 (kL2GroupBytes), each group's tiles longest first (query
    // block slowest, then pair): the pairs in flight share K/V in L2, and the draws that end
    // a group, the call's last ones too, are its short tiles (a short tail).
    const bool dynamic = persistent && p.tile_counter != nullptr;
    const int n_q_blocks = (p.seqlen_q + C::kBr - 1) / C::kBr;
    const int pairs = p.n_heads * p.batch;
    const int n_tiles = persistent ? n_q_blocks * pairs : 1;
    const int first_tile = persistent ? int(blockIdx.x) : 0;
    const int tile_stride = persistent ? int(gridDim.x) : 1;
    const int64_t pair_kv_bytes = 2ll * p.seqlen_k * C::kDHead * sizeof(elem_t);
    const int group_pairs = int(max(int64_t(1), min(int64_t(pairs), kL2GroupBytes / pair_kv_bytes)));
    auto place_of = [&](int t) -> CtaPlace {
        if (!persistent) return cta_place<kSplit>(p);
        if (dynamic) {
            const int first_pair = t / (group_pairs * n_q_blocks) * group_pairs;
            const int in_group = min(group_pairs, pairs - first_pair);
            const int i = t - first_pair * n_q_blocks;  // within the group
            const int pair = first_pair + i % in_group;
            const int head = pair % p.n_heads;
            return {n_q_blocks - 1 - i / in_group, head, pair / p.n_heads, 0,
                    head / (p.n_heads / p.n_heads_k)};
        }
        const int block = t % n_q_blocks, head = (t / n_q_blocks) % p.n_heads;
        // Causal: a head's last query blocks (the most KV blocks) first, as cta_place.
        return {p.is_causal ? n_q_blocks - 1 - block : block, head,
                t / n_q_blocks / p.n_heads, 0, head / (p.n_heads / p.n_heads_k)};
    };
    if (!persistent) {  // a CTA past its sequence's rows (packed batches): the whole CTA
        const CtaPlace at = place_of(0);
        if (at.q_block * C::kBr >= sequence<kKvcache>(p, at.batch).len_q) return;
    }

    if (threadIdx.x == 0) {
        if (tma) {  // the maps' fetch overlaps the setup (short CTAs waited for it)
            tma_prefetch_map(p.tma_q);
            tma_prefetch_map(p.tma_k);
            tma_prefetch_map(p.tma_v);
        }
        const int fill_arrivals = tma ? 1 : 128;
#pragma unroll
        for (int b = 0; b < 2; ++b) {
            mbarrier_init(&q_full[b], fill_arrivals);
            mbarrier_init(&q_empty[b], C::kWarps);
        }
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
            mbarrier_init(&k_full[s], fill_arrivals);
            mbarrier_init(&v_full[s], fill_arrivals);
            mbarrier_init(&k_empty[s], C::kWarps);
            mbarrier_init(&v_empty[s], C::kWarps);
        }
        // The copy engine (the async proxy) completes transactions on the "full" barriers:
        // it must see them initialised (the CUDA guide's TMA pattern).
        if (tma) fence_proxy_async_shared();
    }
    if constexpr (kAlibiColumns) {
        static_assert(C::kBc <= 128, "a thread per table row (threads 0..B_c - 1: the producer)");
        if (threadIdx.x < C::kBc) {
            const float j = float(threadIdx.x);
            const uint4 row = {pack_2<C::kBf16>(j, j), pack_2<C::kBf16>(j, 0.f), 0u, 0u};
            reinterpret_cast<uint4*>(alibi_columns)[threadIdx.x] = row;
            // The tensor cores read it through the async proxy.
            fence_proxy_async_shared();
        }
    }
    __syncthreads();

    if (warp < 4) {
        // ---- producer -----------------------------------------------------------------
        warpgroup_reg_dealloc<kProducerRegs<kGroups>>();
        if (tma) {
            // One thread issues every copy: a tile is one TMA box (all its slabs), so the
            // addresses are the copy engine's, not 128 threads' (docs/perf-log.md, "TMA").
            if (threadIdx.x != 0) return;
            int g = 0;  // KV steps so far, over the CTA's tiles: the ring's position
            int t = first_tile;
            for (int j = 0;; ++j) {  // j: the CTA's tiles so far
                if (!dynamic && t >= n_tiles) break;
                const int qb = j % C::kQBuffers;
                // (a fresh barrier passes the wait for the phase before its first)
                mbarrier_wait(&q_empty[qb], ((j / C::kQBuffers) & 1) ^ 1);
                if (dynamic) {
                    // The consumers learn the tile (or the end) from the buffer's slot, which
                    // the q_full arrival publishes; the end's arrival carries no copy.
                    tile_of_buffer[qb] = t;
                    if (t >= n_tiles) {
                        mbarrier_arrive(&q_full[qb]);
                        break;
                    }
                }
                // The next tile, drawn now so that the atomic's latency passes under this
                // tile's copies.
                const int next = dynamic ? int(gridDim.x) + atomicAdd(p.tile_counter, 1)
                                         : t + tile_stride;
                const CtaPlace at = place_of(t);
                const Sequence seq = sequence<kKvcache>(p, at.batch);
                const int q_row0 = at.q_block * C::kBr;
                const int band = entry_band<kSoftcap, kAlibi, kDropout>(p, at.batch, at.head);
                const KvRange range =
                    kv_range<C, kSplit>(p, seq, q_row0, min(C::kBr, seq.len_q - q_row0), 0, band);
                const int n_steps = max(range.end - range.begin, 0);
                mbarrier_arrive_expect_tx(&q_full[qb], C::kBr * C::kDHead * sizeof(elem_t));
                tma_load_5d(smem_addr(sQ + qb * C::kBr * C::kDHead), p.tma_q, &q_full[qb], 0,
                            q_row0, 0, at.head, at.batch);
                for (int i = 0; i < n_steps; ++i, ++g) {
                    const int stage = g % kStages;
                    const int reuse = ((g / kStages) & 1) ^ 1;  // parity of its last release
                    const int block = C::kKvReverse ? range.end - 1 - i : range.begin + i;
                    const int row = block * C::kBc;
                    mbarrier_wait(&k_empty[stage], reuse);
                    mbarrier_arrive_expect_tx(&k_full[stage], kStageBytes);
                    tma_load_5d(smem_addr(sK + stage * C::kBc * C::kDHead), p.tma_k,
                                &k_full[stage], 0, row, 0, at.head_k, at.batch);
                    mbarrier_wait(&v_empty[stage], reuse);
                    mbarrier_arrive_expect_tx(&v_full[stage], kStageBytes);
                    tma_load_5d(smem_addr(sV + stage * C::kBc * C::kDHead), p.tma_v,
                                &v_full[stage], 0, row, 0, at.head_k, at.batch);
                }
                t = next;
            }
            return;
        }
        // cp.async: one tile (persistent CTAs take the TMA path only).
        const CtaPlace at = place_of(0);
        const Sequence seq = sequence<kKvcache>(p, at.batch);
        const int q_row0 = at.q_block * C::kBr;
        const int q_rows = min(C::kBr, seq.len_q - q_row0);
        const int band = entry_band<kSoftcap, kAlibi, kDropout>(p, at.batch, at.head);
        const KvRange range = kv_range<C, kSplit>(p, seq, q_row0, q_rows, at.split, band);
        const int n_steps = max(range.end - range.begin, 0);
        auto block_of = [&](int i) { return C::kKvReverse ? range.end - 1 - i : range.begin + i; };
        const unsigned tid = threadIdx.x;
        const HeadTiles<C> tiles = head_tiles<C, kKvcache>(p, at, seq, q_row0);
        load_rows_by<C, C::kBr, C::kCopyThreads>(sQ, tiles.q, p.q_seq_stride, q_rows, tid);
        cp_async_commit();
        // Each tile's copies are one cp.async group; waiting for all but the newest group
        // lands the previous tile (its "full" barrier gets the arrival) while this one flies.
        uint64_t* landed = &q_full[0];  // the "full" barrier of the previous group's tile
        auto load_stage = [&](elem_t* dst, const elem_t* head_base, int64_t seq_stride,
                              int64_t page_stride, int block, uint64_t* empty, int reuse,
                              uint64_t* full) {
            mbarrier_wait(empty, reuse);
            const elem_t* src = head_base + int64_t(block) * C::kBc * seq_stride;
            const int rows = seq.len_k - block * C::kBc;
            // Only a sequence's last key block can be short: it takes the general copy.
            if (kKvcache && p.block_table != nullptr) {
                const int32_t* pages = p.block_table + int64_t(at.batch) * p.block_table_stride;
                if ((C::kBc >> p.page_shift) == 0 && rows >= C::kBc) {  // one page, full
                    load_full_rows_by<C, C::kBc, C::kCopyThreads>(
                        dst, paged_tile<C::kBc>(head_base, pages, block * C::kBc, p.page_shift,
                                                p.n_cache_entries, page_stride, seq_stride),
                        seq_stride, tid);
                } else if (rows >= C::kBc) {  // full, over several pages
                    load_full_paged_rows_by<C, C::kBc, C::kCopyThreads>(
                        dst, head_base, seq_stride, page_stride, pages, block * C::kBc,
                        p.page_shift, p.n_cache_entries, tid);
                } else {
                    load_paged_rows_by<C, C::kBc, C::kCopyThreads>(
                        dst, head_base, seq_stride, page_stride, pages, block * C::kBc,
                        p.page_shift, p.n_cache_entries, rows, tid);
                }
            } else if (rows >= C::kBc) {
                load_full_rows_by<C, C::kBc, C::kCopyThreads>(dst, src, seq_stride, tid);
            } else {
                load_rows_by<C, C::kBc, C::kCopyThreads>(dst, src, seq_stride, rows, tid);
            }
            cp_async_commit();
            cp_async_wait<1>();
            fence_proxy_async_shared();
            mbarrier_arrive(landed);
            landed = full;
        };
        for (int i = 0; i < n_steps; ++i) {
            const int stage = i % kStages;
            const int reuse = ((i / kStages) & 1) ^ 1;  // parity of the stage's last release
            const int block = block_of(i);
            load_stage(sK + stage * C::kBc * C::kDHead, tiles.k, p.k_seq_stride,
                       p.k_batch_stride, block, &k_empty[stage], reuse, &k_full[stage]);
            load_stage(sV + stage * C::kBc * C::kDHead, tiles.v, p.v_seq_stride,
                       p.v_batch_stride, block, &v_empty[stage], reuse, &v_full[stage]);
        }
        cp_async_wait<0>();
        fence_proxy_async_shared();
        mbarrier_arrive(landed);
        return;
    }

    // ---- consumers ----------------------------------------------------------------------
    warpgroup_reg_alloc<kConsumerRegs<kGroups>>();
    const int cwarp = warp - 4;                 // consumer warp: rows 16 * cwarp of the CTA
    const int wg = cwarp / 4;                   // consumer warpgroup
    const int row0 = cwarp * C::kRowsPerWarp;   // this warp's first row in the CTA's tile
    const float scale = OnlineSoftmax<C>::score_scale(p.scale_log2);
    const uint64_t seed = kDropout ? *p.dropout_seed : 0;

    int g = 0;  // KV steps so far, over the CTA's tiles: the ring's position
    int t = first_tile;
    for (int j = 0;; ++j) {  // j: the CTA's tiles so far
        const int qb = j % C::kQBuffers;
        if (dynamic) {
            mbarrier_wait(&q_full[qb], (j / C::kQBuffers) & 1);
            t = tile_of_buffer[qb];
        }
        if (t >= n_tiles) break;
        const CtaPlace at = place_of(t);
        const Sequence seq = sequence<kKvcache>(p, at.batch);
        const int q_row0 = at.q_block * C::kBr;
        const int q_rows = min(C::kBr, seq.len_q - q_row0);
        const int band = entry_band<kSoftcap, kAlibi, kDropout>(p, at.batch, at.head);
        const KvRange range = kv_range<C, kSplit>(p, seq, q_row0, q_rows, at.split, band);
        const int n_steps = max(range.end - range.begin, 0);
        // The KV block of step i: last to first (kv_reverse) or first to last.
        auto block_of = [&](int i) { return C::kKvReverse ? range.end - 1 - i : range.begin + i; };
        // This warpgroup's own 64 rows may see fewer of the tile's blocks: in 192-row tiles
        // over 128-key blocks the causal diagonal (or a right window bound) ends a block
        // earlier for the first warpgroup or two, and in a tail tile a warpgroup may have no
        // rows (or no row that sees a key). It skips such a leading step, or the whole tile,
        // passing the skipped steps' turns and ring stages on (pass). Skips take those two
        // shapes only (rows 128 apart end at most one block apart); blocks that a left window
        // bound hides from this warpgroup's rows after its last are computed and masked, as
        // before. The masks keep the tile's range: a per-warpgroup test inside the step loop
        // costs what the skips save (below). Only with three consumer warpgroups: with two
        // (B_r = 128 over 128- or 64-key blocks) only a tail tile's second warpgroup can skip,
        // and the d128 kernel ran 0-3% slower with it (H100). Not in the softcap and ALiBi
        // entries: their consumers spilled with it at 160 registers.
        constexpr bool kOwnRanges = kGroups == 3 && !kSoftcap && !kAlibi;
        int skip = 0;  // 0: every step, 1: all but the first, 2: none
        if constexpr (kOwnRanges) {
            const int own_rows = min(kWarpgroupRows, q_rows - wg * kWarpgroupRows);
            const KvRange own =
                own_rows > 0
                    ? kv_range<C, false>(p, seq, q_row0 + wg * kWarpgroupRows, own_rows, 0)
                    : KvRange{0, 0, 0, 0};
            const int lo = max(range.begin, own.begin), hi = min(range.end, own.end);
            const int first = C::kKvReverse ? range.end - hi : lo - range.begin;
            skip = lo >= hi ? 2 : first == 1 ? 1 : 0;
        }
        elem_t* sQt = sQ + qb * C::kBr * C::kDHead;  // this tile's Q, then its O
        WarpgroupGemm<C> gemm(sQt, sK, sV, cwarp, lane);

        float O[1][C::kOTiles][4];
#pragma unroll
        for (int nd = 0; nd < C::kOTiles; ++nd)
#pragma unroll
            for (int e = 0; e < 4; ++e) O[0][nd][e] = 0.f;
        float S[1][C::kSTiles][4];
        uint32_t P[1][C::kKvSlices][4];  // the previous block's probabilities, 16-bit
        float(&s_acc)[C::kSTiles * 4] = reinterpret_cast<float(&)[C::kSTiles * 4]>(S);
        float(&o_acc)[C::kOTiles * 4] = reinterpret_cast<float(&)[C::kOTiles * 4]>(O);
        OnlineSoftmax<C> softmax;
        const float alibi = kAlibi ? alibi_coefficient(p, at.batch, at.head) : 0.f;
        // ALiBi's one-sided forms serve heads that are not too steep (alibi_one_sided_fits);
        // kAlibiColumns: this warp's A fragment of the column slice (alibi_column_fragment).
        // A head either test fails takes the per-score form on every tile.
        const bool one_sided = kAlibi && OnlineSoftmax<C>::alibi_one_sided_fits(alibi, scale);
        const bool columns_fit = kAlibiColumns && one_sided && alibi_columns_fit<C::kBf16>(alibi);
        const uint32_t alibi_a = kAlibiColumns ? alibi_column_fragment<C::kBf16>(alibi, lane) : 0u;
        const uint32_t alibi_a_negated = alibi_a ^ 0x80008000u;
        const uint32_t alibi_table = kAlibiColumns ? smem_addr(alibi_columns) : 0u;
        // kAlibiColumns: the blocks this warp's rows see wholly left of their diagonals are
        // those below alibi_left_end, wholly right those from alibi_right_begin
        // (OnlineSoftmax::alibi_side's test, made once per tile: per step it cost ~15
        // instructions); none where the slice cannot serve the head.
        int alibi_left_end = 0, alibi_right_begin = INT_MAX;
        if (kAlibiColumns && columns_fit) {
            const int first_diagonal = q_row0 + row0 + seq.len_k - seq.len_q;
            const int last_diagonal = first_diagonal + C::kRowsPerWarp - 1;
            const bool keys_left = p.window_right == 0;  // (no visible key right of a diagonal)
            alibi_left_end = keys_left ? INT_MAX : max(first_diagonal + 1, 0) / C::kBc;
            alibi_right_begin =
                keys_left ? INT_MAX : (max(last_diagonal, 0) + C::kBc - 1) / C::kBc;
        }
        // kDropout with two consumer warpgroups (kEarlyKeep, below): the Philox work that
        // every draw of this warp's rows in the tile shares (DropoutRow).
        constexpr bool kEarlyKeep = kGroups == 2;
        const DropoutRow drop_row =
            kDropout && kEarlyKeep
                ? DropoutRow(seed, (q_row0 + row0) / 16, at.batch * p.n_heads + at.head, lane)
                : DropoutRow();

        mbarrier_wait(&q_full[qb], (j / C::kQBuffers) & 1);
        // With turns, consumer warpgroup 0 issues first: the last one lets it through once.
        // Each turn then hands over to the next (the last one's last hand-over has no taker and
        // is skipped, so every arrival meets a sync; so it is per tile).
        constexpr bool kTurns = kIssueTurns<kGroups>;
        if (kTurns && wg == kGroups - 1 && n_steps > 0)
            named_barrier_arrive(kTurnBarrier + 0, kTurnThreads);
        // Step i's hand-over to the next warpgroup (a step computed or passed alike).
        auto hand_turn_on = [&](int i) {
            if (kTurns && (wg != kGroups - 1 || i < n_steps - 1))
                named_barrier_arrive(kTurnBarrier + (wg + 1) % kGroups, kTurnThreads);
        };

        // Step i: Q K^T of block i and P V of block i - 1 are issued together (in this
        // warpgroup's turn, where there are turns), as two wgmma groups; the softmax of block
        // i starts as soon as the first lands and overlaps the second, which still adds into O,
        // so O's rescale waits for it. The first step has no previous block (kFirst: a
        // compile-time fact, so that no wgmma sits on a branch, which makes ptxas serialize them
        // all). The ring's stages and phases count the CTA's steps over all its tiles (g + i).
        auto step = [&](int i, auto first_tag) {
            constexpr bool kFirst = decltype(first_tag)::value;
            const int gi = g + i;
            const int stage = gi % kStages;
            const int prev = (gi + kStages - 1) % kStages;  // the previous block's stage
            mbarrier_wait(&k_full[stage], (gi / kStages) & 1);
            if (!kFirst) mbarrier_wait(&v_full[prev], ((gi - 1) / kStages) & 1);
            if (kTurns) named_barrier_sync(kTurnBarrier + wg, kTurnThreads);
            // kAlibiColumns: the side of the diagonal this warp's rows see the block on (+1
            // left, -1 right, 0 across: OnlineSoftmax::alibi_side), and the column slice's A:
            // the coefficient signed by the side, or 0 for a block across the diagonal (the
            // slice is issued on every block: a wgmma under a branch makes ptxas serialize
            // them all).
            [[maybe_unused]] int alibi_side = 0;
            [[maybe_unused]] uint32_t column_a[4] = {0u, 0u, 0u, 0u};
            if constexpr (kAlibiColumns) {
                // In bit operations, not selects: ptxas compiled the selects of the three-
                // consumer kernel as branches, and a register operand of a wgmma defined on a
                // path it cannot prove warp-uniform serializes every wgmma (C7520).
                const int b = block_of(i);
                const uint32_t left = b < alibi_left_end, right = b >= alibi_right_begin;
                alibi_side = int(left) - int(right);  // (never both: alibi_right_begin)
                column_a[0] = column_a[1] =
                    (alibi_a & (0u - left)) | (alibi_a_negated & (0u - right));
                wgmma_fence_operands(column_a);
            }
            wgmma_fence_operands(s_acc);
            if (!kFirst) wgmma_fence_operands(o_acc);
            wgmma_fence();
            gemm.qk_issue(s_acc, stage * kStageBytes);
            if constexpr (kAlibiColumns) gemm.column_issue(s_acc, column_a, alibi_table);
            wgmma_commit();
            if constexpr (!kFirst) {
                gemm.pv_issue(o_acc, P[0], prev * kStageBytes);
                wgmma_commit();
            }
            hand_turn_on(i);
            wgmma_wait<kFirst ? 0 : 1>();  // Q K^T has landed
            wgmma_fence_operands(s_acc);
            if (lane == 0) mbarrier_arrive(&k_empty[stage]);
            const int block = block_of(i);
            if constexpr (kSoftcap) OnlineSoftmax<C>::softcap(S, p.softcap_pre);
            float row_terms[1][2];  // ALiBi's row parts (read only with kAlibi)
            if constexpr (kAlibiColumns) {
                OnlineSoftmax<C>::alibi_rows(S, row_terms, alibi, alibi_side, block * C::kBc,
                                             q_row0 + row0, seq.len_k - seq.len_q, lane);
            } else if constexpr (kAlibi) {
                if (!kSoftcap || alibi != 0.f) {  // the *_alibi entries always; softcap's if given
                    OnlineSoftmax<C>::alibi(S, row_terms, alibi, block * C::kBc, q_row0 + row0,
                                            seq.len_k - seq.len_q, p.window_right == 0, lane,
                                            one_sided);
                } else {
                    OnlineSoftmax<C>::zero_row_terms(row_terms);
                }
            }
            if (block >= range.mask_from || block * C::kBc < range.below_keys)
                OnlineSoftmax<C>::mask(S, block * C::kBc, q_row0 + row0, seq.len_q, seq.len_k,
                                       p.window_left, p.window_right, lane);
            // kDropout: the block's keep bytes. With two consumer warpgroups (224 registers)
            // they are drawn here, where ptxas interleaves the Philox rounds with the row
            // maxima's dependent chain, with the Philox's fixed part made once per tile
            // (DropoutRow); drawn after P is packed they run alone on the step's critical
            // path, as with three (160 registers: drawn here they spilled 384 bytes), where
            // DropoutRow gained nothing (docs/perf-log.md, thirty-second session).
            [[maybe_unused]] KeepBytes keep[C::kKvSlices];
            if constexpr (kDropout && kEarlyKeep) drop_row.bytes(keep, block * C::kBc / 16, lane);
            float alpha[1][2];
            const bool rescale =
                softmax.template update_scores<kFirst && C::kOptimizedSoftmax, kAlibi>(
                    S, scale, alpha, row_terms);
            if constexpr (!kFirst) {
                wgmma_wait<0>();  // P V of the previous block has landed: O and P are free
                wgmma_fence_operands(o_acc);
                if (lane == 0) mbarrier_arrive(&v_empty[prev]);
            }
            if (rescale) OnlineSoftmax<C>::rescale(O, alpha);
            pack_a_fragments<C::kBf16>(P, S);
            if constexpr (kDropout && kEarlyKeep) {  // on the packed P
                keep_packed(P[0], P[0], keep, KeepThreshold(p.dropout_threshold));
            } else if constexpr (kDropout) {
                OnlineSoftmax<C>::template dropout_packed<false>(
                    P, seed, (q_row0 + row0) / 16, block * C::kBc / 16,
                    at.batch * p.n_heads + at.head, p.dropout_threshold, lane);
            }
        };
        // A step outside this warpgroup's rows: its turn passes, and its stage is released
        // once filled (an arrival before the fill could count toward the stage's previous
        // release, which the other warps may not have made yet).
        // (With one stage this would deadlock on the cp.async path: its producer signals V's
        // full barrier only after waiting to reuse the next K stage.)
        static_assert(kStages >= 2, "pass waits a stage's V fill before releasing its K");
        auto pass = [&](int i) {
            const int gi = g + i;
            const int stage = gi % kStages;
            if (kTurns) named_barrier_sync(kTurnBarrier + wg, kTurnThreads);
            hand_turn_on(i);
            mbarrier_wait(&k_full[stage], (gi / kStages) & 1);
            mbarrier_wait(&v_full[stage], (gi / kStages) & 1);
            if (lane == 0) {
                mbarrier_arrive(&k_empty[stage]);
                mbarrier_arrive(&v_empty[stage]);
            }
        };
        // The steps, from the first (kLead: from the second) on, then the last block's P V.
        // Each skip shape is its own copy of the step loop, entered on a warp vote: ptxas
        // takes a vote's result as warp-uniform, so the loop's counter and the ring's stages,
        // phases and descriptors stay in uniform registers. Chosen on the plain value (or
        // looped from a per-warpgroup first step) they went per thread: 35 more instructions
        // a step and the d128 kernel 7% slower (H100; docs/perf-log.md, thirty-first session).
        auto run_steps = [&](auto lead_tag) {
            constexpr int kLead = decltype(lead_tag)::value ? 1 : 0;
            if constexpr (kLead) pass(0);
            if (n_steps > kLead) step(kLead, std::true_type{});
            for (int i = kLead + 1; i < n_steps; ++i) step(i, std::false_type{});
            if (n_steps > kLead) {  // the last block's P V
                const int last = (g + n_steps - 1) % kStages;
                mbarrier_wait(&v_full[last], ((g + n_steps - 1) / kStages) & 1);
                wgmma_fence_operands(o_acc);
                wgmma_fence();
                gemm.pv_issue(o_acc, P[0], last * kStageBytes);
                wgmma_commit();
                wgmma_wait<0>();
                wgmma_fence_operands(o_acc);
                // (persistent configs: the ring runs on into the CTA's next tile)
                if (C::kPersistent && lane == 0) mbarrier_arrive(&v_empty[last]);
            }
        };
        if (!kOwnRanges || __all_sync(0xffffffffu, skip == 0)) {
            run_steps(std::false_type{});
        } else if (__all_sync(0xffffffffu, skip == 1)) {
            run_steps(std::true_type{});
        } else {
            for (int i = 0; i < n_steps; ++i) pass(i);
        }
        g += n_steps;

        float lse[1][2];
        softmax.finalize(O, lse);
        if constexpr (kDropout) OnlineSoftmax<C>::scale_o(O, p.dropout_scale);
        if constexpr (kSplit) {
            store_split_partials<C>(p, O, lse, at, seq, q_row0, row0, lane);
            return;
        }
        store_lse<C>(p, lse, at, seq, q_row0, row0, lane);
        // O -> shared (over this warpgroup's own Q rows: only its GEMMs read them, and they are
        // done) -> global in 16-byte coalesced stores by the warpgroup's 128 threads.
        o_to_smem<C>(sQt, O, row0, lane);
        named_barrier_sync(kTurnBarrier + kGroups + wg, 128);  // (this warpgroup's epilogue)
        elem_t* o = static_cast<elem_t*>(p.o) + at.batch * p.o_batch_stride +
                    at.head * p.o_head_stride + int64_t(seq.start_q + q_row0) * p.o_seq_stride;
        const int wtid = threadIdx.x % 128;
        const int chunk = wtid % 8;
#pragma unroll
        for (int slab = 0; slab < C::kSlabs; ++slab)
#pragma unroll
            for (int pass = 0; pass < kWarpgroupRows / C::kRowsPerCopyPass; ++pass) {
                const int row = wg * kWarpgroupRows + wtid / 8 + pass * C::kRowsPerCopyPass;
                if (row < q_rows) {
                    const uint4 val = *reinterpret_cast<const uint4*>(
                        sQt + SmemTile<C>::template offset<C::kBr>(row, slab * 8 + chunk));
                    st_global_16<C::kOStoreCache>(
                        reinterpret_cast<uint4*>(o + row * p.o_seq_stride + slab * C::kSlab +
                                                 chunk * 8),
                        val);
                }
            }
        if (persistent) {
            // This warp has read its rows of O back: the Q buffer may take a later tile's Q.
            // The proxy fence orders these generic reads before that TMA (async-proxy) write;
            // the mbarrier alone does not.
            fence_proxy_async_shared();
            __syncwarp();
            if (lane == 0) mbarrier_arrive(&q_empty[qb]);
        }
        if (!dynamic) t += tile_stride;
    }  // tiles
}

}  // namespace cudaflash
