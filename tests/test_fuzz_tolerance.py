"""tools/fuzz_api.py's allowance for FlashAttention's backward (CPU).

The backward kernels take D_i = sum_d dout_id * out_id from the out the forward stored, in
q's dtype, where autograd's softmax backward has the exact D. Where dS cancels to about 0 (a
sequence of one key: P = 1), both of the fuzz tool's references are exact, so its accuracy
rule would ask the kernel for exactness too; stored_out_error is what that design moves dq
and dk by. Here a float32 model of the kernels' backward (D from the rounded out, dS = P (dP
Z - D) with Z dropout's keep / (1 - p), through the cap) must differ from the exact gradients
by that amount, signed, element by element.
"""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import fuzz_api  # noqa: E402


def kernel_like_gradients(q, k, v, dout, sem, keep):
    """(dq, dk) as FlashAttention's backward computes them, in float32 from q's dtype."""
    groups = q.shape[2] // k.shape[2]
    qf = q.float()
    kf, vf = (t.float().repeat_interleave(groups, dim=2) for t in (k, v))
    raw = torch.einsum("bqhd,bkhd->bhqk", qf, kf) * sem.scale
    capped = sem.softcap * torch.tanh(raw / sem.softcap) if sem.softcap else raw
    probs = torch.softmax(capped, dim=-1)
    drop = keep / (1.0 - sem.dropout_p) if keep is not None else 1.0
    out = torch.einsum("bhqk,bkhd->bqhd", probs * drop, vf)
    stored = out.to(q.dtype).float()
    d_row = (dout.float() * stored).sum(-1).transpose(1, 2)  # (b, h, sq)
    d_probs = torch.einsum("bqhd,bkhd->bhqk", dout.float(), vf) * drop
    d_scores = probs * (d_probs - d_row[..., None])
    if sem.softcap:
        d_scores = d_scores * (1 - torch.tanh(raw / sem.softcap) ** 2)
    dq = torch.einsum("bhqk,bkhd->bqhd", d_scores, kf) * sem.scale
    dk = torch.einsum("bhqk,bqhd->bkhd", d_scores, qf) * sem.scale
    dk = dk.unflatten(2, (k.shape[2], groups)).sum(3)
    return dq, dk


@pytest.mark.parametrize("seqlen_q, seqlen_k, heads, heads_k, softcap, dropout_p", [
    (1, 1, 2, 2, 0.0, 0.0),    # out = v exactly: nothing moves
    (97, 1, 2, 1, 0.0, 0.1),   # one key with dropout: out = v / (1 - p), rounded
    (5, 3, 4, 2, 0.0, 0.0),
    (33, 17, 2, 2, 5.0, 0.0),
    (16, 40, 3, 1, 2.0, 0.3),
])
def test_stored_out_error_is_what_the_rounded_out_moves(seqlen_q, seqlen_k, heads, heads_k,
                                                        softcap, dropout_p):
    gen = torch.Generator().manual_seed(seqlen_q * 1000 + seqlen_k)
    d = 64

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    q, dout = randn(1, seqlen_q, heads, d), randn(1, seqlen_q, heads, d)
    k, v = randn(1, seqlen_k, heads_k, d), randn(1, seqlen_k, heads_k, d)
    keep = (torch.rand(1, heads, seqlen_q, seqlen_k, generator=gen) >= dropout_p
            if dropout_p else None)
    sem = fuzz_api.Semantics(scale=d ** -0.5, window=(-1, -1), softcap=softcap, slopes=None,
                             dropout_p=dropout_p)
    exact = fuzz_api.reference_gradients(q, k, v, dout, sem, keep, upcast=True)
    model = kernel_like_gradients(q, k, v, dout, sem, keep)
    # The signed part alone: stored_out_error adds the float32 sums' allowance to its size.
    leaves = [t.detach().float().requires_grad_() for t in (q, k)]
    out, lse = fuzz_api.attention_reference(leaves[0], leaves[1], v.float(), sem, keep)
    moved = (dout.float() * (out.detach().to(q.dtype).float() - out.detach())).sum(-1)
    signed = torch.autograd.grad(-(moved.transpose(1, 2) * lse).sum(), leaves)
    allowance = fuzz_api.stored_out_error(q, k, v, dout, sem, keep)
    for name, ours, ref, s, allowed in zip(("dq", "dk"), model, exact, signed, allowance):
        moved_by = ours - ref
        scale = max(moved_by.abs().max().item(), 1e-6)
        assert (moved_by - s).abs().max().item() <= 1e-3 * scale + 1e-6, name
        assert (moved_by.abs() <= allowed + 1e-6).all(), name
    if seqlen_k == 1 and dropout_p == 0.0:
        assert model[0].abs().max().item() == 0.0  # out = v: D is exact, dS = 0
    if seqlen_k == 1 and dropout_p:
        assert math.isfinite(model[0].abs().max().item())
        assert model[0].abs().max().item() > 0  # the rule without the allowance would fail


@pytest.mark.parametrize("d, softcap, seqlen_k", [(1, 2.0, 99), (64, 5.0, 300), (128, 30.0, 50)])
def test_approx_tanh_error_bounds_a_perturbed_cap(d, softcap, seqlen_k):
    """The kernels cap scores with tanh.approx.f32 (as flash-attn, through cutlass::fast_tanh),
    whose relative error the fuzz tool allows for: every capped score moved by that error with
    random signs must move out by no more than approx_tanh_error's bound, and the bound must
    not be zero."""
    gen = torch.Generator().manual_seed(d)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    q, k, v = randn(1, 4, 2, d), randn(1, seqlen_k, 2, d), randn(1, seqlen_k, 2, d)
    sem = fuzz_api.Semantics(scale=d ** -0.5, window=(-1, -1), softcap=softcap, slopes=None,
                             dropout_p=0.0)
    exact, _ = fuzz_api.attention_reference(q, k, v, sem, None, upcast=True)
    capped = fuzz_api.masked_scores(q, k, sem, torch.float32)
    allowed, lse_allowed = fuzz_api.approx_tanh_error(q, k, v, exact, sem, None)
    assert allowed.abs().max().item() > 0 and lse_allowed.abs().max().item() > 0
    for _ in range(20):
        sign = torch.randint(0, 2, capped.shape, generator=gen).float() * 2 - 1
        probs = torch.softmax(capped * (1 + sign * fuzz_api.TANH_APPROX_ERROR), dim=-1)
        out = torch.einsum("bhqk,bkhd->bqhd", probs, v.float())
        assert ((out - exact).abs() <= allowed + 1e-7).all()
