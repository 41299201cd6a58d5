"""Attention against K/V caches, inference only: flash_attn_with_kvcache (new queries against
a cache, optionally appending the new keys and values first; paged, indexed or left-padded
caches; rotary embedding) and flash_attn_varlen_func's paged form (paged_varlen_forward)."""

import numbers

import torch

from . import (_autograd, _checks, _driver, _padding, _plans, dispatch, heuristics, launch,
               rotary_embedding)
from ._torch import is_grad_enabled


@torch.compiler.disable  # mutates the cache and reads tensors on the host: runs eagerly
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """Attention of q against a K/V cache whose sequences hold different numbers of
    positions, optionally appending new keys and values to the cache first; inference only.
    Drop-in for flash-attn 2.x's function of the same name: rotary embedding, cache_batch_idx,
    cache_leftpad and paged K/V (block_table) as the README describes them. window_size: the
    sliding window, as in flash_attn_func (repeat decoding steps take a plan keyed with it
    when it is a tuple of two ints); softcap and alibi_slopes as in flash_attn_func (each
    sequence's ALiBi distances count from its own length, cache_seqlens[b] + seqlen_new less
    its cache_leftpad).

    Arguments:
        q: (batch, seqlen_q, nheads, headdim): usually the new tokens' queries.
        k_cache, v_cache: (batch, seqlen_cache, nheads_k, headdim); the rules of
            flash_attn_func's k and v. Written in place when k and v are given.
        k, v: None, or the new keys and values, (batch, seqlen_new, nheads_k, headdim): they
            are written into the cache at positions cache_seqlens[b] to cache_seqlens[b] +
            seqlen_new - 1 of sequence b before the attention, which then includes them.
        cache_seqlens: how many positions of each sequence's cache are filled (before the
            append): None (all seqlen_cache of them; k and v must then be None), an int (the
            same for every sequence), or a (batch,) int32 tensor on q's device. Sequence b
            attends to cache positions 0 to cache_seqlens[b] + seqlen_new - 1. A tensor is
            read on the host only to check the append's bounds (0 <= cache_seqlens[b] and
            cache_seqlens[b] + seqlen_new <= seqlen_cache; one device-to-host copy, so give an
            int or append outside this call where that copy matters). Without an append,
            its values are not checked but clamped into [0, seqlen_cache] on the GPU (never an
            out-of-bounds read); CUDAFLASH_DEBUG=1 checks them and raises.
        causal: each sequence's mask aligned to its own bottom-right corner: query row i of
            sequence b sees keys j <= i + seqlen_k(b) - seqlen_q, where seqlen_k(b) =
            cache_seqlens[b] + seqlen_new.
        num_splits: 0 lets cudaflash choose (split-KV when the grid would leave the GPU
            idle, as for decoding); n >= 1 splits each query block's keys into at most n runs.
        return_softmax_lse: also return the log-sum-exp, float32 (batch, nheads, seqlen_q):
            -inf on rows that see no key (an empty cache), whose out is 0.
        softmax_scale: as in flash_attn_func.
        The caches follow flash_attn_func's rules for k and v (last stride 1, 16-byte aligned
        data); the new k and v may have any layout (torch copies them). cache_seqlens as a
        tensor must be contiguous. Appending at a tensor cache_seqlens cannot be captured in
        a CUDA graph (its bounds check reads the tensor): append with torch ops, then capture
        the call without k and v.

    Returns:
        out (batch, seqlen_q, nheads, headdim), q's dtype; with return_softmax_lse,
        ``(out, softmax_lse)``.

    Repeat calls with a tensor cache_seqlens and no append (a decoding loop's steps) take a
    cached plan, as flash_attn_func's do; the other forms run the full checks every call.
    In grad mode with a q, k, v or cache that requires grad (an evaluation loop without
    torch.no_grad(), say) the call runs as without gradients and out's backward raises:
    flash-attn returns that out without a grad_fn, which would drop the gradient silently.
    """
    if is_grad_enabled() and (getattr(q, "requires_grad", False)  # (getattr: not yet checked)
                              or getattr(k, "requires_grad", False)
                              or getattr(v, "requires_grad", False)
                              or getattr(k_cache, "requires_grad", False)
                              or getattr(v_cache, "requires_grad", False)):
        with torch.no_grad():
            result = flash_attn_with_kvcache(
                q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                cache_batch_idx, cache_leftpad, block_table, softmax_scale, causal, window_size,
                softcap, rotary_interleaved, alibi_slopes, num_splits, return_softmax_lse)
        out, lse = result if return_softmax_lse else (result, None)
        out = _autograd.ForwardOnly.apply(out, "flash_attn_with_kvcache", q, k, v)
        return (out, lse) if return_softmax_lse else out
    # The decoding step: a signature seen before, lengths in a tensor, nothing to append.
    # (A window in the key only as a tuple of two ints: an equal value of another type, such
    # as True for 1, must meet the checks.)
    if (k is None and v is None and type(cache_seqlens) is torch.Tensor and rotary_cos is None
            and rotary_sin is None and cache_batch_idx is None and cache_leftpad is None
            and softcap == 0.0
            and type(window_size) is tuple and len(window_size) == 2
            and type(window_size[0]) is int and type(window_size[1]) is int):
        try:
            plan = _plans.kvcache_plans.get(_plans.kvcache_plan_key(
                q, k_cache, v_cache, cache_seqlens, softmax_scale, causal, num_splits,
                return_softmax_lse, window_size, 0.0, alibi_slopes, block_table))
        except (AttributeError, TypeError):  # not tensors, or unhashable: the checks explain
            plan = None
        if plan is not None:
            done = _plans.replay(plan, q, k_cache, v_cache, return_softmax_lse, 0,
                                 cache_seqlens.data_ptr())
            if done is not None:
                return done if return_softmax_lse else done[0]

    window, softcap, _ = _checks.attention_options(0.0, window_size, softcap)
    q, k, v = _checks.with_unit_last_stride(q, k, v)  # (not the caches: written in place)
    padded = _padding.padded_head_dim(q, k_cache, v_cache)
    if padded is not None:
        return _padding.with_padded_head_dim(
            flash_attn_with_kvcache, padded, q, k, v, softmax_scale,
            dict(rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_seqlens=cache_seqlens,
                 cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                 block_table=block_table, causal=causal, window_size=window, softcap=softcap,
                 rotary_interleaved=rotary_interleaved, alibi_slopes=alibi_slopes,
                 num_splits=num_splits,
                 return_softmax_lse=return_softmax_lse),
            caches=(k_cache, v_cache))
    if (not isinstance(num_splits, numbers.Integral) or isinstance(num_splits, bool)
            or num_splits < 0):
        raise ValueError(f"num_splits={num_splits!r}; it must be an int >= 0 (0: cudaflash "
                         "chooses)")
    if return_softmax_lse not in (True, False):
        raise TypeError(f"return_softmax_lse={return_softmax_lse!r}; it must be a bool")
    # Paged caches and cache_batch_idx decouple the caches' first dim from the batch.
    _checks.check_qkv(q, k_cache, v_cache, names=("q", "k_cache", "v_cache"),
                      same_batch=block_table is None and cache_batch_idx is None)
    cache = _cache_addressing(q, q.shape[0], k_cache, block_table, cache_batch_idx,
                              cache_leftpad)
    alibi_slopes = _checks.check_alibi_slopes(alibi_slopes, q.shape[0], q.shape[2], q.device)
    seqlen_cache = cache.seqlen_cache
    if (k is None) != (v is None):
        raise ValueError(f"k is {'None' if k is None else 'a tensor'} and v is "
                         f"{'None' if v is None else 'a tensor'}: give both (to append them "
                         "to the cache) or neither")
    seqlen_new = 0
    if k is not None:
        _checks.check_new_kv(k, v, k_cache, q.shape[0])
        seqlen_new = k.shape[1]
        if seqlen_new > seqlen_cache:
            raise ValueError(f"k and v hold {seqlen_new} new positions; the caches hold "
                             f"{seqlen_cache} per sequence")
        if any(_checks.overlaps(new, c) for new in (k, v) for c in (k_cache, v_cache)):
            raise ValueError("k or v shares memory with k_cache or v_cache; the new keys "
                             "and values must be tensors of their own")
    rotary = rotary_embedding.check(rotary_cos, rotary_sin, rotary_interleaved, q,
                                    seqlen_cache)
    scale = _checks.softmax_scale(softmax_scale, q.shape[3])
    if causal not in (True, False):
        raise TypeError(f"causal={causal!r}; it must be a bool")
    _checks.check_on_gpu(q)
    want_lse = bool(return_softmax_lse)
    splits = num_splits or None
    index = q.get_device()
    if k is not None and cache_seqlens is None:
        raise ValueError("k and v are written at cache_seqlens, which is None; pass "
                         "cache_seqlens (an int or a (batch,) int32 tensor)")
    plain = (block_table is None and cache_batch_idx is None and cache_leftpad is None
             and rotary is None)
    with torch.cuda.device(index):  # the driver calls work in the current context
        if cache_seqlens is None and plain:
            out, lse = launch.run(None, index, q, k_cache, v_cache, None, scale, bool(causal),
                                  want_lse, num_splits=splits, window=window, softcap=softcap,
                                  alibi=alibi_slopes)
        elif (isinstance(cache_seqlens, torch.Tensor) or not plain
              or _window_needs_the_capacity(window, cache_seqlens, seqlen_new, seqlen_cache)):
            if cache_seqlens is None:  # every position of every sequence
                cache_seqlens = torch.full((q.shape[0],), seqlen_cache, dtype=torch.int32,
                                           device=q.device)
            elif not isinstance(cache_seqlens, torch.Tensor):
                _check_int_seqlens(cache_seqlens, seqlen_cache, seqlen_new)
                cache_seqlens = torch.full((q.shape[0],), int(cache_seqlens),
                                           dtype=torch.int32, device=q.device)
            # The kernel first: a call that cannot run must not have changed the cache.
            kernel = _select_kernel(index, q, k_cache, causal, seqlen_cache, window,
                                    alibi_slopes is not None)
            debug = dispatch.device_kernels(index).debug
            _check_index_vector("cache_seqlens", cache_seqlens, q, q.shape[0])
            _check_values(cache_seqlens, cache, seqlen_new, k is not None, debug)
            if rotary is not None:
                q, k = rotary_embedding.apply(
                    rotary, q, k, cache_seqlens,
                    rotary_embedding.queries_per_token(causal, window, seqlen_cache))
            seqused = cache_seqlens
            if k is not None:
                launch.append_kv(kernel, index, _vector_rows(k), _vector_rows(v), k_cache,
                                 v_cache, cache_seqlens, cache)
                seqused = cache_seqlens + seqlen_new
            # A plan for the decoding step (no append, nothing but the lengths and perhaps
            # ALiBi slopes and a paged cache's block_table, keyed by their addresses); none in
            # debug mode, whose checks of the values the plan would skip.
            plan_key = None
            if (k is None and not debug and cache_batch_idx is None and cache_leftpad is None
                    and rotary is None):
                try:
                    plan_key = _plans.kvcache_plan_key(q, k_cache, v_cache, cache_seqlens,
                                                       softmax_scale, causal, num_splits,
                                                       return_softmax_lse, window, softcap,
                                                       alibi_slopes, block_table)
                    hash(plan_key)
                except TypeError:
                    plan_key = None
            out, lse = launch.run(None, index, q, k_cache, v_cache, None, scale, bool(causal),
                                  want_lse, plan_key=plan_key, num_splits=splits,
                                  seqused_k=seqused, plans=_plans.kvcache_plans, window=window,
                                  softcap=softcap, cache=None if plain else cache,
                                  alibi=alibi_slopes)
        else:
            _check_int_seqlens(cache_seqlens, seqlen_cache, seqlen_new)
            used = int(cache_seqlens) + seqlen_new
            if k is not None:
                _select_kernel(index, q, k_cache, causal, used, window,  # before the append
                               alibi_slopes is not None)
                k_cache[:, cache_seqlens:used] = k
                v_cache[:, cache_seqlens:used] = v
            # Every sequence uses the same prefix: a view of it is a plain padded batch.
            out, lse = launch.run(None, index, q, k_cache[:, :used], v_cache[:, :used], None,
                                  scale, bool(causal), want_lse, num_splits=splits,
                                  window=window, softcap=softcap, alibi=alibi_slopes)
    return (out, lse) if want_lse else out


def _vector_rows(t):
    """t, or a packed copy of it, with rows the append kernel reads as 16-byte vectors: a
    16-byte aligned start, a contiguous last dim and the other strides multiples of 8
    elements (the new k and v may have any layout)."""
    if (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(s % 8 == 0 for s, n in zip(t.stride()[:-1], t.shape[:-1]) if n > 1)):
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _window_needs_the_capacity(window, cache_seqlens, seqlen_new: int,
                               seqlen_cache: int) -> bool:
    """Whether an int cache_seqlens call must take the per-sequence path for its window:
    flash-attn counts a window side as unbounded only from the caches' length (seqlen_cache)
    on, while the int path runs the used prefix as a plain batch, whose rule would count a
    side from the used length on as unbounded (which changes the mask where seqlen_q exceeds
    the used keys)."""
    if not isinstance(cache_seqlens, numbers.Integral) or isinstance(cache_seqlens, bool):
        return False  # (the int path's own checks explain anything else)
    used = cache_seqlens + seqlen_new
    return any(used <= w < seqlen_cache for w in window)


def _check_int_seqlens(cache_seqlens, seqlen_cache: int, seqlen_new: int) -> None:
    if (not isinstance(cache_seqlens, numbers.Integral) or isinstance(cache_seqlens, bool)
            or not 0 <= cache_seqlens <= seqlen_cache - seqlen_new):
        raise ValueError(f"cache_seqlens={cache_seqlens!r}; it must be None, a (batch,) "
                         f"int32 tensor or an int in [0, {seqlen_cache - seqlen_new}] "
                         f"(seqlen_cache={seqlen_cache} minus the {seqlen_new} new "
                         "positions)")


def _check_index_vector(name: str, t, q, batch: int) -> None:
    """A (batch,) int32 tensor on q's device with stride 1, as the kernels read it."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be None or a (batch,) torch.int32 tensor, got "
                        f"{type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} has dtype {t.dtype}; it must be torch.int32")
    if tuple(t.shape) != (batch,):
        raise ValueError(f"{name} has shape {tuple(t.shape)}; it must be (batch,) = ({batch},)")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must be on "
                         "the same device")
    if t.stride(0) != 1 and batch > 1:
        raise ValueError(f"{name} has stride {t.stride(0)}; it must be contiguous")


def _cache_addressing(q, batch: int, k_cache, block_table, cache_batch_idx,
                      cache_leftpad) -> launch.CacheAddressing:
    """Check block_table, cache_batch_idx and cache_leftpad of a batch of ``batch``
    sequences (shapes, dtypes, devices: their values are checked by _check_values) and return
    the caches' addressing."""
    if cache_batch_idx is not None:
        _check_index_vector("cache_batch_idx", cache_batch_idx, q, batch)
    if cache_leftpad is not None:
        _check_index_vector("cache_leftpad", cache_leftpad, q, batch)
    if block_table is None:
        return launch.CacheAddressing(None, cache_batch_idx, cache_leftpad, 0,
                                      k_cache.shape[0], k_cache.shape[1])
    for name, other in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if other is not None:
            raise ValueError(f"{name} is given with block_table; paged K/V takes neither "
                             "cache_batch_idx nor cache_leftpad (as in flash-attn): pass "
                             f"{name}=None")
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table must be None or a (batch, max_blocks_per_seq) "
                        f"torch.int32 tensor, got {type(block_table).__name__}")
    if block_table.dtype != torch.int32:
        raise TypeError(f"block_table has dtype {block_table.dtype}; it must be torch.int32")
    if block_table.dim() != 2 or block_table.shape[0] != batch or block_table.shape[1] < 1:
        raise ValueError(f"block_table has shape {tuple(block_table.shape)}; it must be (batch, "
                         f"max_blocks_per_seq) with batch={batch} and max_blocks_per_seq >= 1")
    if block_table.device != q.device:
        raise ValueError(f"block_table is on {block_table.device} but q is on {q.device}; "
                         "they must be on the same device")
    if block_table.stride(1) != 1 and block_table.shape[1] > 1:
        raise ValueError(f"block_table has strides {block_table.stride()}; its last stride "
                         "must be 1 (block_table.contiguous() gives such a copy)")
    n_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    if n_pages < 1:
        raise ValueError(f"k_cache has shape {tuple(k_cache.shape)}; with block_table it must "
                         "be (num_blocks, page_block_size, nheads_k, headdim) with "
                         "num_blocks >= 1")
    # The kernels find a key's page with shifts, one page per lane of a warp (a tile of up to
    # 512 keys spans at most 32 pages of 16 or more positions).
    if page_size < 16 or page_size & (page_size - 1):
        raise ValueError(f"k_cache has pages of {page_size} positions (page_block_size = "
                         f"k_cache.shape[1]); cudaflash supports powers of two from 16 "
                         "(16, 32, ..., 256, 512, ...)")
    seqlen_cache = block_table.shape[1] * page_size
    if seqlen_cache >= 2**31 or block_table.stride(0) >= 2**31:
        raise ValueError(f"block_table {tuple(block_table.shape)} with pages of {page_size} "
                         "positions addresses 2**31 or more positions per sequence")
    return launch.CacheAddressing(block_table, None, None, page_size, n_pages, seqlen_cache)


def _check_values(cache_seqlens, cache: launch.CacheAddressing, seqlen_new: int,
                  appends: bool, debug: bool) -> None:
    """The values of cache_seqlens, block_table, cache_batch_idx and cache_leftpad, read on
    the host in one device-to-host copy: for a call that appends (it must not write out of
    place) and in debug mode, unless the stream is being captured into a CUDA graph (which
    cannot read on the host: there the kernels bound every index instead, and an append
    writes no position outside the caches). Raises ValueError naming the argument."""
    batch = cache_seqlens.shape[0]
    if not (appends or debug) or batch == 0 or torch.cuda.is_current_stream_capturing():
        return
    lengths = cache_seqlens.long()
    stats = [lengths.min(), lengths.max()]
    table = cache.block_table
    if table is not None:
        # Only the pages a sequence uses must exist (flash-attn's tables pad the rest).
        used = (lengths + seqlen_new).clamp(0, cache.seqlen_cache)
        pages = (used + cache.page_size - 1) // cache.page_size
        in_use = torch.arange(table.shape[1], device=table.device)[None, :] < pages[:, None]
        bad = in_use & ((table < 0) | (table >= cache.n_entries))
        stats.append(bad.sum())
    if cache.cache_batch_idx is not None:
        stats += [cache.cache_batch_idx.min().long(), cache.cache_batch_idx.max().long()]
    if cache.cache_leftpad is not None:
        pad = cache.cache_leftpad.long()
        stats.append(((pad < 0) | (pad > lengths)).sum())
    values = torch.stack(stats).tolist()  # the device-to-host copy
    lo, hi = values[0], values[1]
    if lo < 0 or hi + seqlen_new > cache.seqlen_cache:
        raise ValueError(f"cache_seqlens holds values in [{lo}, {hi}]; with {seqlen_new} new "
                         f"positions they must be in [0, {cache.seqlen_cache - seqlen_new}] "
                         f"(seqlen_cache={cache.seqlen_cache})")
    at = 2
    if table is not None:
        if values[at]:
            raise ValueError(f"block_table holds {values[at]} page indices outside [0, "
                             f"{cache.n_entries}) (k_cache's num_blocks) among the pages the "
                             "sequences use")
        at += 1
    if cache.cache_batch_idx is not None:
        if values[at] < 0 or values[at + 1] >= cache.n_entries:
            raise ValueError(f"cache_batch_idx holds values in [{values[at]}, "
                             f"{values[at + 1]}]; they must be in [0, {cache.n_entries}) "
                             "(k_cache's batch size)")
        at += 2
    if cache.cache_leftpad is not None and values[at]:
        raise ValueError(f"cache_leftpad holds {values[at]} values outside [0, "
                         "cache_seqlens[b]]: a sequence's left padding must lie within its "
                         "filled positions")


def _select_kernel(index: int, q, k_cache, causal: bool, seqlen_k: int, window,
                   alibi: bool):
    """Select (and load) the kernel the call will run, so that a call that cannot run raises
    before it writes into the cache; returns it (its module also appends)."""
    rows, _, kernel_causal, _ = heuristics.kernel_problem(q.shape[1], q.shape[2],
                                                          k_cache.shape[2], seqlen_k,
                                                          bool(causal), window, alibi)
    return dispatch.auto_kernel(_driver.current_context(index), index, q.dtype, q.shape[3],
                         kernel_causal, rows, seqlen_k)


@torch.compiler.disable  # launches directly: runs eagerly under torch.compile (a graph break)
def paged_varlen_forward(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, block_table, softmax_scale, causal, window, softcap,
                         want_lse, alibi_slopes=None):
    """``(out, lse)`` of flash_attn_varlen_func with a block table: q packed (total_q, nheads,
    headdim) as usual, the keys and values in pools of pages (num_blocks, page_block_size,
    nheads_k, headdim); sequence b has cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys, key j in
    page block_table[b, j // page_block_size] (flash-attn's semantics). Forward only.
    ``window``, ``softcap``: checked by the caller. In grad mode with inputs that require
    grad, ``out`` has a grad_fn whose backward raises (_autograd.ForwardOnly)."""
    if _checks.wants_grad(q, k_cache, v_cache):
        with torch.no_grad():
            out, lse = paged_varlen_forward(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k,
                                            max_seqlen_q, max_seqlen_k, block_table,
                                            softmax_scale, causal, window, softcap, want_lse,
                                            alibi_slopes)
        return _autograd.ForwardOnly.apply(out, "flash_attn_varlen_func with block_table", q,
                                           k_cache, v_cache), lse
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q has shape {tuple(getattr(q, 'shape', ()))}; expected 3 dims "
                         "(total_q, nheads, headdim)")
    # q as one row of a batch: the rules of flash_attn_with_kvcache's q and paged caches.
    _checks.check_qkv(q[None], k_cache, v_cache, names=("q", "k", "v"), same_batch=False)
    _checks.check_cu_seqlens(q, cu_seqlens_q, cu_seqlens_k)
    max_seqlen_q = _checks.check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _checks.check_max_seqlen("max_seqlen_k", max_seqlen_k)
    cache = _cache_addressing(q, cu_seqlens_q.numel() - 1, k_cache, block_table, None, None)
    alibi_slopes = _checks.check_alibi_slopes(alibi_slopes, cu_seqlens_q.numel() - 1,
                                              q.shape[1], q.device)
    scale = _checks.softmax_scale(softmax_scale, q.shape[2])
    if causal not in (True, False):
        raise TypeError(f"causal={causal!r}; it must be a bool")
    _checks.check_on_gpu(q)
    index = q.get_device()
    with torch.cuda.device(index):
        return launch.run_varlen(index, q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k,
                                 max_seqlen_q, max_seqlen_k, scale, bool(causal), want_lse,
                                 window=window, softcap=softcap, cache=cache,
                                 alibi=alibi_slopes)
