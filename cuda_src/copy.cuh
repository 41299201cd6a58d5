// Cooperative copies between global memory and a shared (rows, d_head) tile. Thread t moves the
// 16-byte chunk t % 8 of slab rows t / 8, t / 8 + threads / 8, ...: one pass covers
// threads / 8 full rows, and each row is a fully coalesced 128-byte segment per slab.
// Rows at or past `valid_rows` are zero-filled (loads) or skipped (stores), so the caller
// never pads sequences to a block multiple.
#pragma once
#include "ptx.cuh"
#include "smem_layout.cuh"

namespace cudaflash {

// Paged K/V (Params::block_table): a tile's keys [key0, key0 + valid_rows) lie in at most 32
// pages of 2^page_shift >= 16 positions (tiles have <= 512 rows). Lane l of each warp holds the
// tile's l-th page (clamped into the cache), so a row's page is one shuffle away instead of a
// dependent global load per row (tile_page, then paged_row in every lane of the warp).
__device__ __forceinline__ int tile_page(const int32_t* pages, int key0, int valid_rows,
                                         int page_shift, int n_pages, unsigned lane) {
    const int first = key0 >> page_shift;
    const int last = (key0 + valid_rows - 1) >> page_shift;
    return first + int(lane) <= last ? min(max(pages[first + lane], 0), n_pages - 1) : 0;
}

// A tile of kRows keys (key0 a multiple of kRows) in pages of at least kRows positions lies in
// one page: where it starts (the caller then copies it as a contiguous tile).
template <int kRows, class T>
__device__ __forceinline__ const T* paged_tile(const T* head_base, const int32_t* pages, int key0,
                                               int page_shift, int n_pages, int64_t page_stride,
                                               int64_t row_stride) {
    const int page = min(max(pages[key0 >> page_shift], 0), n_pages - 1);
    return head_base + page * page_stride + int64_t(key0 & ((1 << page_shift) - 1)) * row_stride;
}

// Where row `row` of the tile starts. A row past the tile's valid rows gets page 0 or a clamped
// one and a row inside it: an address in the cache (its copy reads nothing: src-size 0).
template <class T>
__device__ __forceinline__ const T* paged_row(const T* head_base, int lane_page, int key0,
                                              int row, int page_shift, int64_t page_stride,
                                              int64_t row_stride) {
    const int mask = (1 << page_shift) - 1;
    const int page = __shfl_sync(0xffffffffu, lane_page, ((key0 & mask) + row) >> page_shift);
    return head_base + page * page_stride + int64_t((key0 + row) & mask) * row_stride;
}

template <class C, int kRows>
struct TileCopy {
    using elem_t = typename C::elem_t;
    static constexpr int kPasses = kRows / C::kRowsPerCopyPass;

    // Global -> shared. `gmem` points at the tile's first row; `row_stride` in elements. Only a
    // sequence's last block has rows to mask: full tiles take the branch-free path.
    __device__ __forceinline__ static void load(elem_t* smem, const elem_t* gmem,
                                                int64_t row_stride, int valid_rows) {
        if (valid_rows >= kRows) {
            load_rows<false>(smem, gmem, row_stride, kRows);
        } else {
            load_rows<true>(smem, gmem, row_stride, valid_rows);
        }
    }

    // Global -> shared for paged K/V: row r is key key0 + r of the table row `pages`
    // (tile_page, paged_row), rows at or past valid_rows zero-filled. Every thread of the
    // CTA takes part (the shuffles).
    __device__ __forceinline__ static void load_paged(elem_t* smem, const elem_t* head_base,
                                                      int64_t row_stride, int64_t page_stride,
                                                      const int32_t* pages, int key0,
                                                      int page_shift, int n_pages,
                                                      int valid_rows) {
        const int chunk = threadIdx.x % 8;
        const int row0 = threadIdx.x / 8;
        const int lane_page =
            tile_page(pages, key0, min(valid_rows, kRows), page_shift, n_pages, threadIdx.x % 32);
        // Rolled: unrolled, the passes' addresses made the 255-register configs spill.
#pragma unroll 1
        for (int pass = 0; pass < kPasses; ++pass) {
            const int row = row0 + pass * C::kRowsPerCopyPass;
            const bool valid = row < valid_rows;
            // A masked row's page is one tile_page zeroed or clamped: an address in the cache.
            const elem_t* src = paged_row(head_base, lane_page, key0, row, page_shift,
                                          page_stride, row_stride) + chunk * 8;
#pragma unroll
            for (int slab = 0; slab < C::kSlabs; ++slab) {
                elem_t* dst = smem + SmemTile<C>::template offset<kRows>(row, slab * 8 + chunk);
                if constexpr (C::kAsyncCopy) {
                    cp_async_16(smem_addr(dst), src + slab * C::kSlab, valid ? 16 : 0);
                } else {
                    uint4 v = valid ? *reinterpret_cast<const uint4*>(src + slab * C::kSlab)
                                    : make_uint4(0, 0, 0, 0);
                    *reinterpret_cast<uint4*>(dst) = v;
                }
            }
        }
    }

    template <bool kMaskRows>
    __device__ __forceinline__ static void load_rows(elem_t* smem, const elem_t* gmem,
                                                     int64_t row_stride, int valid_rows) {
        const int chunk = threadIdx.x % 8;
        const int row0 = threadIdx.x / 8;
#pragma unroll
        for (int slab = 0; slab < C::kSlabs; ++slab) {
#pragma unroll
            for (int pass = 0; pass < kPasses; ++pass) {
                const int row = row0 + pass * C::kRowsPerCopyPass;
                const bool valid = !kMaskRows || row < valid_rows;
                // A masked row still needs an address; row 0 always exists.
                const elem_t* src =
                    gmem + (valid ? row * row_stride : 0) + slab * C::kSlab + chunk * 8;
                elem_t* dst = smem + SmemTile<C>::template offset<kRows>(row, slab * 8 + chunk);
                if constexpr (C::kAsyncCopy) {
                    cp_async_16(smem_addr(dst), src, valid ? 16 : 0);
                } else {
                    uint4 v = valid ? *reinterpret_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
                    *reinterpret_cast<uint4*>(dst) = v;
                }
            }
        }
    }

    // Shared -> global, rows below valid_rows only, with cache hint kCache (ptx.cuh).
    template <StoreCache kCache = StoreCache::kDefault>
    __device__ __forceinline__ static void store(elem_t* gmem, const elem_t* smem,
                                                 int64_t row_stride, int valid_rows) {
        const int chunk = threadIdx.x % 8;
        const int row0 = threadIdx.x / 8;
#pragma unroll
        for (int slab = 0; slab < C::kSlabs; ++slab) {
#pragma unroll
            for (int pass = 0; pass < kPasses; ++pass) {
                const int row = row0 + pass * C::kRowsPerCopyPass;
                if (row < valid_rows) {
                    const uint4 v = *reinterpret_cast<const uint4*>(
                        smem + SmemTile<C>::template offset<kRows>(row, slab * 8 + chunk));
                    st_global_16<kCache>(reinterpret_cast<uint4*>(
                                             gmem + row * row_stride + slab * C::kSlab + chunk * 8),
                                         v);
                }
            }
        }
    }
};

// A (kRows, d_head) tile copied by kThreads threads of a warp-specialized role (`tid` in
// [0, kThreads)), in TileCopy's layout, with the row loop left rolled: a role with few
// registers (the producer) cannot hold every pass's 64-bit address at once. load_rows_by:
// global -> shared by cp.async, rows at or past valid_rows zero-filled; store_rows_by: shared
// -> global, rows below valid_rows only.
template <class C, int kRows, int kThreads>
__device__ __forceinline__ void load_rows_by(typename C::elem_t* smem,
                                             const typename C::elem_t* gmem, int64_t row_stride,
                                             int valid_rows, unsigned tid) {
    static_assert(kThreads % 8 == 0 && kRows % (kThreads / 8) == 0, "whole rows per pass");
    const int chunk = tid % 8;
#pragma unroll 1
    for (int row = tid / 8; row < kRows; row += kThreads / 8) {
        const bool valid = row < valid_rows;
        // A masked row still needs an address; row 0 always exists.
        const typename C::elem_t* src = gmem + (valid ? row * row_stride : 0) + chunk * 8;
#pragma unroll
        for (int slab = 0; slab < C::kSlabs; ++slab)
            cp_async_16(smem_addr(smem + SmemTile<C>::template offset<kRows>(row, slab * 8 + chunk)),
                        src + slab * C::kSlab, valid ? 16 : 0);
    }
}

// load_rows_by for paged K/V: row r is key key0 + r of the table row `pages` (tile_page,
// paged_row); all kThreads threads take part.
template <class C, int kRows, int kThreads>
__device__ __forceinline__ void load_paged_rows_by(typename C::elem_t* smem,
                                                   const typename C::elem_t* head_base,
                                                   int64_t row_stride, int64_t page_stride,
                                                   const int32_t* pages, int key0, int page_shift,
                                                   int n_pages, int valid_rows, unsigned tid) {
    static_assert(kThreads % 32 == 0 && kRows % (kThreads / 8) == 0, "whole rows per pass");
    const int chunk = tid % 8;
    const int lane_page =
        tile_page(pages, key0, min(valid_rows, kRows), page_shift, n_pages, tid % 32);
#pragma unroll 1
    for (int row = tid / 8; row < kRows; row += kThreads / 8) {
        const bool valid = row < valid_rows;
        const typename C::elem_t* src = paged_row(head_base, lane_page, key0, row, page_shift,
                                                  page_stride, row_stride) + chunk * 8;
#pragma unroll
        for (int slab = 0; slab < C::kSlabs; ++slab) {
            const int at = SmemTile<C>::template offset<kRows>(row, slab * 8 + chunk);
            cp_async_16(smem_addr(smem + at), src + slab * C::kSlab, valid ? 16 : 0);
        }
    }
}

// load_paged_rows_by for a full tile, as load_full_rows_by: a pass of kThreads / 8 rows (16
// for a warpgroup) lies in one page (pages hold >= 16 rows, aligned), so each lane keeps one
// shared address advanced by a constant and forms its global address from the pass's page
// (a shuffle with a warp-uniform index) and a row offset.
template <class C, int kRows, int kThreads>
__device__ __forceinline__ void load_full_paged_rows_by(typename C::elem_t* smem,
                                                        const typename C::elem_t* head_base,
                                                        int64_t row_stride, int64_t page_stride,
                                                        const int32_t* pages, int key0,
                                                        int page_shift, int n_pages,
                                                        unsigned tid) {
    using elem_t = typename C::elem_t;
    constexpr int kPassRows = kThreads / 8;
    static_assert(kPassRows % 16 == 0 && kRows % kPassRows == 0, "passes inside one page");
    constexpr int kSlabBytes = kRows * C::kSlab * int(sizeof(elem_t));
    constexpr int kPassBytes = kPassRows * C::kSlab * int(sizeof(elem_t));
    const int chunk = tid % 8;
    const int row0 = tid / 8;
    const int lane_page = tile_page(pages, key0, kRows, page_shift, n_pages, tid % 32);
    const uint32_t dst = smem_addr(smem + SmemTile<C>::template offset<kRows>(row0, chunk));
    const int mask = (1 << page_shift) - 1;
    const elem_t* lane_base = head_base + chunk * 8;
#pragma unroll 1
    for (int pass = 0; pass < kRows / kPassRows; ++pass) {
        const int first = (key0 & mask) + pass * kPassRows;  // the pass's first row, in pages
        const int page = __shfl_sync(0xffffffffu, lane_page, first >> page_shift);
        const elem_t* src = lane_base + page * page_stride +
                            int64_t(((key0 + pass * kPassRows) & mask) + row0) * row_stride;
#pragma unroll
        for (int slab = 0; slab < C::kSlabs; ++slab)
            cp_async_16(dst + pass * kPassBytes + slab * kSlabBytes, src + slab * C::kSlab, 16);
    }
}

// load_rows_by for a full tile (every row valid) by one warp, with few instructions per copy:
// the warp's rows repeat their swizzle every 8 rows (two passes of 4), so each lane keeps two
// shared addresses and one global pointer, advanced by constants, instead of recomputing the
// row, its mask, its 64-bit address and its swizzled offset for every pass (about 20
// instructions per pair of copies, which made the backward's loader warps its bottleneck:
// perf log, "Backward v4.2").
template <class C, int kRows>
__device__ __forceinline__ void load_full_rows_by_warp(typename C::elem_t* smem,
                                                       const typename C::elem_t* gmem,
                                                       int64_t row_stride, unsigned lane) {
    using elem_t = typename C::elem_t;
    constexpr int kPassRows = 4;                   // 32 lanes x 16 bytes = 4 rows of a slab
    constexpr int kSlabBytes = kRows * C::kSlab * int(sizeof(elem_t));
    constexpr int kPeriodBytes = 8 * C::kSlab * int(sizeof(elem_t));  // 8 rows of a slab
    static_assert(kRows % 8 == 0, "whole swizzle periods");
    const int chunk = lane % 8;
    const int row0 = lane / 8;  // 0..3; the next pass's row is row0 + 4, its swizzle row0 + 4
    const uint32_t dst0 = smem_addr(smem + SmemTile<C>::template offset<kRows>(row0, chunk));
    const uint32_t dst1 =
        smem_addr(smem + SmemTile<C>::template offset<kRows>(row0 + kPassRows, chunk));
    const elem_t* src = gmem + row0 * row_stride + chunk * 8;
    const int64_t pass_stride = kPassRows * row_stride;
#pragma unroll 1
    for (int period = 0; period < kRows / 8; ++period) {
        const uint32_t at = period * kPeriodBytes;
#pragma unroll
        for (int slab = 0; slab < C::kSlabs; ++slab) {
            cp_async_16(dst0 + at + slab * kSlabBytes, src + slab * C::kSlab, 16);
            cp_async_16(dst1 + at + slab * kSlabBytes, src + pass_stride + slab * C::kSlab, 16);
        }
        src += 2 * pass_stride;
    }
}

// The same for kThreads threads whose pass covers whole swizzle periods (kThreads / 8 rows, a
// multiple of 8: a warpgroup's 16): each lane's swizzle never changes, so it keeps one shared
// address and one global pointer, both advanced by a constant per pass (the forward's producer
// warpgroup: perf log, "Forward v8.1").
template <class C, int kRows, int kThreads>
__device__ __forceinline__ void load_full_rows_by(typename C::elem_t* smem,
                                                  const typename C::elem_t* gmem,
                                                  int64_t row_stride, unsigned tid) {
    using elem_t = typename C::elem_t;
    constexpr int kPassRows = kThreads / 8;  // 8 threads x 16 bytes: one row of a slab
    static_assert(kPassRows % 8 == 0 && kRows % kPassRows == 0, "whole swizzle periods");
    constexpr int kSlabBytes = kRows * C::kSlab * int(sizeof(elem_t));
    constexpr int kPassBytes = kPassRows * C::kSlab * int(sizeof(elem_t));
    const int chunk = tid % 8;
    const int row0 = tid / 8;
    const uint32_t dst = smem_addr(smem + SmemTile<C>::template offset<kRows>(row0, chunk));
    const elem_t* src = gmem + row0 * row_stride + chunk * 8;
    const int64_t pass_stride = kPassRows * row_stride;
#pragma unroll 1
    for (int pass = 0; pass < kRows / kPassRows; ++pass) {
#pragma unroll
        for (int slab = 0; slab < C::kSlabs; ++slab)
            cp_async_16(dst + pass * kPassBytes + slab * kSlabBytes, src + slab * C::kSlab, 16);
        src += pass_stride;
    }
}

template <class C, int kRows, int kThreads>
__device__ __forceinline__ void store_rows_by(typename C::elem_t* gmem,
                                              const typename C::elem_t* smem, int64_t row_stride,
                                              int valid_rows, unsigned tid) {
    static_assert(kThreads % 8 == 0 && kRows % (kThreads / 8) == 0, "whole rows per pass");
    const int chunk = tid % 8;
#pragma unroll
    for (int row = tid / 8; row < kRows; row += kThreads / 8) {
        if (row >= valid_rows) break;
#pragma unroll
        for (int slab = 0; slab < C::kSlabs; ++slab) {
            const uint4 v = *reinterpret_cast<const uint4*>(
                smem + SmemTile<C>::template offset<kRows>(row, slab * 8 + chunk));
            *reinterpret_cast<uint4*>(gmem + row * row_stride + slab * C::kSlab + chunk * 8) = v;
        }
    }
}

// Completion of the copies issued so far (a no-op for synchronous copies, which complete in
// program order; the caller's __syncthreads makes them visible). With wgmma the tensor cores
// read shared memory through the async proxy, so the wait ends with a proxy fence.
template <class C>
__device__ __forceinline__ void copy_commit() {
    if constexpr (C::kAsyncCopy) cp_async_commit();
}
template <class C>
__device__ __forceinline__ void copy_wait_all() {
    if constexpr (C::kAsyncCopy) cp_async_wait_all();
    if constexpr (C::kWgmma) fence_proxy_async_shared();
}

}  // namespace cudaflash
