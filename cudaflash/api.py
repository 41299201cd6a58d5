"""Public API: ``flash_attn_func``, ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache``
(flash-attn 2.x semantics) and ``forward`` (one config).

A call goes: check the arguments on the host (nothing bad reaches a kernel) -> get the kernel
(cached per context and problem class; on a miss: selection rules filtered by what the
manifest has for this GPU, module load) -> allocate out/lse -> one launch on torch's current
stream (so torch streams and CUDA-graph capture work). Eager calls stay off the torch
dispatcher (a custom op costs 10-30 us per call); under torch.compile the call goes through
the ``cudaflash::fwd`` custom op so the graph sees an opaque op with a fake implementation.

Repeated calls are the common case (every layer of every step has the same shapes), so
flash_attn_func remembers a ``_Plan`` per argument signature (shapes, strides, dtypes,
devices, scale, causal): what the checks concluded, the kernel, the grid and the Params fields
that do not change. A repeat call then only checks what the signature does not fix (data
alignment, autograd, the current device), allocates out and launches. flash_attn_varlen_func
and flash_attn_with_kvcache's decoding steps (tensor lengths, no append) keep plans too.
"""

import bisect
import functools
import math
import numbers
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import _driver, _env, backward as _backward, manifest as _manifest, selection
from ._env import log
from ._params import score_scales
from .config import BWD_D_HEADS, D_HEADS, KernelConfig
from .manifest import KernelEntry

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_GRID_YZ_MAX = 65535  # CUDA limit on grid.y (heads) and grid.z (batch)
_INT32_MAX = 2**31 - 1  # Params sizes are int32
_DIMS = ("batch", "seqlen", "head")

# Used on the per-call path, so bound once here instead of looked up per call.
# Raw handle of torch's current stream on a device: a side stream, or the capture stream
# inside ``torch.cuda.graph``. Same value as ``torch.cuda.current_stream(index).cuda_stream``
# without building a Stream object per call (Inductor's generated code uses the same
# function). None in CPU-only torch builds, where nothing reaches a launch.
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
# torch.cuda.current_device() without its Python wrapper (0.2 instead of 0.5 us): the C
# function does the same lazy CUDA initialisation (and bad-fork check) itself.
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_is_compiling = torch.compiler.is_compiling  # torch.compile recognises the function itself
_is_grad_enabled = torch.is_grad_enabled
_empty_like = torch.empty_like
_float32 = torch.float32
# The allocator of Inductor's generated code (torch/_inductor/codegen/wrapper.py): an empty
# tensor of given sizes, strides and dtype on the current CUDA device, without the dispatcher;
# about half of torch.empty_like's host time. Private to torch, so never trusted blindly:
# _fast_allocator() tries it once per plan and keeps it only if its tensor is what
# torch.empty_like gave; otherwise (or where torch lacks it) the plan allocates as before.
_empty_strided_cuda = getattr(getattr(getattr(torch._C, "_dynamo", None), "guards", None),
                              "_empty_strided_cuda", None)


# ---- public functions ------------------------------------------------------------------------


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False):
    """Scaled dot-product attention, forward only; drop-in for flash-attn 2.x.

    Arguments:
        q: (batch, seqlen_q, nheads, headdim), float16 or bfloat16, on a CUDA GPU (sm_80+);
            headdim any of 1..256, as in flash-attn. Kernels exist for 64, 128 and 256; any
            other head dim runs zero-padded to the next of them (a copy of q, k, v per call,
            the larger head dim's FLOPs, out returned as a view of the padded result).
        k, v: (batch, seqlen_k, nheads_k, headdim), q's dtype and device; nheads must be a
            multiple of nheads_k (GQA/MQA: query head h reads K/V head h // (nheads // nheads_k)).
            Any strides whose last one is 1 (a (batch, nheads, seqlen, headdim) tensor viewed
            with .transpose(1, 2) runs in place); data pointers 16-byte aligned; other strides
            multiples of 8 elements. Unlike flash-attn, a non-unit last stride is an error,
            not a silent copy: .contiguous() makes the copy visible where it is paid for.
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
        dropout_p, alibi_slopes: only their defaults (no dropout, no ALiBi); anything else
            raises NotImplementedError.

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
            and type(window_size) is tuple and window_size == (-1, -1)
            and not _is_compiling()):
        # No lse unless asked for: the kernel skips it and the call saves an allocation.
        want_lse = True if return_attn_probs else False
        try:
            plan = _plans.get((q.shape, q.is_contiguous() or q.stride(), k.shape,
                               k.is_contiguous() or k.stride(), v.shape,
                               v.is_contiguous() or v.stride(), q.dtype, k.dtype, v.dtype,
                               q.get_device(), k.get_device(), v.get_device(), softmax_scale,
                               causal, want_lse))  # = _plan_key()
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
                       alibi_slopes, deterministic, return_attn_probs):
    """flash_attn_func past its plan: every argument checked; head dims without a kernel
    padded; torch.compile's custom op, a sliding window, gradients or a plain forward (which
    records a plan for the next call)."""
    _reject_unsupported(dropout_p, alibi_slopes)
    window = _check_window(window_size)
    softcap = _check_softcap(softcap)
    padded = _padded_head_dim(q, k, v)
    if padded is not None:
        return _with_padded_head_dim(
            flash_attn_func, padded, q, k, v, softmax_scale,
            dict(causal=causal, window_size=window, softcap=softcap,
                 deterministic=deterministic, return_attn_probs=return_attn_probs))
    if _is_compiling():
        out, lse = _fwd_op(q, k, v, softmax_scale, causal, deterministic, *window, softcap)
        return (out, lse, None) if return_attn_probs else out
    if window != (-1, -1) or softcap:
        return _windowed_or_capped_attention(q, k, v, softmax_scale, causal, window, softcap,
                                             deterministic, return_attn_probs)
    want_lse = True if return_attn_probs else False
    if _wants_grad(q, k, v):
        out, lse = _FlashAttnFunction.apply(q, k, v, softmax_scale, causal, deterministic)
        return (out, lse, None) if want_lse else out
    out, lse = _forward(None, q, k, v, None, softmax_scale, causal, want_lse)
    return (out, lse, None) if want_lse else out


class _FlashAttnFunction(torch.autograd.Function):
    """flash_attn_func with gradients: the forward also keeps the lse, the backward runs
    backward.run. Inside forward grad mode is off, so _forward takes its usual path."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, deterministic, window=(-1, -1),
                softcap=0.0):
        _check_deterministic(deterministic)
        out, lse = _forward(None, q, k, v, None, softmax_scale, causal, True, window=window,
                            softcap=softcap)
        # Fail now, not in the backward after a whole forward pass of work.
        _backward.check_supported(q.get_device(), q.dtype, q.shape[3],
                                  _backward.scheme(deterministic, softcap))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = _softmax_scale(softmax_scale, q.shape[3])
        ctx.causal = bool(causal)
        ctx.deterministic = deterministic
        # The window as the forward's kernel took it (clamped by seqlen_k, causal as right 0).
        ctx.kernel_window = _kernel_window(window, k.shape[1], ctx.causal)
        ctx.softcap = softcap
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _run_backward(dout, q, k, v, out, lse, ctx.scale, ctx.causal,
                                   ctx.deterministic, ctx.kernel_window, ctx.softcap)
        return dq, dk, dv, None, None, None, None, None


def _check_deterministic(deterministic) -> None:
    if deterministic not in (True, False):
        raise TypeError(f"deterministic={deterministic!r}; it must be a bool")


def _run_backward(dout, q, k, v, out, lse, scale: float, causal: bool, deterministic: bool,
                  kernel_window: tuple[int, int], softcap: float = 0.0):
    """backward.run on q's device; ``kernel_window`` as the forward's kernel took it
    (_kernel_window: the kernels mask by it, causal included); ``softcap`` the forward's."""
    # torch's global switch counts here too; a cap takes the deterministic scheme
    scheme = _backward.scheme(deterministic, softcap)
    index = q.get_device()
    if index != torch.cuda.current_device():
        with torch.cuda.device(index):
            return _backward.run(dout, q, k, v, out, lse, scale, causal, scheme, kernel_window,
                                 softcap)
    return _backward.run(dout, q, k, v, out, lse, scale, causal, scheme, kernel_window, softcap)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
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
        block_table: paged K/V is not implemented; only None.
        Other arguments (softcap included) as in ``flash_attn_func``.

    Returns:
        out: (total_q, nheads, headdim), q's dtype. With return_attn_probs,
        ``(out, softmax_lse, None)``: softmax_lse float32 (nheads, total_q), flash-attn's layout.
    """
    window = (-1, -1)
    if not (dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None
            and type(window_size) is tuple and window_size == (-1, -1)):
        _reject_unsupported(dropout_p, alibi_slopes)
        window = _check_window(window_size)
        softcap = _check_softcap(softcap)
    else:
        softcap = 0.0
    if block_table is not None:
        raise NotImplementedError(f"block_table is a {type(block_table).__name__}: paged K/V is "
                                  "not implemented; pass block_table=None")
    want_lse = True if return_attn_probs else False
    # A repeat signature takes its plan, as in flash_attn_func (the key through its function
    # here: this path is not tuned for tiny calls the way flash_attn_func's is); never under
    # torch.compile, which takes the custom op.
    if not _is_compiling():
        try:
            plan = _varlen_plans.get(_varlen_plan_key(
                q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
                causal, want_lse, window, softcap))
        except (AttributeError, TypeError):  # not tensors, or unhashable: the checks explain
            plan = None
        if plan is not None:
            done = _replay(plan, q, k, v, want_lse, cu_seqlens_q.data_ptr(),
                           cu_seqlens_k.data_ptr())
            if done is not None:
                out, lse = done
                return (out, lse, None) if want_lse else out

    padded = _padded_head_dim(q, k, v)
    if padded is not None:
        return _with_padded_head_dim(
            flash_attn_varlen_func, padded, q, k, v, softmax_scale,
            dict(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                 max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal,
                 window_size=window, softcap=softcap, deterministic=deterministic,
                 return_attn_probs=return_attn_probs))
    if _is_compiling():
        # The custom op has no autograd formula: calls with gradients run eagerly (a graph
        # break).
        if _wants_grad(q, k, v):
            out, lse = _varlen_eagerly(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                       max_seqlen_k, softmax_scale, causal, window,
                                       deterministic, softcap)
            return (out, lse, None) if return_attn_probs else out
        out, lse = _varlen_fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, softmax_scale, causal, *window, softcap)
        return (out, lse, None) if return_attn_probs else out

    if _wants_grad(q, k, v):
        out, lse = _FlashAttnVarlenFunction.apply(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                  max_seqlen_q, max_seqlen_k, softmax_scale,
                                                  causal, deterministic, window, softcap)
        return (out, lse, None) if want_lse else out
    _check_qkv(q, k, v, varlen=True)
    _check_cu_seqlens(q, cu_seqlens_q, cu_seqlens_k)
    max_seqlen_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    scale = _softmax_scale(softmax_scale, q.shape[2])
    if causal not in (True, False):
        raise TypeError(f"causal={causal!r}; it must be a bool")
    _check_on_gpu(q)
    index = q.get_device()
    with torch.cuda.device(index):  # the driver calls work in the current context
        debug = _device_kernels(index).debug  # CUDAFLASH_DEBUG, as the kernels saw it
        if debug:
            _check_offsets(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q,
                           max_seqlen_k)
        # Plans skip the offset check, so none are recorded while CUDAFLASH_DEBUG is on.
        plan_key = None if debug else _varlen_plan_key(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale,
            causal, want_lse, window, softcap)
        out, lse = _run_varlen(index, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, scale, bool(causal), want_lse, plan_key, window,
                               softcap)
    return (out, lse, None) if want_lse else out


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """flash_attn_func for q, k, v packed in one tensor; drop-in for flash-attn 2.x's.

    qkv: (batch, seqlen, 3, nheads, headdim). q, k, v are its three slices along dim 2, run
    in place (no copy: the kernels take their strides); with gradients, the grad of qkv is
    the three grads stacked. Other arguments and the result as in ``flash_attn_func``.
    """
    q, k, v = _unpack("qkv", qkv, 5, 3, "(batch, seqlen, 3, nheads, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """flash_attn_func with k and v packed in one tensor; drop-in for flash-attn 2.x's.

    kv: (batch, seqlen_k, 2, nheads_k, headdim), run in place as flash_attn_qkvpacked_func's
    qkv. Other arguments and the result as in ``flash_attn_func``.
    """
    k, v = _unpack("kv", kv, 5, 2, "(batch, seqlen_k, 2, nheads_k, headdim)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """flash_attn_varlen_func for a packed batch whose q, k, v share one tensor and one set of
    offsets; drop-in for flash-attn 2.x's. qkv: (total, 3, nheads, headdim); cu_seqlens and
    max_seqlen serve as both the query and the key offsets and maxima. Gradients as in
    ``flash_attn_varlen_func`` (the grad of qkv is the three grads stacked)."""
    q, k, v = _unpack("qkv", qkv, 4, 3, "(total, 3, nheads, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """flash_attn_varlen_func with k and v packed in one tensor, kv: (total_k, 2, nheads_k,
    headdim); drop-in for flash-attn 2.x's. Gradients as in ``flash_attn_varlen_func``."""
    k, v = _unpack("kv", kv, 4, 2, "(total_k, 2, nheads_k, headdim)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic, return_attn_probs)


def _unpack(name: str, packed, dims: int, parts: int, layout: str) -> tuple:
    """The ``parts`` views of a packed tensor along its pack dim (dims - 3), after checking
    that it is one."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
    pack_dim = dims - 3
    if packed.dim() != dims or packed.shape[pack_dim] != parts:
        raise ValueError(f"{name} has shape {tuple(packed.shape)}; expected {layout}")
    return packed.unbind(pack_dim)


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
            plan = _kvcache_plans.get(_kvcache_plan_key(q, k_cache, v_cache, cache_seqlens,
                                                        softmax_scale, causal, num_splits,
                                                        return_softmax_lse, window_size, 0.0))
        except (AttributeError, TypeError):  # not tensors, or unhashable: the checks explain
            plan = None
        if plan is not None:
            done = _replay(plan, q, k_cache, v_cache, return_softmax_lse, 0,
                           cache_seqlens.data_ptr())
            if done is not None:
                return done if return_softmax_lse else done[0]

    for name, value in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin),
                        ("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad),
                        ("block_table", block_table)):
        if value is not None:
            raise NotImplementedError(f"{name} is a {type(value).__name__}: not implemented in "
                                      f"cudaflash; pass {name}=None")
    _reject_unsupported(0.0, alibi_slopes)
    window = _check_window(window_size)
    softcap = _check_softcap(softcap)
    padded = _padded_head_dim(q, k_cache, v_cache)
    if padded is not None:
        return _with_padded_head_dim(
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
    _check_qkv(q, k_cache, v_cache, names=("q", "k_cache", "v_cache"))
    if (k is None) != (v is None):
        raise ValueError(f"k is {'None' if k is None else 'a tensor'} and v is "
                         f"{'None' if v is None else 'a tensor'}: give both (to append them "
                         "to the cache) or neither")
    seqlen_cache = k_cache.shape[1]
    seqlen_new = 0
    if k is not None:
        _check_new_kv(k, v, k_cache)
        seqlen_new = k.shape[1]
        if _overlaps(k, k_cache) or _overlaps(v, v_cache) or _overlaps(k, v_cache) \
                or _overlaps(v, k_cache):
            raise ValueError("k or v shares memory with k_cache or v_cache; the new keys "
                             "and values must be tensors of their own")
    scale = _softmax_scale(softmax_scale, q.shape[3])
    if causal not in (True, False):
        raise TypeError(f"causal={causal!r}; it must be a bool")
    _check_on_gpu(q)
    want_lse = bool(return_softmax_lse)
    splits = num_splits or None
    index = q.get_device()
    with torch.cuda.device(index):  # the driver calls work in the current context
        if cache_seqlens is None:
            if k is not None:
                raise ValueError("k and v are written at cache_seqlens, which is None; pass "
                                 "cache_seqlens (an int or a (batch,) int32 tensor)")
            out, lse = _run(None, index, q, k_cache, v_cache, None, scale, bool(causal),
                            want_lse, num_splits=splits, window=window, softcap=softcap)
        elif isinstance(cache_seqlens, torch.Tensor):
            # The kernel first: a call that cannot run must not have changed the cache.
            _kvcache_kernel(index, q, k_cache, causal, seqlen_cache, window)
            debug = _device_kernels(index).debug
            seqused = _kvcache_append(cache_seqlens, q, k_cache, v_cache, k, v, seqlen_new,
                                      debug)
            # A plan for the decoding step (no append); none in debug mode, whose length
            # check the plan would skip.
            plan_key = None
            if k is None and not debug:
                try:
                    plan_key = _kvcache_plan_key(q, k_cache, v_cache, cache_seqlens,
                                                 softmax_scale, causal, num_splits,
                                                 return_softmax_lse, window, softcap)
                    hash(plan_key)
                except TypeError:
                    plan_key = None
            out, lse = _run(None, index, q, k_cache, v_cache, None, scale, bool(causal),
                            want_lse, plan_key=plan_key, num_splits=splits, seqused_k=seqused,
                            plans=_kvcache_plans, window=window, softcap=softcap)
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
                _kvcache_kernel(index, q, k_cache, causal, used, window)  # before the append
                k_cache[:, cache_seqlens:used] = k
                v_cache[:, cache_seqlens:used] = v
            # Every sequence uses the same prefix: a view of it is a plain padded batch.
            out, lse = _run(None, index, q, k_cache[:, :used], v_cache[:, :used], None, scale,
                            bool(causal), want_lse, num_splits=splits, window=window,
                            softcap=softcap)
    return (out, lse) if want_lse else out


def _replay(plan: "_Plan", q, k, v, want_lse, cu_seqlens_q: int, cu_seqlens_k: int):
    """``(out, lse)`` from ``plan``'s launch on this call's tensors (lse None unless
    ``want_lse``), or None where the plan cannot serve the call (data alignment, the current
    device, autograd: the checked path then explains or switches). The repeat path of
    flash_attn_varlen_func and flash_attn_with_kvcache; flash_attn_func keeps the same steps
    inline, as its per-call host time is the one the budget counts."""
    q_ptr, k_ptr, v_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr()
    index = plan.device_index
    if ((q_ptr | k_ptr | v_ptr) & 15 or _current_device() != index
            or (_is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))):
        return None
    new_out, new_lse = plan.new_out, plan.new_lse
    out = _empty_like(q) if new_out is None else new_out()
    lse = None
    if want_lse:
        lse = q.new_empty(plan.lse_shape, dtype=_float32) if new_lse is None else new_lse()
    plan.launch(_current_stream(index), q_ptr, k_ptr, v_ptr, out.data_ptr(),
                0 if lse is None else lse.data_ptr(), cu_seqlens_q, cu_seqlens_k)
    return out, lse


def _kvcache_kernel(index: int, q, k_cache, causal: bool, seqlen_k: int, window) -> None:
    """Select (and load) the kernel the call will run, so that a call that cannot run raises
    before it writes into the cache."""
    rows, _, kernel_causal = _kernel_problem(q.shape[1], q.shape[2], k_cache.shape[2],
                                             bool(causal), _clamp_window(window, seqlen_k))
    _auto_kernel(_driver.current_context(index), index, q.dtype, q.shape[3], kernel_causal,
                 rows, seqlen_k)


def _kvcache_plan_key(q, k_cache, v_cache, cache_seqlens, softmax_scale, causal, num_splits,
                      return_softmax_lse, window, softcap):
    """The argument signature a flash_attn_with_kvcache _Plan is valid for (see _plan_key);
    the lengths' values are data (the kernel reads them). The types of the scalar arguments
    are in it too: True == 1 as dict keys, but only one of them passes the checks.
    ``window``: window_size as two ints (the caller checks their types); ``softcap``: the
    checked cap (the decoding step's lookup passes 0.0: it only serves softcap=0 calls)."""
    return (_plan_key(q, k_cache, v_cache, softmax_scale, causal, return_softmax_lse),
            cache_seqlens.shape, cache_seqlens.dtype, cache_seqlens.get_device(),
            cache_seqlens.is_contiguous(), num_splits, type(num_splits), type(causal),
            type(return_softmax_lse), type(softmax_scale), window, softcap)


def _check_new_kv(k, v, k_cache) -> None:
    """The new keys and values of flash_attn_with_kvcache: torch copies them into the cache,
    so any layout will do; they must match the cache's batch, heads, head dim, dtype and
    device, and not share its memory."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected 4 dims (batch, "
                             "seqlen_new, nheads_k, headdim)")
        if t.dtype != k_cache.dtype or t.device != k_cache.device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}; it must be k_cache's "
                             f"{k_cache.dtype} on {k_cache.device}")
    if k.shape != v.shape:
        raise ValueError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; they must "
                         "be the same")
    b, _, hk, d = k_cache.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, hk, d):
        raise ValueError(f"k and v have shape {tuple(k.shape)}; they must be (batch, "
                         f"seqlen_new, nheads_k, headdim) with k_cache's batch={b}, "
                         f"nheads_k={hk}, headdim={d}")
    if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
        raise NotImplementedError("k or v requires grad, but flash_attn_with_kvcache has no "
                                  "backward; call it under torch.no_grad() or "
                                  "torch.inference_mode()")


def _kvcache_append(cache_seqlens, q, k_cache, v_cache, k, v, seqlen_new: int, debug: bool):
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


class _FlashAttnVarlenFunction(torch.autograd.Function):
    """flash_attn_varlen_func with gradients: the forward keeps the lse, the backward runs
    backward.run_varlen (the deterministic kernels, whatever ``deterministic`` says)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                softmax_scale, causal, deterministic, window=(-1, -1), softcap=0.0):
        _check_deterministic(deterministic)
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                             max_seqlen_k, softmax_scale=softmax_scale,
                                             causal=causal, window_size=window,
                                             softcap=softcap, return_attn_probs=True)
        # Fail now, not in the backward after a whole forward pass of work.
        _backward.check_supported(q.get_device(), q.dtype, q.shape[2], "deterministic")
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.max_seqlens = (int(max_seqlen_q), int(max_seqlen_k))
        ctx.scale = _softmax_scale(softmax_scale, q.shape[2])
        ctx.causal = bool(causal)
        # As the forward's kernel took it: clamped by max_seqlen_k (flash-attn's rule).
        ctx.kernel_window = _kernel_window(window, ctx.max_seqlens[1], ctx.causal)
        ctx.softcap = softcap
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        with torch.cuda.device(q.get_device()):
            dq, dk, dv = _backward.run_varlen(dout, q, k, v, out, lse, cu_seqlens_q,
                                              cu_seqlens_k, *ctx.max_seqlens, ctx.scale,
                                              ctx.causal, ctx.kernel_window, ctx.softcap)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def forward(config, q, k, v, out=None, softmax_scale=None, causal=False, num_splits=None,
            window_size=(-1, -1), softcap=0.0):
    """Run one explicit kernel config; returns ``(out, lse)``.

    ``config`` is a KernelConfig or its canonical name (``list_kernels(device)`` lists the
    ones built for a GPU); its dtype and d_head must be q's. ``out``, if given, must have q's
    shape, dtype and device, a contiguous last dim and aligned strides, and must not overlap
    q, k or v. ``num_splits``: how many runs each query block's keys are cut into (split-KV,
    then a second kernel combines them); None chooses as flash_attn_func does (split only
    grids too small to fill the GPU), 1 never splits, n splits into at most n runs of at
    least one KV block. ``window_size``: the sliding window, ``softcap`` the softcapping, as in
    ``flash_attn_func`` (no gradients here). Other arguments as in ``flash_attn_func``.
    """
    if isinstance(config, str):
        config = KernelConfig.from_name(config)
    elif not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a KernelConfig or a canonical config name, got "
                        f"{type(config).__name__}")
    if num_splits is not None and (not isinstance(num_splits, numbers.Integral)
                                   or isinstance(num_splits, bool) or num_splits < 1):
        raise ValueError(f"num_splits={num_splits!r}; it must be None or an int >= 1")
    window = _check_window(window_size)
    return _forward(config, q, k, v, out, softmax_scale, causal, num_splits=num_splits,
                    window=window, softcap=_check_softcap(softcap))


def list_kernels(device=None) -> list[KernelEntry]:
    """The manifest's kernels; with ``device`` (index, "cuda:N" or torch.device) only the ones
    that run there, one per config (the cubin or PTX the runtime would load)."""
    if device is None:
        return list(_manifest.load_manifest().kernels)
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device={device}; cudaflash kernels run on CUDA devices")
    index = device.index if device.index is not None else torch.cuda.current_device()
    return list(_device_kernels(index).usable.values())


def clear_caches() -> None:
    """Forget the manifest, selected kernels and loaded functions, so the next call re-reads
    the CUDAFLASH_* variables and the kernel files (tests use it). Modules stay loaded."""
    _manifest.clear_cache()
    _driver.clear_cache()
    _rules.cache_clear()
    _devices.clear()
    _auto_kernels.clear()
    _config_kernels.clear()
    _plans.clear()
    _varlen_plans.clear()
    _kvcache_plans.clear()
    _backward.clear_cache()


# ---- argument checks (host only: no GPU state is touched) --------------------------------


def _reject_unsupported(dropout_p, alibi_slopes) -> None:
    if dropout_p != 0.0:
        raise NotImplementedError(f"dropout_p={dropout_p!r}: cudaflash has no dropout (it is a "
                                  "forward for inference); pass dropout_p=0.0")
    if alibi_slopes is not None:
        raise NotImplementedError(f"alibi_slopes is a {type(alibi_slopes).__name__}: ALiBi is "
                                  "not implemented; pass alibi_slopes=None")


def _check_softcap(softcap) -> float:
    """flash-attn's softcap as a float: 0.0 (none) or a finite cap > 0."""
    if not (isinstance(softcap, numbers.Real) and not isinstance(softcap, bool)
            and math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap={softcap!r}; it must be a finite number >= 0 (0: no "
                         "softcapping; c > 0: scores become c * tanh(scores / c))")
    return float(softcap)


def _check_window(window_size) -> tuple[int, int]:
    """flash-attn's window_size as (left, right): each an int >= -1, -1 meaning unbounded."""
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, numbers.Integral) and not isinstance(w, bool)
                       and -1 <= w <= _INT32_MAX for w in window_size)):
        raise ValueError(f"window_size={window_size!r}; it must be (left, right): two ints in "
                         "[-1, 2**31) (-1: unbounded on that side; query i sees keys i + "
                         "seqlen_k - seqlen_q - left to i + seqlen_k - seqlen_q + right)")
    return int(window_size[0]), int(window_size[1])


def _clamp_window(window, seqlen_k: int) -> tuple[int, int]:
    """flash-attn's normalisation: a side at least seqlen_k long is unbounded (-1). Besides
    matching flash-attn where seqlen_q > seqlen_k, it keeps the kernel's sums of rows, keys
    and bounds far from int32 overflow."""
    left, right = window
    return (-1 if left >= seqlen_k else left, -1 if right >= seqlen_k else right)


def _wants_grad(q, k, v) -> bool:
    """Grad mode is on and q, k or v requires grad (getattr: the arguments are not checked
    yet and may not be tensors; the checks explain those)."""
    return _is_grad_enabled() and (getattr(q, "requires_grad", False)
                                   or getattr(k, "requires_grad", False)
                                   or getattr(v, "requires_grad", False))


def _windowed_or_capped_attention(q, k, v, softmax_scale, causal, window, softcap,
                                  deterministic, return_attn_probs):
    """flash_attn_func with a sliding window or softcapping (``window``: checked (left,
    right) ints; ``softcap``: the checked cap, 0.0 for none): a plan keyed by the signature,
    the window and the cap for repeat calls, as flash_attn_func's own path (one function
    call and a key lookup more); with gradients through _FlashAttnFunction."""
    _check_deterministic(deterministic)
    want_lse = True if return_attn_probs else False
    if _wants_grad(q, k, v):
        out, lse = _FlashAttnFunction.apply(q, k, v, softmax_scale, causal, deterministic,
                                            window, softcap)
        return (out, lse, None) if want_lse else out
    # A repeat signature takes its plan, keyed with the window and cap (_forward records it).
    try:
        plan = _plans.get((_plan_key(q, k, v, softmax_scale, causal, want_lse), window,
                           softcap))
    except (AttributeError, TypeError):  # not tensors, or unhashable: the checks explain
        plan = None
    done = None if plan is None else _replay(plan, q, k, v, want_lse, 0, 0)
    if done is None:
        done = _forward(None, q, k, v, None, softmax_scale, causal, want_lse, window=window,
                        softcap=softcap)
    out, lse = done
    return (out, lse, None) if want_lse else out


def _padded_head_dim(q, k, v) -> Optional[int]:
    """The head dim to run q, k, v at when theirs has no kernel: the smallest built one above
    it. flash-attn takes every head dim up to 256 (its kernels come in steps of 32 and it pads
    to a multiple of 8); cudaflash's come in 64, 128 and 256, so a head dim in between runs
    padded with zeros. None when no padding applies: a built head dim, or arguments that are
    not three tensors sharing a head dim in [1, 256] (the checks explain those)."""
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in (q, k, v)):
        return None
    d_head = q.shape[-1]
    if (d_head in D_HEADS or not 1 <= d_head <= D_HEADS[-1] or k.shape[-1] != d_head
            or v.shape[-1] != d_head):
        return None
    for built in D_HEADS:  # (a loop, not bisect: torch.compile traces this and not bisect)
        if built > d_head:
            return built
    return None  # not reached: d_head <= D_HEADS[-1] and is not in D_HEADS


def _with_padded_head_dim(function, padded: int, q, k, v, softmax_scale, kwargs: dict,
                          caches: tuple = ()):
    """``function(q, k, v, softmax_scale=..., **kwargs)`` with q, k, v zero-padded from their
    head dim to ``padded`` and the result's out sliced back (a view, as flash-attn returns).

    Zero columns add nothing to q . k, so the scores are the unpadded ones, provided the scale
    is the caller's head dim's (passed explicitly); out's padded columns are P @ 0 = 0. The
    padding and the slice are torch ops, so autograd carries gradients through them (dq, dk,
    dv come back at the caller's head dim) and torch.compile traces them. The cost: a copy of
    q, k and v per call and the larger head dim's FLOPs.

    ``caches``: flash_attn_with_kvcache's (k_cache, v_cache), which ``function`` reads and
    appends ``k``, ``v`` to: they are padded too (a copy of each cache per call) and, after a
    successful call with an append, written back into the caller's caches (whole, as
    flash-attn does for head dims that are not a multiple of 8)."""
    d_head = q.shape[-1]
    scale = _softmax_scale(softmax_scale, d_head)
    if _wants_grad(q, k, v) and padded not in BWD_D_HEADS:
        raise NotImplementedError(
            f"q, k, v have head dim {d_head} and require grad; cudaflash runs head dim "
            f"{d_head} padded to {padded}, which has no backward kernel (the backward supports "
            f"head dims up to {max(BWD_D_HEADS)}). Call flash_attn_func under "
            "torch.no_grad() for inference")

    def pad(t):
        return None if t is None else torch.nn.functional.pad(t, (0, padded - d_head))

    padded_caches = tuple(pad(c) for c in caches)
    result = function(pad(q), *padded_caches, pad(k), pad(v), softmax_scale=scale, **kwargs)
    if k is not None:  # for kvcache: an append happened (it has no k without one)
        for cache, padded_cache in zip(caches, padded_caches):
            cache.copy_(padded_cache[..., :d_head])
    if isinstance(result, tuple):
        return (result[0][..., :d_head], *result[1:])
    return result[..., :d_head]


@torch.compiler.disable  # outside the graph: flash_attn_varlen_func's eager path
def _varlen_eagerly(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale, causal, window, deterministic, softcap):
    """(out, lse) of flash_attn_varlen_func run eagerly, gradients included."""
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, softmax_scale=softmax_scale, causal=causal,
                                  window_size=window, softcap=softcap,
                                  deterministic=deterministic, return_attn_probs=True)[:2]


def _check_qkv(q, k, v, varlen=False, names=("q", "k", "v")):
    """Raise for anything about q, k, v that the kernels cannot take. ``varlen``: packed
    (total_seqlen, nheads, headdim) tensors of flash_attn_varlen_func. ``names``: the
    arguments' names in the caller's signature, for the messages."""
    dims, layout = (3, "(total_seqlen, nheads, headdim)") if varlen else (
        4, "(batch, seqlen, nheads, headdim)")
    qn, kn, vn = names
    for name, t in ((qn, q), (kn, k), (vn, v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {dims} dims {layout}")
    if q.dtype not in _DTYPES:
        raise TypeError(f"{qn} has dtype {q.dtype}; cudaflash supports torch.float16 and "
                        "torch.bfloat16")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{qn}, {kn}, {vn} have dtypes {q.dtype}, {k.dtype}, {v.dtype}; they "
                        "must be the same")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        # Returning an out without a grad_fn would silently drop the gradient.
        raise NotImplementedError(
            f"{qn}, {kn} or {vn} requires grad, but only flash_attn_func and "
            "flash_attn_varlen_func have a backward in cudaflash (not flash_attn_with_kvcache "
            "or cudaflash.forward); call this under torch.no_grad() or "
            "torch.inference_mode()")
    if k.shape != v.shape:
        raise ValueError(f"{kn} has shape {tuple(k.shape)} but {vn} has {tuple(v.shape)}; they "
                         "must be the same")
    seqlen_q, n_heads, d_head = q.shape[-3:]
    seqlen_k, n_heads_k, d_head_k = k.shape[-3:]
    batch = 1 if varlen else q.shape[0]
    if not varlen and k.shape[0] != batch:
        raise ValueError(f"{qn} has batch size {batch} but {kn} and {vn} have {k.shape[0]}")
    if d_head_k != d_head:
        raise ValueError(f"{qn} has head dim {d_head} but {kn} and {vn} have {d_head_k}")
    if d_head not in D_HEADS:
        # flash_attn_func and friends pad head dims in [1, 256] to a built one before this.
        raise ValueError(f"head dim {d_head} is not supported; cudaflash has kernels for head "
                         f"dims {list(D_HEADS)} and runs the public functions at any head dim "
                         f"from 1 to {D_HEADS[-1]} (padded to the next kernel's)")
    if n_heads < 1 or n_heads_k < 1 or n_heads % n_heads_k:
        raise ValueError(f"{qn} has {n_heads} heads and {kn}, {vn} have {n_heads_k}; nheads "
                         "must be a positive multiple of nheads_k")
    if batch > _GRID_YZ_MAX or n_heads > _GRID_YZ_MAX:
        raise ValueError(f"batch={batch}, nheads={n_heads}: each must be <= {_GRID_YZ_MAX} "
                         "(the CUDA grid limit); split the call")
    if seqlen_q > _INT32_MAX or seqlen_k > _INT32_MAX:
        what = "total_q, total_k" if varlen else "seqlen_q, seqlen_k"
        raise ValueError(f"{what} = {seqlen_q}, {seqlen_k}: each must be < 2**31")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"{qn}, {kn}, {vn} are on {q.device}, {k.device}, {v.device}; they "
                         "must be on the same device")
    for name, t in ((qn, q), (kn, k), (vn, v)):
        s = t.stride()
        if s[-1] != 1:
            raise ValueError(f"{name} has strides {s}; its last (head dim) stride must be 1. "
                             f"{name}.contiguous() gives such a copy")
        _check_aligned(name, t, s)


def _check_aligned(name: str, t: torch.Tensor, s: tuple) -> None:
    """16-byte aligned data and (batch,) seq and head strides (``s``) of whole 16-byte
    vectors (8 elements): the kernels move q/k/v/out in 16-byte vectors."""
    if t.data_ptr() % 16 == 0 and not any(x % 8 for x in s[:-1]):
        return
    if t.data_ptr() % 16:
        raise ValueError(f"{name} is not 16-byte aligned (data_ptr() % 16 = {t.data_ptr() % 16}"
                         f", storage_offset() = {t.storage_offset()}): cudaflash moves 16-byte "
                         f"vectors; pass a tensor starting on a 16-byte boundary, e.g. "
                         f"{name}.clone()")
    dims = _DIMS[-(len(s) - 1):]  # (batch,) seq, head
    for dim in range(len(s) - 1):
        # A stride of a size-1 dim is never multiplied by a non-zero index.
        if t.shape[dim] > 1 and s[dim] % 8:
            raise ValueError(f"{name} has strides {s}: its {dims[dim]} stride {s[dim]} is not a "
                             "multiple of 8 elements (16 bytes), which cudaflash needs for its "
                             f"16-byte vector loads; {name}.contiguous() fixes it")


def _check_out(out, q, k, v) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out is a {tuple(out.shape)} {out.dtype} tensor on {out.device}; it "
                         f"must be like q: {tuple(q.shape)} {q.dtype} on {q.device}")
    s = out.stride()
    if s[3] != 1:
        raise ValueError(f"out has strides {s}; its last stride must be 1")
    _check_aligned("out", out, s)
    if out.numel() == 0:
        return
    if _internal_overlap(out):
        raise ValueError(f"out has shape {tuple(out.shape)} and strides {out.stride()}: some "
                         "of its elements share memory")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if _overlaps(out, t):
            raise ValueError(f"out overlaps {name} in memory; the kernel would overwrite "
                             f"{name} while reading it. Pass a separate out tensor")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, end byte) that a non-empty tensor touches."""
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if b.numel() == 0:
        return False
    a0, a1 = _span(a)
    b0, b1 = _span(b)
    return a0 < b1 and b0 < a1


def _internal_overlap(t: torch.Tensor) -> bool:
    """Whether two elements may share memory: sufficient test for non-overlap is that, with
    dims sorted by stride, each stride exceeds the extent of all smaller ones."""
    extent = 0
    for stride, size in sorted(zip(t.stride(), t.shape)):
        if size > 1:
            if stride <= extent:
                return True
            extent += (size - 1) * stride
    return False


def _check_cu_seqlens(q, cu_seqlens_q, cu_seqlens_k) -> None:
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int32:
            raise TypeError(f"{name} has dtype {t.dtype}; it must be torch.int32")
        if t.dim() != 1 or t.numel() < 2:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; it must be (batch + 1,) with "
                             "batch >= 1")
        if t.stride(0) != 1:
            raise ValueError(f"{name} has stride {t.stride(0)}; it must be contiguous")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must be on "
                             "the same device")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.numel()} entries and cu_seqlens_k "
                         f"{cu_seqlens_k.numel()}; both must be batch + 1")
    if cu_seqlens_q.numel() - 1 > _GRID_YZ_MAX:
        raise ValueError(f"batch={cu_seqlens_q.numel() - 1} sequences: must be <= "
                         f"{_GRID_YZ_MAX} (the CUDA grid limit); split the call")


def _check_max_seqlen(name: str, value) -> int:
    if (not isinstance(value, numbers.Integral) or isinstance(value, bool)
            or not 0 <= value <= _INT32_MAX):
        raise ValueError(f"{name}={value!r}; it must be an int in [0, 2**31) (the longest "
                         "sequence of the batch)")
    return int(value)


def _check_offsets(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, max_seqlen_q: int,
                   max_seqlen_k: int) -> None:
    """CUDAFLASH_DEBUG: what the kernels trust about the offsets (costs a device-to-host copy)."""
    for name, t, total, most, most_name in (
            ("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q, "max_seqlen_q"),
            ("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k, "max_seqlen_k")):
        offsets = t.tolist()
        lengths = [b - a for a, b in zip(offsets, offsets[1:])]
        if offsets[0] < 0 or offsets[-1] > total or min(lengths) < 0:
            raise ValueError(f"{name}={offsets}: offsets must be non-decreasing and within [0, "
                             f"{total}] (the rows of the packed tensor)")
        if max(lengths) > most:
            raise ValueError(f"{name} holds a sequence of {max(lengths)} but {most_name}="
                             f"{most}; it must be at least the longest")


def _check_on_gpu(q) -> None:
    if not q.is_cuda:
        why = "" if torch.cuda.is_available() else (
            f" (torch.cuda.is_available() is False: torch {torch.__version__} sees no CUDA "
            "GPU or driver)")
        raise ValueError(f"q, k, v are on {q.device}; cudaflash runs on CUDA GPUs only{why}")


def _softmax_scale(softmax_scale, d_head: int) -> float:
    if softmax_scale is None:
        return d_head ** -0.5
    if (isinstance(softmax_scale, numbers.Real) and not isinstance(softmax_scale, bool)
            and math.isfinite(softmax_scale) and softmax_scale > 0):
        return float(softmax_scale)
    raise ValueError(f"softmax_scale={softmax_scale!r}; it must be a finite number > 0 or None "
                     f"(None means headdim ** -0.5 = {d_head ** -0.5:.6g})")


# ---- the call --------------------------------------------------------------------------------


def _plan_key(q, k, v, softmax_scale, causal, want_lse):
    """The argument signature a _Plan is valid for.

    A contiguous tensor's layout is given by its shape, up to the strides of size-1 dims,
    which the kernels only ever multiply by index 0: ``is_contiguous()`` (True) stands for
    the strides then, and is cheaper than reading them (a new tuple to build and hash).
    get_device() (-1 on the CPU) is cheaper than building a torch.device per tensor.
    """
    return (q.shape, q.is_contiguous() or q.stride(), k.shape, k.is_contiguous() or k.stride(),
            v.shape, v.is_contiguous() or v.stride(), q.dtype, k.dtype, v.dtype,
            q.get_device(), k.get_device(), v.get_device(), softmax_scale, causal, want_lse)


def _forward(config: Optional[KernelConfig], q, k, v, out, softmax_scale, causal,
             want_lse=True, num_splits=None, window=(-1, -1), softcap=0.0):
    _check_qkv(q, k, v)
    # flash_attn_func records a plan for the signature, if it is hashable; a windowed or
    # softcapped call's key is the signature's, the window and the cap
    # (_windowed_or_capped_attention looks it up).
    plan_key = None
    if config is None and out is None:
        try:
            plan_key = _plan_key(q, k, v, softmax_scale, causal, want_lse)
            if window != (-1, -1) or softcap:
                plan_key = (plan_key, window, softcap)
            hash(plan_key)
        except TypeError:
            plan_key = None
    d_head = q.shape[3]
    if config is not None and (config.dtype, config.d_head) != (_DTYPES[q.dtype], d_head):
        raise ValueError(f"config {config.name} is for {config.dtype} with d_head="
                         f"{config.d_head}, but q is {_DTYPES[q.dtype]} with head dim {d_head}")
    scale = _softmax_scale(softmax_scale, d_head)
    if causal not in (True, False):
        raise TypeError(f"causal={causal!r}; it must be a bool")
    if out is not None:
        _check_out(out, q, k, v)
    _check_on_gpu(q)
    index = q.get_device()
    if index != torch.cuda.current_device():
        # The driver calls work in the current context: make q's device current.
        with torch.cuda.device(index):
            return _run(config, index, q, k, v, out, scale, bool(causal), want_lse, plan_key,
                        num_splits, window=window, softcap=softcap)
    return _run(config, index, q, k, v, out, scale, bool(causal), want_lse, plan_key,
                num_splits, window=window, softcap=softcap)


def _run(config, index: int, q, k, v, out, scale: float, causal: bool, want_lse: bool,
         plan_key=None, num_splits=None, seqused_k=None, plans=None, window=(-1, -1),
         softcap=0.0):
    """One forward over a padded batch. ``seqused_k``: None, or a (batch,) int32 tensor of
    each entry's key count (flash_attn_with_kvcache; the kernel clamps it into [0,
    seqlen_k]). With a ``plan_key`` the launch is recorded in ``plans`` (default
    flash_attn_func's); the plan takes the key counts' pointer per call. ``window``: the
    sliding window (left, right), -1 unbounded; ``softcap``: the checked cap, 0.0 for none."""
    batch, seqlen_q, n_heads, d_head = q.shape
    seqlen_k, n_heads_k = k.shape[1], k.shape[2]
    window = _clamp_window(window, seqlen_k)
    rows, heads, causal = _kernel_problem(seqlen_q, n_heads, n_heads_k, causal, window)
    ctx = _driver.current_context(index)
    if config is None:
        kernel = _auto_kernel(ctx, index, q.dtype, d_head, causal, rows, seqlen_k)
    else:
        kernel = _config_kernel(ctx, index, config)

    if out is None:
        out = torch.empty_like(q)  # q's layout, as flash-attn does
    lse = q.new_empty((batch, n_heads, seqlen_q), dtype=torch.float32) if want_lse else None
    if batch == 0 or seqlen_q == 0 or seqlen_k == 0:
        if seqlen_k == 0:  # every row sees no key
            out.zero_()
            if lse is not None:
                lse.fill_(-math.inf)
        return out, lse

    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), out.stride()
    q_seq, q_head, o_seq, o_head = qs[1], qs[2], os_[1], os_[2]
    kernel_window = _window_params(window, causal)
    if rows != seqlen_q:  # GQA decoding: row r of head h is query head h * rows + r
        q_seq, q_head, o_seq, o_head = qs[2], rows * qs[2], os_[2], rows * os_[2]
    # Params after the pointers, up to the split counts: strides (the lse's: (batch, n_heads,
    # seqlen_q), which is (batch, heads, rows) for the kernel), sizes, scales.
    fixed_params = (qs[0], q_seq, q_head, ks[0], ks[1], ks[2], vs[0], vs[1], vs[2],
                    os_[0], o_seq, o_head, n_heads * seqlen_q, rows, batch, heads, n_heads_k,
                    rows, seqlen_k, int(causal), 0, 0, *kernel_window,
                    *score_scales(scale, softcap))
    launch = _launch_function(kernel, index, q.device, fixed_params, num_splits, rows=rows,
                              heads=heads, batch=batch, seqlen_k=seqlen_k, d_head=d_head,
                              window=kernel_window, softcap=bool(softcap))
    # lse 0: writes no lse; cu_seqlens_q 0: not packed; cu_seqlens_k: the key counts, if any
    launch(_current_stream(index), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
           0 if lse is None else lse.data_ptr(), 0,
           0 if seqused_k is None else seqused_k.data_ptr())
    if plan_key is not None:
        plans = _plans if plans is None else plans
        if len(plans) >= _MAX_PLANS:  # many distinct shapes (varying lengths): start over
            plans.clear()
        plans[plan_key] = _Plan(device_index=index, launch=launch,
                                lse_shape=(batch, n_heads, seqlen_q),
                                new_out=_fast_allocator(out),
                                new_lse=None if lse is None else _fast_allocator(lse))
    return out, lse


def _varlen_plan_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale, causal, want_lse, window=(-1, -1), softcap=0.0):
    """The argument signature a varlen _Plan is valid for (see _plan_key). The offsets'
    values are data (the kernel reads them): only their tensors' shape, layout, dtype and
    device are in it. ``window``: the checked window_size; ``softcap``: the checked cap."""
    return (q.shape, q.is_contiguous() or q.stride(), k.shape, k.is_contiguous() or k.stride(),
            v.shape, v.is_contiguous() or v.stride(), q.dtype, k.dtype, v.dtype, q.get_device(),
            k.get_device(), v.get_device(), cu_seqlens_q.shape, cu_seqlens_k.shape,
            cu_seqlens_q.is_contiguous(), cu_seqlens_k.is_contiguous(), cu_seqlens_q.dtype,
            cu_seqlens_k.dtype, cu_seqlens_q.get_device(), cu_seqlens_k.get_device(),
            max_seqlen_q, max_seqlen_k, softmax_scale, causal, want_lse, window, softcap)


def _run_varlen(index: int, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                max_seqlen_k: int, scale: float, causal: bool, want_lse: bool, plan_key=None,
                window=(-1, -1), softcap=0.0):
    total_q, n_heads, d_head = q.shape
    total_k, n_heads_k = k.shape[0], k.shape[1]
    batch = cu_seqlens_q.numel() - 1
    out = torch.empty_like(q)
    lse = q.new_empty((n_heads, total_q), dtype=torch.float32) if want_lse else None
    # No sequence is longer than its packed tensor (the kernel clamps offsets into it).
    rows, seqlen_k = min(max_seqlen_q, total_q), min(max_seqlen_k, total_k)
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
    kernel_window = _kernel_window(window, max_seqlen_k, causal)
    ctx = _driver.current_context(index)
    kernel = _auto_kernel(ctx, index, q.dtype, d_head, causal, rows, seqlen_k)
    qs, ks, vs, os_ = q.stride(), k.stride(), v.stride(), out.stride()
    # Batch strides 0: a sequence's place comes from its offsets. lse: (n_heads, total_q).
    fixed_params = (0, qs[0], qs[1], 0, ks[0], ks[1], 0, vs[0], vs[1], 0, os_[0], os_[1],
                    0, total_q, batch, n_heads, n_heads_k, rows, seqlen_k, int(causal),
                    total_q, total_k, *kernel_window, *score_scales(scale, softcap))
    launch = _launch_function(kernel, index, q.device, fixed_params, None, rows=rows,
                              heads=n_heads, batch=batch, seqlen_k=seqlen_k, d_head=d_head,
                              window=kernel_window, softcap=bool(softcap))
    launch(_current_stream(index), q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
           0 if lse is None else lse.data_ptr(), cu_seqlens_q.data_ptr(),
           cu_seqlens_k.data_ptr())
    if plan_key is not None:
        if len(_varlen_plans) >= _MAX_PLANS:
            _varlen_plans.clear()
        _varlen_plans[plan_key] = _Plan(device_index=index, launch=launch,
                                        lse_shape=(n_heads, total_q),
                                        new_out=_fast_allocator(out),
                                        new_lse=None if lse is None else _fast_allocator(lse))
    return out, lse


def _launch_function(kernel: "_Kernel", index: int, device: torch.device, fixed_params: tuple,
                     num_splits: Optional[int], *, rows: int, heads: int, batch: int,
                     seqlen_k: int, d_head: int, window=(-1, -1), softcap: bool = False):
    """The launch of a call: ``fixed_params`` (every Params field between the pointers and
    the split counts) plus the split counts, as one Launcher, or a split-KV pair (the
    *_softcap entries with ``softcap``). With a
    left window bound (clamped) a CTA visits at most its rows plus the window's keys, and
    its split-KV runs start at its first visible block: they are sized over that span."""
    q_blocks = (rows + kernel.block_rows - 1) // kernel.block_rows
    if window[0] >= 0:
        seqlen_k = min(seqlen_k, window[0] + min(rows, kernel.block_rows) + max(window[1], 0))
    num_splits, per_split = _splits(kernel, index, num_splits, q_blocks=q_blocks, rows=rows,
                                    heads=heads, batch=batch, seqlen_k=seqlen_k)
    fixed_params = fixed_params + (num_splits, per_split)
    if num_splits == 1:
        return _driver.Launcher(
            kernel.fns.forward_softcap if softcap else kernel.fns.forward, kernel.label,
            grid=(q_blocks, heads, batch),
            threads=kernel.threads, smem=kernel.smem, synchronize=kernel.synchronize,
            fixed_params=fixed_params).launch
    return _split_launch(kernel, device, fixed_params, q_blocks=q_blocks, heads=heads,
                         batch=batch, rows=rows, d_head=d_head, num_splits=num_splits,
                         softcap=softcap)


def _kernel_problem(seqlen_q: int, n_heads: int, n_heads_k: int, causal: bool,
                    window=(-1, -1)) -> tuple[int, int, bool]:
    """(query rows per head, heads, causal) of the problem the kernel runs for a call.

    Decoding with GQA/MQA (one query row, several query heads per K/V head): the query heads
    that share a K/V head become rows of one head (their data are consecutive heads of q and
    out), so each K/V block is read once for all of them instead of once per query head. One
    query row sees every key under the bottom-right causal mask, so the rows are not causal.
    Not with a sliding window (``window``, clamped), whose bounds the kernel would apply to
    each of those rows as if it were another query position.
    """
    group = n_heads // n_heads_k
    if seqlen_q == 1 and group > 1 and window == (-1, -1):
        return group, n_heads_k, False
    return seqlen_q, n_heads, causal


def _window_params(window, causal: bool) -> tuple[int, int]:
    """Params.window_left/right: flash-attn's (left, right), -1 unbounded, with causal as a
    right bound of 0 (the kernel masks by the window alone)."""
    return window[0], 0 if causal else window[1]


def _kernel_window(window, seqlen_k: int, causal: bool) -> tuple[int, int]:
    """The window_left/right the kernels take for flash-attn's ``window``: clamped by
    ``seqlen_k`` (_clamp_window), causal as right = 0. The forward's and the backward's
    params of one call come from here, so they mask alike."""
    return _window_params(_clamp_window(window, seqlen_k), causal)


# Split-KV: a grid of fewer CTAs than the GPU holds at once leaves SMs idle for the whole call
# (decoding: one query row per sequence; a short chunk of queries against a long cache).
# Cutting each query block's KV blocks into runs, one CTA each, fills them; a second kernel
# combines the runs' partial results, at the price of writing and reading them in float32.
_SPLIT_BELOW = 0.8  # split grids that fill less than this fraction of the GPU's CTA slots
_MIN_BLOCKS_PER_SPLIT = 2
# A split writes and reads rows x d_head float32 partials (8 bytes per element) and reads
# keys x d_head of K and V (4 bytes per element): at >= 16 keys per row the partials are at
# most 1/8 of that traffic. With fewer (a 1024-query prefill), splitting measured slower
# (docs/perf-log.md, "Split-KV").
_MIN_KEYS_PER_ROW = 16
_MAX_SPLITS = 128
_COMBINE_ROWS = 4  # query rows per CTA of cudaflash_combine (kCombineRows, flash_fwd.cu)
_COMBINE_THREADS = 32 * _COMBINE_ROWS  # one warp per row


def _splits(kernel: "_Kernel", index: int, asked: Optional[int], *, q_blocks: int, rows: int,
            heads: int, batch: int, seqlen_k: int) -> tuple[int, int]:
    """(splits, KV blocks per split) of a call: ``asked`` (forward's num_splits), else the
    rule below, each split keeping at least one block."""
    kv_blocks = (seqlen_k + kernel.block_cols - 1) // kernel.block_cols
    if asked is None:
        slots = _device_kernels(index).device.sm_count * kernel.fns.split_ctas_per_sm
        most = _max_splits(kv_blocks * kernel.block_cols, kv_blocks,
                           min(rows, kernel.block_rows), batch)
        asked = _split_count(q_blocks * heads * batch, slots, most)
    splits = min(asked, kv_blocks, _GRID_YZ_MAX // batch)
    per_split = (kv_blocks + splits - 1) // splits
    return (kv_blocks + per_split - 1) // per_split, per_split


def _max_splits(keys: int, kv_blocks: int, rows_per_cta: int, batch: int) -> int:
    """The most splits worth making: each keeps >= _MIN_BLOCKS_PER_SPLIT KV blocks and
    >= _MIN_KEYS_PER_ROW keys per query row of its CTA, and grid.z = batch x splits fits."""
    return min(_MAX_SPLITS, kv_blocks // _MIN_BLOCKS_PER_SPLIT, _GRID_YZ_MAX // batch,
               keys // (_MIN_KEYS_PER_ROW * rows_per_cta))


def _split_count(ctas: int, slots: int, most: int) -> int:
    """How many runs to cut each query block's KV blocks into, for a grid of ``ctas`` CTAs on
    a GPU with ``slots`` CTA slots (SMs x CTAs per SM), at most ``most``: 1 when the grid
    fills the GPU; otherwise the fewest splits whose waves are about as full as the best
    count's (the fewest: every split adds partial results to write and combine)."""
    if ctas >= _SPLIT_BELOW * slots or most < 2:
        return 1

    def wave_fill(splits: int) -> float:  # busy fraction of the CTA slots over all waves
        waves = ctas * splits / slots
        return waves / math.ceil(waves)

    best = max(wave_fill(s) for s in range(1, most + 1))
    return next(s for s in range(1, most + 1) if wave_fill(s) >= 0.85 * best)


def _split_launch(kernel: "_Kernel", device: torch.device, fixed_params: tuple, *, q_blocks: int,
                  heads: int, batch: int, rows: int, d_head: int, num_splits: int,
                  softcap: bool = False):
    """The launch function of a split-KV call: allocate the float32 workspace (one tensor
    from torch's allocator, on the current stream: released once both kernels have run), run
    the split forward, then the combine kernel."""
    forward = _driver.Launcher(
        kernel.fns.split_softcap if softcap else kernel.fns.split,
        kernel.label.replace("(", "(split ", 1),
        grid=(q_blocks, heads, batch * num_splits), threads=kernel.threads, smem=kernel.smem,
        synchronize=kernel.synchronize, fixed_params=fixed_params)
    combine = _driver.Launcher(
        kernel.fns.combine, kernel.label.replace("(", "(combine ", 1),
        grid=((rows + _COMBINE_ROWS - 1) // _COMBINE_ROWS, heads, batch),
        threads=_COMBINE_THREADS, smem=0, synchronize=kernel.synchronize,
        fixed_params=fixed_params)
    # o_accum (num_splits, batch, heads, rows, d_head) then lse_accum (num_splits, batch,
    # heads, rows), float32, in one allocation.
    lse_values = num_splits * batch * heads * rows
    lse_offset = lse_values * d_head * 4  # bytes

    def launch(stream: int, q: int, k: int, v: int, o: int, lse: int, cu_seqlens_q: int,
               cu_seqlens_k: int) -> None:
        # Held until both kernels are enqueued: freed earlier, the block could go to another
        # allocation whose work is enqueued before ours.
        workspace = torch.empty(lse_values * (d_head + 1), dtype=_float32, device=device)
        o_accum = workspace.data_ptr()
        lse_accum = o_accum + lse_offset
        forward.launch_with_workspace(stream, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k,
                                      o_accum, lse_accum)
        combine.launch_with_workspace(stream, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k,
                                      o_accum, lse_accum)

    return launch


# ---- kernels: per device, per context, per problem class -------------------------------------


@dataclass(frozen=True)
class _Kernel:
    """What a launch needs, resolved once per (context, problem class or config)."""

    fns: "_driver.Functions"  # forward, split forward, combine
    label: str  # names the kernel in a launch error
    block_rows: int  # B_r: query rows per CTA
    block_cols: int  # B_c: keys per KV block
    threads: int
    smem: int
    synchronize: bool  # CUDAFLASH_DEBUG


@dataclass(frozen=True)
class _DeviceKernels:
    device: "_driver.Device"
    usable: dict  # config name -> KernelEntry, manifest order
    debug: bool

    def head_dims(self, dtype: str) -> list[int]:
        return sorted({e.config.d_head for e in self.usable.values() if e.config.dtype == dtype})

    def describe(self) -> str:
        d = self.device
        return f"cuda:{d.index} ({d.name}, sm_{d.arch}, {d.smem_optin} bytes of shared memory)"


@dataclass(frozen=True)
class _Rules:
    rules: tuple
    # Every max_seqlen bound of the rules, sorted: two lengths with the same bisect position
    # satisfy the same conditions, so that position is the cache key's seqlen bucket.
    q_bounds: tuple[int, ...]
    k_bounds: tuple[int, ...]


@dataclass(frozen=True)
class _Plan:
    """What the checked path concluded for one argument signature of flash_attn_func (or of
    flash_attn_varlen_func, or a flash_attn_with_kvcache decoding step)."""

    device_index: int
    # Launcher.launch, bound once: the kernel, geometry and fixed Params fields (out laid out
    # like q) are in its Launcher.
    launch: object
    lse_shape: tuple[int, ...]
    # Zero-argument allocators of out and lse (_fast_allocator), or None: torch.empty_like(q)
    # and q.new_empty(lse_shape, dtype=float32).
    new_out: Optional[Callable[[], torch.Tensor]] = None
    new_lse: Optional[Callable[[], torch.Tensor]] = None


def _fast_allocator(like: torch.Tensor,
                    empty_strided=None) -> Optional[Callable[[], torch.Tensor]]:
    """A zero-argument function returning a new uninitialised tensor with ``like``'s shape,
    strides, dtype and device, through ``empty_strided`` (default: torch's private
    _empty_strided_cuda, which allocates on the current device: ``like``'s, here). None
    where that function is missing, fails, or makes a tensor that differs from ``like`` in
    any of these: the caller then allocates through torch's public functions."""
    empty_strided = empty_strided or _empty_strided_cuda
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


_MAX_PLANS = 4096
_plans: dict[tuple, _Plan] = {}
_varlen_plans: dict[tuple, _Plan] = {}  # flash_attn_varlen_func's
_kvcache_plans: dict[tuple, _Plan] = {}  # flash_attn_with_kvcache's decoding steps
_devices: dict[int, _DeviceKernels] = {}
_auto_kernels: dict[tuple, _Kernel] = {}
_config_kernels: dict[tuple, _Kernel] = {}


@functools.cache
def _rules(arch: int) -> _Rules:
    """Selection rules for GPUs of compute capability ``arch``, first match wins: the user's
    (CUDAFLASH_CONFIG), then this arch's tuned table (``python -m cudaflash tune``), then the
    shipped ones from the manifest."""
    rules = _manifest.load_manifest().selection
    tuned = _env.tuned_table_path(arch)
    if tuned.is_file():
        rules = selection.load_user_rules(tuned) + rules
    path = _env.config_path()
    if path is not None:
        rules = selection.load_user_rules(path) + rules
    return _Rules(rules,
                  tuple(sorted({r.max_seqlen_q for r in rules if r.max_seqlen_q is not None})),
                  tuple(sorted({r.max_seqlen_k for r in rules if r.max_seqlen_k is not None})))


def selected_config(device_index: int, dtype: str, d_head: int, causal: bool, seqlen_q: int,
                    seqlen_k: int, n_heads: int = 1, n_heads_k: int = 1) -> tuple[str, str]:
    """The config ``flash_attn_func`` runs on cuda:``device_index`` for such a call (with
    ``n_heads`` query heads reading ``n_heads_k`` K/V heads), and the rule that chose it.
    Raises LookupError when no built config fits."""
    dk = _device_kernels(device_index)
    rows, _, causal = _kernel_problem(seqlen_q, n_heads, n_heads_k, causal)
    return selection.select(_rules(dk.device.arch).rules, dk.usable, arch=dk.device.arch,
                            dtype=dtype, d_head=d_head, causal=causal, seqlen_q=rows,
                            seqlen_k=seqlen_k)


def _device_kernels(index: int) -> _DeviceKernels:
    dk = _devices.get(index)
    if dk is None:
        device = _driver.device(index)
        if device.arch < selection.MIN_ARCH:
            raise RuntimeError(f"cuda:{index} ({device.name}) is sm_{device.arch}; cudaflash "
                               f"needs sm_{selection.MIN_ARCH} (Ampere) or newer")
        usable = _manifest.load_manifest().usable(device.arch, device.smem_optin)
        dk = _devices[index] = _DeviceKernels(device, usable, _env.debug())
    return dk


def _auto_kernel(ctx: int, index: int, dtype: torch.dtype, d_head: int, causal: bool,
                 seqlen_q: int, seqlen_k: int) -> _Kernel:
    dk = _device_kernels(index)
    r = _rules(dk.device.arch)
    key = (ctx, dtype, d_head, causal, bisect.bisect_left(r.q_bounds, seqlen_q),
           bisect.bisect_left(r.k_bounds, seqlen_k))
    kernel = _auto_kernels.get(key)
    if kernel is None:
        name = _DTYPES[dtype]
        if d_head not in dk.head_dims(name):
            raise ValueError(f"no {name} kernel with head dim {d_head} runs on {dk.describe()}; "
                             f"{name} head dims built for it: {dk.head_dims(name)}")
        config_name, reason = selection.select(
            r.rules, dk.usable, arch=dk.device.arch, dtype=name, d_head=d_head, causal=causal,
            seqlen_q=seqlen_q, seqlen_k=seqlen_k)
        if dk.debug:
            log.debug("cuda:%d %s d_head=%d causal=%s seqlen_q=%d seqlen_k=%d -> %s (%s)", index,
                      name, d_head, causal, seqlen_q, seqlen_k, config_name, reason)
        kernel = _auto_kernels[key] = _make_kernel(dk, dk.usable[config_name], ctx)
    return kernel


def _config_kernel(ctx: int, index: int, config: KernelConfig) -> _Kernel:
    kernel = _config_kernels.get((ctx, config))
    if kernel is not None:
        return kernel
    dk = _device_kernels(index)
    entry = dk.usable.get(config.name)
    if entry is None:
        raise ValueError(f"config {config.name} is not built for {dk.describe()}; configs "
                         f"built for it: {list(dk.usable) or 'none'}")
    if dk.debug:
        log.debug("cuda:%d explicit config %s", index, config.name)
    kernel = _config_kernels[(ctx, config)] = _make_kernel(dk, entry, ctx)
    return kernel


def _make_kernel(dk: _DeviceKernels, entry: KernelEntry, ctx: int) -> _Kernel:
    fns = _driver.get_functions(entry, dk.device.index, ctx)
    return _Kernel(fns=fns, label=f"cuLaunchKernel({entry.name})", block_rows=entry.config.B_r,
                   block_cols=entry.config.B_c, threads=entry.threads, smem=entry.smem_bytes,
                   synchronize=dk.debug)


# ---- torch.compile ---------------------------------------------------------------------------


# The ops take the sliding window as flash-attn's two sides (-1: unbounded), checked by the
# public function before the op is called.
@torch.library.custom_op("cudaflash::fwd", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, float? softmax_scale, "
                                "bool causal, bool deterministic=False, int window_left=-1, "
                                "int window_right=-1, float softcap=0.0) -> (Tensor, Tensor)")
def _fwd_op(q, k, v, softmax_scale, causal, deterministic=False, window_left=-1,
            window_right=-1, softcap=0.0):
    # The compiled graph runs this body eagerly (is_compiling() is False here), so the call
    # takes flash_attn_func's plans like any eager call instead of re-checking every time.
    # Gradients are the op's registered autograd (below), not flash_attn_func's own.
    with torch.no_grad():
        out, lse, _ = flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal,
                                      window_size=(window_left, window_right),
                                      softcap=softcap, return_attn_probs=True)
    return out, lse


@_fwd_op.register_fake
def _(q, k, v, softmax_scale, causal, deterministic=False, window_left=-1, window_right=-1,
      softcap=0.0):
    batch, seqlen_q, n_heads, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, n_heads, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("cudaflash::bwd", mutates_args=(),
                         schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
                                "Tensor lse, float? softmax_scale, bool causal, "
                                "bool deterministic, int window_left=-1, int window_right=-1, "
                                "float softcap=0.0) -> (Tensor, Tensor, Tensor)")
def _bwd_op(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, window_left=-1,
            window_right=-1, softcap=0.0):
    return _run_backward(dout, q, k, v, out, lse, _softmax_scale(softmax_scale, q.shape[3]),
                         causal, deterministic,
                         _kernel_window((window_left, window_right), k.shape[1], causal),
                         softcap)


@_bwd_op.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, window_left=-1,
      window_right=-1, softcap=0.0):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fwd_op_setup_context(ctx, inputs, output):
    q, k, v, softmax_scale, causal, deterministic, window_left, window_right, softcap = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
    ctx.window = (window_left, window_right)
    ctx.softcap = softcap


def _fwd_op_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _bwd_op(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal,
                         ctx.deterministic, *ctx.window, ctx.softcap)
    return dq, dk, dv, None, None, None, None, None, None


_fwd_op.register_autograd(_fwd_op_backward, setup_context=_fwd_op_setup_context)


@torch.library.custom_op("cudaflash::varlen_fwd", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
                                "Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
                                "float? softmax_scale, bool causal, int window_left=-1, "
                                "int window_right=-1, float softcap=0.0) -> (Tensor, Tensor)")
def _varlen_fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                   softmax_scale, causal, window_left=-1, window_right=-1, softcap=0.0):
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, softmax_scale=softmax_scale,
                                         causal=causal, window_size=(window_left, window_right),
                                         softcap=softcap, return_attn_probs=True)
    return out, lse


@_varlen_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
      window_left=-1, window_right=-1, softcap=0.0):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
