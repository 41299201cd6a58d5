"""Gradients and torch.compile: the autograd functions of flash_attn_func and
flash_attn_varlen_func, and the ``cudaflash::*`` custom ops.

Both call the checked call layer (_call) and the backward's launches (backward), never the
public functions: the public functions come here, not the other way round.
"""

import torch

from . import _call, _checks, _dropout, backward, dispatch, heuristics


def _keep_call(ctx, softmax_scale, d_head: int, causal, window, seqlen_k: int, softcap,
               alibi_slopes, lse) -> None:
    """What both autograd functions' backward reads of the call: the scale, causal, the
    window as the forward's kernel took it (clamped by ``seqlen_k``, causal as right 0), the
    cap and the ALiBi slopes (checked by the forward; they get no gradient, as in
    flash-attn); lse is an output without a gradient."""
    ctx.scale = _checks.softmax_scale(softmax_scale, d_head)
    ctx.causal = bool(causal)
    ctx.kernel_window = heuristics.kernel_window(window, seqlen_k, ctx.causal)
    ctx.softcap = softcap
    ctx.alibi_slopes = alibi_slopes
    ctx.mark_non_differentiable(lse)


class FlashAttnFunction(torch.autograd.Function):
    """flash_attn_func with gradients: the forward also keeps the lse, the backward runs
    backward.run. Inside forward grad mode is off, so the forward replays the signature's
    plan as an inference call does (the first call takes the checked path and records it)."""

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, deterministic, window=(-1, -1),
                softcap=0.0, alibi_slopes=None, dropout=None):
        # dropout: the call's _dropout.Dropout (its seed drawn by the caller) or None
        _checks.check_deterministic(deterministic)
        if dropout is not None:  # each call its own seed: no plan
            out, lse = _call.checked_forward(None, q, k, v, None, softmax_scale, causal, True,
                                             window=window, softcap=softcap,
                                             alibi_slopes=alibi_slopes, dropout=dropout)
        else:
            # The signature's plan, as flash_attn_func's inference calls take it: the checked
            # path costs ~90 us more host time per call, which a training step at 1k tokens
            # pays on the GPU's critical path (the backward's host work queues behind it).
            out, lse = _call.planned_forward(q, k, v, softmax_scale, causal, True, window,
                                             softcap, alibi_slopes)
        # Fail now, not in the backward after a whole forward pass of work.
        dispatch.check_backward_supported(
            q.get_device(), q.dtype, q.shape[3],
            backward.scheme(deterministic, softcap, alibi_slopes is not None))
        ctx.save_for_backward(q, k, v, out, lse)
        # The engine would zero-fill a gradient for lse (never used) before every backward:
        # one allocation and one kernel less per step (backward: None for an unused output).
        ctx.set_materialize_grads(False)
        ctx.deterministic = deterministic
        ctx.dropout = dropout
        _keep_call(ctx, softmax_scale, q.shape[3], causal, window, k.shape[1], softcap,
                   alibi_slopes, lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        if dout is None:  # out took no part in what is differentiated (lse's gradient is
            # ignored, as flash-attn ignores it): the gradients of a zero dout, without a pass
            zeros = tuple(torch.zeros_like(t) for t in (q, k, v))
            return (*zeros, None, None, None, None, None, None, None)
        dq, dk, dv = run_backward(dout, q, k, v, out, lse, ctx.scale, ctx.causal,
                                  ctx.deterministic, ctx.kernel_window, ctx.softcap,
                                  ctx.alibi_slopes, ctx.dropout)
        return dq, dk, dv, None, None, None, None, None, None, None


class ForwardOnly(torch.autograd.Function):
    """An output whose inputs record gradients but whose call has no backward (a paged
    flash_attn_varlen_func, flash_attn_with_kvcache; neither has one in flash-attn): the
    forward passes a copy of ``out`` through, the backward raises. flash-attn's tests run the
    paged varlen call in grad mode without a backward; an out without a grad_fn (flash-attn's
    kvcache) would silently drop the gradient of a loss that reached it."""

    @staticmethod
    def forward(ctx, out, what, *inputs):
        ctx.what = what
        # A copy: an input returned as-is would come back as a view, which a caller could not
        # modify in place (flash-attn's out has no grad_fn, so code may). Only calls made in
        # grad mode with inputs that require grad pay it.
        return out.clone()

    @staticmethod
    def backward(ctx, dout):
        raise NotImplementedError(f"{ctx.what} has no backward (as in flash-attn); its output "
                                  "cannot take part in a gradient")


def run_backward(dout, q, k, v, out, lse, scale: float, causal: bool, deterministic: bool,
                 kernel_window: tuple[int, int], softcap: float = 0.0, alibi_slopes=None,
                 dropout=None):
    """backward.run on q's device; ``kernel_window`` as the forward's kernel took it
    (heuristics.kernel_window: the kernels mask by it, causal included); ``softcap`` and
    ``alibi_slopes`` the forward's."""
    # torch's global switch counts here too; a cap or ALiBi takes the deterministic scheme
    # (dropout runs in either: backward.run)
    scheme = backward.scheme(deterministic, softcap, alibi_slopes is not None)
    index = q.get_device()
    if index != torch.cuda.current_device():
        with torch.cuda.device(index):
            return backward.run(dout, q, k, v, out, lse, scale, causal, scheme, kernel_window,
                                softcap, alibi_slopes, dropout)
    return backward.run(dout, q, k, v, out, lse, scale, causal, scheme, kernel_window, softcap,
                        alibi_slopes, dropout)


class FlashAttnVarlenFunction(torch.autograd.Function):
    """flash_attn_varlen_func with gradients: the forward keeps the lse, the backward runs
    backward.run_varlen in the call's scheme (backward.scheme)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                softmax_scale, causal, deterministic, window=(-1, -1), softcap=0.0,
                alibi_slopes=None, dropout=None):
        # dropout: the call's _dropout.Dropout (its seed drawn by the caller) or None
        _checks.check_deterministic(deterministic)
        ctx.dropout = dropout
        if dropout is not None:  # each call its own seed: no plan
            out, lse = _call.checked_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                    max_seqlen_q, max_seqlen_k, softmax_scale,
                                                    causal, True, window, softcap,
                                                    alibi_slopes, dropout)
        else:
            out, lse = _call.planned_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k,
                                                    max_seqlen_q, max_seqlen_k, softmax_scale,
                                                    causal, True, window, softcap, alibi_slopes)
        # Fail now, not in the backward after a whole forward pass of work.
        dispatch.check_backward_supported(q.get_device(), q.dtype, q.shape[2], "deterministic")
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
        ctx.max_seqlens = (int(max_seqlen_q), int(max_seqlen_k))
        ctx.deterministic = deterministic
        # The window clamped by max_seqlen_k (flash-attn's rule for packed batches).
        _keep_call(ctx, softmax_scale, q.shape[2], causal, window, ctx.max_seqlens[1], softcap,
                   alibi_slopes, lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        scheme = backward.scheme(ctx.deterministic, ctx.softcap, ctx.alibi_slopes is not None)
        with torch.cuda.device(q.get_device()):
            dq, dk, dv = backward.run_varlen(dout, q, k, v, out, lse, cu_seqlens_q,
                                             cu_seqlens_k, *ctx.max_seqlens, ctx.scale,
                                             ctx.causal, ctx.kernel_window, ctx.softcap,
                                             ctx.alibi_slopes, ctx.dropout, scheme)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None


# ---- torch.compile ---------------------------------------------------------------------------


# The ops take the sliding window as flash-attn's two sides (-1: unbounded), checked by the
# public function before the op is called (and again here: the ops can be called directly).
# Dropout: the caller draws the seed (a traced torch.randint under torch.compile) and passes
# it in, so the ops stay functions of their inputs and the backward op rebuilds the mask.
@torch.library.custom_op("cudaflash::fwd", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, float? softmax_scale, "
                                "bool causal, bool deterministic=False, int window_left=-1, "
                                "int window_right=-1, float softcap=0.0, "
                                "Tensor? alibi_slopes=None, float dropout_p=0.0, "
                                "Tensor? dropout_seed=None) -> (Tensor, Tensor)")
def fwd_op(q, k, v, softmax_scale, causal, deterministic=False, window_left=-1,
           window_right=-1, softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_seed=None):
    # The compiled graph runs this body eagerly (is_compiling() is False here), so the call
    # takes flash_attn_func's plans like any eager call instead of re-checking every time.
    # Gradients are the op's registered autograd (below), not FlashAttnFunction.
    window = _checks.check_window((window_left, window_right))
    softcap = _checks.check_softcap(softcap)
    dropout = _op_dropout(dropout_p, dropout_seed, softcap, q.device)
    with torch.no_grad():
        if dropout is not None:  # a new seed every call: no plan
            return _call.checked_forward(None, q, k, v, None, softmax_scale, causal, True,
                                         window=window, alibi_slopes=alibi_slopes,
                                         dropout=dropout)
        return _call.planned_forward(q, k, v, softmax_scale, causal, True, window, softcap,
                                     alibi_slopes)


def _op_dropout(dropout_p, dropout_seed, softcap, device):
    """The ops' dropout state (None without), checked: the ops can be called directly."""
    dropout_p = _dropout.check_dropout_p(dropout_p)
    if not dropout_p:
        return None
    if softcap:
        raise NotImplementedError("dropout_p > 0 with softcap is not implemented (flash-attn "
                                  "refuses it too)")
    if dropout_seed is None:
        raise ValueError("dropout_p > 0 needs dropout_seed, a (1,) torch.int64 tensor on q's "
                         "device (flash_attn_func draws it with torch.randint)")
    return _dropout.with_seed(dropout_p, dropout_seed, device)


@fwd_op.register_fake
def _(q, k, v, softmax_scale, causal, deterministic=False, window_left=-1, window_right=-1,
      softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_seed=None):
    batch, seqlen_q, n_heads, _ = q.shape
    return torch.empty_like(q), q.new_empty((batch, n_heads, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("cudaflash::bwd", mutates_args=(),
                         schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, "
                                "Tensor lse, float? softmax_scale, bool causal, "
                                "bool deterministic, int window_left=-1, int window_right=-1, "
                                "float softcap=0.0, Tensor? alibi_slopes=None, "
                                "float dropout_p=0.0, Tensor? dropout_seed=None) "
                                "-> (Tensor, Tensor, Tensor)")
def bwd_op(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, window_left=-1,
           window_right=-1, softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_seed=None):
    # Called directly, the op checks the slopes itself (from the forward op they are checked).
    alibi_slopes = _checks.check_alibi_slopes(alibi_slopes, q.shape[0], q.shape[2], q.device)
    dropout = _op_dropout(dropout_p, dropout_seed, softcap, q.device)
    return run_backward(dout, q, k, v, out, lse,
                        _checks.softmax_scale(softmax_scale, q.shape[3]), causal, deterministic,
                        heuristics.kernel_window((window_left, window_right), k.shape[1],
                                                 causal),
                        softcap, alibi_slopes, dropout)


@bwd_op.register_fake
def _(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, window_left=-1,
      window_right=-1, softcap=0.0, alibi_slopes=None, dropout_p=0.0, dropout_seed=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fwd_op_setup_context(ctx, inputs, output):
    (q, k, v, softmax_scale, causal, deterministic, window_left, window_right, softcap,
     alibi_slopes, dropout_p, dropout_seed) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
    ctx.window = (window_left, window_right)
    ctx.softcap = softcap
    ctx.alibi_slopes = alibi_slopes
    ctx.dropout = (dropout_p, dropout_seed)


def _fwd_op_backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = bwd_op(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal,
                        ctx.deterministic, *ctx.window, ctx.softcap, ctx.alibi_slopes,
                        *ctx.dropout)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None


fwd_op.register_autograd(_fwd_op_backward, setup_context=_fwd_op_setup_context)


@torch.library.custom_op("cudaflash::varlen_fwd", mutates_args=(),
                         schema="(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
                                "Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
                                "float? softmax_scale, bool causal, int window_left=-1, "
                                "int window_right=-1, float softcap=0.0, "
                                "Tensor? alibi_slopes=None) -> (Tensor, Tensor)")
def varlen_fwd_op(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  softmax_scale, causal, window_left=-1, window_right=-1, softcap=0.0,
                  alibi_slopes=None):
    window = _checks.check_window((window_left, window_right))
    softcap = _checks.check_softcap(softcap)
    return _call.planned_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k, softmax_scale, causal, True, window,
                                        softcap, alibi_slopes)


@varlen_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
      window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
