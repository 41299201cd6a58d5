// BwdConfig: the compile-time config of one backward module (cuda_src/flash_bwd.cu), from
// the -D macros that cudaflash.backward_config.BackwardConfig.nvcc_defines() produces. The validity
// rules repeat BackwardConfig.errors().
//
// Build one config by hand (what build_cubins.py does):
//   nvcc -cubin -gencode arch=compute_90,code=sm_90 -O3 -std=c++17 -I cuda_src \
//        -DCF_DTYPE_BF16=1 -DCF_D_HEAD=128 -DCF_B_R=64 -DCF_B_C=64 -DCF_N_WARPS=4 \
//        -DCF_WGMMA=0 -DCF_WARP_SPECIALIZED=0 -DCF_WS_QUERY_ROWS=64 cuda_src/flash_bwd.cu -o bwd.cubin
// (CF_WGMMA=1 needs the arch-specific target: arch=compute_90a,code=sm_90a.)
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <type_traits>

#if !defined(CF_DTYPE_BF16) || !defined(CF_D_HEAD) || !defined(CF_B_R) || !defined(CF_B_C) || \
    !defined(CF_N_WARPS) || !defined(CF_WGMMA) || !defined(CF_WARP_SPECIALIZED) ||        \
    !defined(CF_WS_QUERY_ROWS)
#error "define every CF_* macro: see cudaflash.backward_config.BackwardConfig.nvcc_defines()"
#endif

namespace cudaflash {

struct BwdConfig {
    static constexpr bool kBf16 = CF_DTYPE_BF16;
    static constexpr int kDHead = CF_D_HEAD;
    static constexpr int kWarps = CF_N_WARPS;
    static constexpr int kThreads = 32 * kWarps;
    // Each warp owns 16 rows of its CTA's own tile: keys in cudaflash_bwd_dkdv, query rows in
    // cudaflash_bwd_dq. Each kernel streams tiles of the other kind past them:
    static constexpr int kCtaRows = 16 * kWarps;
    static constexpr int kBr = CF_B_R;  // query rows per tile streamed by the dK/dV kernel
    static constexpr int kBc = CF_B_C;  // keys per tile streamed by the dQ kernel

    using elem_t = std::conditional_t<kBf16, __nv_bfloat16, __half>;

    // What the shared tile and copy helpers (smem_layout.cuh, copy.cuh) read.
    static constexpr int kSlab = 64;
    static constexpr int kSlabs = kDHead / kSlab;
    static constexpr int kRowsPerCopyPass = kThreads / 8;
    static constexpr bool kSwizzled = true;
    static constexpr bool kDHeadTiled = true;  // (rows, 64) slabs: smem_layout.cuh
    static constexpr bool kAsyncCopy = true;
    // The dK/dV kernels' GEMMs on Hopper's warpgroup MMA (sm_90a); the dQ kernel keeps
    // mma.sync. Also read by copy.cuh: cp.async writes reach wgmma through a proxy fence.
    static constexpr bool kWgmma = CF_WGMMA;

    // d256: the deterministic scheme only, its dK/dV kernel either mma.sync (dK and dV in two
    // passes) or warp-specialized (bwd_warp_specialized_d256.cuh): flash_bwd.cu,
    // bwd_dkdv_deterministic.
    static_assert(kDHead == 64 || kDHead == 128 ||
                      (kDHead == 256 &&
                       (!CF_WGMMA || (CF_WARP_SPECIALIZED && CF_WS_QUERY_ROWS == 64))),
                  "backward: d_head must be 64 or 128, or 256 without wgmma or warp-specialized "
                  "with ws_query_rows 64");
    static_assert(kWarps == 4 || kWarps == 8, "n_warps must be 4 or 8");
    static_assert(kBr % 16 == 0 && kBr % kRowsPerCopyPass == 0 && kBr <= 128,
                  "B_r must be a multiple of 16 and of threads / 8, at most 128");
    static_assert(kBc % 16 == 0 && kBc % kRowsPerCopyPass == 0 && kBc <= 128,
                  "B_c must be a multiple of 16 and of threads / 8, at most 128");

    // cudaflash_bwd_dkdv_dq: dS^T of a step is one (keys, 64) slab, so B_r <= 64; the warps
    // split the step's (B_r, d_head) dQ product into 16-row blocks x kDqCols columns, which
    // must be whole k16 slices, within one 64-column slab or whole slabs.
    static_assert(kBr <= 64 && kWarps % (kBr / 16) == 0,
                  "B_r must be at most 64 and B_r / 16 must divide n_warps");
    static constexpr int kDqCols = kDHead / (kWarps / (kBr / 16));
    static_assert(kDqCols % 16 == 0 && (kDqCols <= 64 || kDqCols % 64 == 0),
                  "d_head / (n_warps / (B_r / 16)) must be 16, 32, 48, 64 or a multiple of 64");

    // wgmma: each warpgroup (4 warps) owns 64 keys of the dK/dV CTA; the step's dQ = dS K is
    // one 64-row wgmma (B_r = 64 query rows) whose d_head columns the warpgroups split.
    static constexpr int kWarpgroups = kWarps / 4;
    static constexpr int kDqWgCols = kDHead / kWarpgroups;
    static_assert(!kWgmma || kBr == 64, "wgmma: B_r must be 64 (one wgmma's M for dQ = dS K)");
    // wgmma, atomic scheme, d128: the step's dQ share (B_r rows x d_head, float32) goes
    // through a double-buffered shared tile to the accumulator by one bulk reduction (the
    // rows are contiguous there as in the accumulator) instead of per-lane float4 atomics.
    // H100 A/B (perf log "Backward: dQ by bulk reductions"): d128 +1.8% (median of 12), d64
    // -2.5% (its 16 KB tile's bank-conflicted stores cost more than its atomics), so d64
    // keeps the atomics. cudaflash.backward_config.BackwardConfig.dkdv_dq_smem_bytes mirrors this.
    static constexpr bool kBulkDq = kWgmma && kDHead == 128;
    static constexpr int kDqRowFloats = kDHead;

    // The atomic scheme's dK/dV + dQ kernel warp-specialized (bwd_warp_specialized.cuh): a
    // producer warpgroup (loads, dQ bulk reductions) beside the kWarps consumer warps, so its
    // entries launch kFusedThreads threads.
    static constexpr bool kWarpSpecialized = CF_WARP_SPECIALIZED;
    static_assert(!kWarpSpecialized || (kWgmma && kWarps == 8 && kBr == 64),
                  "warp_specialized needs wgmma, n_warps 8 and B_r 64");
    static constexpr int kFusedThreads = kThreads + (kWarpSpecialized ? 128 : 0);
    // Query rows per step of the warp-specialized kernel (its own tile: the module's other
    // kernels keep B_r): 64, or 128 (S^T and dP^T as N = 128 wgmmas, dQ as two M = 64 halves).
    static constexpr int kWsQueryRows = CF_WS_QUERY_ROWS;
    // d64's warp-specialized kernel: each consumer warpgroup computes its own keys' share of a
    // step's dQ (all columns), the two shares summed in shared memory, so neither warpgroup
    // waits for the other's dS^T and they run half a step apart (perf log, "Backward v6").
    // d128's (whose share's accumulators do not fit beside dK and dV) compute dQ over both
    // warpgroups' keys, each half the columns, one step late (bwd_warp_specialized.cuh).
    static constexpr bool kWsDqOwnKeys = kWarpSpecialized && kDHead == 64;
    static_assert(kWsQueryRows == 64 || (kWsQueryRows == 128 && kWarpSpecialized),
                  "ws_query_rows must be 64, or 128 with warp_specialized");
};

}  // namespace cudaflash
