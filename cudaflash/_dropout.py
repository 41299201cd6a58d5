"""Dropout's per-call state: the probability, the kernels' 8-bit threshold and O's scale,
and the seed, a (1,) int64 tensor drawn on q's device by torch's own RNG (torch.randint), so
torch.manual_seed reproduces a call, CUDA-graph capture records the draw as torch's RNG ops
are recorded, and the backward rebuilds the same keep mask from the saved tensor
(cuda_src/philox.cuh; docs/design-notes.md, "Dropout")."""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple, Optional

import torch

SEED_HIGH = 2**63 - 1  # torch.randint's exclusive bound for an int64 seed


class Dropout(NamedTuple):
    p: float
    threshold: int  # a score is kept when its random byte is >= this: round(p * 256) <= 255
    scale: float  # 1 / (1 - p), flash-attn's scale of the kept weights
    seed: torch.Tensor  # (1,) int64 on the call's device


def check_dropout_p(dropout_p) -> float:
    """flash-attn's dropout_p as a float in [0, 1)."""
    if not (isinstance(dropout_p, numbers.Real) and not isinstance(dropout_p, bool)
            and math.isfinite(dropout_p) and 0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p={dropout_p!r}; it must be a number in [0, 1) (0: no "
                         "dropout)")
    return float(dropout_p)


def draw(dropout_p: float, device: torch.device) -> Optional[Dropout]:
    """The state of one call with the checked ``dropout_p`` on ``device`` (None for 0): one
    torch.randint on the device, nothing read on the host. The kernels drop a score when its
    random byte is below round(p * 256): the rate is p rounded to a multiple of 1/256 (as in
    flash-attn's kernels), and the kept scores are scaled by 1 / (1 - p), as flash-attn
    scales them (its tests' reference does too)."""
    if dropout_p == 0.0:
        return None
    return with_seed(dropout_p, draw_seed(device), device)


def draw_seed(device: torch.device) -> torch.Tensor:
    """A call's (1,) int64 seed tensor on ``device``: one torch.randint (under torch.compile
    a traced RNG op, so the graph draws a new one at each run)."""
    return torch.randint(0, SEED_HIGH, (1,), dtype=torch.int64, device=device)


def with_seed(dropout_p: float, seed: torch.Tensor, device: torch.device) -> Optional[Dropout]:
    """The state of a call on ``device`` with the checked ``dropout_p`` and a given seed
    tensor (the torch.compile ops take it as an input). None where nothing is dropped: p = 0,
    and p < 1/512, whose threshold round(p * 256) is 0 (the kernels then run no dropout at
    all, so no 1 / (1 - p) either: the backward takes a zero threshold as no dropout)."""
    if dropout_p == 0.0:
        return None
    if not (isinstance(seed, torch.Tensor) and seed.dtype == torch.int64
            and tuple(seed.shape) == (1,)):
        raise ValueError(f"dropout_seed must be a (1,) torch.int64 tensor, got "
                         f"{seed.dtype if isinstance(seed, torch.Tensor) else type(seed)} of "
                         f"shape {tuple(getattr(seed, 'shape', ()))}")
    if seed.device != torch.device(device):
        raise ValueError(f"dropout_seed is on {seed.device} but q is on {device}; the kernels "
                         "read it on q's device")
    threshold = min(round(dropout_p * 256), 255)
    if threshold == 0:
        return None
    return Dropout(dropout_p, threshold, 1.0 / (1.0 - dropout_p), seed)


# ---- return_attn_probs: flash-attn's S_dmask, computed with torch ops (a testing hook) ------

_MASK32 = 0xFFFFFFFF


def _mulhilo(m: int, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of the 64-bit product m * c for a 32-bit constant m and a tensor
    c of 32-bit values held in int64 (split in 16-bit halves: no product exceeds 2^49)."""
    c_hi, c_lo = c >> 16, c & 0xFFFF
    t1, t2 = m * c_lo, m * c_hi
    u = ((t2 & 0xFFFF) << 16) + t1
    return (t2 >> 16) + (u >> 32), u & _MASK32


# Philox's round count: cuda_src/philox.cuh's kPhiloxRounds (flash-attn 2's count; the
# header says why), which the masks built here must match bit for bit.
PHILOX_ROUNDS = 7


def philox4x32(c0, c1, c2, c3, k0, k1, rounds: int = PHILOX_ROUNDS):
    """Philox4x32 with ``rounds`` rounds (the kernels': cuda_src/philox.cuh) on int64 tensors
    of 32-bit values; the key words ints or int64 tensors (broadcast)."""
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(0xD2511F53, c0)
        hi1, lo1 = _mulhilo(0xCD9E8D57, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + 0x9E3779B9) & _MASK32, (k1 + 0xBB67AE85) & _MASK32
    return c0, c1, c2, c3


def keep_mask(dropout: Dropout, batch: int, heads: int, seqlen_q: int, seqlen_k: int,
              device, entry: Optional[int] = None) -> torch.Tensor:
    """(batch, heads, seqlen_q, seqlen_k) bool: the scores the kernels keep for this call
    (philox.cuh's counters and bytes), computed with torch ops on the seed tensor where it
    lives (no host read: torch.compile traces it). ``entry``: only batch entry ``entry``'s
    heads, (1, heads, seqlen_q, seqlen_k) (a packed batch's sequence ``entry`` draws that
    entry's numbers)."""
    seed = dropout.seed.to(device)  # (1,) int64 in [0, 2^63): its halves are the key
    q_idx = torch.arange(seqlen_q, device=device)[:, None].expand(seqlen_q, seqlen_k)
    k_idx = torch.arange(seqlen_k, device=device)[None, :].expand(seqlen_q, seqlen_k)
    quad = 4 * (q_idx % 8 // 2) + k_idx % 8 // 2
    word_at = q_idx % 2 + 2 * (q_idx % 16 // 8)
    byte_at = k_idx % 2 + 2 * (k_idx % 16 // 8)
    entries = range(batch) if entry is None else (entry,)
    masks = []
    for bh in (b * heads + h for b in entries for h in range(heads)):
        words = philox4x32(q_idx // 16, k_idx // 16, torch.full_like(q_idx, bh), quad,
                           seed & _MASK32, (seed >> 32) & _MASK32)
        word = torch.stack(words, -1).gather(-1, word_at[..., None])[..., 0]
        masks.append((word >> (8 * byte_at)) & 0xFF >= dropout.threshold)
    return torch.stack(masks).view(len(entries), heads, seqlen_q, seqlen_k)


def visible(seqlen_q: int, seqlen_k: int, causal: bool, window, device) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool: the keys each query row sees (causal and the window
    aligned to the bottom-right corner, flash-attn's rule)."""
    left, right = window
    right = 0 if causal else right
    row = torch.arange(seqlen_q, device=device)[:, None] + seqlen_k - seqlen_q
    col = torch.arange(seqlen_k, device=device)[None, :]
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        allowed &= col <= row + right
    if left >= 0:
        allowed &= col >= row - left
    return allowed


def alibi_bias(alibi_slopes, batch: int, heads: int, seqlen_q: int, seqlen_k: int):
    """flash-attn's ALiBi bias, float32 (batch or 1, heads, seqlen_q, seqlen_k): query i and
    key j get -slope * |i + seqlen_k - seqlen_q - j|; None without slopes. ``alibi_slopes``:
    (heads,) or (batch, heads) float32 (checked by the forward)."""
    if alibi_slopes is None:
        return None
    device = alibi_slopes.device
    rows = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    distance = (rows - torch.arange(seqlen_k, device=device)[None, :]).abs().float()
    slopes = alibi_slopes.float().reshape(-1, heads)  # (1 or batch, heads)
    return -slopes[:, :, None, None] * distance


def attention_probs(q, k, scale: float, causal: bool, window, dropout: Optional[Dropout],
                    alibi_slopes=None, block_head_dim: Optional[int] = None):
    """flash_attn_func's S_dmask for a dropout call: q (batch, seqlen_q, heads, d), k
    (batch, seqlen_k, heads_k, d) -> float32 (batch, heads, seqlen_q, seqlen_k). ``dropout``
    None (a p too small to drop anything): every score kept. ``alibi_slopes``: the call's.
    ``block_head_dim``: as in attention_matrix."""
    batch, seqlen_q, heads, _ = q.shape
    seqlen_k = k.shape[1]
    keep = (torch.ones(batch, heads, seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
            if dropout is None else keep_mask(dropout, batch, heads, seqlen_q, seqlen_k, q.device))
    return attention_matrix(q.detach(), k.detach(), scale,
                            visible(seqlen_q, seqlen_k, causal, window, q.device), dropout,
                            keep, alibi_bias(alibi_slopes, batch, heads, seqlen_q, seqlen_k),
                            block_head_dim)


def varlen_attention_probs(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int,
                           max_seqlen_k: int, scale: float, causal: bool, window,
                           dropout: Optional[Dropout], alibi_slopes=None,
                           block_head_dim: Optional[int] = None):
    """flash_attn_varlen_func's S_dmask for a dropout call: q (total_q, heads, d), k
    (total_k, heads_k, d) -> float32 (batch, heads, max_seqlen_q, max_seqlen_k), sequence b
    in entry b's top-left corner (its rows and keys counted within the sequence), zeros
    elsewhere. Reads the offsets on the host."""
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    batch, heads = len(starts_q) - 1, q.shape[1]
    probs = torch.zeros(batch, heads, max_seqlen_q, max_seqlen_k, dtype=torch.float32,
                        device=q.device)
    for b in range(batch):
        len_q = min(starts_q[b + 1] - starts_q[b], max_seqlen_q)
        len_k = min(starts_k[b + 1] - starts_k[b], max_seqlen_k)
        if len_q <= 0 or len_k <= 0:
            continue
        qb = q[None, starts_q[b]:starts_q[b] + len_q]
        kb = k[None, starts_k[b]:starts_k[b] + len_k]
        keep = (torch.ones(1, heads, len_q, len_k, dtype=torch.bool, device=q.device)
                if dropout is None else keep_mask(dropout, batch, heads, len_q, len_k,
                                                  q.device, entry=b))
        slopes = (alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1
                  else alibi_slopes[b])
        probs[b, :, :len_q, :len_k] = attention_matrix(
            qb.detach(), kb.detach(), scale, visible(len_q, len_k, causal, window, q.device),
            dropout, keep, alibi_bias(slopes, 1, heads, len_q, len_k), block_head_dim)[0]
    return probs


def block_size_n(head_dim: int) -> int:
    """The key block size flash-attn 2.8.3's tests assume for a dropout call
    (flash_attn_interface._get_block_size_n with is_dropout=True, the same on every GPU):
    S_dmask's rows are scaled per block. (Before 2.8, head dims 129-160 took 32 on sm80 and
    sm90; 2.8 runs them on the hdim-192 kernel, 64.)"""
    if head_dim <= 32:
        return 128
    if head_dim <= 96:
        return 64
    if head_dim <= 128:
        return 32
    return 64


def attention_matrix(q, k, softmax_scale: float, allowed: torch.Tensor, dropout: Dropout,
                     keep: torch.Tensor, bias: Optional[torch.Tensor] = None,
                     block_head_dim: Optional[int] = None) -> torch.Tensor:
    """flash-attn's S_dmask of a dropout call, float32 (batch, heads, seqlen_q, seqlen_k): the
    exponentials exp(s - M_n) of FlashAttention-2's kernel, M_n the largest score of key block
    n and the blocks after it (it walks them last to first), negated where dropped, 0 where
    `allowed` (the causal/window mask, broadcastable) hides the score. q: (batch, seqlen_q,
    heads, d), k: (batch, seqlen_k, heads_k, d); ``bias``: added to the scaled scores
    (ALiBi's, broadcastable), as flash-attn's kernel and tests add it. ``block_head_dim``:
    the head dim whose key block size applies (default q's): a call padded to the next
    kernel's head dim passes the caller's, the one flash-attn's tests normalize with. An
    argument, not a context variable, so that torch.compile traces it."""
    groups = q.shape[2] // k.shape[2]
    qf = q.float().transpose(1, 2)
    kf = k.float().repeat_interleave(groups, dim=2).transpose(1, 2)
    scores = (qf @ kf.transpose(-1, -2)) * softmax_scale
    if bias is not None:
        scores = scores + bias
    scores = scores.masked_fill(~allowed, float("-inf"))
    block = block_size_n(block_head_dim or q.shape[-1])
    blocks = scores.split(block, dim=-1)
    block_max = torch.stack([b.amax(-1) for b in blocks], -1)
    running = torch.cummax(block_max.flip(-1), -1).values.flip(-1)
    out = torch.cat([torch.exp(b - running[..., n, None]) for n, b in enumerate(blocks)], -1)
    out = torch.nan_to_num(out, nan=0.0)  # rows that see no key: -inf - -inf
    return torch.where(keep, out, -out)
