"""``ring_flash_attn_func``: context-parallel attention (ring attention) with gradients."""

from __future__ import annotations

import contextlib

import torch

from .. import _checks
from .blocks import CudaflashBlocks
from .layout import check_zigzag_length
from .ring import ProcessGroupRing, ring_backward, ring_forward


def _on_device(t: torch.Tensor):
    """Make t's GPU the current device (NCCL's batched P2P and cudaflash's launches need it)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


class RingAttentionFunction(torch.autograd.Function):
    """The ring's forward and backward as one autograd node: the forward keeps q, k, v and
    the merged out and lse; the backward sends the K/V blocks round the ring again."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, ring, blocks):
        with _on_device(q):
            out, lse = ring_forward(blocks, ring, q, k, v, scale, causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.causal, ctx.ring, ctx.blocks = scale, causal, ring, blocks
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        with _on_device(q):
            dq, dk, dv = ring_backward(ctx.blocks, ctx.ring, dout, q, k, v, out, lse,
                                       ctx.scale, ctx.causal)
        return dq, dk, dv, None, None, None, None


@torch.compiler.disable  # process groups and P2P: runs eagerly (a graph break)
def ring_flash_attn_func(q, k, v, softmax_scale=None, causal=False, deterministic=False,
                         return_attn_probs=False, group=None, blocks=None):
    """Attention over a sequence split across the ranks of a process group (context
    parallelism, ring attention), with gradients.

    Every rank of ``group`` calls this with its own rows of q, k, v, tensors of the same
    shapes on every rank; the K/V blocks go round the ring (NCCL point-to-point on GPUs) and
    each rank returns the attention of its queries against the whole sequence's keys.

    Arguments:
        q: (batch, seqlen_local, nheads, headdim), k, v: (batch, seqlen_local_k, nheads_k,
            headdim), this rank's rows; dtypes, head dims and GQA as in flash_attn_func
            (head dims 64 and 128 with gradients).
        causal: the causal mask of the whole sequence. It needs the zigzag layout: with W
            ranks the sequence is cut into 2W equal chunks and rank r holds chunk r followed
            by chunk 2W-1-r (``zigzag_shard`` cuts a whole tensor so, ``zigzag_positions``
            gives the rows' positions, e.g. for rotary embeddings); q and k then have the same
            (even) local length. Without causal any split of the sequence works, the same for
            q and k or not.
        softmax_scale: default headdim ** -0.5.
        deterministic: the backward's scheme of cudaflash's kernels, as in flash_attn_func;
            the ring adds its steps in a fixed order, so True gives bitwise reproducible
            gradients.
        return_attn_probs: also return the log-sum-exp over the whole sequence's keys.
        group: the torch.distributed process group of the ring (default: the default group).
        blocks: the attention of one ring step (cudaflash.distributed.blocks): default
            CudaflashBlocks(deterministic); TorchBlocks() runs the same ring in plain PyTorch
            (any device, e.g. CPU processes on gloo).

    Returns:
        out: (batch, seqlen_local, nheads, headdim) in q's dtype; with return_attn_probs,
        ``(out, softmax_lse, None)``, softmax_lse float32 (batch, nheads, seqlen_local).
    """
    if blocks is None:
        blocks = CudaflashBlocks(deterministic)
    if causal not in (True, False):
        raise TypeError(f"causal={causal!r}; it must be a bool")
    needs_grad = _checks.wants_grad(q, k, v)
    blocks.check(q, k, v, needs_grad)
    if k.shape != v.shape:
        raise ValueError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; they must "
                         "be the same")
    ring = ProcessGroupRing(group)
    if causal:
        if q.shape[1] != k.shape[1]:
            raise ValueError(f"causal=True: q has {q.shape[1]} local rows and k {k.shape[1]}; the "
                             "zigzag layout of a causal ring needs the same rows of q, k and v "
                             "on each rank")
        check_zigzag_length(q.shape[1] * ring.world_size, ring.world_size,
                            what=f"the sequence length ({q.shape[1]} local rows x "
                                 f"{ring.world_size} ranks)")
    scale = _checks.softmax_scale(softmax_scale, q.shape[3])
    if needs_grad:
        out, lse = RingAttentionFunction.apply(q, k, v, scale, bool(causal), ring, blocks)
    else:
        with torch.no_grad(), _on_device(q):
            out, lse = ring_forward(blocks, ring, q, k, v, scale, bool(causal))
    return (out, lse, None) if return_attn_probs else out
