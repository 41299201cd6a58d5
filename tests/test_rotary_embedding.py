"""cudaflash.rotary_embedding on the CPU: flash-attn's rotation (GPT-J and GPT-NeoX pairings,
partial rotary_dim, per-sequence offsets) against complex multiplication, and the positions
flash_attn_with_kvcache gives q and the new keys."""

import math

import pytest
import torch

from cudaflash import rotary_embedding


def tables(n, rotary_dim, dtype=torch.float32):
    angle = torch.arange(n)[:, None] * torch.linspace(0.1, 1.0, rotary_dim // 2)[None, :]
    return angle.cos().to(dtype), angle.sin().to(dtype)


def by_complex(x, cos, sin, positions, interleaved):
    half = cos.shape[1]
    turn = torch.polar(torch.ones_like(cos[positions]), torch.atan2(sin[positions], cos[positions]))
    part = x[..., :2 * half].double()
    if interleaved:
        z = torch.view_as_complex(part.unflatten(-1, (half, 2)).contiguous())
        out = torch.view_as_real(z * turn[:, :, None, :].to(z.dtype)).flatten(-2)
    else:
        z = torch.complex(part[..., :half], part[..., half:])
        z = z * turn[:, :, None, :].to(z.dtype)
        out = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((out.to(x.dtype), x[..., 2 * half:]), dim=-1)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotation_matches_complex_multiplication(interleaved, rotary_dim):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, 64, generator=g)
    cos, sin = tables(20, rotary_dim)
    positions = torch.tensor([[0, 1, 2], [7, 8, 9]])
    got = rotary_embedding._rotate(x, rotary_embedding.Rotary(cos, sin, interleaved), positions)
    want = by_complex(x, cos, sin, positions, interleaved)
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.equal(got[..., rotary_dim:], x[..., rotary_dim:]), "columns past rotary_dim"
    # A rotation keeps each pair's length.
    assert torch.allclose(got.norm(dim=-1), x.norm(dim=-1), atol=1e-4)


@pytest.mark.parametrize("per_token_q", [True, False])
def test_positions_are_the_cache_rows(per_token_q):
    """flash-attn's positions: the new keys at cache_seqlens[b] + i, the rows they take in
    the cache; left padding counts (flash-attn's kernel reads its tables at the cache row,
    cache_leftpad + the key's index in the sequence, and its test rotates at
    seqlen_offsets=cache_seqlens with and without cache_leftpad)."""
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 3, 4, 32, generator=g), torch.randn(2, 2, 1, 32, generator=g)
    cos, sin = tables(40, 32)
    rotary = rotary_embedding.Rotary(cos, sin, False)
    seqlens = torch.tensor([5, 12], dtype=torch.int32)
    q_ro, k_ro = rotary_embedding.apply(rotary, q, k, seqlens, per_token_q)
    start = torch.tensor([5, 12])[:, None]
    assert torch.allclose(k_ro, by_complex(k, cos, sin, start + torch.arange(2), False), atol=1e-5)
    q_pos = start + torch.arange(3) if per_token_q else start.expand(-1, 3)
    assert torch.allclose(q_ro, by_complex(q, cos, sin, q_pos, False), atol=1e-5)


@pytest.mark.parametrize("causal, window, per_token", [
    (False, (-1, -1), False),
    (True, (-1, -1), True),
    (False, (10, -1), True),
    (False, (-1, 0), True),
    (False, (64, -1), False),   # a side as long as the caches is unbounded (flash-attn)
    (False, (63, 64), True),
    (False, (100, 200), False),
    (True, (100, -1), True),
])
def test_queries_take_their_own_positions_when_causal_or_local(causal, window, per_token):
    assert rotary_embedding.queries_per_token(causal, window, 64) is per_token


def test_low_precision_rounds_once():
    """bf16 in, the rotation in float32, one rounding back (flash-attn's kernel does the same)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(1, 1, 1, 16, generator=g).to(torch.bfloat16)
    cos, sin = tables(4, 16, torch.bfloat16)
    positions = torch.tensor([[3]])
    got = rotary_embedding._rotate(x, rotary_embedding.Rotary(cos, sin, True), positions)
    want = rotary_embedding._rotate(x.float(), rotary_embedding.Rotary(cos.float(), sin.float(),
                                                                       True), positions)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
    assert not math.isnan(got.float().sum().item())
