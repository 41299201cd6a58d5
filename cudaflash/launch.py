"""The forward's launches: Params filled from checked arguments, grids, split-KV.

``run`` (a padded batch, flash_attn_with_kvcache's too) and ``run_varlen`` (a packed batch)
take values the callers have checked (_checks) on q's device, made current. Each selects the
kernel (dispatch), fills every Params field that a call signature fixes, launches on torch's
current stream, and, given a plan key, records the launch as a plan (_plans) that repeat
calls replay.
"""

import math
import struct
from typing import NamedTuple, Optional

import torch

from . import _driver, _plans, _tma, dispatch, heuristics
from ._params import (APPEND_PARAMS_FORMAT, NO_CACHE_ADDRESSING, alibi_params, dropout_params,
                      score_scales)
from ._torch import current_stream, float32

_COMBINE_ROWS = 4  # query rows per CTA of cudaflash_combine (kCombineRows, flash_fwd.cu)
_COMBINE_THREADS = 32 * _COMBINE_ROWS  # one warp per row
_APPEND_THREADS = 64  # kAppendThreads (flash_fwd.cu)
_pack_append = struct.Struct(APPEND_PARAMS_FORMAT).pack


class CacheAddressing(NamedTuple):
    """flash_attn_with_kvcache's cache addressing, checked (kvcache.py): block_table
    (paged K/V: the caches are (n_entries, page_size, nheads_k, headdim) pages, seqlen_cache =
    page_size x the table's columns), cache_batch_idx and cache_leftpad, each a tensor or None.
    n_entries: the caches' first dim (batch entries or pages)."""

    block_table: Optional[torch.Tensor]
    cache_batch_idx: Optional[torch.Tensor]
    cache_leftpad: Optional[torch.Tensor]
    page_size: int
    n_entries: int
    seqlen_cache: int

    def params(self) -> tuple:
        """The Params fields block_table to paged_keys."""
        table = self.block_table
        if table is None:
            return (0, 0 if self.cache_batch_idx is None else self.cache_batch_idx.data_ptr(),
                    0 if self.cache_leftpad is None else self.cache_leftpad.data_ptr(), 0, 0,
                    self.n_entries, 0)
        return (table.data_ptr(), 0, 0, table.stride(0), self.page_size.bit_length() - 1,
                self.n_entries, self.seqlen_cache)


def run(config, index: int, q, k, v, out, scale: float, causal: bool, want_lse: bool,
        plan_key=None, num_splits=None, seqused_k=None, plans=None, window=(-1, -1),
        softcap=0.0, cache: Optional[CacheAddressing] = None, alibi=None, dropout=None,
        alibi_band: bool = False):
    """One forward over a padded batch. ``seqused_k``: None, or a (batch,) int32 tensor of
    each entry's key count (flash_attn_with_kvcache; the kernel clamps it into [0,
    seqlen_k]). With a ``plan_key`` the launch is recorded in ``plans`` (default
    flash_attn_func's); the plan takes the key counts' pointer per call. ``window``: the
    sliding window (left, right), -1 unbounded; ``softcap``: the checked cap, 0.0 for none.
    ``cache``: flash_attn_with_kvcache's cache addressing; its tensors' pointers are packed
    with the fixed fields (a plan key must hold them: _plans.address_key). ``alibi``: the
    checked ALiBi slopes or None; their pointer is packed with the fixed fields too.
    ``alibi_band``: with ALiBi, skip the keys beyond each head's band (fwd_range.cuh) where
    heuristics.alibi_band_pays (flash_attn_func and forward; not the kvcache paths, where
    the bound would read whole caches every step)."""
    batch, seqlen_q, n_heads, d_head = q.shape
    n_heads_k = k.shape[2]
    # A cache's positions per sequence (paged: the table's, not a page's).
    seqlen_k = k.shape[1] if cache is None else cache.seqlen_cache
    rows, heads, causal, kernel_window = heuristics.kernel_problem(
        seqlen_q, n_heads, n_heads_k, seqlen_k, causal, window,
        alibi is not None or dropout is not None)
    ctx = _driver.current_context(index)
    # Tensor maps describe whole (batch, seqlen, heads, d_head) tensors: not cache addressing,
    # not key counts (keys past a count may be garbage that cp.async's zero fill hides), not
    # GQA decoding's rows.
    maps_ok = cache is None and seqused_k is None and rows == seqlen_q
    if config is None:
        # (whether maps will be given, as launch_function decides it for a persistent kernel:
        # a padded call big enough over the keys its CTAs visit, not split on request)
        maps = maps_ok and _tma.selects_with_maps(rows, seqlen_k, heads, batch, kernel_window,
                                                  num_splits)
        kernel = dispatch.auto_kernel(ctx, index, q.dtype, d_head, causal, rows, seqlen_k,
                                      maps=maps, dropout=dropout is not None)
    else:
        kernel = dispatch.config_kernel(ctx, index, config)

    if out is None:
        out = torch.empty_like(q)  # q's layout, as flash-attn does
    lse = q.new_empty((batch, n_heads, seqlen_q), dtype=torch.float32) if want_lse else None
    if batch == 0 or seqlen_q == 0 or seqlen_k == 0:
        if seqlen_k == 0:  # every row sees no key
            out.zero_()
            if lse is not None:
                lse.fill_(-math.inf)
        return out, lse

    # ALiBi's band (fwd_range.cuh): the bound is this call's tensors', so no plan replays it.
    band_bound = None
    if (alibi_band and alibi is not None and cache is None and seqused_k is None
            and not softcap and dropout is None and heuristics.alibi_band_pays(
                seqlen_q, seqlen_k, n_heads, n_heads_k, kernel_window)):
        band_bound = alibi_score_bound(q, k, scale)
        plan_key = None
    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), out.stride()
    q_seq, q_head, o_seq, o_head = qs[1], qs[2], os_[1], os_[2]
    if rows != seqlen_q:  # GQA decoding: row r of head h is query head h * rows + r
        q_seq, q_head, o_seq, o_head = qs[2], rows * qs[2], os_[2], rows * os_[2]
    # Params after the pointers, up to the split counts: strides (the lse's: (batch, n_heads,
    # seqlen_q), which is (batch, heads, rows) for the kernel), sizes, scales.
    fixed_params = (qs[0], q_seq, q_head, ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
                    os_[0], o_seq, o_head, n_heads * seqlen_q, rows, batch, heads, n_heads_k,
                    rows, seqlen_k, int(causal), 0, 0, *kernel_window,
                    *score_scales(scale, softcap))
    launch = launch_function(kernel, index, q.device, fixed_params, num_splits, rows=rows,
                             heads=heads, batch=batch, seqlen_k=seqlen_k, d_head=d_head,
                             window=kernel_window, softcap=bool(softcap), cache=cache,
                             alibi=alibi, alibi_bound=band_bound, dropout=dropout,
                             tma_tensors=(q, k, v) if maps_ok else None)
    # lse 0: writes no lse; cu_seqlens_q 0: not packed; cu_seqlens_k: the key counts, if any
    launch(current_stream(index), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
           0 if lse is None else lse.data_ptr(), 0,
           0 if seqused_k is None else seqused_k.data_ptr())
    if plan_key is not None and dropout is None:  # (dropout: a new seed every call)
        _plans.record(_plans.plans if plans is None else plans, plan_key, index, launch,
                      (batch, n_heads, seqlen_q), out, lse)
    return out, lse


def alibi_score_bound(q, k, scale: float) -> torch.Tensor:
    """A float32 device scalar no scaled score exceeds in magnitude: softmax_scale max|q_i|
    max|k_j| (Cauchy-Schwarz; norms over the head dim, in float32, raised by 2^-10 for their
    rounding). Torch ops on the current stream, no host copy: a CUDA graph captures them.
    NaN or inf inputs give a NaN or inf bound, for which the kernels keep every key. Its
    cost (about 290 us for a 64 MB q and k on the H100, the same with norms in q's dtype)
    decides where the band pays: heuristics.alibi_band_pays."""
    q_most = torch.linalg.vector_norm(q, dim=-1, dtype=torch.float32).amax()
    k_most = torch.linalg.vector_norm(k, dim=-1, dtype=torch.float32).amax()
    return q_most * k_most * (scale * (1.0 + 2.0 ** -10))


def append_kv(kernel: dispatch.Kernel, index: int, k_new, v_new, k_cache, v_cache,
              cache_seqlens, cache: CacheAddressing) -> None:
    """Write k_new, v_new (batch, seqlen_new, nheads_k, headdim) into the caches at
    positions cache_seqlens[b] + i, on the GPU (cudaflash_append_kv of ``kernel``'s module:
    nothing read on the host, so a CUDA graph can capture it). Positions outside the caches
    are not written."""
    batch, seqlen_new, n_heads_k, _ = k_new.shape
    if batch == 0 or seqlen_new == 0:
        return
    kn, vn, kc, vc = k_new.stride(), v_new.stride(), k_cache.stride(), v_cache.stride()
    table = cache.block_table
    args = _driver.PackedArgs(_pack_append(
        k_new.data_ptr(), v_new.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        cache_seqlens.data_ptr(),
        0 if cache.cache_batch_idx is None else cache.cache_batch_idx.data_ptr(),
        0 if table is None else table.data_ptr(),
        *kn[:3], *vn[:3], *kc[:3], *vc[:3],
        batch, seqlen_new, n_heads_k, cache.seqlen_cache,
        0 if table is None else table.stride(0), cache.page_size, cache.n_entries, 0))
    _driver.launch_packed(kernel.fns.append_kv, kernel.label.replace("(", "(append_kv ", 1),
                          (seqlen_new, n_heads_k, batch), _APPEND_THREADS, 0,
                          current_stream(index), args, kernel.synchronize)


def run_varlen(index: int, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
               max_seqlen_k: int, scale: float, causal: bool, want_lse: bool, plan_key=None,
               window=(-1, -1), softcap=0.0, cache: Optional[CacheAddressing] = None,
               alibi=None, dropout=None):
    """One forward over a packed batch; with a ``plan_key`` the launch is recorded in the
    varlen plans. Arguments as in ``run``; ``cache``: a block table (k and v are then pools
    of pages (num_blocks, page_size, nheads_k, headdim), cu_seqlens_k gives the lengths
    only, and no plan is recorded)."""
    total_q, n_heads, d_head = q.shape
    paged = cache is not None
    if paged:  # the offsets only count keys: the clamp is the table's (paged_keys)
        total_k, n_heads_k = 2**31 - 1, k.shape[2]
        plan_key = None
    else:
        total_k, n_heads_k = k.shape[0], k.shape[1]
    batch = cu_seqlens_q.numel() - 1
    out = torch.empty_like(q)
    lse = q.new_empty((n_heads, total_q), dtype=torch.float32) if want_lse else None
    # No sequence is longer than its packed tensor (the kernel clamps offsets into it).
    rows = min(max_seqlen_q, total_q)
    seqlen_k = min(max_seqlen_k, cache.seqlen_cache if paged else total_k)
    if rows == 0:
        return out, lse
    if total_k == 0:  # every row sees no key
        out.zero_()
        if lse is not None:
            lse.fill_(-math.inf)
        return out, lse
    # The kernel reads each sequence's key count from cu_seqlens_k; seqlen_k only sizes the
    # split-KV runs (the last one takes every block left), so a 0 here is not trusted.
    seqlen_k = max(seqlen_k, 1)
    # As flash-attn, clamped by the longest sequence.
    kernel_window = heuristics.kernel_window(window, max_seqlen_k, causal)
    ctx = _driver.current_context(index)
    kernel = dispatch.auto_kernel(ctx, index, q.dtype, d_head, causal, rows, seqlen_k,
                                  dropout=dropout is not None)
    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), out.stride()
    # Batch strides 0: a sequence's place comes from its offsets (paged K/V: page strides,
    # the pages come from the table). lse: (n_heads, total_q).
    k_strides = ks[:3] if paged else (0, ks[0], ks[1])
    v_strides = vs[:3] if paged else (0, vs[0], vs[1])
    fixed_params = (0, qs[0], qs[1], *k_strides, *v_strides, 0, os_[0], os_[1],
                    0, total_q, batch, n_heads, n_heads_k, rows, seqlen_k, int(causal),
                    total_q, total_k, *kernel_window, *score_scales(scale, softcap))
    launch = launch_function(kernel, index, q.device, fixed_params, None, rows=rows,
                             heads=n_heads, batch=batch, seqlen_k=seqlen_k, d_head=d_head,
                             window=kernel_window, softcap=bool(softcap), cache=cache,
                             alibi=alibi, dropout=dropout)
    launch(current_stream(index), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
           0 if lse is None else lse.data_ptr(), cu_seqlens_q.data_ptr(),
           cu_seqlens_k.data_ptr())
    if plan_key is not None and dropout is None:
        _plans.record(_plans.varlen_plans, plan_key, index, launch, (n_heads, total_q), out,
                      lse)
    return out, lse


def launch_function(kernel: dispatch.Kernel, index: int, device: torch.device,
                    fixed_params: tuple, num_splits: Optional[int], *, rows: int, heads: int,
                    batch: int, seqlen_k: int, d_head: int, window=(-1, -1),
                    softcap: bool = False, cache: Optional[CacheAddressing] = None,
                    alibi=None, alibi_bound=None, dropout=None, tma_tensors=None):
    """The launch of a call: ``fixed_params`` (every Params field between the pointers and
    the split counts) plus the split counts, the cache addressing and ALiBi's fields, as one
    Launcher, or a split-KV pair (the *_softcap entries with ``softcap``, the *_alibi ones
    with ``alibi`` alone: the checked slopes). ``num_splits``: forward's, or None for the
    rule
    (heuristics.split_count). With a left window bound (``window``: the kernel's) a CTA
    visits at most its rows plus the window's keys, and its split-KV runs start at its first
    visible block: they are sized over that span. With a ``cache`` (its Params fields packed
    with the fixed ones) the *_kvcache entries run. ``tma_tensors``: (q, k, v) where tensor
    maps may describe the call (a padded batch, see run), for a kernel that loads through
    them (_tma.py: a whole, big enough call)."""
    q_blocks = (rows + kernel.block_rows - 1) // kernel.block_rows
    seqlen_k = heuristics.visited_keys(seqlen_k, rows, kernel.block_rows, window)
    kv_blocks = (seqlen_k + kernel.block_cols - 1) // kernel.block_cols
    if dropout is not None:  # training calls: the dropout entry is whole, never split
        if softcap:  # (the public functions refuse the pair before they get here)
            raise ValueError("dropout with softcap has no kernel entry")
        num_splits = 1
    mods = "_softcap" if softcap else "" if alibi is None else "_alibi"
    if num_splits is None:
        split_role = "split" + mods + ("" if cache is None else "_kvcache")
        slots = (dispatch.device_kernels(index).device.sm_count
                 * kernel.split_ctas_per_sm(split_role))
        most = heuristics.max_splits(kv_blocks * kernel.block_cols, kv_blocks,
                                     min(rows, kernel.block_rows), batch)
        num_splits = heuristics.split_count(q_blocks * heads * batch, slots, most)
    num_splits, per_split = heuristics.split_sizes(num_splits, kv_blocks, batch)
    maps = None
    if (tma_tensors is not None and kernel.tma_loads and num_splits == 1
            and _tma.worth_maps(rows, seqlen_k, heads, batch,
                                causal=window[1] == 0 and window[0] < 0,
                                persistent=kernel.persistent)):
        maps = _tma.tensor_maps(*tma_tensors, kernel.block_rows, kernel.block_cols)
    fixed_params = (fixed_params + (num_splits, per_split)
                    + (NO_CACHE_ADDRESSING if cache is None else cache.params())
                    + alibi_params(alibi)
                    + (0 if alibi_bound is None else alibi_bound.data_ptr(),)
                    + dropout_params(dropout) + (int(maps is not None),))
    if num_splits == 1:
        role = (("forward_dropout" if alibi is None else "forward_dropout_alibi")
                if dropout is not None else _role("forward", mods, cache))
        grid = (q_blocks, heads, batch)
        if maps is not None and kernel.persistent:
            # One CTA per SM (1 per SM fits: warp-specialized) walks the q_blocks x heads x
            # batch tiles (fwd_warp_specialized.cuh).
            sm_count = dispatch.device_kernels(index).device.sm_count
            grid = (min(q_blocks * heads * batch, sm_count), 1, 1)
        launcher = _driver.Launcher(
            getattr(kernel.fns, role), kernel.label,
            grid=grid,
            threads=kernel.threads, smem=kernel.smem_of(role), synchronize=kernel.synchronize,
            fixed_params=fixed_params, device_index=index, maps=maps)
        if maps is not None and kernel.persistent:
            return _persistent_launch(launcher, device, tile_counter=window[1] == 0)
        return launcher.launch
    return _split_launch(kernel, index, device, fixed_params, q_blocks=q_blocks, heads=heads,
                         batch=batch, rows=rows, d_head=d_head, num_splits=num_splits,
                         mods=mods, cache=cache)


def _role(kind: str, mods: str, cache) -> str:
    """The entry role of ``kind`` (forward or split) for a call with the score modifiers
    ``mods`` ("": none; "_softcap": softcapping, with or without ALiBi; "_alibi": ALiBi
    alone) and with or without cache addressing: the role names of
    config.KernelConfig.ROLES."""
    return kind + mods + ("" if cache is None else "_kvcache")


def _persistent_launch(launcher: "_driver.Launcher", device: torch.device, *,
                       tile_counter: bool):
    """The launch function of a persistent kernel's call. Causal calls (``tile_counter``:
    tiles of different lengths) get a zeroed int32 per call, from which the CTAs draw their
    tiles after the first; the others walk a fixed order and get a null counter (packed
    explicitly: a launch's workspace fields may hold a previous call's)."""
    if not tile_counter:
        def launch(stream: int, q: int, k: int, v: int, o: int, lse: int, cu_seqlens_q: int,
                   cu_seqlens_k: int) -> None:
            launcher.launch_with_workspace(stream, q, k, v, o, lse, cu_seqlens_q,
                                           cu_seqlens_k, 0, 0, 0)
        return launch

    def launch(stream: int, q: int, k: int, v: int, o: int, lse: int, cu_seqlens_q: int,
               cu_seqlens_k: int) -> None:
        # On the current stream, like the split workspace: held until the kernel is enqueued,
        # then free for later work on this stream, which runs after it.
        counter = torch.zeros(1, dtype=torch.int32, device=device)
        launcher.launch_with_workspace(stream, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k,
                                       0, 0, counter.data_ptr())
    return launch


def _split_launch(kernel: dispatch.Kernel, index: int, device: torch.device,
                  fixed_params: tuple, *,
                  q_blocks: int, heads: int, batch: int, rows: int, d_head: int,
                  num_splits: int, mods: str = "", cache=None):
    """The launch function of a split-KV call: allocate the float32 workspace (one tensor
    from torch's allocator, on the current stream: released once both kernels have run), run
    the split forward, then the combine kernel."""
    role = _role("split", mods, cache)
    forward = _driver.Launcher(
        getattr(kernel.fns, role), kernel.label.replace("(", "(split ", 1),
        grid=(q_blocks, heads, batch * num_splits), threads=kernel.threads,
        smem=kernel.smem_of(role),
        synchronize=kernel.synchronize, fixed_params=fixed_params, device_index=index)
    combine = _driver.Launcher(
        kernel.fns.combine, kernel.label.replace("(", "(combine ", 1),
        grid=((rows + _COMBINE_ROWS - 1) // _COMBINE_ROWS, heads, batch),
        threads=_COMBINE_THREADS, smem=0, synchronize=kernel.synchronize,
        fixed_params=fixed_params, device_index=index)
    # o_accum (num_splits, batch, heads, rows, d_head) then lse_accum (num_splits, batch,
    # heads, rows), float32, in one allocation.
    lse_values = num_splits * batch * heads * rows
    lse_offset = lse_values * d_head * 4  # bytes

    def launch(stream: int, q: int, k: int, v: int, o: int, lse: int, cu_seqlens_q: int,
               cu_seqlens_k: int) -> None:
        # Held until both kernels are enqueued: freed earlier, the block could go to another
        # allocation whose work is enqueued before ours.
        workspace = torch.empty(lse_values * (d_head + 1), dtype=float32, device=device)
        o_accum = workspace.data_ptr()
        lse_accum = o_accum + lse_offset
        forward.launch_with_workspace(stream, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k,
                                      o_accum, lse_accum)
        combine.launch_with_workspace(stream, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k,
                                      o_accum, lse_accum)

    return launch
