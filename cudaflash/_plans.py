"""Plans: what the checked path concluded for one argument signature, replayed by repeat calls.

Repeated calls are the common case (every layer of every step has the same shapes), so the
public functions remember a ``Plan`` per argument signature (shapes, strides, dtypes,
devices, scale, causal, and the window, cap and ALiBi slopes where they are not the
defaults): the kernel,
the grid and the Params fields that do not change, bound into one launch. A repeat call then
only checks what the signature does not fix (data alignment, autograd, the current device),
allocates out (and lse) and launches. flash_attn_func does those steps inline (its per-call
host time is the one the budget counts); flash_attn_varlen_func, flash_attn_with_kvcache's
decoding steps and windowed or capped calls go through ``replay``.
"""

import functools
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ._torch import (current_device, current_stream, empty_like, empty_strided_cuda, float32,
                     is_grad_enabled)


@dataclass(frozen=True)
class Plan:
    """What the checked path concluded for one argument signature of flash_attn_func (or of
    flash_attn_varlen_func, or a flash_attn_with_kvcache decoding step)."""

    device_index: int
    # Launcher.launch, bound once: the kernel, geometry and fixed Params fields (out laid out
    # like q) are in its Launcher.
    launch: object
    lse_shape: tuple[int, ...]
    # Zero-argument allocators of out and lse (fast_allocator), or None: torch.empty_like(q)
    # and q.new_empty(lse_shape, dtype=float32).
    new_out: Optional[Callable[[], torch.Tensor]] = None
    new_lse: Optional[Callable[[], torch.Tensor]] = None


MAX_PLANS = 4096
plans: dict[tuple, Plan] = {}  # flash_attn_func's (windowed and capped calls included)
varlen_plans: dict[tuple, Plan] = {}  # flash_attn_varlen_func's
kvcache_plans: dict[tuple, Plan] = {}  # flash_attn_with_kvcache's decoding steps


def clear() -> None:
    plans.clear()
    varlen_plans.clear()
    kvcache_plans.clear()


def plan_key(q, k, v, softmax_scale, causal, want_lse):
    """The argument signature a Plan is valid for (flash_attn_func's fast path builds the
    same tuple inline).

    A contiguous tensor's layout is given by its shape, up to the strides of size-1 dims,
    which the kernels only ever multiply by index 0: ``is_contiguous()`` (True) stands for
    the strides then, and is cheaper than reading them (a new tuple to build and hash).
    get_device() (-1 on the CPU) is cheaper than building a torch.device per tensor.
    """
    return (q.shape, q.is_contiguous() or q.stride(), k.shape, k.is_contiguous() or k.stride(),
            v.shape, v.is_contiguous() or v.stride(), q.dtype, k.dtype, v.dtype,
            q.get_device(), k.get_device(), v.get_device(), softmax_scale, causal, want_lse)


def address_key(t):
    """The plan-key part of a tensor whose pointer a plan packs with its fixed Params fields
    (ALiBi's slopes, a paged cache's block_table): None, or its address, shape, strides,
    dtype and device. The kernels read the values there at each launch, so new values at
    the same address are seen, and a call with the tensor elsewhere needs a plan of its
    own."""
    if t is None:
        return None
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.get_device())


def options_key(key, window, softcap, alibi_slopes):
    """flash_attn_func's plan key for a call with a window, a cap or ALiBi slopes: the
    signature's ``key`` and those options (the signature's alone when all are defaults)."""
    if window == (-1, -1) and not softcap and alibi_slopes is None:
        return key
    return (key, window, softcap, address_key(alibi_slopes))


def varlen_plan_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, causal, want_lse, window=(-1, -1), softcap=0.0,
                    alibi_slopes=None):
    """The argument signature a varlen Plan is valid for (see plan_key). The offsets'
    values are data (the kernel reads them): only their tensors' shape, layout, dtype and
    device are in it. ``window``: the checked window_size; ``softcap``: the checked cap;
    ``alibi_slopes``: address_key's part."""
    return (q.shape, q.is_contiguous() or q.stride(), k.shape, k.is_contiguous() or k.stride(),
            v.shape, v.is_contiguous() or v.stride(), q.dtype, k.dtype, v.dtype, q.get_device(),
            k.get_device(), v.get_device(), cu_seqlens_q.shape, cu_seqlens_k.shape,
            cu_seqlens_q.is_contiguous(), cu_seqlens_k.is_contiguous(), cu_seqlens_q.dtype,
            cu_seqlens_k.dtype, cu_seqlens_q.get_device(), cu_seqlens_k.get_device(),
            max_seqlen_q, max_seqlen_k, softmax_scale, causal, want_lse, window, softcap,
            address_key(alibi_slopes))


def kvcache_plan_key(q, k_cache, v_cache, cache_seqlens, softmax_scale, causal, num_splits,
                     return_softmax_lse, window, softcap, alibi_slopes=None, block_table=None):
    """The argument signature a flash_attn_with_kvcache Plan is valid for (see plan_key);
    the lengths' values are data (the kernel reads them). The types of the scalar arguments
    are in it too: True == 1 as dict keys, but only one of them passes the checks.
    ``window``: window_size as two ints (the caller checks their types); ``softcap``: the
    checked cap (the decoding step's lookup passes 0.0: it only serves softcap=0 calls);
    ``alibi_slopes`` and ``block_table`` (paged caches): address_key's parts."""
    return (plan_key(q, k_cache, v_cache, softmax_scale, causal, return_softmax_lse),
            cache_seqlens.shape, cache_seqlens.dtype, cache_seqlens.get_device(),
            cache_seqlens.is_contiguous(), num_splits, type(num_splits), type(causal),
            type(return_softmax_lse), type(softmax_scale), window, softcap,
            address_key(alibi_slopes), address_key(block_table))


def replay(plan: Plan, q, k, v, want_lse, cu_seqlens_q: int, cu_seqlens_k: int):
    """``(out, lse)`` from ``plan``'s launch on this call's tensors (lse None unless
    ``want_lse``), or None where the plan cannot serve the call (data alignment, the current
    device, autograd: the checked path then explains or switches). flash_attn_func keeps
    the same steps inline."""
    q_ptr, k_ptr, v_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr()
    index = plan.device_index
    if ((q_ptr | k_ptr | v_ptr) & 15 or current_device() != index
            or (is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))):
        return None
    new_out, new_lse = plan.new_out, plan.new_lse
    out = empty_like(q) if new_out is None else new_out()
    lse = None
    if want_lse:
        lse = q.new_empty(plan.lse_shape, dtype=float32) if new_lse is None else new_lse()
    plan.launch(current_stream(index), q_ptr, k_ptr, v_ptr, out.data_ptr(),
                0 if lse is None else lse.data_ptr(), cu_seqlens_q, cu_seqlens_k)
    return out, lse


def record(table: dict, key, index: int, launch, lse_shape: tuple, out: torch.Tensor,
           lse: Optional[torch.Tensor]) -> None:
    """Remember the launch of a call that just ran, under its signature ``key``."""
    if len(table) >= MAX_PLANS:  # many distinct shapes (varying lengths): start over
        table.clear()
    table[key] = Plan(device_index=index, launch=launch, lse_shape=lse_shape,
                      new_out=fast_allocator(out),
                      new_lse=None if lse is None else fast_allocator(lse))


def fast_allocator(like: torch.Tensor,
                   empty_strided=None) -> Optional[Callable[[], torch.Tensor]]:
    """A zero-argument function returning a new uninitialised tensor with ``like``'s shape,
    strides, dtype and device, through ``empty_strided`` (default: torch's private
    _empty_strided_cuda, which allocates on the current device: ``like``'s, here). None
    where that function is missing, fails, or makes a tensor that differs from ``like`` in
    any of these: the caller then allocates through torch's public functions."""
    empty_strided = empty_strided or empty_strided_cuda
    if empty_strided is None:
        return None
    shape, stride, dtype = tuple(like.shape), like.stride(), like.dtype
    allocate = functools.partial(empty_strided, shape, stride, dtype)
    try:
        made = allocate()
    except Exception:  # a torch whose private function takes other arguments
        return None
    same = (type(made) is torch.Tensor and made.shape == like.shape
            and made.stride() == stride and made.dtype == dtype
            and made.device == like.device and not made.requires_grad)
    return allocate if same else None
