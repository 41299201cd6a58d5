"""Head dims without a kernel: flash-attn takes every head dim up to 256; cudaflash's kernels
come in 64, 128 and 256, so the public functions run a head dim in between zero-padded to the
next built one (padded_head_dim decides, with_padded_head_dim pads and slices back)."""

from typing import Optional

import torch

from . import _checks
from .backward_config import BWD_D_HEADS
from .config import D_HEADS


def padded_head_dim(q, k, v) -> Optional[int]:
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


def with_padded_head_dim(function, padded: int, q, k, v, softmax_scale, kwargs: dict,
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
    flash-attn does for head dims that are not a multiple of 8).

    A dropout call with return_attn_probs also passes ``probs_head_dim`` (the caller's head
    dim, whose key block size flash-attn's tests normalize S_dmask with), so ``function`` is
    then an internal entry that takes it, not a public function."""
    d_head = q.shape[-1]
    scale = _checks.softmax_scale(softmax_scale, d_head)
    if _checks.wants_grad(q, k, v) and padded not in BWD_D_HEADS:
        raise NotImplementedError(
            f"q, k, v have head dim {d_head} and require grad; cudaflash runs head dim "
            f"{d_head} padded to {padded}, which has no backward kernel (the backward supports "
            f"head dims up to {max(BWD_D_HEADS)}). Call flash_attn_func under "
            "torch.no_grad() for inference")

    def pad(t):
        return None if t is None else torch.nn.functional.pad(t, (0, padded - d_head))

    padded_caches = tuple(pad(c) for c in caches)
    # A dropout call's S_dmask is built inside the padded call, with the caller's key blocks:
    # ``function`` then takes the caller's head dim as probs_head_dim.
    if kwargs.get("dropout_p") and kwargs.get("return_attn_probs"):
        kwargs = dict(kwargs, probs_head_dim=d_head)
    result = function(pad(q), *padded_caches, pad(k), pad(v), softmax_scale=scale, **kwargs)
    if k is not None:  # for kvcache: an append happened (it has no k without one)
        for cache, padded_cache in zip(caches, padded_caches):
            cache.copy_(padded_cache[..., :d_head])
    if isinstance(result, tuple):
        return (result[0][..., :d_head], *result[1:])
    return result[..., :d_head]
