"""Dropout's per-call state: the probability, the kernels' 16-bit threshold and O's scale,
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
    threshold: int  # a score is kept when its 16-bit number is >= this: round(p * 65536)
    scale: float  # 1 / (1 - p)
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
    torch.randint on the device, nothing read on the host."""
    if dropout_p == 0.0:
        return None
    seed = torch.randint(0, SEED_HIGH, (1,), dtype=torch.int64, device=device)
    threshold = min(round(dropout_p * 65536), 65535)
    return Dropout(dropout_p, threshold, 1.0 / (1.0 - dropout_p), seed)
