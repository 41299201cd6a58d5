"""flash-attn's semantics in plain torch (float32 math), as stand-ins for cudaflash's
functions where a test checks the code around the kernels on the CPU (the transformers
integration). They take the arguments cudaflash's functions take and check the forms
cudaflash's own checks insist on (int32 offsets, int maxima, window tuples), so a caller
that would fail on the GPU fails here too. Differentiable."""

from __future__ import annotations

import torch


def alibi_bias(alibi_slopes, batch, heads, seqlen_q, seqlen_k, rows=None):
    """flash-attn's ALiBi bias, float32 (batch, heads, len(rows), seqlen_k): query row i and
    key j of head h in batch entry b get -slope * |i + seqlen_k - seqlen_q - j|, slope =
    alibi_slopes[h] ((heads,) slopes) or alibi_slopes[b, h] ((batch, heads)). ``rows``: the
    query rows' indices in the sequence of seqlen_q rows (default: all of them)."""
    device = alibi_slopes.device
    rows = torch.arange(seqlen_q, device=device) if rows is None else rows.to(device)
    cols = torch.arange(seqlen_k, device=device)
    distance = (rows[:, None] + (seqlen_k - seqlen_q) - cols[None, :]).abs().float()
    slopes = alibi_slopes.float().expand(batch, heads)
    return -slopes[:, :, None, None] * distance


def check_alibi_slopes(alibi_slopes, batch, heads):
    """The forms cudaflash's checks insist on: None or float32 (heads,) or (batch, heads)."""
    if alibi_slopes is None:
        return
    if not isinstance(alibi_slopes, torch.Tensor) or alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be a float32 tensor, got {alibi_slopes!r}")
    if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes has shape {tuple(alibi_slopes.shape)}; it must be "
                         f"({heads},) or ({batch}, {heads})")


def attention(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
              alibi_slopes=None, dropout_p=0.0):
    """flash_attn_func: q (batch, seqlen_q, heads, d), k and v (batch, seqlen_k, heads_k, d);
    causal and windows aligned to the bottom-right corner; rows that see no key give 0.
    alibi_slopes: flash-attn's ALiBi (alibi_bias), added to the scaled (and capped) scores.
    dropout_p: torch's dropout on the probabilities (kept ones scaled by 1 / (1 - p)), a float
    in [0, 1) as cudaflash insists."""
    if not (isinstance(dropout_p, float) and 0.0 <= dropout_p < 1.0):
        raise TypeError(f"dropout_p={dropout_p!r} is not a float in [0, 1)")
    if not (isinstance(window_size, tuple) and len(window_size) == 2
            and all(type(w) is int for w in window_size)):
        raise TypeError(f"window_size={window_size!r} is not a tuple of two ints")
    if not isinstance(softcap, float):
        raise TypeError(f"softcap={softcap!r} is not a float")
    batch, seqlen_q, heads, d = q.shape
    check_alibi_slopes(alibi_slopes, batch, heads)
    seqlen_k, groups = k.shape[1], heads // k.shape[2]
    qf = q.float().transpose(1, 2)
    kf = k.float().repeat_interleave(groups, dim=2).transpose(1, 2)
    vf = v.float().repeat_interleave(groups, dim=2).transpose(1, 2)
    scale = d ** -0.5 if softmax_scale is None else softmax_scale
    scores = qf @ kf.transpose(-1, -2) * scale  # (batch, heads, seqlen_q, seqlen_k)
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes, batch, heads, seqlen_q, seqlen_k).to(
            scores.device)
    row = torch.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q
    col = torch.arange(seqlen_k)[None, :]
    left, right = window_size
    right = 0 if causal else right
    allowed = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool)
    if right >= 0:
        allowed &= col <= row + right
    if left >= 0:
        allowed &= col >= row - left
    allowed = allowed.to(q.device)
    sees_a_key = allowed.any(-1, keepdim=True)
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(~sees_a_key, 0.0)
    probs = scores.softmax(-1) * sees_a_key
    if dropout_p:
        probs = torch.nn.functional.dropout(probs, dropout_p)
    return (probs @ vf).transpose(1, 2).to(q.dtype)


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                     softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                     alibi_slopes=None, dropout_p=0.0):
    """flash_attn_varlen_func: packed (total, heads, d) rows, int32 offsets, int maxima;
    alibi_slopes (heads,) or (batch, heads), sequence b's bias from its own lengths."""
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1:
            raise TypeError(f"{name} must be a 1D int32 tensor, got {cu.dtype} {tuple(cu.shape)}")
    if type(max_seqlen_q) is not int or type(max_seqlen_k) is not int:
        raise TypeError("max_seqlen_q and max_seqlen_k must be ints")
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if max(b - a for a, b in zip(starts_q, starts_q[1:])) > max_seqlen_q or \
            max(b - a for a, b in zip(starts_k, starts_k[1:])) > max_seqlen_k:
        raise ValueError("a sequence is longer than max_seqlen_q or max_seqlen_k")
    check_alibi_slopes(alibi_slopes, len(starts_q) - 1, q.shape[1])
    outs = []
    for b in range(len(starts_q) - 1):
        qs, ks = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
        slopes = (alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1
                  else alibi_slopes[b:b + 1])
        outs.append(attention(q[None, qs], k[None, ks], v[None, ks], softmax_scale, causal,
                              window_size, softcap, slopes, dropout_p)[0])
    return torch.cat(outs)
