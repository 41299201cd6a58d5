"""How much of an ALiBi forward could be skipped: blocks whose weights all fall under e^-T of
their row's largest (analysis for issue 21's ALiBi item; CPU only, nothing is built).

With ALiBi's slopes 2^(-8 (h + 1) / H), the bias -slope |i - j| drops by T within T / slope
keys of the diagonal. If every score is within +-B (B = scale max|q| max|k| bounds it), a key
farther than (2 B + T) / slope from row i's diagonal has a weight under e^-T of the row's
largest, so a band of that half-width per head gives the same out and lse to within
seqlen_k e^-T relative. This prints, for the bench's sizes (nheads = 2048 / d), the fraction
of key blocks a 128-row tile still visits, and checks in float64 that the banded attention
equals the full one.

    python tools/alibi_band.py [--margin 40]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))
from cudaflash.cli.suite_calls import paper_alibi_slopes  # noqa: E402 (the alibi suite's)

BLOCK = 128


def half_width(score_bound: float, slope: float, margin: float) -> int:
    """Keys farther than this from the diagonal weigh under e^-margin of the row's largest."""
    return math.ceil((2.0 * score_bound + margin) / slope)


def kept_fraction(seqlen: int, heads: int, score_bound: float, margin: float,
                  causal: bool) -> float:
    """Mean over heads of the key blocks a 128-row tile visits inside the band, over those it
    visits today (all, or up to the diagonal when causal); seqlen_q = seqlen_k."""
    tiles = seqlen // BLOCK
    total = 0.0
    for slope in paper_alibi_slopes(heads, "cpu").tolist():
        width = half_width(score_bound, slope, margin)
        kept = full = 0
        for tile in range(tiles):
            first, last = tile * BLOCK, (tile + 1) * BLOCK - 1
            lo = max(0, first - width)
            hi = last if causal else min(seqlen - 1, last + width)
            kept += hi // BLOCK - lo // BLOCK + 1
            full += tile + 1 if causal else tiles
        total += kept / full
    return total / heads


def banded_equals_full(seqlen: int = 2048, heads: int = 8, d: int = 64,
                       margin: float = 40.0) -> float:
    """max |out_banded - out_full| in float64 with randn inputs, each head's band from the
    bound B = scale max|q| max|k| of its own tensors."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(seqlen, heads, d, generator=gen, dtype=torch.float64)
               for _ in range(3))
    scale = d ** -0.5
    distance = (torch.arange(seqlen)[:, None] - torch.arange(seqlen)[None, :]).abs()
    worst = 0.0
    for head, slope in enumerate(paper_alibi_slopes(heads, "cpu").tolist()):
        bound = scale * q[:, head].norm(dim=-1).max().item() * k[:, head].norm(dim=-1).max().item()
        scores = q[:, head] @ k[:, head].T * scale - slope * distance
        full = torch.softmax(scores, dim=-1) @ v[:, head]
        outside = distance > half_width(bound, slope, margin)
        banded = torch.softmax(scores.masked_fill(outside, -math.inf), dim=-1) @ v[:, head]
        worst = max(worst, (full - banded).abs().max().item())
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--margin", type=float, default=40.0,
                        help="T: skip weights under e^-T of the row's largest (default 40)")
    args = parser.parse_args()
    seqlens = (1024, 2048, 4096, 8192, 16384)
    print("kept key blocks per 128-row tile (bench sizes, seqlen_q = seqlen_k):")
    print(f"{'d':>4} {'heads':>5} {'bound':>6} {'causal':>6} "
          + " ".join(f"{s:>6}" for s in seqlens))
    for d in (64, 128):
        heads = 2048 // d
        # randn q, k: max|q| max|k| ~ (1.3 sqrt(d))^2, times scale = d^-1/2; and scores within
        # +-5, what the exact test after Q K^T would see
        for name, bound in (("norms", 1.3 ** 2 * math.sqrt(d)), ("+-5", 5.0)):
            for causal in (False, True):
                fractions = (kept_fraction(s, heads, bound, args.margin, causal) for s in seqlens)
                print(f"{d:>4} {heads:>5} {name:>6} {str(causal):>6} "
                      + " ".join(f"{f:>6.2f}" for f in fractions))
    print(f"float64, S 2048, 8 heads, d 64: max |banded - full| = "
          f"{banded_equals_full(margin=args.margin):.3g}")


if __name__ == "__main__":
    main()
