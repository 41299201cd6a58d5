// The deterministic scheme's dK/dV and dQ kernels at d256 on Hopper (BwdConfig::
// kWarpSpecialized with kDHead 256; sm_90a, wgmma): design-notes.md, "d256 backward".
//
// Why d256 needs its own partition: a warpgroup owning 64 keys would hold dK and dV (64 x 256
// float32 each: 128 + 128 registers per thread) beside the step's score tiles, more than the
// 255 a thread has. So both consumer warpgroups own the SAME 64 keys and split the step's four
// GEMMs two and two, each holding one accumulator:
//
//   warpgroup 0, the producer: one thread of warp 0 loads K and V once and each step's Q, dO,
//     lse (log2 units) and delta into a ring of kBwdStages stages through TMA, exactly as the
//     d64/d128 warp-specialized kernel's loader (bwd_warp_specialized.cuh), with 64-key boxes.
//   warpgroup 1, the "values" group: S^T = K Q^T, P^T = exp2(S^T * scale - lse), hands P^T
//     (its 16-bit A fragments) to warpgroup 2 through shared memory, then dV += P^T dO.
//   warpgroup 2, the "keys" group: dP^T = V dO^T, takes P^T, dS^T = P^T (dP^T - delta), then
//     dK += dS^T Q.
//
// The P^T hand-off is the only rendezvous: two buffers (step % 2), a named barrier "ready"
// (values group arrives, keys group waits) and "free" (the reverse) per buffer. The fragments
// go to shared memory in thread order (each thread's 64 bytes as four 16-byte stores, 2 KB per
// store instruction per warpgroup, conflict-free): thread t of the keys group reads what
// thread t of the values group wrote, since both hold the same keys x queries tile in the same
// fragment layout.
//
// The dQ kernel (bwd_dq_ws_d256, below) mirrors it: 64 query rows per CTA, streaming 64-key
// tiles of K and V through a TMA ring; the "scores" warpgroup computes S = Q K^T and P, the
// "grads" warpgroup dP = dO V^T and dS = P (dP - delta), P and dS cross in shared memory the
// same way, and each warpgroup adds dS K for half of dQ's 256 columns (64 x 128 float32: 64
// registers), so the two do equal GEMM work.
//
// Included by flash_bwd.cu after bwd_warp_specialized.cuh (the loader's helpers, kBwd*).
#pragma once

namespace cudaflash {

// Named barriers of this kernel (0 is __syncthreads): per P^T buffer, "ready" and "free".
constexpr int kD256PReadyBarrier = 1;  // + buffer: values group -> keys group, P^T is written
constexpr int kD256PFreeBarrier = 3;   // + buffer: keys group -> values group, P^T was read
constexpr int kD256EpilogueBarrier = 5;  // both consumer groups, around dK/dV staging
constexpr int kD256Keys = 64;            // keys per CTA (both consumer warpgroups' M)
constexpr int kD256PFragments = 4;       // 16-byte fragments per thread of a 64 x 64 P^T

// A consumer warpgroup's 64 x 64 tile of 16-bit A fragments (kD256PFragments per thread)
// into, or out of, a hand-off buffer in thread order: `slot` is the buffer at this thread's
// place, each fragment one 16-byte store (a warpgroup's 2 KB apart), so the other group's
// thread of the same place reads back its own layout.
__device__ __forceinline__ void put_fragments(uint4* slot,
                                              const uint32_t (&a)[1][kD256PFragments][4]) {
#pragma unroll
    for (int i = 0; i < kD256PFragments; ++i)
        slot[i * 128] = make_uint4(a[0][i][0], a[0][i][1], a[0][i][2], a[0][i][3]);
}
__device__ __forceinline__ void take_fragments(uint32_t (&a)[1][kD256PFragments][4],
                                               const uint4* slot) {
#pragma unroll
    for (int i = 0; i < kD256PFragments; ++i) {
        const uint4 f = slot[i * 128];
        a[0][i][0] = f.x;
        a[0][i][1] = f.y;
        a[0][i][2] = f.z;
        a[0][i][3] = f.w;
    }
}

// Shared memory (cudaflash.backward_config.BackwardConfig.dkdv_smem_bytes mirrors it):
// K, V (64 x 256) | kBwdStages x Q, dO (64 x 256) | 2 x P^T fragments (128 threads x 64 B) |
// kBwdStages x lse, delta (64 float32) | mbarriers (1 + 2 * kBwdStages).
// p: the CTA's sequence (sequence_view for a packed batch); origin: where it lies in the maps.
template <bool kWindow>
__device__ __forceinline__ void bwd_dkdv_ws_d256(const BwdParams& p, const MapOrigin origin) {
    const BwdParams& maps = *origin.maps;  // the tensor maps (grid-constant params)
    static_assert(kD == 256 && C::kWarpSpecialized && C::kWsQueryRows == 64,
                  "the d256 partition: two consumer warpgroups on the same 64 keys");
    constexpr int kKeys = kD256Keys;
    constexpr int kQ = 64;  // query rows per step
    constexpr int kStages = kBwdStages;
    constexpr int kGroupThreads = 128;

    extern __shared__ __align__(1024) unsigned char smem[];
    elem_t* sK = reinterpret_cast<elem_t*>(smem);  // (kKeys, d); holds dK at the end
    elem_t* sV = sK + kKeys * kD;                  // (kKeys, d); holds dV at the end
    elem_t* sQ = sV + kKeys * kD;                  // kStages x (kQ, d)
    elem_t* sdO = sQ + kStages * kQ * kD;          // kStages x (kQ, d)
    uint4* sP = reinterpret_cast<uint4*>(sdO + kStages * kQ * kD);  // 2 x P^T fragments
    float* sLse = reinterpret_cast<float*>(sP + 2 * kD256PFragments * kGroupThreads);
    float* sDelta = sLse + kStages * kQ;  // kStages x kQ
    uint64_t* bars = reinterpret_cast<uint64_t*>(sDelta + kStages * kQ);
    uint64_t& kv_full = bars[0];
    uint64_t* full = bars + 1;
    uint64_t* empty = full + kStages;

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
    const int n_steps = group * tiles.per_head;
    const StepWalk<kQ> walk0(head_k * group, tiles);  // as the d128 kernel's

    constexpr uint32_t kKvBytes = 2 * kKeys * kD * sizeof(elem_t);
    ws_setup<kStages>(maps, &kv_full, full, empty);

    if (warp < 4) {
        warpgroup_reg_dealloc<kBwdProducerRegs>();
        if (warp != 0 || lane != 0) return;
        // ---- loader: one thread, as bwd_dkdv_dq_ws's ------------------------------------
        mbarrier_arrive_expect_tx(&kv_full, kKvBytes);
        const int map_key0 = origin.k_row + key0;
        tma_load_5d(smem_addr(sK), maps.tma_k, &kv_full, 0, map_key0, 0, head_k,
                    origin.map_batch);
        tma_load_5d(smem_addr(sV), maps.tma_v, &kv_full, 0, map_key0, 0, head_k,
                    origin.map_batch);
        StepWalk<kQ> at = walk0;
#pragma unroll 1
        for (int step = 0; step < n_steps; ++step, at.next())
            load_query_stage<kQ, kStages>(p, maps, step, at.head, at.q0, origin.q_row + at.q0,
                                          origin.map_batch, batch, origin.stats_rows, sQ, sdO,
                                          sLse, sDelta, full, empty);
        return;
    }

    // ---- consumers ---------------------------------------------------------------------------
    warpgroup_reg_alloc<kBwdConsumerRegs>();
    const bool values_group = warp < 8;     // warpgroup 1: S^T, P^T, dV; warpgroup 2: dK
    const int gtid = threadIdx.x % kGroupThreads;  // thread within its warpgroup
    const int row0 = (warp % 4) * 16;       // the warp's keys within the CTA's 64
    const WindowBounds window(p);
    const uint32_t k_tile = smem_addr(sK), v_tile = smem_addr(sV);
    float acc[kD / 8][4];  // dV (values group) or dK (keys group): 128 registers
#pragma unroll
    for (int nd = 0; nd < kD / 8; ++nd)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nd][e] = 0.f;
    mbarrier_wait(&kv_full, 0);

    StepWalk<kQ> at = walk0;
    for (int step = 0; step < n_steps; ++step, at.next()) {
        const int stage = step % kStages;
        const int buf = step % 2;
        const int q0 = at.q0;
        const uint32_t q_tile = smem_addr(sQ + stage * kQ * kD);
        const uint32_t do_tile = smem_addr(sdO + stage * kQ * kD);
        uint4* p_slot = sP + buf * kD256PFragments * kGroupThreads + gtid;
        mbarrier_wait(&full[stage], (step / kStages) & 1);
        if (origin.zero_tails && q0 + kQ > p.seqlen_q)  // (the same in both groups)
            zero_tail_rows<kQ>(sQ + stage * kQ * kD, sdO + stage * kQ * kD, p.seqlen_q - q0,
                               threadIdx.x - kBwdProducerThreads);

        float S[1][kQ / 8][4];  // S^T then P^T (values group); dP^T then dS^T (keys group)
        uint32_t a[1][kQ / 16][4];
        wgmma_fence_operands(wg::flat(S[0]));
        wgmma_fence();
        wg::rows_rows<kKeys, kQ>(S[0], values_group ? k_tile : v_tile,
                                 values_group ? q_tile : do_tile);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(wg::flat(S[0]));
        if (values_group) {
            const bool mask =
                kWindow ? window.cuts(key0 - (q0 + kQ - 1) - shift, key0 + kKeys - 1 - q0 - shift)
                        : p.is_causal && q0 + shift < key0 + kKeys - 1;
            step_probabilities<kQ, kWindow, false>(S[0], p, sLse + stage * kQ, mask, window,
                                                   key0 + row0, q0, shift, 0.f);
            pack_a_fragments<C::kBf16>(a, S);
            // Buffer `buf` was last read by the keys group at step - 2.
            if (step >= 2) named_barrier_sync(kD256PFreeBarrier + buf, kBwdConsumerThreads);
            put_fragments(p_slot, a);
            named_barrier_arrive(kD256PReadyBarrier + buf, kBwdConsumerThreads);
            // dV += P^T dO
            wgmma_fence_operands(wg::flat(acc));
            wgmma_fence();
            wg::regs_tile<kQ, kQ / 16>(acc, a, do_tile);
        } else {
            named_barrier_sync(kD256PReadyBarrier + buf, kBwdConsumerThreads);
            take_fragments(a, p_slot);
            // The values group waits for this buffer again only at step + 2.
            if (step + 2 < n_steps)
                named_barrier_arrive(kD256PFreeBarrier + buf, kBwdConsumerThreads);
            step_score_grads_packed<kQ>(S[0], a, sDelta + stage * kQ);
            pack_a_fragments<C::kBf16>(a, S);  // dS^T
            // dK += dS^T Q (scaled at the end)
            wgmma_fence_operands(wg::flat(acc));
            wgmma_fence();
            wg::regs_tile<kQ, kQ / 16>(acc, a, q_tile);
        }
        wgmma_commit();
        wgmma_wait<0>();  // this warp is done with the stage
        wgmma_fence_operands(wg::flat(acc));
        __syncwarp();
        if (lane == 0) mbarrier_arrive(&empty[stage]);
    }

    // dV over V, dK = scale * dS^T Q over K, once both groups' last GEMMs have read K and V;
    // then every consumer thread stores rows of both.
    named_barrier_sync(kD256EpilogueBarrier, kBwdConsumerThreads);
    if (values_group) {
        acc_to_tile<kKeys>(sV, acc, 1.f, row0);
    } else {
        acc_to_tile<kKeys>(sK, acc, p.softmax_scale, row0);
    }
    named_barrier_sync(kD256EpilogueBarrier, kBwdConsumerThreads);
    const unsigned ctid = threadIdx.x - kBwdProducerThreads;
    store_rows_by<C, kKeys, kBwdConsumerThreads>(
        row_of(static_cast<elem_t*>(p.dk), p.dk_strides, batch, key0, head_k), sK,
        p.dk_strides.seq, key_rows, ctid);
    store_rows_by<C, kKeys, kBwdConsumerThreads>(
        row_of(static_cast<elem_t*>(p.dv), p.dv_strides, batch, key0, head_k), sV,
        p.dv_strides.seq, key_rows, ctid);
}

namespace wg {

// acc (64 x kN) += A (64 x 16 kK, registers) * tile b from column block `b_cols` on (16 kK rows,
// kN columns, read MN-major; b_cols: the tile's address at the first column, a whole slab):
// the dQ kernel's halves of dQ += dS K.
template <int kRowsB, int kK, int kN>
__device__ __forceinline__ void regs_cols(float (&acc)[kN / 8][4], const uint32_t (&a)[1][kK][4],
                                          uint32_t b_cols) {
    constexpr uint64_t kFields = smem_desc_mn_major(kRowsB);
#pragma unroll
    for (int kk = 0; kk < kK; ++kk)
        wgmma_rs<kN, C::kBf16>(flat(acc), a[0][kk], smem_desc_at(kFields, b_cols + kk * 16 * 128),
                               1);
}

}  // namespace wg

// The P and dS hand-offs of the dQ kernel, per buffer: P "ready"/"free" as in the dK/dV
// kernel, and dS "ready" (grads group -> scores group) / "free" (the reverse).
constexpr int kD256DsReadyBarrier = 7;  // + buffer
constexpr int kD256DsFreeBarrier = 9;   // + buffer

// Shared memory (BackwardConfig.dq_smem_bytes mirrors it): Q, dO (64 x 256) | kBwdStages x
// K, V (64 x 256) | 2 x P, 2 x dS fragments (128 threads x 64 B each) | lse, delta (64
// float32) | mbarriers (1 + 2 * kBwdStages).
// p, origin: as bwd_dkdv_ws_d256's.
template <bool kWindow>
__device__ __forceinline__ void bwd_dq_ws_d256(const BwdParams& p, const MapOrigin origin) {
    const BwdParams& maps = *origin.maps;  // the tensor maps (grid-constant params)
    static_assert(kD == 256 && C::kWarpSpecialized && C::kBc == 64,
                  "the d256 dQ partition: 64-key tiles (B_c 64)");
    constexpr int kRows = 64;  // query rows per CTA
    constexpr int kKv = C::kBc;  // keys per tile
    constexpr int kStages = kBwdStages;
    constexpr int kGroupThreads = 128;
    constexpr int kFrags = kD256PFragments * kGroupThreads;  // uint4 per hand-off buffer

    extern __shared__ __align__(1024) unsigned char smem[];
    elem_t* sQ = reinterpret_cast<elem_t*>(smem);  // (kRows, d); holds dQ at the end
    elem_t* sdO = sQ + kRows * kD;                 // (kRows, d)
    elem_t* sK = sdO + kRows * kD;                 // kStages x (kKv, d)
    elem_t* sV = sK + kStages * kKv * kD;          // kStages x (kKv, d)
    uint4* sP = reinterpret_cast<uint4*>(sV + kStages * kKv * kD);  // 2 x P fragments
    uint4* sdS = sP + 2 * kFrags;                                    // 2 x dS fragments
    float* sLse = reinterpret_cast<float*>(sdS + 2 * kFrags);       // kRows, log2 units
    float* sDelta = sLse + kRows;                                   // kRows
    uint64_t* bars = reinterpret_cast<uint64_t*>(sDelta + kRows);
    uint64_t& rows_full = bars[0];  // Q, dO, lse and delta have landed
    uint64_t* full = bars + 1;      // per stage: the K and V tiles have landed
    uint64_t* empty = full + kStages;

    // Causal CTAs with more key tiles start first, as in bwd_dq.
    const int q_block = p.is_causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
    const int head = blockIdx.y;
    const int batch = blockIdx.z;
    const int head_k = head / (p.n_heads / p.n_heads_k);
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int q0 = q_block * kRows;
    if (q0 >= p.seqlen_q) return;  // the whole CTA, before any barrier
    const int q_rows = min(kRows, p.seqlen_q - q0);
    const int shift = p.seqlen_k - p.seqlen_q;
    const KeyTiles visible = key_tiles<kKv>(p, q0, q_rows);
    const int n_tiles = visible.end - visible.first;

    constexpr uint32_t kRowsBytes = 2 * kRows * kD * sizeof(elem_t) + 2 * kRows * sizeof(float);
    constexpr uint32_t kStageBytes = 2 * kKv * kD * sizeof(elem_t);
    ws_setup<kStages>(maps, &rows_full, full, empty);

    if (warp < 4) {
        warpgroup_reg_dealloc<kBwdProducerRegs>();
        if (warp != 0 || lane != 0) return;
        // ---- loader: one thread ------------------------------------------------------------
        mbarrier_arrive_expect_tx(&rows_full, kRowsBytes);
        const int map_q0 = origin.q_row + q0;
        tma_load_5d(smem_addr(sQ), maps.tma_q, &rows_full, 0, map_q0, 0, head, origin.map_batch);
        tma_load_5d(smem_addr(sdO), maps.tma_do, &rows_full, 0, map_q0, 0, head, origin.map_batch);
        const int64_t row = (int64_t(batch) * p.n_heads + head) * origin.stats_rows + q0;
        bulk_load(smem_addr(sLse), p.lse_log2_tiles + row, kRows * sizeof(float), &rows_full);
        bulk_load(smem_addr(sDelta), p.delta_tiles + row, kRows * sizeof(float), &rows_full);
#pragma unroll 1
        for (int i = 0; i < n_tiles; ++i) {
            const int stage = i % kStages;
            const int key0 = (visible.first + i) * kKv;
            mbarrier_wait(&empty[stage], ((i / kStages) & 1) ^ 1);
            mbarrier_arrive_expect_tx(&full[stage], kStageBytes);
            const int map_key0 = origin.k_row + key0;
            tma_load_5d(smem_addr(sK + stage * kKv * kD), maps.tma_k, &full[stage], 0, map_key0, 0,
                        head_k, origin.map_batch);
            tma_load_5d(smem_addr(sV + stage * kKv * kD), maps.tma_v, &full[stage], 0, map_key0, 0,
                        head_k, origin.map_batch);
        }
        return;
    }

    // ---- consumers ---------------------------------------------------------------------------
    warpgroup_reg_alloc<kBwdConsumerRegs>();
    const bool scores_group = warp < 8;  // warpgroup 1: S, P; warpgroup 2: dP, dS
    const int gtid = threadIdx.x % kGroupThreads;
    const int row0 = (warp % 4) * 16;  // the warp's query rows within the CTA's 64
    const WindowBounds window(p);
    constexpr int kHalf = kD / 2;  // dQ columns per warpgroup
    float dQ[kHalf / 8][4];
#pragma unroll
    for (int nd = 0; nd < kHalf / 8; ++nd)
#pragma unroll
        for (int e = 0; e < 4; ++e) dQ[nd][e] = 0.f;
    mbarrier_wait(&rows_full, 0);
    // This thread's two query rows (lane / 4 and lane / 4 + 8 of the warp's 16).
    float lse[2], delta[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        lse[r] = sLse[row0 + lane / 4 + 8 * r];
        delta[r] = sDelta[row0 + lane / 4 + 8 * r];
    }
    const uint32_t q_tile = smem_addr(sQ), do_tile = smem_addr(sdO);
    // The warpgroup's dQ columns: slabs 0-1 (scores group) or 2-3 (grads group) of K.
    const int col_slab = scores_group ? 0 : kHalf / 64;

    for (int i = 0; i < n_tiles; ++i) {
        const int stage = i % kStages;
        const int buf = i % 2;
        const int tile = visible.first + i;
        const uint32_t k_tile = smem_addr(sK + stage * kKv * kD);
        const uint32_t v_tile = smem_addr(sV + stage * kKv * kD);
        mbarrier_wait(&full[stage], (i / kStages) & 1);
        if (origin.zero_tails && (tile + 1) * kKv > p.seqlen_k)  // (the same in both groups)
            zero_tail_rows<kKv>(sK + stage * kKv * kD, sV + stage * kKv * kD,
                                p.seqlen_k - tile * kKv, threadIdx.x - kBwdProducerThreads);

        float S[1][kKv / 8][4];  // S then P (scores group); dP then dS (grads group)
        uint32_t a[1][kKv / 16][4];
        wgmma_fence_operands(wg::flat(S[0]));
        wgmma_fence();
        wg::rows_rows<kRows, kKv>(S[0], scores_group ? q_tile : do_tile,
                                  scores_group ? k_tile : v_tile);
        wgmma_commit();
        wgmma_wait<0>();
        wgmma_fence_operands(wg::flat(S[0]));
        if (scores_group) {
            const bool mask = tile >= visible.mask_from || tile < visible.mask_below;
#pragma unroll
            for (int nj = 0; nj < kKv / 8; ++nj)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float x = ex2(fmaf(S[0][nj][e], p.scale_log2, -lse[e / 2]));
                    if (mask) {
                        const int key = tile * kKv + fragment_column(nj, e);
                        const int row = q0 + row0 + lane / 4 + 8 * (e / 2);
                        if (key >= p.seqlen_k || window.hides(key - row - shift)) x = 0.f;
                    }
                    S[0][nj][e] = x;
                }
            pack_a_fragments<C::kBf16>(a, S);
            uint4* p_slot = sP + buf * kFrags + gtid;
            if (i >= 2) named_barrier_sync(kD256PFreeBarrier + buf, kBwdConsumerThreads);
            put_fragments(p_slot, a);
            named_barrier_arrive(kD256PReadyBarrier + buf, kBwdConsumerThreads);
            // dS from the grads group, as the A operand of this group's half of dQ += dS K.
            const uint4* ds_slot = sdS + buf * kFrags + gtid;
            named_barrier_sync(kD256DsReadyBarrier + buf, kBwdConsumerThreads);
            take_fragments(a, ds_slot);
            if (i + 2 < n_tiles)
                named_barrier_arrive(kD256DsFreeBarrier + buf, kBwdConsumerThreads);
        } else {
            const uint4* p_slot = sP + buf * kFrags + gtid;
            named_barrier_sync(kD256PReadyBarrier + buf, kBwdConsumerThreads);
            take_fragments(a, p_slot);
            if (i + 2 < n_tiles)
                named_barrier_arrive(kD256PFreeBarrier + buf, kBwdConsumerThreads);
            // dS = P (dP - delta), P read back from its 16-bit fragments (the value the
            // scores group rounded; each row's delta).
#pragma unroll
            for (int nj = 0; nj < kKv / 8; ++nj)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    S[0][nj][e] = fragment_value(a, nj, e) * (S[0][nj][e] - delta[e / 2]);
            pack_a_fragments<C::kBf16>(a, S);
            uint4* ds_slot = sdS + buf * kFrags + gtid;
            if (i >= 2) named_barrier_sync(kD256DsFreeBarrier + buf, kBwdConsumerThreads);
            put_fragments(ds_slot, a);
            named_barrier_arrive(kD256DsReadyBarrier + buf, kBwdConsumerThreads);
        }
        // This warpgroup's half of dQ += dS K.
        wgmma_fence_operands(wg::flat(dQ));
        wgmma_fence();
        wg::regs_cols<kKv, kKv / 16, kHalf>(dQ, a, k_tile + col_slab * kKv * 128);
        wgmma_commit();
        wgmma_wait<0>();  // this warp is done with the stage
        wgmma_fence_operands(wg::flat(dQ));
        __syncwarp();
        if (lane == 0) mbarrier_arrive(&empty[stage]);
    }

    // dQ = scale * dS K through shared memory (over Q, once the scores group's last GEMM has
    // read it), each warpgroup its half of the columns; then every consumer thread stores rows.
    named_barrier_sync(kD256EpilogueBarrier, kBwdConsumerThreads);
    acc_to_tile<kRows, kHalf / 8>(sQ + col_slab * kRows * 64, dQ, p.softmax_scale, row0);
    named_barrier_sync(kD256EpilogueBarrier, kBwdConsumerThreads);
    store_rows_by<C, kRows, kBwdConsumerThreads>(
        row_of(static_cast<elem_t*>(p.dq), p.dq_strides, batch, q0, head), sQ, p.dq_strides.seq,
        q_rows, threadIdx.x - kBwdProducerThreads);
}

}  // namespace cudaflash
