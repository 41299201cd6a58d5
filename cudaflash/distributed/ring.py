"""Ring attention over a torch.distributed process group: the forward and backward loops and
the K/V exchange between neighbours.

Each of the W ranks of the group holds its own rows of q, k, v (layout.py). The K/V blocks go
round the ring: at step i rank r holds the block of rank (r - i) mod W, computes its queries
against it (layout.ring_step says which rows, masked or not) and passes it on to rank r + 1.

Forward: each step gives a block out and lse; they are merged into a running out and lse in
float32 (``merge_into``), as the softmax over all keys is a weighted mean of the blocks'
softmaxes, each weighted by exp(block lse - total lse).

Backward: with the final out and lse every block's share of the gradient is independent of
the others (P = exp(scale * q k^T - lse) are the final probabilities, delta = rowsum(dout *
out) the final one), so dq is a sum over steps kept locally, and dk, dv of a block are sums
over the ranks it visits: their float32 running sums travel round the ring with the block,
each rank adding its share, and arrive complete at the block's owner after W hops. The last
hop carries the finished sums in the output dtype (half the bytes: it is the one transfer
nothing overlaps).

Overlap: every exchange is one ``batch_isend_irecv`` (NCCL runs it on its own stream) issued
before the step's compute, whose kernels then run while the bytes move; ``wait()`` only makes
the compute stream wait for the transfer before the received block is used. In the backward,
the running dk, dv of step i travel while step i + 1 computes.

The block attention is a parameter (blocks.py): the tests run these loops on CPU processes
(gloo) with the PyTorch stand-in.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .layout import ring_step

# batch_isend_irecv tags (gloo matches a send to a receive by peer and tag; NCCL by order)
_KV_TAG, _DKV_TAG = 0, 2


class Shift:
    """One exchange in flight: what this rank sent on and the buffers it receives into."""

    def __init__(self, works: list, received: tuple, sent: tuple) -> None:
        self._works = works
        self._sent = sent  # kept alive until the transfer has read them
        self.received = received

    def wait(self) -> tuple:
        """The received tensors, once usable: on CUDA the current stream waits for the
        transfer (the host does not); on CPU the host waits."""
        for work in self._works:
            work.wait()
        self._works, self._sent = [], ()
        return self.received


class ProcessGroupRing:
    """Rank ``rank`` of a ring of ``world_size`` ranks over ``group`` (None: the default
    group): ``shift`` sends tensors to the next rank and receives the previous rank's."""

    def __init__(self, group=None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call "
                               "torch.distributed.init_process_group first (torchrun sets up "
                               "its environment)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of group; every rank of the ring "
                             "must call with a group it belongs to")
        self._next = _global_rank(group, (self.rank + 1) % self.world_size)
        self._prev = _global_rank(group, (self.rank - 1) % self.world_size)

    def shift(self, tensors: tuple, tag: int) -> Shift:
        """Send ``tensors`` (contiguous) to the next rank and receive the previous rank's
        tensors of the same shapes and dtypes, all in one batch (one NCCL group call)."""
        received = tuple(torch.empty_like(t) for t in tensors)
        ops = [dist.P2POp(dist.isend, t, self._next, self.group, tag + i)
               for i, t in enumerate(tensors)]
        ops += [dist.P2POp(dist.irecv, t, self._prev, self.group, tag + i)
                for i, t in enumerate(received)]
        return Shift(dist.batch_isend_irecv(ops), received, tensors)


def _global_rank(group, group_rank: int) -> int:
    """P2POp takes global ranks."""
    if group is None or group is dist.GroupMember.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
               block_lse: torch.Tensor) -> None:
    """Fold a block's (out, lse) into the running ones, in place: out (b, s, h, d) and lse
    (b, h, s) in float32 (or wider). With L = log(e^lse + e^block_lse) the merged out is
    out + w (block_out - out), w = e^(block_lse - L) the block's share of the softmax mass.
    Rows that have seen no key on either side (both -inf) keep out and lse (w would be NaN)."""
    new_lse = torch.logaddexp(lse, block_lse)
    weight = torch.nan_to_num(torch.exp(block_lse - new_lse), nan=0.0)
    out.lerp_(block_out.to(out.dtype), weight.transpose(1, 2).unsqueeze(-1))
    lse.copy_(new_lse)


def ring_forward(blocks, ring, q, k, v, scale: float, causal: bool):
    """(out in q's dtype, lse (b, h, s_q) in float32 or wider) of this rank's queries against
    every rank's keys."""
    world, rank = ring.world_size, ring.rank
    acc = torch.promote_types(q.dtype, torch.float32)
    k, v = k.contiguous(), v.contiguous()  # sent as they are
    out = lse = None
    for i in range(world):
        # Issued before this step's compute, so the transfer runs under it.
        shift = ring.shift((k, v), _KV_TAG) if i + 1 < world else None
        step = ring_step(rank, (rank - i) % world, causal, q.shape[1])
        block_out, block_lse = blocks.forward(q[:, step.q_rows], k[:, step.kv_rows],
                                              v[:, step.kv_rows], scale, step.causal)
        if out is None:  # step 0, the rank's own block: every query row
            out, lse = block_out.to(acc), block_lse.to(acc)
        else:
            merge_into(out[:, step.q_rows], lse[:, :, step.q_rows], block_out, block_lse)
        if shift is not None:
            k, v = shift.wait()
    return out.to(q.dtype), lse


def ring_backward(blocks, ring, dout, q, k, v, out, lse, scale: float, causal: bool):
    """(dq, dk, dv) of this rank's q, k, v, given the gradient of its out and the final out
    and lse of the forward."""
    world, rank = ring.world_size, ring.rank
    acc = torch.promote_types(q.dtype, torch.float32)
    k_dtype, v_dtype = k.dtype, v.dtype
    k, v, dout = k.contiguous(), v.contiguous(), dout.contiguous()
    dq = dk = dv = None
    dkv_shift = None
    for i in range(world):
        last = i + 1 == world
        kv_shift = None if last else ring.shift((k, v), _KV_TAG)
        step = ring_step(rank, (rank - i) % world, causal, q.shape[1])
        rows, keys = step.q_rows, step.kv_rows
        block_dq, block_dk, block_dv = blocks.backward(
            dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows], lse[:, :, rows],
            scale, step.causal)
        if dq is None:  # step 0 covers every query row
            dq = block_dq.to(acc)
        else:
            dq[:, rows] += block_dq
        if dkv_shift is None:  # step 0: our own block, whose running sums start here
            dk, dv = block_dk.to(acc), block_dv.to(acc)
        else:  # the sums of the block we now hold, from the ranks it visited before
            dk, dv = dkv_shift.wait()
            dk[:, keys] += block_dk
            dv[:, keys] += block_dv
        if kv_shift is not None:
            k, v = kv_shift.wait()
        if world > 1:
            if last:  # complete: the hop to the owner in the output dtype
                dk, dv = dk.to(k_dtype), dv.to(v_dtype)
            dkv_shift = ring.shift((dk, dv), _DKV_TAG)
    if dkv_shift is not None:
        dk, dv = dkv_shift.wait()
    return dq.to(q.dtype), dk.to(k_dtype), dv.to(v_dtype)
