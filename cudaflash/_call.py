"""The checked call below the public functions: check -> plan -> launch.

The public functions (api.py) check their own arguments' forms (window, softcap, head-dim
padding, autograd) and then come here; so do the autograd functions and the custom ops
(_autograd.py), which must never call the public functions. Everything here runs eagerly on
q's device, made current where it is not.
"""

from typing import Optional

import torch

from . import _checks, _plans, dispatch, launch
from ._checks import DTYPES
from .config import KernelConfig


def checked_forward(config: Optional[KernelConfig], q, k, v, out, softmax_scale, causal,
                    want_lse=True, num_splits=None, window=(-1, -1), softcap=0.0,
                    alibi_slopes=None, dropout=None):
    """``(out, lse)`` of one forward over a padded batch, every tensor argument checked;
    ``config`` None: the selection rules choose, and the call records a plan for its
    signature (if it is hashable). ``window``, ``softcap``: checked by the caller;
    ``alibi_slopes``: checked here; ``dropout``: the call's _dropout.Dropout (drawn by the
    caller on q's device) or None; a call with dropout records no plan."""
    _checks.check_qkv(q, k, v)
    alibi_slopes = _checks.check_alibi_slopes(alibi_slopes, q.shape[0], q.shape[2], q.device)
    # flash_attn_func records a plan for the signature; a windowed, softcapped or ALiBi
    # call's key holds those options too (planned_forward looks it up).
    plan_key = None
    if config is None and out is None:
        try:
            plan_key = _plans.options_key(_plans.plan_key(q, k, v, softmax_scale, causal,
                                                          want_lse),
                                          window, softcap, alibi_slopes)
            hash(plan_key)
        except TypeError:
            plan_key = None
    d_head = q.shape[3]
    if config is not None and (config.dtype, config.d_head) != (DTYPES[q.dtype], d_head):
        raise ValueError(f"config {config.name} is for {config.dtype} with d_head="
                         f"{config.d_head}, but q is {DTYPES[q.dtype]} with head dim {d_head}")
    scale = _checks.softmax_scale(softmax_scale, d_head)
    if causal not in (True, False):
        raise TypeError(f"causal={causal!r}; it must be a bool")
    if out is not None:
        _checks.check_out(out, q, k, v)
    _checks.check_on_gpu(q)
    index = q.get_device()
    if index != torch.cuda.current_device():
        # The driver calls work in the current context: make q's device current.
        with torch.cuda.device(index):
            return launch.run(config, index, q, k, v, out, scale, bool(causal), want_lse,
                              plan_key, num_splits, window=window, softcap=softcap,
                              alibi=alibi_slopes, dropout=dropout, alibi_band=True)
    return launch.run(config, index, q, k, v, out, scale, bool(causal), want_lse, plan_key,
                      num_splits, window=window, softcap=softcap, alibi=alibi_slopes,
                      dropout=dropout, alibi_band=True)


def planned_forward(q, k, v, softmax_scale, causal, want_lse, window=(-1, -1), softcap=0.0,
                    alibi_slopes=None):
    """``(out, lse)`` of flash_attn_func without gradients: the signature's plan (keyed with
    the window, the cap and the ALiBi slopes where they are not the defaults), else
    checked_forward, which records one. flash_attn_func's own fast path does the default
    case inline."""
    try:
        plan = _plans.plans.get(_plans.options_key(
            _plans.plan_key(q, k, v, softmax_scale, causal, want_lse), window, softcap,
            alibi_slopes))
    except (AttributeError, TypeError):  # not tensors, or unhashable: the checks explain
        plan = None
    done = None if plan is None else _plans.replay(plan, q, k, v, want_lse, 0, 0)
    if done is None:
        done = checked_forward(None, q, k, v, None, softmax_scale, causal, want_lse,
                               window=window, softcap=softcap, alibi_slopes=alibi_slopes)
    return done


def replayed_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            softmax_scale, causal, want_lse, window, softcap, alibi_slopes=None):
    """``(out, lse)`` of a packed batch from its signature's plan, or None (no plan, or one
    that cannot serve this call)."""
    try:
        plan = _plans.varlen_plans.get(_plans.varlen_plan_key(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
            causal, want_lse, window, softcap, alibi_slopes))
    except (AttributeError, TypeError):  # not tensors, or unhashable: the checks explain
        return None
    if plan is None:
        return None
    return _plans.replay(plan, q, k, v, want_lse, cu_seqlens_q.data_ptr(),
                         cu_seqlens_k.data_ptr())


def checked_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale, causal, want_lse, window, softcap, alibi_slopes=None,
                           dropout=None):
    """``(out, lse)`` of one forward over a packed batch, every tensor argument checked; records
    a plan (outside CUDAFLASH_DEBUG; not with ``dropout``, a _dropout.Dropout). ``window``, ``softcap``: checked by the caller;
    ``alibi_slopes``: checked here ((nheads,) or (batch, nheads): a slope per sequence)."""
    _checks.check_qkv(q, k, v, varlen=True)
    _checks.check_cu_seqlens(q, cu_seqlens_q, cu_seqlens_k)
    alibi_slopes = _checks.check_alibi_slopes(alibi_slopes, cu_seqlens_q.numel() - 1,
                                              q.shape[1], q.device)
    max_seqlen_q = _checks.check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _checks.check_max_seqlen("max_seqlen_k", max_seqlen_k)
    scale = _checks.softmax_scale(softmax_scale, q.shape[2])
    if causal not in (True, False):
        raise TypeError(f"causal={causal!r}; it must be a bool")
    _checks.check_on_gpu(q)
    index = q.get_device()
    with torch.cuda.device(index):  # the driver calls work in the current context
        debug = dispatch.device_kernels(index).debug  # CUDAFLASH_DEBUG, as the kernels saw it
        if debug:
            _checks.check_offsets(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0],
                                  max_seqlen_q, max_seqlen_k)
        # Plans skip the offset check, so none are recorded while CUDAFLASH_DEBUG is on.
        plan_key = None if debug else _plans.varlen_plan_key(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
            causal, want_lse, window, softcap, alibi_slopes)
        return launch.run_varlen(index, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                 max_seqlen_k, scale, bool(causal), want_lse, plan_key, window,
                                 softcap, alibi=alibi_slopes, dropout=dropout)


def planned_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           softmax_scale, causal, want_lse, window=(-1, -1), softcap=0.0,
                           alibi_slopes=None):
    """``(out, lse)`` of flash_attn_varlen_func without gradients: the plan, else the checks
    and a launch that records one."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
            causal, want_lse, window, softcap, alibi_slopes)
    done = replayed_varlen_forward(*args)
    return checked_varlen_forward(*args) if done is None else done
