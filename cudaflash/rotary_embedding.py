"""Rotary embedding as flash-attn 2.x's flash_attn_with_kvcache applies it (rotary_cos,
rotary_sin, rotary_interleaved): the checks of the tables and the rotation of q and the new
keys at each sequence's positions, with torch ops in float32 (capturable in a CUDA graph; not
fused into a kernel yet)."""

from typing import NamedTuple

import torch

from . import heuristics


class Rotary(NamedTuple):
    """Checked rotary tables: cos and sin (seqlen_ro, rotary_dim / 2), and the pairing."""

    cos: torch.Tensor
    sin: torch.Tensor
    interleaved: bool


def check(rotary_cos, rotary_sin, rotary_interleaved, q, seqlen_cache: int):
    """The rotary tables, checked as flash-attn takes them, or None without rotary."""
    if rotary_cos is None and rotary_sin is None:
        return None
    if rotary_cos is None or rotary_sin is None:
        raise ValueError("rotary_cos and rotary_sin go together: give both (rotary "
                         "embedding) or neither")
    if rotary_interleaved not in (True, False):
        raise TypeError(f"rotary_interleaved={rotary_interleaved!r}; it must be a bool")
    for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; it must be (seqlen_ro, "
                             "rotary_dim / 2)")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}; it must be q's {q.dtype} "
                             f"on {q.device}")
    if rotary_cos.shape != rotary_sin.shape:
        raise ValueError(f"rotary_cos has shape {tuple(rotary_cos.shape)} but rotary_sin has "
                         f"{tuple(rotary_sin.shape)}; they must be the same")
    seqlen_ro, half = rotary_cos.shape
    if not 1 <= 2 * half <= q.shape[3]:
        raise ValueError(f"rotary_cos has shape {tuple(rotary_cos.shape)}: rotary_dim = "
                         f"{2 * half} must be in [2, headdim={q.shape[3]}]")
    if seqlen_ro < seqlen_cache:
        raise ValueError(f"rotary_cos has {seqlen_ro} positions; it must cover the caches' "
                         f"{seqlen_cache} (seqlen_ro >= seqlen_cache)")
    return Rotary(rotary_cos, rotary_sin, bool(rotary_interleaved))


def _rotate(x, rotary: Rotary, positions):
    """x (batch, seqlen, nheads, headdim) with its first rotary_dim columns rotated by the
    angles at ``positions`` (batch, seqlen), in float32 as flash-attn's rotary kernel does:
    pairs (2i, 2i + 1) when interleaved (GPT-J), else (i, i + rotary_dim / 2) (GPT-NeoX)."""
    half = rotary.cos.shape[1]
    positions = positions.clamp(0, rotary.cos.shape[0] - 1)
    cos = rotary.cos[positions].float().unsqueeze(2)  # (batch, seqlen, 1, half)
    sin = rotary.sin[positions].float().unsqueeze(2)
    part = x[..., :2 * half].float()
    if rotary.interleaved:
        x1, x2 = part[..., 0::2], part[..., 1::2]
        turned = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    else:
        x1, x2 = part[..., :half], part[..., half:]
        turned = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return torch.cat((turned.to(x.dtype), x[..., 2 * half:]), dim=-1)


def apply(rotary: Rotary, q, k, cache_seqlens, per_token_q: bool):
    """q and the new k rotated at each sequence's positions, as flash-attn does: the new
    keys at cache_seqlens[b] + i; the queries at those positions when per_token_q (causal or
    windowed: queries_per_token), else all at cache_seqlens[b] (they come after the cache).
    Positions count cache rows from the start of the sequence's cache, left padding
    (cache_leftpad) included: flash-attn's kernel reads the tables at the keys' rows in the
    cache, not at their index among the sequence's own keys."""
    offsets = cache_seqlens.long()[:, None]
    q_steps = torch.arange(q.shape[1], device=q.device)[None, :]
    q = _rotate(q, rotary, offsets + q_steps if per_token_q else offsets.expand(-1, q.shape[1]))
    if k is not None:
        k = _rotate(k, rotary, offsets + torch.arange(k.shape[1], device=k.device)[None, :])
    return q, k


def queries_per_token(causal: bool, window: tuple[int, int], seqlen_cache: int) -> bool:
    """Whether each query row takes its own position (flash-attn: a causal or local call)
    rather than all of them cache_seqlens[b]. flash-attn decides on the window as its kernel
    takes it, a side of at least the caches' length (seqlen_cache: a paged cache's
    max_blocks_per_seq * page_block_size) unbounded: heuristics.kernel_window's rule."""
    left, right = heuristics.kernel_window(window, seqlen_cache, False)
    return bool(causal) or left >= 0 or right >= 0
