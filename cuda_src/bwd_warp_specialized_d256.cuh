// The deterministic scheme's dK/dV kernel at d256 on Hopper (BwdConfig::kWarpSpecialized with
// kDHead 256; sm_90a, wgmma): design-notes.md, "d256 backward: the plan".
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
// fragment layout. dQ comes from the module's dQ kernel (bwd_dq), as in the deterministic
// scheme at every head dim.
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

// Shared memory (cudaflash.backward_config.BackwardConfig.dkdv_smem_bytes mirrors it):
// K, V (64 x 256) | kBwdStages x Q, dO (64 x 256) | 2 x P^T fragments (128 threads x 64 B) |
// kBwdStages x lse, delta (64 float32) | mbarriers (1 + 2 * kBwdStages).
template <bool kWindow>
__device__ __forceinline__ void bwd_dkdv_ws_d256(const BwdParams& p) {
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
    // (head, first query row) of each step, walked with counters as the d128 kernel does.
    struct StepWalk {
        int head, q0, first_q0, end_q0;
        __device__ __forceinline__ void next() {
            q0 += kQ;
            if (q0 == end_q0) {
                q0 = first_q0;
                ++head;
            }
        }
    };
    const StepWalk walk0{head_k * group, tiles.first * kQ, tiles.first * kQ,
                         (tiles.first + tiles.per_head) * kQ};

    constexpr uint32_t kKvBytes = 2 * kKeys * kD * sizeof(elem_t);
    constexpr uint32_t kStageBytes = 2 * kQ * kD * sizeof(elem_t) + 2 * kQ * sizeof(float);
    if (threadIdx.x == 0) {
        tma_prefetch_map(p.tma_k);
        tma_prefetch_map(p.tma_v);
        tma_prefetch_map(p.tma_q);
        tma_prefetch_map(p.tma_do);
        mbarrier_init(&kv_full, 1);
#pragma unroll
        for (int s = 0; s < kStages; ++s) {
            mbarrier_init(&full[s], 1);
            mbarrier_init(&empty[s], kBwdConsumerThreads / 32);  // every consumer warp
        }
        fence_proxy_async_shared();
    }
    __syncthreads();

    if (warp < 4) {
        warpgroup_reg_dealloc<kBwdProducerRegs>();
        if (warp != 0 || lane != 0) return;
        // ---- loader: one thread, as bwd_dkdv_dq_ws's ------------------------------------
        mbarrier_arrive_expect_tx(&kv_full, kKvBytes);
        tma_load_5d(smem_addr(sK), p.tma_k, &kv_full, 0, key0, 0, head_k, batch);
        tma_load_5d(smem_addr(sV), p.tma_v, &kv_full, 0, key0, 0, head_k, batch);
        StepWalk at = walk0;
#pragma unroll 1
        for (int step = 0; step < n_steps; ++step, at.next()) {
            const int stage = step % kStages;
            mbarrier_wait(&empty[stage], ((step / kStages) & 1) ^ 1);
            mbarrier_arrive_expect_tx(&full[stage], kStageBytes);
            tma_load_5d(smem_addr(sQ + stage * kQ * kD), p.tma_q, &full[stage], 0, at.q0, 0,
                        at.head, batch);
            tma_load_5d(smem_addr(sdO + stage * kQ * kD), p.tma_do, &full[stage], 0, at.q0, 0,
                        at.head, batch);
            const int64_t row = (int64_t(batch) * p.n_heads + at.head) * dq_accum_rows(p) + at.q0;
            bulk_load(smem_addr(sLse + stage * kQ), p.lse_log2_tiles + row, kQ * sizeof(float),
                      &full[stage]);
            bulk_load(smem_addr(sDelta + stage * kQ), p.delta_tiles + row, kQ * sizeof(float),
                      &full[stage]);
        }
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

    StepWalk at = walk0;
    for (int step = 0; step < n_steps; ++step, at.next()) {
        const int stage = step % kStages;
        const int buf = step % 2;
        const int q0 = at.q0;
        const uint32_t q_tile = smem_addr(sQ + stage * kQ * kD);
        const uint32_t do_tile = smem_addr(sdO + stage * kQ * kD);
        uint4* p_slot = sP + buf * kD256PFragments * kGroupThreads + gtid;
        mbarrier_wait(&full[stage], (step / kStages) & 1);

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
#pragma unroll
            for (int i = 0; i < kD256PFragments; ++i)
                p_slot[i * kGroupThreads] = make_uint4(a[0][i][0], a[0][i][1], a[0][i][2],
                                                       a[0][i][3]);
            named_barrier_arrive(kD256PReadyBarrier + buf, kBwdConsumerThreads);
            // dV += P^T dO
            wgmma_fence_operands(wg::flat(acc));
            wgmma_fence();
            wg::regs_tile<kQ, kQ / 16>(acc, a, do_tile);
        } else {
            named_barrier_sync(kD256PReadyBarrier + buf, kBwdConsumerThreads);
#pragma unroll
            for (int i = 0; i < kD256PFragments; ++i) {
                const uint4 f = p_slot[i * kGroupThreads];
                a[0][i][0] = f.x;
                a[0][i][1] = f.y;
                a[0][i][2] = f.z;
                a[0][i][3] = f.w;
            }
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

}  // namespace cudaflash
