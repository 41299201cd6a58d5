// Thin wrappers over the PTX instructions the kernel is built from (sm_80+):
// cp.async (global -> shared without registers), ldmatrix (shared -> mma fragments),
// mma.sync m16n8k16 with fp32 accumulators, and ex2.approx.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace cudaflash {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte asynchronous copy; src_bytes = 0 writes zeros and reads nothing (masked tail rows).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

// Four 8x8 b16 matrices; lane l supplies the row address of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// D (16x8 fp32) += A (16x16, row) * B (16x8, col).
template <bool kBf16>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    if constexpr (kBf16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

// Writes to shared memory through the generic proxy (cp.async, st.shared) become visible to
// wgmma's operand reads, which go through the async proxy, only after this fence and then a
// barrier (sm_90).
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Cache hint of a global store (cudaflash.config.O_STORE_CACHE, in this order): none; .cs,
// streaming (likely accessed once: evict first from L1 and L2); L1::no_allocate (the line is
// not kept in L1).
enum class StoreCache { kDefault = 0, kStreaming = 1, kNoAllocate = 2 };

// 16-byte global store with cache hint kCache.
template <StoreCache kCache>
__device__ __forceinline__ void st_global_16(uint4* ptr, uint4 v) {
    if constexpr (kCache == StoreCache::kDefault) {
        *ptr = v;
    } else if constexpr (kCache == StoreCache::kStreaming) {
        asm volatile("st.global.cs.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(ptr), "r"(v.x),
                     "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
    } else {
        asm volatile("st.global.L1::no_allocate.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(ptr),
                     "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
    }
}

// 2^x on the SFU (one MUFU.EX2); ex2(-inf) = +0, which the masked softmax relies on.
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// tanh(x) on the SFU (one MUFU.TANH, sm_75+; max relative error about 2^-11), as flash-attn's
// softcapping uses: the error it puts on a softcapped score (cap * tanh) is below the bf16/fp16
// rounding of the same score in a half-precision reference.
__device__ __forceinline__ float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// log2(x) on the SFU (one MUFU.LG2); lg2(+0) = -inf.
__device__ __forceinline__ float lg2(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// Two floats -> one 32-bit register of two 16-bit values (lo in the low half), the layout of
// mma A fragments and of consecutive output columns.
template <bool kBf16>
__device__ __forceinline__ uint32_t pack_2(float lo, float hi) {
    if constexpr (kBf16) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    } else {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    }
}

// Accumulators -> A fragments, rounded to 16 bits: the m16n8 accumulator layout of two
// adjacent n8 tiles is exactly the m16k16 A-fragment layout (of mma.sync, and per warp of
// wgmma's register A operand), so P = S converts without touching shared memory.
template <bool kBf16, int kM, int kNTiles>
__device__ __forceinline__ void pack_a_fragments(uint32_t (&a)[kM][kNTiles / 2][4],
                                                 const float (&c)[kM][kNTiles][4]) {
#pragma unroll
    for (int mi = 0; mi < kM; ++mi)
#pragma unroll
        for (int kk = 0; kk < kNTiles / 2; ++kk) {
            a[mi][kk][0] = pack_2<kBf16>(c[mi][2 * kk][0], c[mi][2 * kk][1]);
            a[mi][kk][1] = pack_2<kBf16>(c[mi][2 * kk][2], c[mi][2 * kk][3]);
            a[mi][kk][2] = pack_2<kBf16>(c[mi][2 * kk + 1][0], c[mi][2 * kk + 1][1]);
            a[mi][kk][3] = pack_2<kBf16>(c[mi][2 * kk + 1][2], c[mi][2 * kk + 1][3]);
        }
}

// ---- Hopper (sm_90) synchronization of the warp-specialized forward kernel ----------------

// mbarrier: a 64-bit shared-memory barrier with an arrival count and a phase bit. A phase
// completes when `count` arrivals have been made; waiters name the parity of the phase they
// wait for (a fresh barrier is in phase 0, and a wait for parity 1 returns at once).
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count)
                 : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, int parity) {
    asm volatile(
        "{\n.reg .pred done;\n"
        "WAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)),
        "r"(parity)
        : "memory");
}

// Named barriers 1..15 (0 is __syncthreads): sync waits until `threads` threads have arrived,
// arrive counts this warp in without waiting. Both count whole warps.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// cp.async groups: wait until at most kPending of this thread's groups are in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Bulk reductions (sm_90): the TMA unit adds `bytes` (a multiple of 16) of float32 from
// shared memory to global memory (both 16-byte aligned), element by element and atomically,
// while the issuing thread goes on. Each thread tracks its own bulk groups: commit closes a
// group of its bulk operations; wait_read<N> returns once at most N of its groups still read
// their shared source (the source may then be overwritten); wait<N> once at most N are
// unfinished (their global writes done). The shared source, written through the generic
// proxy, must be fenced (fence_proxy_async_shared) by its writers and then barrier'd.
__device__ __forceinline__ void bulk_reduce_add_f32(float* global, uint32_t shared, uint32_t bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                 ::"l"(global), "r"(shared), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void bulk_commit() {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(kPending) : "memory");
#endif
}
template <int kPending>
__device__ __forceinline__ void bulk_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

// Tensor-map loads (TMA, sm_90): one thread asks the copy engine for a whole box of a tensor
// described by a CUtensorMap (params.cuh, Params::tma_*), which lands in shared memory in the
// map's swizzled layout, rows outside the tensor filled with zeros. The box's bytes count down
// an mbarrier's transaction count: the issuing thread first arrives on it with expect_tx (the
// box's size), and the barrier's phase completes once those bytes have landed. `map` is the
// generic address of a map in kernel-parameter, constant or global memory.
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)),
                 "r"(bytes)
                 : "memory");
#endif
}
__device__ __forceinline__ void tma_prefetch_map(const void* map) {
#if __CUDA_ARCH__ >= 900
    asm volatile("prefetch.tensormap [%0];\n" ::"l"(map) : "memory");
#endif
}
// The box at coordinates (c0, .., c4), innermost dimension first, into shared memory at dst.
__device__ __forceinline__ void tma_load_5d(uint32_t dst, const void* map, uint64_t* bar, int c0,
                                            int c1, int c2, int c3, int c4) {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n" ::"r"(dst),
        "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(smem_addr(bar))
        : "memory");
#endif
}

// A plain bulk copy (no tensor map) of `bytes` contiguous bytes from global memory to shared
// memory at dst, completing on `bar` as tma_load_5d's boxes do. Both addresses 16-byte aligned,
// `bytes` a multiple of 16; nothing is zero-filled, so the source must hold all of them.
__device__ __forceinline__ void bulk_load(uint32_t dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
        ::"r"(dst), "l"(src), "r"(bytes), "r"(smem_addr(bar))
        : "memory");
#endif
}

// setmaxnreg (sm_90a): this warpgroup's registers per thread move to kRegs (a multiple of 8 in
// 24..256), giving them back to the CTA's pool (dec) or taking them from it (inc).
template <int kRegs>
__device__ __forceinline__ void warpgroup_reg_dealloc() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void warpgroup_reg_alloc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

}  // namespace cudaflash
