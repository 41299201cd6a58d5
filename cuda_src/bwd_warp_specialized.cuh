// The warp-specialized dK/dV + dQ kernel of the atomic scheme on Hopper (BwdConfig::
// kWarpSpecialized; sm_90a, wgmma, 8 consumer warps, B_r = 64): the structure of
// FlashAttention-3's backward. Three warpgroups per CTA:
//
//   warpgroup 0, the producer (few registers, setmaxnreg):
//     one thread of warp 0 (the loader) issues every load through TMA: the CTA's K and V
//       tiles once, then each step's Q and dO tiles (tensor maps, BwdParams::tma_*) and its
//       rows' lse (log2 units) and delta (bulk copies of the padded statistics the preprocess
//       kernel wrote) into a ring of kBwdStages stages, each stage's "full" mbarrier counting
//       the bytes down; a stage is refilled once its "empty" mbarrier says every consumer
//       warp's GEMMs have read it. (Until v5 two warps did this with cp.async, spilling their
//       bookkeeping at the producer's 24 registers: perf log "Backward v5".)
//     warp 1 (the dQ reducer) adds each step's dQ tile (64 query rows x d_head, float32) from
//       shared memory to the global accumulator with one bulk reduction (cp.reduce.async.bulk)
//       as soon as the consumers have written it, and hands the tile's buffer back once the
//       reduction has read it. No consumer issues an atomic or waits for one.
//   warpgroups 1 and 2, the consumers: 64 keys each, the step's GEMMs on wgmma as bwd_dkdv's
//     (S^T and dP^T, the softmax under dP^T, dV, dS^T under dV, dK), dK and dV in registers
//     across all steps. Neither waits for the other's dS^T of the same step, so they run
//     about half a step apart and one's softmax runs under the other's GEMMs (perf log,
//     "Backward v6"; a per-step rendezvous before dQ cost 5-15%). The waits left are one-way
//     hand-offs the leader has normally long passed (d64: warpgroup 2 adds its dQ share to
//     the one warpgroup 1 stored). dQ = dS K sums over both warpgroups'
//     keys: at d64 (BwdConfig::kWsDqOwnKeys) each warpgroup computes its own keys' share of
//     the whole tile and the shares are summed in shared memory; at d128 (whose share would
//     not fit the registers) each computes half the columns over both warpgroups' dS^T, one
//     step late, when the other's rows of it are long written.
//
// What it removes from bwd_dkdv's step (perf log, "Backward v4"): both CTA-wide barriers (the
// loads' double buffer, and the dQ tile handed to thread 0), the consumers' copy instructions
// and lse loads, and the dQ tile's bank conflicts: the tile is written in the consumers'
// fragment order (each warp's store covers 512 contiguous bytes) and reduced into the
// accumulator in that order; dq_convert reads it back (dq_tile_index).
//
// Included by flash_bwd.cu after the helpers it shares with bwd_dkdv (fragments, masks, the
// step's elementwise functions, the dQ accumulator's layout).
#pragma once
#include <type_traits>

namespace cudaflash {

constexpr int kBwdStages = 2;             // Q/dO ring depth (3 does not fit d128's shared memory)
constexpr int kBwdProducerThreads = 128;  // warpgroup 0
constexpr int kBwdConsumerThreads = 256;  // warpgroups 1 and 2
// Registers per thread after setmaxnreg: 128 * 24 + 256 * 240 = 64512, the 168 per thread
// of the launch (ptxas's cap for 384 threads) times 384: setmaxnreg.inc waits until the pool
// has the registers, so asking for more than the launch gave deadlocks.
// cudaflash.backward_config.BWD_WS_PRODUCER_REGS / _CONSUMER_REGS mirror these; the build checks them
// against the launch's registers (build_cubins.py, _check_register_pool).
constexpr int kBwdProducerRegs = 24;
constexpr int kBwdConsumerRegs = 240;
// Named barriers (0 is __syncthreads). zero_tail_rows (shared with the d256 kernels, where 6 is
// free) meets at kBwdTailBarrier; the fused kernel's own:
constexpr int kBwdTailBarrier = 6;
constexpr int kBwdOffsetBarrier = 1;    // once: warpgroup 2 starts after 1's first softmax
constexpr int kBwdDqFullBarrier = 2;    // + buffer: consumers -> reducer, the dQ tile is written
constexpr int kBwdDqEmptyBarrier = 7;   // + 2 warpgroup + buffer: reducer -> that warpgroup,
                                        // the tile was read
constexpr int kBwdEpilogueBarrier = 11; // the consumers, around dK/dV through shared memory
constexpr int kBwdDsBarrier = 12;       // + 2 warpgroup + buffer (lagged dQ): that warpgroup
                                        // wrote its rows of dS^T and read the previous ones;
                                        // kWsDqOwnKeys: + warpgroup, its own rows are written
constexpr int kBwdDqHalfBarrier = 4;    // + buffer (kWsDqOwnKeys): warpgroup 1 -> 2, its dQ
                                        // share is stored
constexpr int kBwdWarpgroupThreads = 128;

// Shared memory of the kernel (cudaflash.backward_config.BackwardConfig.dkdv_dq_smem_bytes mirrors it):
// K, V (kCtaRows x d) | kBwdStages x Q, dO (Q x d) | 2 x dS^T (kCtaRows x Q) |
// 2 x dQ tile (Q x d float32) | kBwdStages x lse, delta (Q float32) | mbarriers, where Q is
// BwdConfig::kWsQueryRows (mbarriers: 8 bytes each, 1 + 2 * kBwdStages of them).

// dS^T = P^T * (dP^T - delta) in place of dP^T, with P^T read back from its 16-bit A
// fragments (pack_a_fragments' layout): the 128-query-row step keeps no float32 P^T beside
// dP^T, dK, dV and the fragments, which would not fit its 240 registers (ptxas serialized
// the wgmmas). P^T is then the value the dV GEMM used; the reference's rounding is the same.
template <int kQ>
__device__ __forceinline__ void step_score_grads_packed(float (&dS)[kQ / 8][4],
                                                        const uint32_t (&a)[1][kQ / 16][4],
                                                        const float* delta) {
#pragma unroll
    for (int nj = 0; nj < kQ / 8; ++nj)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int col = fragment_column(nj, e);
            dS[nj][e] = fragment_value(a, nj, e) * (dS[nj][e] - delta[col]);
        }
}

// Dropout's dS^T = P^T o (keep o dPd^T / (1 - p) - delta), in place of dPd^T = V dO^T,
// computed as (1 - p) dS^T = kept * dPd - P * delta', with delta' = (1 - p) delta (the
// preprocess kernel writes delta_tiles so for dropout calls) and 1 / (1 - p) applied once to
// dK (this kernel's epilogue) and dQ (dq_convert): one multiply per score fewer than scaling
// dPd here. `a_kept` is dV's operand (P^T o keep, keep_packed's 16-bit fragments, read back
// here), so the keep mask is already in its zeros and costs nothing per score here (drawn as
// bits and applied to dPd it cost ~3.5 instructions per score). P^T in the delta term: its
// float32 values where the step keeps them (kFloatP, 64 query rows), else read back from its
// fragments `a` (step_score_grads_packed's reason); the kept term always takes the 16-bit
// P^T, the value dV's GEMM used (at 64 rows the old form took float32 P^T there too: a
// difference within P's 16-bit rounding). A dropped score gives -P * delta' (0 * dPd), NaN
// only where dPd is not finite, where its column's gradients are NaN anyway. Both fragment
// arrays are read while dV's wgmma may still read `a_kept` (as step_score_grads_packed reads
// `a`): read-only, nothing writes them before the step's wait.
template <int kQ, bool kFloatP>
__device__ __forceinline__ void step_score_grads_dropped(float (&dS)[kQ / 8][4],
                                                         const float (&P)[kQ / 8][4],
                                                         const uint32_t (&a)[1][kQ / 16][4],
                                                         const uint32_t (&a_kept)[1][kQ / 16][4],
                                                         const float* kept_delta) {
#pragma unroll
    for (int nj = 0; nj < kQ / 8; ++nj)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int col = fragment_column(nj, e);
            const float kept_prob = fragment_value(a_kept, nj, e);
            const float prob = kFloatP ? P[nj][e] : fragment_value(a, nj, e);
            dS[nj][e] = fmaf(kept_prob, dS[nj][e], -prob * kept_delta[col]);
        }
}

// The (query head, first query row) pairs of a dK/dV CTA's steps (kQ query rows each), in
// order: each role walks them with counters, not a division per step (the producer's few
// registers).
template <int kQ>
struct StepWalk {
    int head, q0, first_q0, end_q0;
    __device__ __forceinline__ StepWalk(int first_head, const QueryTiles& tiles)
        : head(first_head), q0(tiles.first * kQ), first_q0(tiles.first * kQ),
          end_q0((tiles.first + tiles.per_head) * kQ) {}
    __device__ __forceinline__ void next() {
        q0 += kQ;
        if (q0 == end_q0) {
            q0 = first_q0;
            ++head;
        }
    }
};

// The warp-specialized kernels' setup: thread 0 prefetches the four tensor maps (their
// fetch overlaps the rest) and initialises the barriers, `once` (the CTA's own tiles, loaded
// once: one arrival with their bytes) and per stage of the ring "full" (the loader's one
// arrival with the stage's bytes) and "empty" (lane 0 of each consumer warp); then the CTA
// meets. The copy engine (the async proxy) completes transactions on these barriers: it
// must see them initialised (the CUDA guide's TMA pattern).
template <int kStages>
__device__ __forceinline__ void ws_setup(const BwdParams& p, uint64_t* once, uint64_t* full,
                                         uint64_t* empty) {
    if (threadIdx.x == 0) {
        tma_prefetch_map(p.tma_k);
        tma_prefetch_map(p.tma_v);
        tma_prefetch_map(p.tma_q);
        tma_prefetch_map(p.tma_do);
        mbarrier_init(once, 1);
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
            mbarrier_init(&full[s], 1);
            mbarrier_init(&empty[s], kBwdConsumerThreads / 32);
        }
        fence_proxy_async_shared();
    }
    __syncthreads();
}

// The dK/dV loader's step `step` (one thread): once every consumer warp has released its
// stage, the Q and dO tiles of query head `head` (tensor maps of `maps`, at row map_q0 of
// map entry map_batch) and the rows' lse and delta (bulk copies of p's padded statistics:
// stats_rows per head of entry stats_batch, from row q0), counted down on the stage's
// "full" barrier. A padded batch passes p as maps and its own rows and entry.
template <int kQ, int kStages>
__device__ __forceinline__ void load_query_stage(const BwdParams& p, const BwdParams& maps,
                                                 int step, int head, int q0, int map_q0,
                                                 int map_batch, int stats_batch, int stats_rows,
                                                 elem_t* sQ, elem_t* sdO, float* sLse,
                                                 float* sDelta, uint64_t* full,
                                                 uint64_t* empty) {
    constexpr uint32_t kStageBytes = 2 * kQ * kD * sizeof(elem_t) + 2 * kQ * sizeof(float);
    const int stage = step % kStages;
    mbarrier_wait(&empty[stage], ((step / kStages) & 1) ^ 1);
    mbarrier_arrive_expect_tx(&full[stage], kStageBytes);
    tma_load_5d(smem_addr(sQ + stage * kQ * kD), maps.tma_q, &full[stage], 0, map_q0, 0, head,
                map_batch);
    tma_load_5d(smem_addr(sdO + stage * kQ * kD), maps.tma_do, &full[stage], 0, map_q0, 0,
                head, map_batch);
    // (recomputed per step from the params, not kept across the loop: the producer's 24
    // registers)
    const int64_t row = (int64_t(stats_batch) * p.n_heads + head) * stats_rows + q0;
    bulk_load(smem_addr(sLse + stage * kQ), p.lse_log2_tiles + row, kQ * sizeof(float),
              &full[stage]);
    bulk_load(smem_addr(sDelta + stage * kQ), p.delta_tiles + row, kQ * sizeof(float),
              &full[stage]);
}

// Where a CTA's sequence lies in the tensor maps and the padded statistics: a padded batch's
// entry blockIdx.z from row 0, or a packed (varlen) batch's sequence blockIdx.z from its first
// row of the maps' one entry (the host describes the packed (total, heads, d) tensors as
// (1, total, heads, d)). Rows past the sequence's end are then the next sequence's, not zero
// fill: its keys are masked like the tail of a padded batch's (dQ: key >= seqlen_k; dK/dV:
// never stored), its query rows carry lse +inf and delta 0 in the statistics (P = dS = 0).
// stats_rows: the statistics' rows per head (dq_accum_rows of the call: of the longest
// sequence for a packed batch). maps: the kernel's own __grid_constant__ params, whose
// tensor maps TMA reads (a sequence view is a local copy, and TMA takes no map from local
// memory).
// zero_tails: a packed batch, whose tiles past a sequence's end hold the next sequence's rows
// (zero_tail_rows).
struct MapOrigin {
    const BwdParams* maps;
    int q_row, k_row, map_batch, stats_rows;
    bool zero_tails;
};
// (p: the kernel's params)
__device__ __forceinline__ MapOrigin padded_origin(const BwdParams& p) {
    return {&p, 0, 0, int(blockIdx.z), dq_accum_rows(p), false};
}
// (p: the packed batch's params, before sequence_view; the clamps are sequence_view's)
__device__ __forceinline__ MapOrigin packed_origin(const BwdParams& p) {
    const int b = blockIdx.z;
    return {&p, min(max(p.cu_seqlens_q[b], 0), p.total_q),
            min(max(p.cu_seqlens_k[b], 0), p.total_k), 0, dq_accum_rows(p), true};
}


// A consumer warp's dQ fragments of one 64-row half (kN n8 blocks, m64nNk16 accumulator
// layout) into the dQ tile in fragment order (dq_tile_index), from `at` (this lane's float4
// of the warp's first block; block nd at at[nd * 32]): each warp's float4 accesses cover 512
// contiguous bytes, free of bank conflicts. kAdd: added to what the tile holds.
template <bool kAdd, int kN>
__device__ __forceinline__ void put_dq_fragments(float4* at, const float (&dq)[kN][4]) {
#pragma unroll
    for (int nd = 0; nd < kN; ++nd) {
        float4 v = make_float4(dq[nd][0], dq[nd][1], dq[nd][2], dq[nd][3]);
        if constexpr (kAdd) {
            const float4 held = at[nd * 32];
            v = make_float4(held.x + v.x, held.y + v.y, held.z + v.z, held.w + v.w);
        }
        at[nd * 32] = v;
    }
}

// Rows first_row.. of two (kRows, d) stage tiles set to zero by the 256 consumer threads
// (ctid), then a barrier of both groups before either's GEMMs read them. A packed batch's
// tile that runs past its sequence's end holds the next sequence's rows instead of TMA's zero
// fill: P and dS are 0 there, but 0 times a non-finite value (a spare row of garbage after
// the last sequence) is NaN, which the GEMMs would sum into this sequence's gradients.
template <int kRows>
__device__ __forceinline__ void zero_tail_rows(elem_t* a, elem_t* b, int first_row,
                                               unsigned ctid) {
    constexpr int kChunks = kD / 8;  // 16-byte chunks per row
    for (int i = ctid; i < (kRows - first_row) * kChunks; i += kBwdConsumerThreads) {
        const int offset = SmemTile<C>::template offset<kRows>(first_row + i / kChunks,
                                                                i % kChunks);
        *reinterpret_cast<uint4*>(a + offset) = make_uint4(0u, 0u, 0u, 0u);
        *reinterpret_cast<uint4*>(b + offset) = make_uint4(0u, 0u, 0u, 0u);
    }
    fence_proxy_async_shared();  // these generic writes, then the wgmmas' (async) reads
    named_barrier_sync(kBwdTailBarrier, kBwdConsumerThreads);
}

// p: the CTA's sequence (sequence_view for a packed batch); origin: where it lies in the maps
// and the statistics. kPacked: a packed batch (origin.zero_tails), whose dQ tiles go to the
// packed accumulator (packed_dq_accum_row) and whose tiles past the sequence's end are zeroed
// (zero_tail_rows: here K and V too, since dQ = dS K sums over every key row of the tile).
// kDropout: the forward's dropout (BwdParams::dropout_*), its keep mask drawn per step as the
// deterministic dK/dV kernel draws it; dV from the kept P (keep_packed), dS^T from the kept
// and the undropped P (step_score_grads_dropped).
template <bool kWindow, class Cfg = C, bool kPacked = false, bool kDropout = false>
__device__ __forceinline__ void bwd_dkdv_dq_ws(const BwdParams& p, const MapOrigin origin) {
    const BwdParams& maps = *origin.maps;  // the tensor maps (grid-constant params)
    static_assert(Cfg::kWarpSpecialized && Cfg::kWgmma && Cfg::kWarps == 8,
                  "two consumer warpgroups of 64 keys on wgmma");
    constexpr int kKeys = C::kCtaRows;
    constexpr int kQ = C::kWsQueryRows;  // query rows per step: 64, or 128 (two dQ halves)
    constexpr int kHalves = kQ / 64;
    constexpr bool kOwnKeys = C::kWsDqOwnKeys;  // each warpgroup its own keys' dQ share
    // The dQ tile's barriers: "full" has the reducer wait for the warpgroups that write the
    // tile (kOwnKeys: warpgroup 2 hands it over; else both), "empty" one warpgroup wait for the
    // reducer (kOwnKeys: warpgroup 1, which stores first; else each its own).
    constexpr int kDqFullThreads = (kOwnKeys ? kBwdWarpgroupThreads : kBwdConsumerThreads) + 32;
    constexpr int kDqEmptyThreads = kBwdWarpgroupThreads + 32;
    constexpr int kStages = kBwdStages;
    constexpr int kDqTileFloats = kQ * kD;

    extern __shared__ __align__(1024) unsigned char smem[];
    elem_t* sK = reinterpret_cast<elem_t*>(smem);  // (kKeys, d); holds dK at the end
    elem_t* sV = sK + kKeys * kD;                  // (kKeys, d); holds dV at the end
    elem_t* sQ = sV + kKeys * kD;                  // kStages x (kQ, d)
    elem_t* sdO = sQ + kStages * kQ * kD;          // kStages x (kQ, d)
    elem_t* sdS = sdO + kStages * kQ * kD;         // 2 x dS^T (kKeys, kQ): step % 2
    float* sdQ = reinterpret_cast<float*>(sdS + 2 * kKeys * kQ);  // 2 x dQ tile: step % 2
    float* sLse = sdQ + 2 * kDqTileFloats;                       // kStages x kQ, log2 units
    float* sDelta = sLse + kStages * kQ;                         // kStages x kQ
    uint64_t* bars = reinterpret_cast<uint64_t*>(sDelta + kStages * kQ);
    uint64_t& kv_full = bars[0];   // the loader's bytes: K and V have landed
    uint64_t* full = bars + 1;     // per stage, the loader's bytes: the stage has landed
    uint64_t* empty = full + kStages;  // per stage, lane 0 of each consumer warp: read

    const int head_k = blockIdx.y;
    const int batch = blockIdx.z;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int key0 = blockIdx.x * kKeys;
    if (key0 >= p.seqlen_k) return;  // the whole CTA, before any barrier
    const int key_rows = min(kKeys, p.seqlen_k - key0);
    const int group = p.n_heads / p.n_heads_k;
    const int shift = p.seqlen_k - p.seqlen_q;
    const QueryTiles tiles = query_tiles<kQ, kWindow>(p, key0, key_rows);
    const int n_steps = group * tiles.per_head;  // (query head, query tile) pairs, in order
    const StepWalk<kQ> walk0(head_k * group, tiles);  // each role walks the steps with it

    // One producer thread issues every load through TMA: K and V once (tensor maps), then
    // per step the Q and dO tiles (tensor maps) and the tile's lse and delta (plain bulk
    // copies of the padded statistics). Each "full" barrier takes that thread's one arrival
    // with the bytes as its transaction count, which the copies count down.
    constexpr uint32_t kKvBytes = 2 * kKeys * kD * sizeof(elem_t);
    ws_setup<kStages>(maps, &kv_full, full, empty);

    if (warp < 4) {
        warpgroup_reg_dealloc<kBwdProducerRegs>();
        if (warp == 0) {
            // ---- loader: one thread -------------------------------------------------------
            if (lane != 0) return;
            mbarrier_arrive_expect_tx(&kv_full, kKvBytes);
            const int map_key0 = origin.k_row + key0;
            tma_load_5d(smem_addr(sK), maps.tma_k, &kv_full, 0, map_key0, 0, head_k,
                        origin.map_batch);
            tma_load_5d(smem_addr(sV), maps.tma_v, &kv_full, 0, map_key0, 0, head_k,
                        origin.map_batch);
            StepWalk<kQ> at = walk0;
            // Not unrolled: nvcc's unrolled copies spilled at the producer's 24 registers.
#pragma unroll 1
            for (int step = 0; step < n_steps; ++step, at.next())
                load_query_stage<kQ, kStages>(p, maps, step, at.head, at.q0,
                                              origin.q_row + at.q0, origin.map_batch, batch,
                                              origin.stats_rows, sQ, sdO, sLse, sDelta, full,
                                              empty);
        } else if (warp == 1) {
            // ---- dQ reducer --------------------------------------------------------------
            StepWalk<kQ> at = walk0;
            for (int step = 0; step < n_steps; ++step, at.next()) {
                const int buf = step % 2;
                named_barrier_sync(kBwdDqFullBarrier + buf, kDqFullThreads);
                if (lane == 0) {
                    bulk_reduce_add_f32(accum_row<kPacked>(p, batch, at.head, at.q0),
                                        smem_addr(sdQ + buf * kDqTileFloats), kDqTileFloats * 4);
                    bulk_commit();
                    bulk_wait_read<0>();
                }
                __syncwarp();
                // The consumers wait for this buffer again only at step + 2.
                if (step + 2 < n_steps) {
                    named_barrier_arrive(kBwdDqEmptyBarrier + buf, kDqEmptyThreads);
                    if (!kOwnKeys) named_barrier_arrive(kBwdDqEmptyBarrier + 2 + buf, kDqEmptyThreads);
                }
            }
            if (lane == 0) bulk_wait<0>();
        }
        return;
    }

    // ---- consumers ---------------------------------------------------------------------------
    warpgroup_reg_alloc<kBwdConsumerRegs>();
    const int cwarp = warp - 4;     // 0..7: keys 16 * cwarp.. of the CTA's tile
    const int cgroup = cwarp / 4;   // consumer warpgroup: keys 64 * cgroup..
    const int row0 = cwarp * 16;
    const WindowBounds window(p);
    const uint64_t seed = kDropout ? *p.dropout_seed : 0;

    float dK[kD / 8][4], dV[kD / 8][4];
#pragma unroll
    for (int nd = 0; nd < kD / 8; ++nd)
#pragma unroll
        for (int e = 0; e < 4; ++e) dK[nd][e] = dV[nd][e] = 0.f;

    const uint32_t k_tile = smem_addr(sK);
    const uint32_t own_rows = cgroup * 64 * 128;  // bytes: the warpgroup's rows of a slab
    const uint32_t k_rows = k_tile + own_rows;
    const uint32_t v_rows = smem_addr(sV) + own_rows;
    // Without kOwnKeys: the warpgroup's columns of dQ (the warpgroups split d_head), in the K
    // tile; a step's dQ is computed one step late (lagged_dq).
    const int dq_col0 = cgroup * C::kDqWgCols;
    const uint32_t dq_k_cols = k_tile + (dq_col0 / 64) * kKeys * 128 + (dq_col0 % 64) * 2;
    mbarrier_wait(&kv_full, 0);
    if constexpr (kPacked) {
        if (key_rows < kKeys) zero_tail_rows<kKeys>(sK, sV, key_rows, threadIdx.x - kBwdProducerThreads);
    }

    // Without kOwnKeys: step t's dQ = dS K (both warpgroups' rows of dS^T, this warpgroup's
    // columns) into dQ tile t % 2, then handed to the reducer. dQ before dK: the tensor pipe
    // runs them in issue order, so the tile is stored while dK runs (perf log, "Backward
    // v4.3"); stored in fragment order (put_dq_fragments). `then_dk` issues dK after the dQ
    // GEMMs.
    constexpr int kDqN8 = C::kDqWgCols / 8;  // a consumer warp's n8 blocks of the dQ tile
    auto lagged_dq = [&](int t, auto then_dk) {
        const int tbuf = t % 2;
        const elem_t* ds_tile = sdS + tbuf * kKeys * kQ;  // (kKeys, 64) slabs, one per half
        float dQ[kHalves][kDqN8][4];  // set by the first wgmma of each half (accumulate 0)
#pragma unroll
        for (int h = 0; h < kHalves; ++h) wgmma_fence_operands(wg::flat(dQ[h]));
        wgmma_fence();
#pragma unroll
        for (int h = 0; h < kHalves; ++h)
            wg::ds_k<kKeys>(dQ[h], smem_addr(ds_tile + h * kKeys * 64), dq_k_cols);
        wgmma_commit();
        then_dk();
#pragma unroll
        for (int h = 0; h < kHalves; ++h) wgmma_fence_operands(wg::flat(dQ[h]));
        if (t >= 2)
            named_barrier_sync(kBwdDqEmptyBarrier + 2 * cgroup + tbuf, kDqEmptyThreads);
#pragma unroll
        for (int h = 0; h < kHalves; ++h)
            put_dq_fragments<false>(
                reinterpret_cast<float4*>(sdQ + tbuf * kDqTileFloats + h * 64 * kD) +
                    cwarp * kDqN8 * 32 + lane,
                dQ[h]);
        fence_proxy_async_shared();
        named_barrier_arrive(kBwdDqFullBarrier + tbuf, kDqFullThreads);
    };

    // Warpgroup 2 starts once warpgroup 1's first softmax is done, so that from the first step
    // one's softmax runs under the other's GEMMs (neither scheme has a warpgroup wait for the
    // other's dS^T of the same step). Not in a packed batch: a tail step's zero_tail_rows has
    // them meet.
    if (!kPacked && cgroup == 1 && n_steps > 0)
        named_barrier_sync(kBwdOffsetBarrier, kBwdConsumerThreads);
    StepWalk<kQ> at = walk0;
    for (int step = 0; step < n_steps; ++step, at.next()) {
        const int stage = step % kStages;
        const int buf = step % 2;
        const int q0 = at.q0;
        const uint32_t q_tile = smem_addr(sQ + stage * kQ * kD);
        const uint32_t do_tile = smem_addr(sdO + stage * kQ * kD);
        const float* lse = sLse + stage * kQ;
        const float* delta = sDelta + stage * kQ;
        const bool mask =
            (kWindow ? window.cuts(key0 - (q0 + kQ - 1) - shift, key0 + kKeys - 1 - q0 - shift)
                     : p.is_causal && q0 + shift < key0 + kKeys - 1) ||
            key_rows < kKeys;  // keys past seqlen_k (step_probabilities, kKeyTail)
        mbarrier_wait(&full[stage], (step / kStages) & 1);
        if constexpr (kPacked) {
            if (q0 + kQ > p.seqlen_q)  // (the same in both consumer warpgroups)
                zero_tail_rows<kQ>(sQ + stage * kQ * kD, sdO + stage * kQ * kD, p.seqlen_q - q0,
                                   threadIdx.x - kBwdProducerThreads);
        }

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
        step_probabilities<kQ, kWindow, false, true>(P[0], p, lse, mask, window, key0 + row0,
                                                     q0, shift, 0.f);
        uint32_t a[1][kQ / 16][4];
        pack_a_fragments<C::kBf16>(a, P);
        // kDropout: dV's operand, P^T with the dropped scores zeroed (dV = sum (P o keep)^T dO
        // is scaled by 1 / (1 - p) once, in the epilogue); dS^T reads both. The keep bytes of
        // the warp's 16 keys x kQ queries (the transposed layout, as the deterministic dK/dV
        // kernel draws them) are drawn here, while dP^T runs, two 16-query blocks at a time,
        // and die in keep_packed: drawn before S^T's wait they lived across the softmax (16
        // registers at 128 query rows, where they spilled, so they were squeezed to bits at ~2
        // instructions per score). Philox unrolled, its key schedule hoisted (kLeanKeys off:
        // uniform registers): as a rolled loop it took 12 instructions a round, 3.4 per score.
        uint32_t a_kept[1][kQ / 16][4];
        if constexpr (kDropout) {
            const KeepThreshold threshold(p.dropout_threshold);
#pragma unroll
            for (int h = 0; h < kQ / 32; ++h) {  // two 16-query blocks each
                KeepBytes bytes[2];
                dropout_bytes<true, 2, false>(bytes, seed, q0 / 16 + 2 * h, (key0 + row0) / 16,
                                              1, 0, batch * p.n_heads + at.head, lane);
                keep_packed(reinterpret_cast<uint32_t(&)[2][4]>(a_kept[0][2 * h]),
                            reinterpret_cast<const uint32_t(&)[2][4]>(a[0][2 * h]), bytes,
                            threshold);
            }
        }
        wgmma_fence_operands(wg::flat(dV));
        wgmma_fence();
        wg::regs_tile<kQ, kQ / 16>(dV, *(kDropout ? &a_kept : &a), do_tile);
        wgmma_commit();
        if (!kPacked && step == 0 && cgroup == 0)
            named_barrier_arrive(kBwdOffsetBarrier, kBwdConsumerThreads);
        wgmma_wait<1>();  // dP^T (dV may still run)
        wgmma_fence_operands(wg::flat(dS[0]));
        if constexpr (kDropout) {
            step_score_grads_dropped<kQ, kQ != 128>(dS[0], P[0], a, a_kept, delta);
        } else if constexpr (kQ == 128) {
            step_score_grads_packed<kQ>(dS[0], a, delta);
        } else {
            step_score_grads<kQ, false>(dS[0], P[0], p, lse, delta, 0, 0, 0, 0.f);
        }
        uint32_t ds_a[1][kQ / 16][4];
        pack_a_fragments<C::kBf16>(ds_a, dS);
        elem_t* ds_tile = sdS + buf * kKeys * kQ;  // (kKeys, 64) slabs, one per dQ half
        if constexpr (kOwnKeys) {
            // Each warpgroup computes its own keys' share of the step's dQ, the whole tile, so
            // it waits only for its own warps' rows of dS^T (their previous reads of this
            // buffer, step - 2's, were waited for) and the warpgroups run half a step apart
            // (perf log, "Backward v6"). Warpgroup 1 stores its share into the dQ tile,
            // warpgroup 2 adds its own and hands the tile to the reducer (put_dq_fragments, per
            // 64-row half).
            acc_to_tile<kKeys, kQ / 8>(ds_tile, dS[0], 1.f, row0);
            fence_proxy_async_shared();
            wgmma_wait<0>();  // dV (issued before dS^T was computed: done by now)
            wgmma_fence_operands(wg::flat(dV));
            named_barrier_sync(kBwdDsBarrier + cgroup, kBwdWarpgroupThreads);
            float dQ[kHalves][kD / 8][4];  // set by the first wgmma of each half (accumulate 0)
#pragma unroll
            for (int h = 0; h < kHalves; ++h) wgmma_fence_operands(wg::flat(dQ[h]));
            wgmma_fence();
#pragma unroll
            for (int h = 0; h < kHalves; ++h)
                wg::ds_k<kKeys, kD, 64>(dQ[h], smem_addr(ds_tile + h * kKeys * 64) + own_rows,
                                        k_rows);
            wgmma_commit();
            wgmma_fence_operands(wg::flat(dK));
            wg::regs_tile<kQ, kQ / 16>(dK, ds_a, q_tile);
            wgmma_commit();
            wgmma_wait<1>();  // dQ (dK may still run)
#pragma unroll
            for (int h = 0; h < kHalves; ++h) wgmma_fence_operands(wg::flat(dQ[h]));
            float4* dq_tile = reinterpret_cast<float4*>(sdQ + buf * kDqTileFloats) +
                              (cwarp % 4) * (kD / 8) * 32 + lane;
            if (cgroup == 0) {
                if (step >= 2) named_barrier_sync(kBwdDqEmptyBarrier + buf, kDqEmptyThreads);
#pragma unroll
                for (int h = 0; h < kHalves; ++h)
                    put_dq_fragments<false>(dq_tile + h * 64 * kD / 4, dQ[h]);
                named_barrier_arrive(kBwdDqHalfBarrier + buf, kBwdConsumerThreads);
            } else {
                named_barrier_sync(kBwdDqHalfBarrier + buf, kBwdConsumerThreads);
#pragma unroll
                for (int h = 0; h < kHalves; ++h)
                    put_dq_fragments<true>(dq_tile + h * 64 * kD / 4, dQ[h]);
                fence_proxy_async_shared();
                named_barrier_arrive(kBwdDqFullBarrier + buf, kDqFullThreads);
            }
        } else {
            // dQ needs both warpgroups' rows of dS^T: computed one step late, when the other
            // warpgroup (at most a step behind) has long written them, so neither waits for
            // the other within a step (perf log, "Backward v6"). Before writing this step's
            // rows into buffer `buf`: the other warpgroup's dS^T of step - 1 is written and
            // its reads of this buffer (step - 2's dQ) are done (kBwdDsBarrier: it arrives
            // after both). Then step - 1's dQ, with dK issued after it.
            const int other = 1 - cgroup;
            if (step >= 1)
                named_barrier_sync(kBwdDsBarrier + 2 * other + (step - 1) % 2, kBwdConsumerThreads);
            acc_to_tile<kKeys, kQ / 8>(ds_tile, dS[0], 1.f, row0);
            fence_proxy_async_shared();
            auto issue_dk = [&] {
                wgmma_fence_operands(wg::flat(dK));
                wg::regs_tile<kQ, kQ / 16>(dK, ds_a, q_tile);
                wgmma_commit();
                wgmma_wait<1>();  // dV and the dQ GEMMs (dK may still run)
            };
            if (step >= 1) {
                lagged_dq(step - 1, issue_dk);
            } else {
                wgmma_fence();
                issue_dk();
            }
            named_barrier_arrive(kBwdDsBarrier + 2 * cgroup + buf, kBwdConsumerThreads);
        }
        wgmma_wait<0>();  // dK: this warp is done with the stage
        wgmma_fence_operands(wg::flat(dK));
        wgmma_fence_operands(wg::flat(dV));
        __syncwarp();
        if (lane == 0) mbarrier_arrive(&empty[stage]);
    }
    if constexpr (!kOwnKeys) {
        // The last step's dQ.
        if (n_steps > 0) {
            named_barrier_sync(kBwdDsBarrier + 2 * (1 - cgroup) + (n_steps - 1) % 2,
                               kBwdConsumerThreads);
            lagged_dq(n_steps - 1, [] { wgmma_wait<0>(); });
        }
    }

    // dK = scale * dS^T Q and dV through shared memory (over K and V) for coalesced stores,
    // once both warpgroups' last GEMMs have read K.
    named_barrier_sync(kBwdEpilogueBarrier, kBwdConsumerThreads);
    // kDropout: dS^T is (1 - p) times the gradient (step_score_grads_dropped) and dV's operand
    // the kept P (keep_packed), so both take 1 / (1 - p) here.
    acc_to_tile<kKeys>(sK, dK, kDropout ? p.softmax_scale * p.dropout_scale : p.softmax_scale,
                       row0);
    acc_to_tile<kKeys>(sV, dV, kDropout ? p.dropout_scale : 1.f, row0);
    named_barrier_sync(kBwdEpilogueBarrier, kBwdConsumerThreads);
    const unsigned ctid = threadIdx.x - kBwdProducerThreads;
    store_rows_by<C, kKeys, kBwdConsumerThreads>(
        row_of(static_cast<elem_t*>(p.dk), p.dk_strides, batch, key0, head_k), sK,
        p.dk_strides.seq, key_rows, ctid);
    store_rows_by<C, kKeys, kBwdConsumerThreads>(
        row_of(static_cast<elem_t*>(p.dv), p.dv_strides, batch, key0, head_k), sV,
        p.dv_strides.seq, key_rows, ctid);
}

}  // namespace cudaflash
