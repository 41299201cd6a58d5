"""The attention of one ring step, as the ring calls it: a forward that returns the block's
out and log-sum-exp, and a backward that takes the final (merged) out and lse.

The ring (ring.py) only needs these two calls, so the kernels are pluggable:
``CudaflashBlocks`` runs cudaflash's kernels (the default, CUDA only); ``TorchBlocks`` is
the same math in plain PyTorch, for CPU runs (the tests run the ring on gloo with it) and
for checking. Tensors are (batch, seqlen, nheads, headdim) as in flash_attn_func; the lse is
(batch, nheads, seqlen_q), in float32 or wider; ``causal`` is bottom-right aligned. The
ring may modify the tensors a backward returns: return fresh ones.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from .. import _autograd, _call, _checks, backward as _backward, dispatch, heuristics
from ..backward_config import BWD_D_HEADS
from ..config import D_HEADS


class BlockAttention(Protocol):
    def check(self, q, k, v, needs_grad: bool) -> None:
        """Raise for local q, k, v this implementation cannot take (before any work)."""

    def forward(self, q, k, v, scale: float, causal: bool):
        """(out, lse): out (b, sq, h, d) in q's dtype, lse (b, h, sq) float32 or wider,
        -inf for a row that sees no key (and out 0 there)."""

    def backward(self, dout, q, k, v, out, lse, scale: float, causal: bool):
        """(dq, dk, dv) of this block's share of the attention, given the final out and lse
        of the query rows (so P = exp(scale * q k^T - lse) are the final probabilities)."""


class CudaflashBlocks:
    """cudaflash's kernels, called below the public functions: the checked (and planned)
    forward of ``_call`` with the lse kept, and the backward launches of ``_autograd``
    (``run_backward``: the same path flash_attn_func's gradients take). ``deterministic``:
    the backward's scheme, as in flash_attn_func."""

    def __init__(self, deterministic: bool = False) -> None:
        _checks.check_deterministic(deterministic)
        self.deterministic = deterministic

    def check(self, q, k, v, needs_grad: bool) -> None:
        d_head = getattr(q, "shape", (0,))[-1]
        if isinstance(q, torch.Tensor) and q.dim() == 4 and d_head not in D_HEADS:
            # flash_attn_func pads such head dims; the ring does not (yet)
            raise ValueError(f"q has head dim {d_head}; the ring runs cudaflash's kernels at "
                             f"head dims {list(D_HEADS)} ({list(BWD_D_HEADS)} with gradients)")
        with torch.no_grad():  # check_qkv refuses tensors that require grad in grad mode
            _checks.check_qkv(q, k, v)
        _checks.check_on_gpu(q)
        if needs_grad:
            dispatch.check_backward_supported(q.get_device(), q.dtype, q.shape[3],
                                              _backward.scheme(self.deterministic))

    def forward(self, q, k, v, scale: float, causal: bool):
        with torch.no_grad():
            return _call.planned_forward(q, k, v, scale, causal, True)

    def backward(self, dout, q, k, v, out, lse, scale: float, causal: bool):
        # The window exactly as the forward's kernel took it: causal is right = 0.
        window = heuristics.kernel_window((-1, -1), k.shape[1], causal)
        return _autograd.run_backward(dout, q, k, v, out, lse, scale, causal,
                                      self.deterministic, window)


class TorchBlocks:
    """The block attention in plain PyTorch, computed in q's dtype promoted to at least
    float32 (float64 stays float64). Any device; GQA as in flash_attn_func (query head h
    reads K/V head h // (nheads // nheads_k))."""

    def check(self, q, k, v, needs_grad: bool) -> None:
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{name} must be a 4-dim (batch, seqlen, nheads, headdim) "
                                 f"tensor, got {getattr(t, 'shape', type(t).__name__)}")
        if q.shape[2] % k.shape[2]:
            raise ValueError(f"q has {q.shape[2]} heads and k {k.shape[2]}; nheads must be a "
                             "multiple of nheads_k")

    @staticmethod
    def _scores(q, k, scale: float, causal: bool):
        """(scores (b, h, sq, sk) in the compute dtype, masked with -inf; k with its heads
        repeated for GQA)."""
        dtype = torch.promote_types(q.dtype, torch.float32)
        k = k.to(dtype).repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q.to(dtype), k) * scale
        if causal:
            sq, sk = q.shape[1], k.shape[1]
            rows = torch.arange(sq, device=q.device)[:, None]
            cols = torch.arange(sk, device=q.device)[None, :]
            scores = scores.masked_fill(cols > rows + sk - sq, -math.inf)
        return scores, k

    @staticmethod
    def _probabilities(scores, lse):
        """exp(scores - lse), 0 on rows whose lse is -inf (they see no key)."""
        seen = ~torch.isneginf(lse)[..., None]
        return torch.where(seen, torch.exp(scores - torch.where(seen, lse[..., None], 0)), 0)

    def forward(self, q, k, v, scale: float, causal: bool):
        scores, _ = self._scores(q, k, scale, causal)
        lse = torch.logsumexp(scores, dim=-1)
        p = self._probabilities(scores, lse)
        v = v.to(p.dtype).repeat_interleave(q.shape[2] // v.shape[2], dim=2)
        return torch.einsum("bhqk,bkhd->bqhd", p, v).to(q.dtype), lse

    def backward(self, dout, q, k, v, out, lse, scale: float, causal: bool):
        scores, k_rep = self._scores(q, k, scale, causal)
        dtype = scores.dtype
        p = self._probabilities(scores, lse.to(dtype))
        groups = q.shape[2] // k.shape[2]
        v_rep = v.to(dtype).repeat_interleave(groups, dim=2)
        dout, out, qc = dout.to(dtype), out.to(dtype), q.to(dtype)
        dv = torch.einsum("bhqk,bqhd->bkhd", p, dout)
        dp = torch.einsum("bqhd,bkhd->bhqk", dout, v_rep)
        delta = (dout * out).sum(-1).transpose(1, 2)  # (b, h, sq): rowsum(dO * O)
        ds = p * (dp - delta[..., None])
        dq = torch.einsum("bhqk,bkhd->bqhd", ds, k_rep) * scale
        dk = torch.einsum("bhqk,bqhd->bkhd", ds, qc) * scale

        def per_kv_head(t):  # the query heads of a K/V group sum into it
            b, s, _, d = t.shape
            return t.reshape(b, s, k.shape[2], groups, d).sum(3)

        return dq.to(q.dtype), per_kv_head(dk).to(k.dtype), per_kv_head(dv).to(v.dtype)
