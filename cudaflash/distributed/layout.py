"""Where each rank's rows sit in the sequence, and what one ring step computes. Pure
functions: no process group, no GPU.

The zigzag layout. The sequence (length S, any multiple of 2W for W ranks) is cut into 2W
chunks of c = S / 2W rows; rank r holds chunk r followed by chunk 2W-1-r, 2c rows in all.
With a causal mask the rows late in the sequence see more keys than the early ones: with
plain contiguous chunks the last rank would do W times the first rank's work. Pairing an
early chunk with its mirror image gives every rank the same work (see ``ring_step``).

Positions below are rows of the whole sequence; "local" rows are rows of a rank's tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


def check_zigzag_length(seqlen: int, world_size: int, what: str = "seqlen") -> int:
    """The chunk length c of a sequence of ``seqlen`` rows in the zigzag layout over
    ``world_size`` ranks; ValueError unless ``seqlen`` is a positive multiple of 2W."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size}; it must be >= 1")
    if seqlen < 2 * world_size or seqlen % (2 * world_size):
        raise ValueError(f"{what}={seqlen}: the zigzag layout cuts the sequence into 2 * "
                         f"world_size = {2 * world_size} chunks of equal length, so it must "
                         f"be a positive multiple of {2 * world_size}")
    return seqlen // (2 * world_size)


def zigzag_positions(seqlen: int, rank: int, world_size: int,
                     device: Optional[torch.device] = None) -> torch.Tensor:
    """The positions in the whole sequence (int64, shape (2c,)) of rank ``rank``'s local rows:
    chunk ``rank``, then chunk ``2 * world_size - 1 - rank``. Use them for what depends on
    the position, e.g. rotary embeddings."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}; it must be in [0, world_size={world_size})")
    c = check_zigzag_length(seqlen, world_size)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    mirror = 2 * world_size - 1 - rank
    return torch.cat([first, torch.arange(mirror * c, (mirror + 1) * c, device=device)])


def zigzag_shard(x: torch.Tensor, rank: int, world_size: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s rows of ``x`` (the whole sequence along ``dim``) in the zigzag layout:
    a new tensor of ``x.shape[dim] / world_size`` rows (chunk ``rank``, then its mirror)."""
    c = check_zigzag_length(x.shape[dim], world_size, what=f"x.shape[{dim}]")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}; it must be in [0, world_size={world_size})")
    mirror = 2 * world_size - 1 - rank
    return torch.cat([x.narrow(dim, rank * c, c), x.narrow(dim, mirror * c, c)], dim=dim)


def zigzag_unshard(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's zigzag shard (``shards[r]``: rank r's), the
    inverse of ``zigzag_shard``."""
    world_size = len(shards)
    if world_size < 1:
        raise ValueError("shards is empty; it must hold one tensor per rank")
    chunks: list = [None] * (2 * world_size)
    for rank, shard in enumerate(shards):
        if shard.shape[dim] % 2 or shard.shape != shards[0].shape:
            raise ValueError(f"shards[{rank}] has shape {tuple(shard.shape)}; every shard must "
                             f"have shards[0]'s shape {tuple(shards[0].shape)} with an even "
                             f"length along dim {dim}")
        first, mirror = shard.chunk(2, dim=dim)
        chunks[rank], chunks[2 * world_size - 1 - rank] = first, mirror
    return torch.cat(chunks, dim=dim)


# ---- one ring step ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """What a rank computes at one ring step: its local query rows ``q_rows`` against rows
    ``kv_rows`` of the K/V block it holds, with a causal mask or without one."""

    q_rows: slice
    kv_rows: slice
    causal: bool


_ALL = slice(None)


def ring_step(rank: int, source: int, causal: bool, local_len: int) -> Step:
    """The attention rank ``rank`` computes with the K/V block of rank ``source``.

    Not causal: every query sees every key, so each step is the whole local q against the
    whole block, unmasked, whatever the layout.

    Causal, zigzag layout (local rows: chunk a = ``rank`` then chunk b = 2W-1-``rank``;
    the block's rows: chunk ``source`` then chunk 2W-1-``source``; h = local_len / 2):

    - source == rank (the diagonal): in local order the rows are chunks a < b and the keys the
      same chunks, so "key position <= query position" is exactly the causal mask of the
      2h x 2h local problem: a sees the lower triangle of a and nothing of b; b sees all of a
      and the lower triangle of b. One causal call over everything.
    - source < rank: the block's first chunk (source) lies before chunk a (and so before
      b): both of our chunks see all of it. Its second chunk 2W-1-source lies after chunk
      2W-1-rank = b (and after a): nobody here sees it. One unmasked call: all 2h query rows
      against the block's first h keys.
    - source > rank: chunk a (= rank < source <= W-1) lies before both of the block's chunks
      (source, and 2W-1-source >= W): it sees nothing. Chunk b (2W-1-rank >= W) lies after
      chunk source (< W) and after chunk 2W-1-source (2W-1-source < 2W-1-rank): it sees all
      of the block. One unmasked call: the last h query rows against all 2h keys.

    Every step is the same work, h x 2h scores (the diagonal's 2h x 2h causal triangle is
    that too), which is why the layout balances the ranks. For the bottom-right causal
    alignment of cudaflash's kernels, the diagonal's square problem is also top-left
    aligned, as it must be.
    """
    if not causal or source == rank:
        return Step(_ALL, _ALL, causal)
    half = local_len // 2
    if source < rank:
        return Step(_ALL, slice(0, half), False)
    return Step(slice(half, None), _ALL, False)
