// KernelConfig: the compile-time config of one forward kernel, from the -D macros that
// cudaflash.config.KernelConfig.nvcc_defines() produces. The validity rules repeat
// KernelConfig.errors() so a config compiled by hand fails with the same explanation.
//
// Build one config by hand (what build_cubins.py does):
//   nvcc -cubin -gencode arch=compute_90,code=sm_90 -O3 -std=c++17 -I cuda_src \
//        -DCF_DTYPE_BF16=1 -DCF_D_HEAD=128 -DCF_B_R=128 -DCF_B_C=64 -DCF_N_WARPS=4 \
//        -DCF_ASYNC_COPY=1 -DCF_EAGER_LOAD_BLOCKS=1 -DCF_SWIZZLED=1 -DCF_Q_FRAGS=2 \
//        -DCF_K_FRAGS=2 -DCF_V_FRAGS=0 -DCF_DOUBLE_BUFFER=1 -DCF_OPTIMIZED_SOFTMAX=1 \
//        -DCF_MIN_CTAS_PER_SM=1 -DCF_WGMMA=0 -DCF_EXP2_SOFTMAX=1 -DCF_KV_REVERSE=1 \
//        -DCF_D_HEAD_TILED=1 -DCF_O_STORE_CACHE=0 -DCF_WARP_SPECIALIZED=0 -DCF_PERSISTENT=0 \
//        cuda_src/flash_fwd.cu -o fwd.cubin
// (wgmma configs: -gencode arch=compute_90a,code=sm_90a; Hopper only)
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <type_traits>

#include "ptx.cuh"  // StoreCache

#if !defined(CF_DTYPE_BF16) || !defined(CF_D_HEAD) || !defined(CF_B_R) || !defined(CF_B_C) ||   \
    !defined(CF_N_WARPS) || !defined(CF_ASYNC_COPY) || !defined(CF_EAGER_LOAD_BLOCKS) ||          \
    !defined(CF_SWIZZLED) || !defined(CF_Q_FRAGS) || !defined(CF_K_FRAGS) ||                      \
    !defined(CF_V_FRAGS) || !defined(CF_DOUBLE_BUFFER) || !defined(CF_OPTIMIZED_SOFTMAX) ||  \
    !defined(CF_MIN_CTAS_PER_SM) || !defined(CF_WGMMA) || !defined(CF_EXP2_SOFTMAX) ||        \
    !defined(CF_KV_REVERSE) || !defined(CF_D_HEAD_TILED) || !defined(CF_O_STORE_CACHE) ||   \
    !defined(CF_WARP_SPECIALIZED) || !defined(CF_PERSISTENT)
#error "define every CF_* macro: see cudaflash.config.KernelConfig.nvcc_defines()"
#endif

namespace cudaflash {

constexpr bool is_even_pow2_or_zero(int n) { return n == 0 || (n >= 2 && (n & (n - 1)) == 0); }

// Largest legal *_FRAGS value for a reduction dimension of k_dim columns: with double
// buffering two slice groups must alternate; without it, a value covering the whole operand
// would be the same kernel as 0.
constexpr int max_load_frags(int k_dim, bool double_buffer) {
    return double_buffer ? k_dim / 16 : k_dim / 8 - 1;
}

struct KernelConfig {
    static constexpr bool kBf16 = CF_DTYPE_BF16;
    static constexpr int kDHead = CF_D_HEAD;
    static constexpr int kBr = CF_B_R;  // query rows per CTA
    static constexpr int kBc = CF_B_C;  // key rows per KV iteration
    static constexpr int kWarps = CF_N_WARPS;
    static constexpr bool kAsyncCopy = CF_ASYNC_COPY;
    static constexpr bool kEagerLoad = CF_EAGER_LOAD_BLOCKS;
    static constexpr bool kSwizzled = CF_SWIZZLED;
    static constexpr int kQFrags = CF_Q_FRAGS;
    static constexpr int kKFrags = CF_K_FRAGS;
    static constexpr int kVFrags = CF_V_FRAGS;
    static constexpr bool kDoubleBuffer = CF_DOUBLE_BUFFER;
    static constexpr bool kOptimizedSoftmax = CF_OPTIMIZED_SOFTMAX;
    // __launch_bounds__ occupancy: registers per thread <= 65536 / (kMinCtasPerSm * threads).
    static constexpr int kMinCtasPerSm = CF_MIN_CTAS_PER_SM;
    // GEMMs on Hopper's warpgroup MMA (wgmma, sm_90a) instead of warp-level mma.sync.
    static constexpr bool kWgmma = CF_WGMMA;
    // Softmax in base-2 units with the scale folded into one FFMA (else natural units).
    static constexpr bool kExp2Softmax = CF_EXP2_SOFTMAX;
    // KV blocks last to first (else first to last).
    static constexpr bool kKvReverse = CF_KV_REVERSE;
    // Shared tiles as (rows, 64) slabs (else whole rows of d_head elements): smem_layout.cuh.
    static constexpr bool kDHeadTiled = CF_D_HEAD_TILED;
    static constexpr StoreCache kOStoreCache = StoreCache(CF_O_STORE_CACHE);
    // A producer warpgroup loads Q and a ring of K/V stages for kWarps consumer warps
    // (fwd_warp_specialized.cuh); kWarps counts the consumers only.
    static constexpr bool kWarpSpecialized = CF_WARP_SPECIALIZED;
    // Persistent CTAs (config field persistent): one CTA per SM walks the padded batch's
    // tiles when the host gave tensor maps, the producer loading the next tile's Q (a second
    // Q buffer) and K/V while the consumers finish this one (fwd_warp_specialized.cuh).
    static constexpr bool kPersistent = CF_PERSISTENT;
    // 3: +1-11% over 2 at d128 (perf log v8); d256 fits two (Q 64 KB + 2 x 2 x 32 KB of 227);
    // persistent configs two, for their second Q buffer.
    static constexpr int kKvStages =
        kWarpSpecialized ? (kDHead == 256 || kPersistent ? 2 : 3) : 1;
    static constexpr int kQBuffers = kPersistent ? 2 : 1;
    // Three consumer warpgroups leave the producer 32 registers, where its cp.async copies of
    // paged or indexed caches spilled: such a config compiles no *_kvcache entries (they
    // trap; config.py needs_tensor_maps: the runtime never selects it for those calls).
    static constexpr bool kServesKvcache = !(kWarpSpecialized && kWarps == 12);

    using elem_t = std::conditional_t<kBf16, __nv_bfloat16, __half>;

    static constexpr int kThreads = 32 * kWarps + (kWarpSpecialized ? 128 : 0);
    // The threads that copy tiles between global and shared memory: all, or the producer's.
    static constexpr int kCopyThreads = kWarpSpecialized ? 128 : kThreads;
    static constexpr int kRowsPerWarp = kBr / kWarps;
    static constexpr int kMTiles = kRowsPerWarp / 16;  // m16 tiles per warp
    static constexpr int kSlab = 64;                   // smem/gmem copies work in 64-column slabs
    static constexpr int kSlabs = kDHead / kSlab;
    static constexpr int kSlabRowBytes = kSlab * int(sizeof(elem_t));  // 128: a swizzle row
    // Bytes from one row of a shared tile to the next: one slab row, or a whole d_head row.
    static constexpr int kRowPitchBytes =
        kDHeadTiled ? kSlabRowBytes : kDHead * int(sizeof(elem_t));
    // Bytes from a row's slab to its next slab, in a tile of `rows` rows.
    static constexpr int slab_pitch_bytes(int rows) {
        return kDHeadTiled ? rows * kSlabRowBytes : kSlabRowBytes;
    }
    static constexpr int kRowsPerCopyPass = kCopyThreads / 8;  // 8 threads x 16 B: a slab row

    static constexpr int kDSlices = kDHead / 16;  // k16 slices of the QK^T reduction
    static constexpr int kKvSlices = kBc / 16;    // k16 slices of the PV reduction
    static constexpr int kSTiles = kBc / 8;       // n8 tiles of S per m16 tile
    static constexpr int kOTiles = kDHead / 8;    // n8 tiles of O per m16 tile

    // k16 slices moved smem -> registers per load step (the whole operand when *_FRAGS is 0).
    static constexpr int kKGroup = kKFrags == 0 ? kDSlices : kKFrags / 2;
    static constexpr int kVGroup = kVFrags == 0 ? kKvSlices : kVFrags / 2;

    static_assert(kDHead == 64 || kDHead == 128 || kDHead == 256, "d_head must be 64, 128 or 256");
    static_assert(kWarps == 4 || kWarps == 8 || (kWarps == 12 && kWarpSpecialized),
                  "n_warps must be 4 or 8 (12: three consumer warpgroups, warp-specialized)");
    static_assert(kBc == 32 || kBc == 64 || kBc == 128, "B_c must be 32, 64 or 128");
    static_assert(kBr % kWarps == 0 && (kRowsPerWarp == 16 || kRowsPerWarp == 32),
                  "B_r / n_warps must be 16 or 32: each warp owns whole m16 mma tiles");
    static_assert(kBr % kRowsPerCopyPass == 0 && kBc % kRowsPerCopyPass == 0,
                  "B_r and B_c must be multiples of the rows one copy pass covers (threads / 8)");
    static_assert(is_even_pow2_or_zero(kQFrags) && is_even_pow2_or_zero(kKFrags) &&
                      is_even_pow2_or_zero(kVFrags),
                  "*_mma_load_K_fragments must be 0 or an even power of two");
    static_assert(kQFrags <= max_load_frags(kDHead, kDoubleBuffer) &&
                      kKFrags <= max_load_frags(kDHead, kDoubleBuffer) &&
                      kVFrags <= max_load_frags(kBc, kDoubleBuffer),
                  "*_mma_load_K_fragments too large for the reduction dimension");
    static_assert(kQFrags == 0 || kQFrags == kKFrags,
                  "Q_mma_load_K_fragments must be 0 or equal K_mma_load_K_fragments");
    static_assert(!kDoubleBuffer || kQFrags || kKFrags || kVFrags,
                  "mma_double_buffer_loads needs an operand loaded in slices");
    static_assert(!kEagerLoad || kAsyncCopy, "eager_load_blocks needs async_copy");
    static_assert(kMinCtasPerSm >= 1 && kMinCtasPerSm <= 4, "min_ctas_per_sm must be 1..4");
    static_assert(!kWgmma || (kRowsPerWarp == 16 && kBc >= 64 && kSwizzled &&
                              kAsyncCopy && kQFrags == 0 && kKFrags == 0 && kVFrags == 0 &&
                              !kDoubleBuffer),
                  "wgmma: 16 rows per warp, B_c >= 64, swizzled cp.async tiles, "
                  "no *_mma_load_K_fragments or mma_double_buffer_loads (no ldmatrix path)");
    static_assert(CF_O_STORE_CACHE >= 0 && CF_O_STORE_CACHE <= 2,
                  "o_store_cache must be 0 (default), 1 (streaming) or 2 (no_allocate)");
    static_assert(kDHeadTiled || (kDHead > 64 && !kWgmma),
                  "d_head_tiled=0 needs d_head >= 128 (one slab at 64) and no wgmma");
    static_assert(!kWarpSpecialized || (kWgmma && (kWarps == 8 || kWarps == 12) &&
                                        kMinCtasPerSm == 1 && kEagerLoad),
                  "warp_specialized: wgmma, n_warps = 8 or 12 (two or three consumer "
                  "warpgroups), min_ctas_per_sm = 1, eager_load_blocks");
    static_assert(!kPersistent || kWarpSpecialized, "persistent needs warp_specialized");
#if CF_WGMMA && defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "wgmma configs compile for sm_90a only: -gencode arch=compute_90a,code=sm_90a"
#endif
};

}  // namespace cudaflash
