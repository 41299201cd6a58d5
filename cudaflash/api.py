"""Public API: ``flash_attn_func`` and its packed forms, ``flash_attn_varlen_func`` and its
packed forms (flash-attn 2.x semantics), ``forward`` (one config), ``list_kernels``;
``flash_attn_with_kvcache`` lives in kvcache.py.

A call goes: check the arguments on the host (_checks: nothing bad reaches a kernel) -> the
signature's plan (_plans), or the checked call (_call) -> kernel (dispatch: selection rules
filtered by what the manifest has for this GPU, module load) -> allocate out/lse -> one launch
on torch's current stream (launch; so torch streams and CUDA-graph capture work). Calls with
gradients go through the autograd functions (_autograd), whose backward launches the backward
kernels (backward). Eager calls stay off the torch dispatcher (a custom op costs 10-30 us per
call); under torch.compile the call goes through the ``cudaflash::*`` custom ops so the graph
sees an opaque op with a fake implementation.

flash_attn_func's repeat calls (the common case: every layer of every step has the same
shapes) take the plan lookup inline (see the comment there): that code is the per-call host
time the README promises.
"""

import numbers

import torch

from . import (_call, _checks, _driver, _dropout, _padding, _plans, dispatch, kvcache,
               manifest as _manifest)
from ._autograd import FlashAttnFunction, FlashAttnVarlenFunction, fwd_op, varlen_fwd_op
from ._plans import plans as _forward_plans
from ._torch import (current_device as _current_device, current_stream as _current_stream,
                     empty_like as _empty_like, float32 as _float32,
                     is_compiling as _is_compiling, is_grad_enabled as _is_grad_enabled)
from .config import KernelConfig
from .dispatch import selected_config  # noqa: F401 (public: the config a call would run)
from .kvcache import flash_attn_with_kvcache  # noqa: F401 (public)
from .manifest import KernelEntry


# ---- public functions ------------------------------------------------------------------------


# The default window_size: no window. The per-call paths test the default by identity and
# an explicit (-1, -1) of two ints by value; any other value (lists, numpy integers,
# tensors: flash-attn takes integer-like sides) goes through _checks.check_window.
NO_WINDOW = (-1, -1)


def _no_window(window_size) -> bool:
    """Whether window_size is an explicit (-1, -1) of two ints (the caller tests identity
    with NO_WINDOW first, inline)."""
    return (type(window_size) is tuple and len(window_size) == 2 and type(window_size[0]) is int
            and type(window_size[1]) is int and window_size == NO_WINDOW)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=NO_WINDOW, softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """Scaled dot-product attention, with gradients; drop-in for flash-attn 2.x.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), float16 or bfloat16, on a CUDA GPU (sm_80+);
            headdim any of 1..256, as in flash-attn. Kernels exist for 64, 128 and 256; any
            other head dim runs zero-padded to the next of them (a copy of q, k, v per call,
            the larger head dim's FLOPs, out returned as a view of the padded result).
        k, v: (batch, seqlen_k, nheads_k, headdim), q's dtype and device; nheads must be a
            multiple of nheads_k (GQA/MQA: query head h reads K/V head h // (nheads // nheads_k)).
            Any strides whose last one is 1 (a (batch, nheads, seqlen, headdim) tensor viewed
            with .transpose(1, 2) runs in place); data pointers 16-byte aligned; other strides
            multiples of 8 elements. As in flash-attn, a q, k or v whose last stride is not 1
            is copied first (.contiguous()).
        softmax_scale: scale of q @ k^T before the softmax; default headdim ** -0.5.
        causal: mask aligned to the bottom-right corner (query i sees keys
            j <= i + seqlen_k - seqlen_q); query rows that see no key give out = 0.
        deterministic: the backward's scheme (the forward is always deterministic). False
            (flash-attn's default): dq is summed with float32 atomics, the faster scheme,
            whose last bits vary from run to run. True, or under
            torch.use_deterministic_algorithms(True): bitwise reproducible gradients (dq in a
            kernel of its own, which recomputes two GEMMs).
        return_attn_probs: also return the softmax log-sum-exp.
        Gradients: when q, k or v requires grad (and grad mode is on), out has a grad_fn and
            its backward computes dq, dk, dv (head dims 64 and 128; see deterministic).
        window_size: (left, right), sliding-window attention as in flash-attn: query i sees
            keys i + seqlen_k - seqlen_q - left to i + seqlen_k - seqlen_q + right; -1 (or a
            side at least seqlen_k long) is unbounded; causal makes right 0. Gradients
            included; repeat calls take a plan keyed with the window; under torch.compile
            the window reaches the custom ops (no graph break).
        softcap: 0 (none) or a cap c > 0: the scaled scores become c * tanh(scores / c)
            before the softmax (Gemma 2, Grok), as in flash-attn. Gradients too, always in the
            deterministic scheme (whatever ``deterministic`` says). Repeat calls take a plan
            keyed with the cap, as for a window; under torch.compile the cap reaches the
            custom ops.
        alibi_slopes: None, or ALiBi's float32 slopes, (nheads,) or (batch, nheads), on q's
            device with a unit last stride: query head h of batch entry b adds
            -slope * |i + seqlen_k - seqlen_q - j| to its scaled score of key j (after the
            softcap), as in flash-attn (whose kernels add a per-row constant less when causal:
            the same out, cudaflash's lse is the formula's). Gradients too (none for the
            slopes), always in the deterministic scheme. Repeat calls take a plan keyed with
            the slopes' address (the kernel reads their values at each call).
        dropout_p: the probability of dropping each attention weight, in [0, 1): one
            mask per call from torch's CUDA generator (torch.manual_seed reproduces it),
            rebuilt by the backward (always the deterministic scheme); the rate is p rounded
            to a multiple of 1/256 and kept weights are scaled by 1 / (1 - p), as in
            flash-attn (README). With alibi_slopes too; not with softcap.

    Returns:
        out: (batch, seqlen_q, nheads, headdim), q's dtype, laid out like q (torch.empty_like,
        as in flash-attn). With return_attn_probs, ``(out, softmax_lse, None)``: softmax_lse
        float32 (batch, nheads, seqlen_q), the natural log of the sum of exp(scaled scores)
        per query row (-inf for rows that see no key).
    """
    # The per-call path: a signature seen before has a plan (what the checked path concluded).
    # Every line here is paid on every attention call, and a tiny attention costs less on the
    # GPU than this on the host, hence inline code and pre-bound functions. Only calls with
    # the defaults take it (anything else gets the full checks, which raise or accept an
    # equivalent value such as window_size=[-1, -1]), and never under torch.compile.
    if (dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None
            and (window_size is NO_WINDOW or _no_window(window_size))
            and not _is_compiling()):
        # No lse unless asked for: the kernel skips it and the call saves an allocation.
        want_lse = True if return_attn_probs else False
        try:
            plan = _forward_plans.get((q.shape, q.is_contiguous() or q.stride(), k.shape,
                               k.is_contiguous() or k.stride(), v.shape,
                               v.is_contiguous() or v.stride(), q.dtype, k.dtype, v.dtype,
                               q.get_device(), k.get_device(), v.get_device(), softmax_scale,
                               causal, want_lse))  # = _plans.plan_key()
        except (AttributeError, TypeError):
            # Not tensors (no isinstance checks: they cost more than this rare fallback), or
            # an unhashable softmax_scale: the checked path explains what is wrong.
            plan = None
        if plan is not None:
            # What the signature does not fix: data alignment, the current device, autograd.
            # Any of them wrong: the checked path raises, or switches device.
            q_ptr, k_ptr, v_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr()
            index = plan.device_index
            if not ((q_ptr | k_ptr | v_ptr) & 15 or _current_device() != index
                    or (_is_grad_enabled()
                        and (q.requires_grad or k.requires_grad or v.requires_grad))):
                # q's layout, as flash-attn does; the plan's out strides are empty_like's for
                # q's shape and strides, which the key fixes.
                new_out = plan.new_out
                out = _empty_like(q) if new_out is None else new_out()
                stream = _current_stream(index)
                if want_lse:
                    new_lse = plan.new_lse
                    lse = (q.new_empty(plan.lse_shape, dtype=_float32) if new_lse is None
                           else new_lse())
                    plan.launch(stream, q_ptr, k_ptr, v_ptr, out.data_ptr(), lse.data_ptr(), 0,
                                0)
                    return out, lse, None
                # 0: no lse; 0, 0: not a packed (varlen) batch
                plan.launch(stream, q_ptr, k_ptr, v_ptr, out.data_ptr(), 0, 0, 0)
                return out
    return _attention_checked(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                              alibi_slopes, deterministic, return_attn_probs)


def _attention_checked(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                       alibi_slopes, deterministic, return_attn_probs, probs_head_dim=None):
    """flash_attn_func past its plan: every argument checked; head dims without a kernel
    padded (the padded call comes back here, with the caller's head dim as probs_head_dim
    for S_dmask); torch.compile's custom op, a sliding window, gradients or a plain forward
    (which records a plan for the next call)."""
    window, softcap, dropout_p = _checks.attention_options(dropout_p, window_size, softcap)
    q, k, v = _checks.with_unit_last_stride(q, k, v)
    padded = _padding.padded_head_dim(q, k, v)
    if padded is not None:
        return _padding.with_padded_head_dim(
            _attention_checked, padded, q, k, v, softmax_scale,
            dict(dropout_p=dropout_p, causal=causal, window_size=window, softcap=softcap,
                 alibi_slopes=alibi_slopes, deterministic=deterministic,
                 return_attn_probs=return_attn_probs))
    if dropout_p:
        return _dropout_attention(q, k, v, dropout_p, softmax_scale, causal, window, softcap,
                                  alibi_slopes, deterministic, return_attn_probs,
                                  probs_head_dim)
    if _is_compiling():
        out, lse = fwd_op(q, k, v, softmax_scale, causal, deterministic, *window, softcap,
                          alibi_slopes)
        return (out, lse, None) if return_attn_probs else out
    if window != (-1, -1) or softcap or alibi_slopes is not None:
        return _attention_with_options(q, k, v, softmax_scale, causal, window, softcap,
                                       alibi_slopes, deterministic, return_attn_probs)
    want_lse = True if return_attn_probs else False
    if _checks.wants_grad(q, k, v):
        out, lse = FlashAttnFunction.apply(q, k, v, softmax_scale, causal, deterministic)
        return (out, lse, None) if want_lse else out
    out, lse = _call.checked_forward(None, q, k, v, None, softmax_scale, causal, want_lse)
    return (out, lse, None) if want_lse else out


def _dropout_attention(q, k, v, dropout_p, softmax_scale, causal, window, softcap,
                       alibi_slopes, deterministic, return_attn_probs, probs_head_dim=None):
    """flash_attn_func with dropout (plain scores; gradients through FlashAttnFunction, or
    the custom op's autograd under torch.compile, in the deterministic scheme). Each call
    draws its own seed (one torch.randint on q's device, after q, k, v are checked): no
    plan. return_attn_probs adds flash-attn's S_dmask, built with torch ops
    (_dropout.attention_matrix: a testing hook, O(seqlen_q * seqlen_k) memory)."""
    if softcap:
        raise NotImplementedError("dropout_p > 0 with softcap is not implemented (flash-attn "
                                  "refuses it too)")
    if _is_compiling():
        # The seed is a traced torch.randint: each run of the graph draws a new mask, and
        # S_dmask (torch ops on the seed tensor) is built from the same seed.
        seed = _dropout.draw_seed(q.device)
        out, lse = fwd_op(q, k, v, softmax_scale, causal, deterministic, *window, 0.0,
                          alibi_slopes, dropout_p, seed)
        if not return_attn_probs:
            return out
        scale = _checks.softmax_scale(softmax_scale, q.shape[3])
        return out, lse, _dropout.attention_probs(
            q, k, scale, causal, window, _dropout.with_seed(dropout_p, seed, q.device),
            alibi_slopes, probs_head_dim)
    with torch.no_grad():  # (check_qkv refuses leaves that require grad: the autograd
        _checks.check_qkv(q, k, v)  # function below takes them)
    _checks.check_on_gpu(q)
    dropout = _dropout.draw(dropout_p, q.device)
    if _checks.wants_grad(q, k, v):
        out, lse = FlashAttnFunction.apply(q, k, v, softmax_scale, causal, deterministic,
                                           window, 0.0, alibi_slopes, dropout)
    else:
        out, lse = _call.checked_forward(None, q, k, v, None, softmax_scale, causal,
                                         bool(return_attn_probs), window=window,
                                         alibi_slopes=alibi_slopes, dropout=dropout)
    if not return_attn_probs:
        return out
    scale = _checks.softmax_scale(softmax_scale, q.shape[3])
    return out, lse, _dropout.attention_probs(q, k, scale, causal, window, dropout,
                                              alibi_slopes, probs_head_dim)


def _dropout_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    dropout_p, softmax_scale, causal, window, softcap, alibi_slopes,
                    deterministic, return_attn_probs, block_table, probs_head_dim=None):
    """flash_attn_varlen_func with dropout, as _dropout_attention (under torch.compile the
    call runs eagerly: a graph break, as varlen calls with gradients do)."""
    if softcap:
        raise NotImplementedError("dropout_p > 0 with softcap is not implemented (flash-attn "
                                  "refuses it too)")
    if block_table is not None:
        raise NotImplementedError("dropout_p > 0 with block_table (paged K/V) is not "
                                  "implemented: the dropout kernels have no cache-addressing "
                                  "form (and a paged flash_attn_varlen_func call has no "
                                  "backward, in flash-attn either)")
    if _is_compiling():
        return _dropout_varlen_eagerly(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, dropout_p, softmax_scale, causal, window,
                                       deterministic, alibi_slopes, return_attn_probs,
                                       probs_head_dim)
    with torch.no_grad():  # (check_qkv refuses leaves that require grad)
        _checks.check_qkv(q, k, v, varlen=True)
    _checks.check_on_gpu(q)
    dropout = _dropout.draw(dropout_p, q.device)
    if _checks.wants_grad(q, k, v):
        out, lse = FlashAttnVarlenFunction.apply(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                 max_seqlen_q, max_seqlen_k, softmax_scale,
                                                 causal, deterministic, window, 0.0,
                                                 alibi_slopes, dropout)
    else:
        out, lse = _call.checked_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                max_seqlen_q, max_seqlen_k, softmax_scale,
                                                causal, bool(return_attn_probs), window, 0.0,
                                                alibi_slopes, dropout=dropout)
    if not return_attn_probs:
        return out
    scale = _checks.softmax_scale(softmax_scale, q.shape[2])
    return out, lse, _dropout.varlen_attention_probs(q, k, cu_seqlens_q, cu_seqlens_k,
                                                     max_seqlen_q, max_seqlen_k, scale, causal,
                                                     window, dropout, alibi_slopes,
                                                     probs_head_dim)


def _attention_with_options(q, k, v, softmax_scale, causal, window, softcap, alibi_slopes,
                            deterministic, return_attn_probs):
    """flash_attn_func with a sliding window, softcapping or ALiBi (``window``: checked
    (left, right) ints; ``softcap``: the checked cap, 0.0 for none; ``alibi_slopes``: None or
    the slopes, checked by the checked forward): a plan keyed by the signature and those
    options for repeat calls, as flash_attn_func's own path (one function call and a key
    lookup more); with gradients through FlashAttnFunction."""
    _checks.check_deterministic(deterministic)
    want_lse = True if return_attn_probs else False
    if _checks.wants_grad(q, k, v):
        out, lse = FlashAttnFunction.apply(q, k, v, softmax_scale, causal, deterministic,
                                           window, softcap, alibi_slopes)
        return (out, lse, None) if want_lse else out
    # A repeat signature takes its plan, keyed with the options (the checked forward records
    # it).
    out, lse = _call.planned_forward(q, k, v, softmax_scale, causal, want_lse, window, softcap,
                                     alibi_slopes)
    return (out, lse, None) if want_lse else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=NO_WINDOW,
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None):
    """Attention over a packed batch of sequences of different lengths; drop-in for flash-attn
    2.x's function of the same name.

    Arguments:
        q: (total_q, nheads, headdim): the batch's query rows, sequence after sequence.
        k, v: (total_k, nheads_k, headdim), likewise; dtype, device, head and stride rules as
            in ``flash_attn_func`` (strides of the first two dims multiples of 8 elements).
        cu_seqlens_q, cu_seqlens_k: (batch + 1,) int32 on q's device, contiguous: sequence b
            is rows cu_seqlens_q[b] to cu_seqlens_q[b + 1] - 1 of q and keys cu_seqlens_k[b]
            to cu_seqlens_k[b + 1] - 1 of k and v.
        max_seqlen_q, max_seqlen_k: ints, the longest query and key lengths of the batch. As in
            flash-attn they are trusted, not checked against the offsets on the GPU (that
            would cost a device-to-host copy per call): rows of a sequence longer than
            max_seqlen_q are not computed, and with maxima below the real lengths the
            gradients of such a sequence are undefined (as in flash-attn). CUDAFLASH_DEBUG=1
            checks the offsets and the maxima on every call. Offsets outside [0, total] are
            clamped: never an out-of-bounds access.
        causal: the mask of each sequence aligned to its bottom-right corner.
        deterministic: ignored; the backward always runs the deterministic kernels here.
        Gradients: when q, k or v requires grad (and grad mode is on), out has a grad_fn and
            its backward computes dq, dk, dv per sequence (head dims 64 and 128), bitwise
            reproducible; rows of no sequence get zero gradients. Under torch.compile the
            call runs eagerly (a graph break: its custom op has no autograd formula yet).
        block_table: None, or (batch, max_blocks_per_seq) int32 for paged K/V: k and v are
            then pools of pages (num_blocks, page_block_size, nheads_k, headdim), page sizes
            powers of two from 16, and sequence b's cu_seqlens_k[b + 1] - cu_seqlens_k[b] keys
            are in its pages (flash_attn_with_kvcache's layout). Forward only, as in
            flash-attn (in grad mode out's backward raises).
        alibi_slopes: as in ``flash_attn_func``; (batch, nheads) gives each sequence its own,
            and each sequence's bias uses its own lengths.
        Other arguments (softcap included) as in ``flash_attn_func``.

    Returns:
        out: (total_q, nheads, headdim), q's dtype. With return_attn_probs,
        ``(out, softmax_lse, None)``: softmax_lse float32 (nheads, total_q), flash-attn's layout.
        Rows outside ``cu_seqlens_q[0]:cu_seqlens_q[-1]`` belong to no sequence: neither is
        written there, as in flash-attn.
    """
    window = (-1, -1)
    if not (dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None
            and (window_size is NO_WINDOW or _no_window(window_size))):
        window, softcap, dropout_p = _checks.attention_options(dropout_p, window_size, softcap)
    else:
        softcap, dropout_p = 0.0, 0.0
    want_lse = True if return_attn_probs else False
    # A repeat signature takes its plan, as in flash_attn_func (the key through its function
    # here: this path is not tuned for tiny calls the way flash_attn_func's is); never under
    # torch.compile, which takes the custom op, nor with paged K/V, which records none.
    if block_table is None and not dropout_p and not _is_compiling():
        done = _call.replayed_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                             max_seqlen_k, softmax_scale, causal, want_lse,
                                             window, softcap, alibi_slopes)
        if done is not None:
            out, lse = done
            return (out, lse, None) if want_lse else out

    q, k, v = _checks.with_unit_last_stride(q, k, v)
    padded = _padding.padded_head_dim(q, k, v)
    if padded is not None:
        return _padding.with_padded_head_dim(
            _padded_varlen, padded, q, k, v, softmax_scale,
            dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=dropout_p,
                 causal=causal, window_size=window, softcap=softcap,
                 alibi_slopes=alibi_slopes, deterministic=deterministic,
                 return_attn_probs=return_attn_probs, block_table=block_table))
    if dropout_p:
        return _dropout_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p, softmax_scale, causal, window, softcap, alibi_slopes,
                               deterministic, return_attn_probs, block_table)
    if block_table is not None:
        # Paged K/V (flash_attn_with_kvcache's caches): forward only, no plan, eagerly.
        out, lse = kvcache.paged_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                max_seqlen_q, max_seqlen_k, block_table,
                                                softmax_scale, causal, window, softcap,
                                                want_lse, alibi_slopes)
        return (out, lse, None) if want_lse else out
    if _is_compiling():
        # The custom op has no autograd formula: calls with gradients run eagerly (a graph
        # break).
        if _checks.wants_grad(q, k, v):
            out, lse = _varlen_eagerly(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, softmax_scale, causal, window,
                                       deterministic, softcap, alibi_slopes)
            return (out, lse, None) if return_attn_probs else out
        out, lse = varlen_fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, softmax_scale, causal, *window, softcap,
                                  alibi_slopes)
        return (out, lse, None) if return_attn_probs else out

    if _checks.wants_grad(q, k, v):
        out, lse = FlashAttnVarlenFunction.apply(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                 max_seqlen_q, max_seqlen_k, softmax_scale,
                                                 causal, deterministic, window, softcap,
                                                 alibi_slopes)
        return (out, lse, None) if want_lse else out
    out, lse = _call.checked_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                            max_seqlen_k, softmax_scale, causal, want_lse,
                                            window, softcap, alibi_slopes)
    return (out, lse, None) if want_lse else out


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=NO_WINDOW, softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """flash_attn_func for q, k, v packed in one tensor; drop-in for flash-attn 2.x's.

    qkv: (batch, seqlen, 3, nheads, headdim). q, k, v are its three slices along dim 2, run
    in place (no copy: the kernels take their strides); with gradients, the grad of qkv is
    the three grads stacked. Other arguments and the result as in ``flash_attn_func``.
    """
    q, k, v = _checks.unpack("qkv", qkv, 5, 3, "(batch, seqlen, 3, nheads, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=NO_WINDOW, softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """flash_attn_func with k and v packed in one tensor; drop-in for flash-attn 2.x's.

    kv: (batch, seqlen_k, 2, nheads_k, headdim), run in place as flash_attn_qkvpacked_func's
    qkv. Other arguments and the result as in ``flash_attn_func``.
    """
    k, v = _checks.unpack("kv", kv, 5, 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=NO_WINDOW,
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash_attn_varlen_func for a packed batch whose q, k, v share one tensor and one set of
    offsets; drop-in for flash-attn 2.x's. qkv: (total, 3, nheads, headdim); cu_seqlens and
    max_seqlen serve as both the query and the key offsets and maxima. Gradients as in
    ``flash_attn_varlen_func`` (the grad of qkv is the three grads stacked)."""
    q, k, v = _checks.unpack("qkv", qkv, 4, 3, "(total, 3, nheads, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=NO_WINDOW, softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """flash_attn_varlen_func with k and v packed in one tensor, kv: (total_k, 2, nheads_k,
    headdim); drop-in for flash-attn 2.x's. Gradients as in ``flash_attn_varlen_func``."""
    k, v = _checks.unpack("kv", kv, 4, 2, "(total_k, 2, nheads_k, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs)


def _padded_varlen(q, k, v, softmax_scale, probs_head_dim=None, **options):
    """flash_attn_varlen_func on q, k, v padded to a built head dim (_padding's
    ``function``); with probs_head_dim (dropout with return_attn_probs) the dropout path
    directly, which builds S_dmask with the caller's key blocks."""
    if probs_head_dim is None:
        return flash_attn_varlen_func(q, k, v, softmax_scale=softmax_scale, **options)
    o = options
    return _dropout_varlen(q, k, v, o["cu_seqlens_q"], o["cu_seqlens_k"], o["max_seqlen_q"],
                           o["max_seqlen_k"], o["dropout_p"], softmax_scale, o["causal"],
                           o["window_size"], o["softcap"], o["alibi_slopes"],
                           o["deterministic"], o["return_attn_probs"], o["block_table"],
                           probs_head_dim)


@torch.compiler.disable  # outside the graph: flash_attn_varlen_func's eager path
def _dropout_varlen_eagerly(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            dropout_p, softmax_scale, causal, window, deterministic,
                            alibi_slopes, return_attn_probs, probs_head_dim=None):
    """flash_attn_varlen_func's dropout path run eagerly, gradients included: out, or with
    return_attn_probs (out, lse, S_dmask)."""
    return _dropout_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p, softmax_scale, causal, window, 0.0, alibi_slopes,
                           deterministic, return_attn_probs, None, probs_head_dim)


@torch.compiler.disable  # outside the graph: flash_attn_varlen_func's eager path
def _varlen_eagerly(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, causal, window, deterministic, softcap, alibi_slopes):
    """(out, lse) of flash_attn_varlen_func run eagerly, gradients included."""
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
                                  window_size=window, softcap=softcap,
                                  alibi_slopes=alibi_slopes, deterministic=deterministic,
                                  return_attn_probs=True)[:2]


def forward(config, q, k, v, out=None, softmax_scale=None, causal=False, num_splits=None,
            window_size=NO_WINDOW, softcap=0.0, alibi_slopes=None):
    """Run one explicit kernel config; returns ``(out, lse)``.

    ``config`` is a KernelConfig or its canonical name (``list_kernels(device)`` lists the
    ones built for a GPU); its dtype and d_head must be q's. ``out``, if given, must have q's
    shape, dtype and device, a contiguous last dim and aligned strides, and must not overlap
    q, k or v. ``num_splits``: how many runs each query block's keys are cut into (split-KV,
    then a second kernel combines them); None chooses as flash_attn_func does (split only
    grids too small to fill the GPU), 1 never splits, n splits into at most n runs of at
    least one KV block. ``window_size``: the sliding window, ``softcap`` the softcapping,
    ``alibi_slopes`` ALiBi, as in ``flash_attn_func`` (no gradients here). Other arguments as
    in ``flash_attn_func``.
    """
    if isinstance(config, str):
        config = KernelConfig.from_name(config)
    elif not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a KernelConfig or a canonical config name, got "
                        f"{type(config).__name__}")
    if num_splits is not None and (not isinstance(num_splits, numbers.Integral)
                                   or isinstance(num_splits, bool) or num_splits < 1):
        raise ValueError(f"num_splits={num_splits!r}; it must be None or an int >= 1")
    window = _checks.check_window(window_size)
    return _call.checked_forward(config, q, k, v, out, softmax_scale, causal,
                                 num_splits=num_splits, window=window,
                                 softcap=_checks.check_softcap(softcap),
                                 alibi_slopes=alibi_slopes)


def list_kernels(device=None) -> list[KernelEntry]:
    """The manifest's kernels; with ``device`` (index, "cuda:N" or torch.device) only the ones
    that run there, one per config (the cubin or PTX the runtime would load)."""
    if device is None:
        return list(_manifest.load_manifest().kernels)
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device={device}; cudaflash kernels run on CUDA devices")
    index = device.index if device.index is not None else torch.cuda.current_device()
    return list(dispatch.device_kernels(index).usable.values())


def clear_caches() -> None:
    """Forget the manifest, selected kernels and loaded functions, so the next call re-reads
    the CUDAFLASH_* variables and the kernel files (tests use it). Modules stay loaded."""
    _manifest.clear_cache()
    _driver.clear_cache()
    dispatch.clear_cache()
    _plans.clear()
