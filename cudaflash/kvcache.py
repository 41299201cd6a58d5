"""flash_attn_with_kvcache: attention of new queries against a K/V cache, optionally
appending the new keys and values first; inference only."""

import numbers

import torch

from . import _checks, _driver, _padding, _plans, dispatch, heuristics, launch


@torch.compiler.disable  # mutates the cache and reads tensors on the host: runs eagerly
def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """Attention of q against a K/V cache whose sequences hold different numbers of
    positions, optionally appending new keys and values to the cache first; inference only.
    Drop-in for flash-attn 2.x's function of the same name, without rotary embedding,
    cache_batch_idx, cache_leftpad and paged K/V (block_table), which raise
    NotImplementedError, as does ALiBi. window_size: the sliding window, as in
    flash_attn_func (repeat decoding steps take a plan keyed with it when it is a tuple of
    two ints); softcap as in flash_attn_func.

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
        softmax_scale: as in flash_attn_func. rotary_interleaved is ignored (no rotary).
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
    """
    # The decoding step: a signature seen before, lengths in a tensor, nothing to append.
    # (A window in the key only as a tuple of two ints: an equal value of another type, such
    # as True for 1, must meet the checks.)
    if (k is None and v is None and type(cache_seqlens) is torch.Tensor and rotary_cos is None
            and rotary_sin is None and cache_batch_idx is None and cache_leftpad is None
            and block_table is None and softcap == 0.0 and alibi_slopes is None
            and type(window_size) is tuple and len(window_size) == 2
            and type(window_size[0]) is int and type(window_size[1]) is int):
        try:
            plan = _plans.kvcache_plans.get(_plans.kvcache_plan_key(
                q, k_cache, v_cache, cache_seqlens, softmax_scale, causal, num_splits,
                return_softmax_lse, window_size, 0.0))
        except (AttributeError, TypeError):  # not tensors, or unhashable: the checks explain
            plan = None
        if plan is not None:
            done = _plans.replay(plan, q, k_cache, v_cache, return_softmax_lse, 0,
                                 cache_seqlens.data_ptr())
            if done is not None:
                return done if return_softmax_lse else done[0]

    for name, value in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                        ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad),
                        ("block_table", block_table)):
        if value is not None:
            raise NotImplementedError(f"{name} is a {type(value).__name__}: not implemented in "
                                      f"cudaflash; pass {name}=None")
    window, softcap = _checks.attention_options(0.0, alibi_slopes, window_size, softcap)
    padded = _padding.padded_head_dim(q, k_cache, v_cache)
    if padded is not None:
        return _padding.with_padded_head_dim(
            flash_attn_with_kvcache, padded, q, k, v, softmax_scale,
            dict(cache_seqlens=cache_seqlens, causal=causal, window_size=window, softcap=softcap,
                 num_splits=num_splits, return_softmax_lse=return_softmax_lse),
            caches=(k_cache, v_cache))
    if (not isinstance(num_splits, numbers.Integral) or isinstance(num_splits, bool)
            or num_splits < 0):
        raise ValueError(f"num_splits={num_splits!r}; it must be an int >= 0 (0: cudaflash "
                         "chooses)")
    if return_softmax_lse not in (True, False):
        raise TypeError(f"return_softmax_lse={return_softmax_lse!r}; it must be a bool")
    _checks.check_qkv(q, k_cache, v_cache, names=("q", "k_cache", "v_cache"))
    if (k is None) != (v is None):
        raise ValueError(f"k is {'None' if k is None else 'a tensor'} and v is "
                         f"{'None' if v is None else 'a tensor'}: give both (to append them "
                         "to the cache) or neither")
    seqlen_cache = k_cache.shape[1]
    seqlen_new = 0
    if k is not None:
        _checks.check_new_kv(k, v, k_cache)
        seqlen_new = k.shape[1]
        if any(_checks.overlaps(new, cache) for new in (k, v) for cache in (k_cache, v_cache)):
            raise ValueError("k or v shares memory with k_cache or v_cache; the new keys "
                             "and values must be tensors of their own")
    scale = _checks.softmax_scale(softmax_scale, q.shape[3])
    if causal not in (True, False):
        raise TypeError(f"causal={causal!r}; it must be a bool")
    _checks.check_on_gpu(q)
    want_lse = bool(return_softmax_lse)
    splits = num_splits or None
    index = q.get_device()
    with torch.cuda.device(index):  # the driver calls work in the current context
        if cache_seqlens is None:
            if k is not None:
                raise ValueError("k and v are written at cache_seqlens, which is None; pass "
                                 "cache_seqlens (an int or a (batch,) int32 tensor)")
            out, lse = launch.run(None, index, q, k_cache, v_cache, None, scale, bool(causal),
                                  want_lse, num_splits=splits, window=window, softcap=softcap)
        elif isinstance(cache_seqlens, torch.Tensor):
            # The kernel first: a call that cannot run must not have changed the cache.
            _select_kernel(index, q, k_cache, causal, seqlen_cache, window)
            debug = dispatch.device_kernels(index).debug
            seqused = _append(cache_seqlens, q, k_cache, v_cache, k, v, seqlen_new, debug)
            # A plan for the decoding step (no append); none in debug mode, whose length
            # check the plan would skip.
            plan_key = None
            if k is None and not debug:
                try:
                    plan_key = _plans.kvcache_plan_key(q, k_cache, v_cache, cache_seqlens,
                                                       softmax_scale, causal, num_splits,
                                                       return_softmax_lse, window, softcap)
                    hash(plan_key)
                except TypeError:
                    plan_key = None
            out, lse = launch.run(None, index, q, k_cache, v_cache, None, scale, bool(causal),
                                  want_lse, plan_key=plan_key, num_splits=splits,
                                  seqused_k=seqused, plans=_plans.kvcache_plans, window=window,
                                  softcap=softcap)
        else:
            if (not isinstance(cache_seqlens, numbers.Integral)
                    or isinstance(cache_seqlens, bool)
                    or not 0 <= cache_seqlens <= seqlen_cache - seqlen_new):
                raise ValueError(f"cache_seqlens={cache_seqlens!r}; it must be None, a (batch,) "
                                 f"int32 tensor or an int in [0, {seqlen_cache - seqlen_new}] "
                                 f"(seqlen_cache={seqlen_cache} minus the {seqlen_new} new "
                                 "positions)")
            used = int(cache_seqlens) + seqlen_new
            if k is not None:
                _select_kernel(index, q, k_cache, causal, used, window)  # before the append
                k_cache[:, cache_seqlens:used] = k
                v_cache[:, cache_seqlens:used] = v
            # Every sequence uses the same prefix: a view of it is a plain padded batch.
            out, lse = launch.run(None, index, q, k_cache[:, :used], v_cache[:, :used], None,
                                  scale, bool(causal), want_lse, num_splits=splits,
                                  window=window, softcap=softcap)
    return (out, lse) if want_lse else out


def _select_kernel(index: int, q, k_cache, causal: bool, seqlen_k: int, window) -> None:
    """Select (and load) the kernel the call will run, so that a call that cannot run raises
    before it writes into the cache."""
    rows, _, kernel_causal, _ = heuristics.kernel_problem(q.shape[1], q.shape[2],
                                                          k_cache.shape[2], seqlen_k,
                                                          bool(causal), window)
    dispatch.auto_kernel(_driver.current_context(index), index, q.dtype, q.shape[3],
                         kernel_causal, rows, seqlen_k)


def _append(cache_seqlens, q, k_cache, v_cache, k, v, seqlen_new: int, debug: bool):
    """flash_attn_with_kvcache with a tensor cache_seqlens: check it, write k and v (if
    given) into the caches at each sequence's own position, and return the key count each
    sequence attends to, as the kernel reads it ((batch,) int32)."""
    batch, seqlen_cache = q.shape[0], k_cache.shape[1]
    if cache_seqlens.dtype != torch.int32:
        raise TypeError(f"cache_seqlens has dtype {cache_seqlens.dtype}; it must be "
                        "torch.int32")
    if tuple(cache_seqlens.shape) != (batch,):
        raise ValueError(f"cache_seqlens has shape {tuple(cache_seqlens.shape)}; it must be "
                         f"(batch,) = ({batch},)")
    if cache_seqlens.device != q.device:
        raise ValueError(f"cache_seqlens is on {cache_seqlens.device} but q is on {q.device}; "
                         "they must be on the same device")
    if cache_seqlens.stride(0) != 1 and batch > 1:
        raise ValueError(f"cache_seqlens has stride {cache_seqlens.stride(0)}; it must be "
                         "contiguous")
    if (k is None and not debug) or batch == 0:
        return cache_seqlens  # the kernel clamps each count into [0, seqlen_cache]
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("flash_attn_with_kvcache appends k and v at a tensor cache_seqlens "
                           "after checking its bounds on the host, which a CUDA graph being "
                           "captured cannot do; capture the call without k and v (write them "
                           "into the cache with torch ops first) or pass an int cache_seqlens")
    lo, hi = torch.stack(torch.aminmax(cache_seqlens)).tolist()  # the device-to-host copy
    if lo < 0 or hi + seqlen_new > seqlen_cache:
        raise ValueError(f"cache_seqlens holds values in [{lo}, {hi}]; with {seqlen_new} new "
                         f"positions they must be in [0, {seqlen_cache - seqlen_new}] "
                         f"(seqlen_cache={seqlen_cache})")
    if k is None:
        return cache_seqlens
    positions = cache_seqlens.long()[:, None] + torch.arange(seqlen_new, device=q.device)
    rows = torch.arange(batch, device=q.device)[:, None]
    k_cache[rows, positions] = k
    v_cache[rows, positions] = v
    return cache_seqlens + seqlen_new
