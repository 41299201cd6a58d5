#!/usr/bin/env python3
"""Randomized differential test of cudaflash's public API against flash-attn's semantics,
computed in float32 with torch.

    PYTHONPATH=. python3 tools/fuzz_api.py --cases 400 --seed 1 [--time-limit 240]
    PYTHONPATH=. python3 tools/fuzz_api.py --seed 1 --only 17        # rerun case 17 alone
    PYTHONPATH=. python3 tools/fuzz_api.py --case '{...}'            # a printed case dict
    PYTHONPATH=. python3 tools/fuzz_api.py --dry-run --cases 40      # no GPU needed

Each case is drawn from (seed, index) alone, so ``--only N`` redraws case N exactly, and no
case depends on another or on the order they run in. A case is one call of flash_attn_func
(or flash_attn_qkvpacked_func / flash_attn_kvpacked_func), flash_attn_varlen_func (its packed
forms, its paged form with block_table) or flash_attn_with_kvcache (contiguous, indexed,
left-padded or paged caches, with or without appended k/v, rotary), with random dtype, head
dim, sizes, GQA, causal, window_size, softcap, ALiBi, softmax_scale, dropout, memory layouts,
deterministic, return_attn_probs / return_softmax_lse and num_splits. What it checks:

- out and lse against two references, the attention math in float32 and the same math in the
  input dtype, under FlashAttention's accuracy rule as tests/test_gpu_correctness.py applies
  it: max|ours - fp32| <= 2 * max|lowp - fp32| + 2 * (one rounding of fp32 to the stored
  type) + 1e-5 (1e-3 with dropout, as tests/test_gpu_dropout.py); rows that see no key must
  give out = 0 and lse = -inf exactly; nothing may be NaN or +inf;
- gradients (dq, dk, dv for a random dout, through the views the call took) against autograd
  through both references, under the same rule, and zero gradients outside the views and
  outside every packed sequence;
- dropout: the keep mask rebuilt on the host from the call's seed (torch.manual_seed, then
  the one torch.randint cudaflash draws: tests/test_gpu_dropout.py's way; Philox in numpy from
  tests/_dropout_reference.py), and S_dmask's signs when return_attn_probs gives it;
- flash_attn_with_kvcache's caches after an append: the new (rotated) keys and values at
  each sequence's positions, every other byte of the cache buffers unchanged (also after a
  refused call);
- some cases run twice on fresh copies of the inputs (the second call replays the plans the
  first recorded): out and lse must be bitwise the same, and so must the gradients when
  deterministic=True.

Outcomes: pass; rejected (the forward call raised ValueError, TypeError or
NotImplementedError: a documented refusal, tallied by the message's first words); failed
(any other exception, an exception in the backward, a mismatch, NaN/Inf, a cache byte out of
place, a CUDA error). After each case the GPU is synchronized: a sticky CUDA error ends the run
with that case's repro. Exit status 1 if any case failed.

The reference follows flash-attn 2.x where cudaflash's documentation says it does: a window
side at least as long as the keys is unbounded, the keys counted as flash-attn counts them
(seqlen_k; max_seqlen_k for varlen; the cache's capacity for flash_attn_with_kvcache), and
rotary queries are rotated per row when the call is causal or keeps a bounded window side
after that rule; rotary positions are the rows the new keys take in the cache
(cache_seqlens[b] + i, left padding included), as flash-attn's kernel and tests count them.
Where cudaflash goes beyond flash-attn the reference follows cudaflash: q is rotated whenever
rotary_cos is given (flash-attn refuses rotary tables without k and v).

A failing case reruns alone with --only N; CUDAFLASH_DEBUG=1 then synchronizes after every
launch, so a CUDA error names the kernel that raised it.

--dry-run touches no GPU: it draws and prints the cases, builds their inputs on the CPU and
runs each case's whole check pipeline against a CPU stand-in for cudaflash (flash-attn's
semantics from tests/_flash_reference.py, whose argument checks every case must pass, an
implementation independent of this script's reference), which checks the drawing, the
inputs and the comparison code without a GPU (400 cases: about half a minute).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Optional

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
# The tests' host-side references: flash-attn's semantics in plain torch, and the kernels'
# dropout random numbers rebuilt in numpy from the Philox paper (both import nothing from
# cudaflash, so they check the package rather than repeat it).
sys.path.insert(0, str(REPO / "tests"))
# cudaflash itself: as PYTHONPATH=. gives it, else the checkout this script is in (last, so
# an explicit PYTHONPATH or installed package is what runs).
sys.path.append(str(REPO))
import _flash_reference as flash_reference  # noqa: E402
from _dropout_reference import random8, threshold as dropout_threshold  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
SEED_HIGH = 2**63 - 1  # torch.randint's bound for cudaflash's int64 dropout seed (_dropout.py)
REJECTION_TYPES = (ValueError, TypeError, NotImplementedError)

# Head dims: the three with kernels of their own, often; the rest run zero-padded to the next
# of them (forward, gradients and caches), so odd sizes test the padding.
BUILT_HEAD_DIMS = (64, 128, 256)
PADDED_HEAD_DIMS = (1, 8, 16, 32, 40, 72, 80, 96, 100, 160, 192, 200, 255)
# Lengths at block edges (64-, 128-row and -key tiles) and just past them: tails.
EDGE_LENGTHS = (16, 32, 63, 64, 65, 127, 128, 129, 176, 255, 256, 257, 384, 511, 512, 640)
DROPOUT_PS = (0.001, 0.1, 0.17, 0.5, 0.9)  # 0.001 < 1/512: rounds to no dropout at all
SOFTCAPS = (0.5, 2.0, 10.0, 30.0)
PAGE_SIZES = (16, 32, 64, 128, 256)  # cudaflash's paged caches: powers of two from 16

# Work budgets, in scores (batch x heads x query rows x keys), so 400 cases take minutes: a
# backward costs about three forwards, and dropout rebuilds its mask in numpy on the host.
FORWARD_SCORES = 4_000_000
BACKWARD_SCORES = 1_500_000
DROPOUT_SCORES = 800_000
# --dry-run runs the full pipeline on the CPU for cases up to this size: every case the
# budgets above allow (400 cases take about half a minute).
DRY_RUN_SCORES = FORWARD_SCORES


class CaseFailure(Exception):
    """A check failed: the case counts as failed."""


class Rejection(Exception):
    """The forward call refused its arguments with a clear Python exception."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def fail_unless(condition, message: str) -> None:
    if not condition:
        raise CaseFailure(message)


# ---- drawing cases ----------------------------------------------------------------------------


def weighted(rng: random.Random, choices):
    """One value of ``choices``, a list of (value, weight)."""
    values, weights = zip(*choices)
    return rng.choices(values, weights=weights)[0]


def draw_length(rng: random.Random, low: int = 1, high: int = 700) -> int:
    """A length in [low, high], often tiny or at a tile edge, where kernels have special
    cases."""
    r = rng.random()
    if r < 0.15:
        n = rng.randint(low, low + 3)
    elif r < 0.35:
        n = rng.choice(EDGE_LENGTHS)
    elif r < 0.7:
        n = rng.randint(low, min(high, 200))
    else:
        n = rng.randint(low, high)
    return max(low, min(high, n))


def draw_sequence_length(rng: random.Random) -> int:
    """A packed sequence's length: empty and one-row sequences often (the API allows both)."""
    r = rng.random()
    if r < 0.1:
        return 0
    if r < 0.25:
        return 1
    return draw_length(rng)


def draw_heads(rng: random.Random) -> tuple[int, int]:
    """(nheads, nheads_k): MHA, GQA and MQA ratios, odd counts included."""
    heads_k = rng.choice([1, 1, 2, 2, 3, 4])
    group = rng.choice([1, 1, 2, 3, 4, 8])
    return heads_k * min(group, 16 // heads_k), heads_k


def draw_window(rng: random.Random, keys: int) -> Optional[list]:
    """None (no window_size argument) or [left, right]: -1, 0, short and long sides, and
    sides about as long as the keys, where flash-attn's 'at least seqlen_k is unbounded'
    rule starts."""
    if rng.random() < 0.7:
        return None

    def side():
        r = rng.random()
        if r < 0.3:
            return -1
        if r < 0.45:
            return 0
        if r < 0.75:
            return rng.randint(1, 64)
        if r < 0.9:
            return rng.randint(1, max(1, keys))
        return rng.choice([max(keys - 1, 0), keys, keys + 1, 2**31 - 1])

    return [side(), side()]


def draw_layout(rng: random.Random) -> str:
    """How a q/k/v argument lies in memory (see ``laid_out``). 'nonunit' and 'misaligned'
    break the kernels' stride and alignment rules: cudaflash refuses them at head dims with a
    kernel (ValueError) and copies them at padded ones, so they test both paths."""
    return weighted(rng, [("contiguous", 0.55), ("transposed", 0.15), ("head_slice", 0.08),
                          ("seq_slice", 0.08), ("dim_pad", 0.08), ("nonunit", 0.03),
                          ("misaligned", 0.03)])


def draw_common(rng: random.Random, case: dict, keys: int) -> None:
    """The options every function takes: mask, score modifiers, scale."""
    case["causal"] = rng.random() < 0.4
    case["window"] = draw_window(rng, keys)
    case["window_form"] = "list" if rng.random() < 0.15 else "tuple"  # flash-attn takes both
    case["softcap"] = rng.choice(SOFTCAPS) if rng.random() < 0.15 else 0.0
    case["alibi"] = weighted(rng, [(None, 0.84), ("heads", 0.08), ("batch_heads", 0.08)])
    case["scale"] = (round(case["d"] ** -0.5 * rng.uniform(0.3, 3.0), 5)
                     if rng.random() < 0.25 else None)


def draw_training(rng: random.Random, case: dict, can_backward: bool = True) -> None:
    """flash_attn_func's and flash_attn_varlen_func's dropout and gradient options."""
    case["dropout_p"] = rng.choice(DROPOUT_PS) if rng.random() < 0.12 else 0.0
    case["manual_seed"] = rng.randrange(2**31)
    case["backward"] = can_backward and rng.random() < 0.5
    case["deterministic"] = rng.random() < 0.3
    case["return_probs"] = rng.random() < 0.4
    case["dout"] = weighted(rng, [("randn", 0.85), ("transposed", 0.1), ("ones", 0.05)])


def score_budget(case: dict) -> int:
    if case.get("dropout_p"):
        return DROPOUT_SCORES
    return BACKWARD_SCORES if case.get("backward") else FORWARD_SCORES


def draw_func(rng: random.Random, case: dict) -> None:
    fn = weighted(rng, [("func", 0.8), ("qkvpacked", 0.1), ("kvpacked", 0.1)])
    case["fn"] = fn
    case["b"] = rng.randint(1, 4)
    case["h"], case["hk"] = draw_heads(rng)
    case["sq"] = draw_length(rng)
    case["sk"] = case["sq"] if rng.random() < 0.25 else draw_length(rng)
    if fn == "qkvpacked":  # one tensor: same lengths and heads
        case["sk"], case["hk"] = case["sq"], case["h"]
    draw_common(rng, case, case["sk"])
    draw_training(rng, case)
    case["layout_q"] = "packed" if fn == "qkvpacked" else draw_layout(rng)
    case["layout_kv"] = draw_layout(rng) if fn == "func" else "packed"
    budget = score_budget(case)
    while case["b"] * case["h"] * case["sq"] * case["sk"] > budget:
        if case["sq"] >= case["sk"]:
            case["sq"] = max(1, case["sq"] // 2)
        else:
            case["sk"] = max(1, case["sk"] // 2)
        if fn == "qkvpacked":
            case["sk"] = case["sq"] = min(case["sq"], case["sk"])


def draw_varlen(rng: random.Random, case: dict) -> None:
    fn = weighted(rng, [("varlen", 0.8), ("varlen_qkvpacked", 0.1), ("varlen_kvpacked", 0.1)])
    case["fn"] = fn
    nseq = rng.randint(1, 5)
    case["h"], case["hk"] = draw_heads(rng)
    if fn == "varlen_qkvpacked":
        case["hk"] = case["h"]
    same_lengths = fn == "varlen_qkvpacked" or rng.random() < 0.35
    lens_q = [draw_sequence_length(rng) for _ in range(nseq)]
    lens_k = list(lens_q) if same_lengths else [draw_sequence_length(rng) for _ in range(nseq)]
    case["paged"] = fn == "varlen" and rng.random() < 0.15
    draw_common(rng, case, max(lens_k))
    draw_training(rng, case, can_backward=not case["paged"])  # paged varlen: forward only
    # Rows before the first sequence and after the last (cu_seqlens need not start at 0 nor
    # end at the total), and maxima above the longest sequence: all valid, all trusted.
    case["lead_q"] = rng.randint(1, 5) if rng.random() < 0.1 else 0
    case["spare_q"] = rng.randint(1, 3) if rng.random() < 0.2 else 0
    case["slack_q"] = rng.randint(1, 40) if rng.random() < 0.2 else 0
    if fn == "varlen_qkvpacked":  # one tensor, one set of offsets and maxima
        case["lead_k"], case["spare_k"], case["slack_k"] = (case["lead_q"], case["spare_q"],
                                                            case["slack_q"])
    else:
        case["lead_k"] = rng.randint(1, 5) if rng.random() < 0.1 and not case["paged"] else 0
        case["spare_k"] = rng.randint(1, 3) if rng.random() < 0.2 and not case["paged"] else 0
        case["slack_k"] = rng.randint(1, 40) if rng.random() < 0.2 else 0
    budget = score_budget(case)
    while case["h"] * sum(a * b for a, b in zip(lens_q, lens_k)) > budget:
        lens_q = [n // 2 if n > 1 else n for n in lens_q]
        lens_k = list(lens_q) if same_lengths else [n // 2 if n > 1 else n for n in lens_k]
    case["lens_q"], case["lens_k"] = lens_q, lens_k
    if case["paged"]:
        case["page"] = rng.choice(PAGE_SIZES)
        case["blocks"] = max(1, -(-max(lens_k) // case["page"])) + rng.randint(0, 1)
        case["extra_pages"] = rng.randint(0, 3)
    case["layout_q"] = "packed" if fn == "varlen_qkvpacked" else draw_layout(rng)
    case["layout_kv"] = ("packed" if fn != "varlen" else
                         "contiguous" if case["paged"] else draw_layout(rng))


def draw_kvcache(rng: random.Random, case: dict) -> None:
    case["fn"] = "kvcache"
    b = case["b"] = rng.randint(1, 4)
    case["h"], case["hk"] = draw_heads(rng)
    r = rng.random()
    case["sq"] = 1 if r < 0.5 else rng.randint(2, 16) if r < 0.85 else draw_length(rng, 2, 300)
    case["paged"] = rng.random() < 0.35
    if case["paged"]:
        case["page"] = rng.choice(PAGE_SIZES)
        case["blocks"] = rng.randint(1, max(1, 768 // case["page"]))
        case["extra_pages"] = rng.randint(0, 3)
        capacity = case["blocks"] * case["page"]
    else:
        capacity = case["sc"] = draw_length(rng)
    while b * case["h"] * case["sq"] * capacity > FORWARD_SCORES and case["sq"] > 1:
        case["sq"] //= 2
    draw_common(rng, case, capacity)
    new = 0
    if rng.random() < 0.5:
        new = min(capacity, rng.choice([1, 1, 2, 3, 4, 7, 16, rng.randint(1, 64)]))
    case["new"] = new
    kinds = [("tensor", 0.75), ("int", 0.25)] if new else [("tensor", 0.6), ("int", 0.2),
                                                          ("none", 0.2)]
    kind = case["seqlens_kind"] = weighted(rng, kinds)
    room = capacity - new  # the largest length that still fits the append

    def length():
        r = rng.random()
        return 0 if r < 0.1 else room if r < 0.25 else rng.randint(0, room)

    if kind == "none":
        lens = [capacity] * b
    elif kind == "int":
        lens = [length()] * b
    else:
        lens = [length() for _ in range(b)]
    case["lens"] = lens
    case["batch_idx"] = None
    case["leftpad"] = None
    if not case["paged"]:  # flash-attn takes neither with block_table
        if rng.random() < 0.25:
            entries = b + rng.randint(0, 3)
            # Appending sequences must own their entries; reading ones may share.
            case["batch_idx"] = (rng.sample(range(entries), b) if new else
                                 [rng.randrange(entries) for _ in range(b)])
            case["entries"] = entries
        if rng.random() < 0.2:
            case["leftpad"] = [rng.randint(0, n) for n in lens]
    case["rotary"] = None
    if case["d"] >= 2 and rng.random() < 0.3:
        d = case["d"]
        dims = [d - d % 2, 2 * rng.randint(1, d // 2)] + [x for x in (16, 32, 64, 128) if x <= d]
        # seqlen_ro covers every position a query or new key is rotated at (the API needs
        # only seqlen_ro >= the cache's; beyond it cudaflash clamps, flash-attn does not).
        case["rotary"] = {"dim": rng.choice(dims), "interleaved": rng.random() < 0.5,
                          "seqlen_ro": capacity + case["sq"] + rng.randint(0, 8)}
    # Pages no sequence reaches may hold garbage indices (flash-attn's tables pad them).
    case["table_garbage"] = case["paged"] and kind != "none" and rng.random() < 0.3
    case["num_splits"] = 0 if rng.random() < 0.7 else rng.randint(1, 8)
    case["return_lse"] = rng.random() < 0.5
    case["layout_q"] = weighted(rng, [("contiguous", 0.7), ("transposed", 0.2),
                                      ("head_slice", 0.1)])
    case["layout_cache"] = ("contiguous" if case["paged"] else
                            weighted(rng, [("contiguous", 0.7), ("seq_prefix", 0.15),
                                           ("head_slice", 0.15)]))
    case["layout_new"] = weighted(rng, [("contiguous", 0.6), ("transposed", 0.2),
                                        ("nonunit", 0.2)])


def draw_case(seed: int, index: int) -> dict:
    """Case ``index`` of the run with ``seed``: a JSON-able dict of everything the call and
    its inputs depend on (a string seed: Python hashes it with sha512, the same on every
    machine and run)."""
    rng = random.Random(f"cudaflash-fuzz:{seed}:{index}")
    case = {"seed": seed, "index": index, "dtype": rng.choice(sorted(DTYPES)),
            "d": (rng.choice(BUILT_HEAD_DIMS) if rng.random() < 0.6
                  else rng.choice(PADDED_HEAD_DIMS))}
    family = weighted(rng, [("func", 0.36), ("varlen", 0.28), ("kvcache", 0.36)])
    {"func": draw_func, "varlen": draw_varlen, "kvcache": draw_kvcache}[family](rng, case)
    case["recheck"] = rng.random() < 0.2
    case["tensor_seed"] = rng.getrandbits(48)
    return case


def case_scores(case: dict) -> int:
    """The case's attention scores (its work, roughly)."""
    if case["fn"].startswith("varlen"):
        return case["h"] * sum(a * b for a, b in zip(case["lens_q"], case["lens_k"]))
    if case["fn"] == "kvcache":
        capacity = case["blocks"] * case["page"] if case["paged"] else case["sc"]
        return case["b"] * case["h"] * case["sq"] * capacity
    return case["b"] * case["h"] * case["sq"] * case["sk"]


# ---- inputs -----------------------------------------------------------------------------------


class TensorSource:
    """A case's random tensors, drawn on the CPU from its tensor_seed (the same values on any
    device) in the order the case builds them."""

    def __init__(self, seed: int, device, dtype):
        self.gen = torch.Generator().manual_seed(seed)
        self.device, self.dtype = device, dtype

    def randn(self, *shape, dtype=None):
        return torch.randn(shape, generator=self.gen).to(self.device, dtype or self.dtype)

    def rand(self, *shape):
        return torch.rand(shape, generator=self.gen).to(self.device)

    def randperm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.gen)

    def laid_out(self, shape, layout: str) -> "Laid":
        alloc, view_of = layout_of(tuple(shape), layout)
        return Laid(self.randn(*alloc), view_of)


def layout_of(shape: tuple, layout: str) -> tuple[tuple, Callable]:
    """(the shape to allocate, the view of it that has ``shape``) for a (..., seqlen, heads,
    headdim) tensor laid out as ``layout`` says."""
    *lead, s, h, d = shape
    lead = tuple(lead)
    if layout == "contiguous":
        return shape, lambda t: t
    if layout == "transposed":  # (..., heads, seqlen, headdim) memory, as BHSD models keep it
        return lead + (h, s, d), lambda t: t.transpose(-3, -2)
    if layout == "head_slice":  # some heads of a wider tensor
        return lead + (s, h + 2, d), lambda t: t[..., 1:h + 1, :]
    if layout == "seq_slice":  # rows in the middle of a longer buffer
        return lead + (s + 3, h, d), lambda t: t[..., 2:s + 2, :, :]
    if layout == "seq_prefix":  # a cache that is the front of a longer buffer
        return lead + (s + 5, h, d), lambda t: t[..., :s, :, :]
    if layout == "dim_pad":  # rows padded past the head dim
        return lead + (s, h, d + 8), lambda t: t[..., :d]
    if layout == "nonunit":  # head dim not contiguous
        return lead + (s, d, h), lambda t: t.transpose(-1, -2)
    if layout == "misaligned":  # data 2 bytes off a 16-byte boundary
        return (math.prod(shape) + 1,), lambda t: t[1:].view(shape)
    raise ValueError(f"unknown layout {layout!r}")


@dataclass
class Laid:
    """A tensor argument: ``base`` is what was allocated (the leaf that gets gradients),
    ``view_of(base)`` the argument."""

    base: torch.Tensor
    view_of: Callable

    @property
    def view(self) -> torch.Tensor:
        return self.view_of(self.base)

    def grad(self, what: str) -> torch.Tensor:
        """The gradient of the argument, after checking that none reached the base outside
        the view."""
        fail_unless(self.base.grad is not None, f"{what}: no gradient reached the input")
        inside = torch.zeros(self.base.shape, dtype=torch.bool, device=self.base.device)
        self.view_of(inside).fill_(True)
        fail_unless(not self.base.grad[~inside].any(),
                    f"{what}: a gradient reached memory outside the argument's view")
        return self.view_of(self.base.grad)


def int32(values, device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def offsets(lengths, start: int = 0) -> list:
    out = [start]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def make_slopes(src: TensorSource, case: dict, batch: int) -> Optional[torch.Tensor]:
    """ALiBi slopes: random ones in [0.1, 0.6) (the bias then matters over a few hundred
    keys) or the ALiBi paper's 2**(-8 (h + 1) / nheads)."""
    h = case["h"]
    if case["alibi"] is None:
        return None
    if case["alibi"] == "batch_heads":
        return src.rand(batch, h) * 0.5 + 0.1
    if src.rand(1).item() < 0.5:
        return src.rand(h) * 0.5 + 0.1
    return torch.tensor([2.0 ** (-8 * (i + 1) / h) for i in range(h)], device=src.device)


def make_dout(src: TensorSource, case: dict, shape: tuple) -> torch.Tensor:
    """The gradient of out: random, random in a transposed layout, or all ones as
    out.sum().backward() hands it (an expanded tensor, all strides 0)."""
    if case["dout"] == "ones":
        return torch.ones((), dtype=src.dtype, device=src.device).expand(shape)
    layout = "transposed" if case["dout"] == "transposed" else "contiguous"
    return src.laid_out(shape, layout).view


# ---- the reference ----------------------------------------------------------------------------


@dataclass
class Semantics:
    """What a call computes, besides its tensors."""

    scale: float
    window: tuple  # (left, right) as flash-attn masks: flash_window's
    softcap: float
    slopes: Optional[torch.Tensor]  # (nheads,) or (batch, nheads) float32, or None
    dropout_p: float  # kept weights are scaled by 1 / (1 - dropout_p)

    def entry(self, b: int) -> "Semantics":
        """The semantics of batch entry (or packed sequence) b as a batch of one."""
        if self.slopes is None or self.slopes.dim() == 1:
            return self
        return Semantics(self.scale, self.window, self.softcap, self.slopes[b],
                         self.dropout_p)


def flash_window(window, keys: int, causal: bool) -> tuple[int, int]:
    """flash-attn's window_size as its kernels mask by it: a side at least ``keys`` long (the
    keys as flash-attn counts them for the call) is unbounded (-1); causal is right = 0."""
    left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    left = -1 if left >= keys else left
    right = -1 if right >= keys else right
    return left, (0 if causal else right)


def visible_keys(seqlen_q: int, seqlen_k: int, window: tuple, device) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool: query i sees key j when i + seqlen_k - seqlen_q - left <= j
    <= i + seqlen_k - seqlen_q + right (a side -1: unbounded), bottom-right aligned."""
    left, right = window
    row = torch.arange(seqlen_q, device=device)[:, None] + (seqlen_k - seqlen_q)
    col = torch.arange(seqlen_k, device=device)[None, :]
    seen = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if right >= 0:
        seen &= col <= row + right
    if left >= 0:
        seen &= col >= row - left
    return seen


def capped_scores(q, k, sem: Semantics, compute) -> torch.Tensor:
    """(batch, nheads, seqlen_q, seqlen_k) in ``compute``: q k^T scaled, then capped
    (softcap * tanh(s / softcap)) if the call caps. Differentiable."""
    groups = q.shape[2] // k.shape[2]  # GQA: query head h reads K/V head h // groups
    kc = k.to(compute).repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.to(compute), kc) * sem.scale
    if sem.softcap:
        scores = sem.softcap * torch.tanh(scores / sem.softcap)
    return scores


def masked_scores(q, k, sem: Semantics, compute, capped=None) -> torch.Tensor:
    """The scores softmax takes: ``capped`` (default capped_scores'), ALiBi's bias added in
    float32 after the cap as flash-attn's tests add it, -inf where hidden. Differentiable."""
    scores = capped_scores(q, k, sem, compute) if capped is None else capped
    batch, seqlen_q, heads, _ = q.shape
    if sem.slopes is not None:
        flash_reference.check_alibi_slopes(sem.slopes, batch, heads)
        scores = scores + flash_reference.alibi_bias(sem.slopes, batch, heads, seqlen_q,
                                                     k.shape[1]).to(scores.device)
    seen = visible_keys(seqlen_q, k.shape[1], sem.window, q.device)
    return scores.masked_fill(~seen, -math.inf)


def reference_probs(scores) -> torch.Tensor:
    """softmax over the last dim of masked float32 scores, 0 on rows that see no key (not
    NaN), without gradients: the weights the allowances below scale by."""
    with torch.no_grad():
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        return torch.where(torch.isneginf(lse), 0.0, torch.exp(scores - lse))


def attention_reference(q, k, v, sem: Semantics, keep=None, upcast=True):
    """(out, lse) of flash-attn's attention: q (batch, seqlen_q, nheads, d), k and v (batch,
    seqlen_k, nheads_k, d). The math in float32 (upcast) or in q's dtype, FlashAttention's
    tests' two references; ALiBi's bias added in float32 after the cap, as theirs; ``keep``
    a (batch, nheads, seqlen_q, seqlen_k) bool dropout mask or None. out float32 (upcast) or
    q's dtype; lse float32 (batch, nheads, seqlen_q), -inf on rows that see no key, whose out
    is 0. Differentiable."""
    compute = torch.float32 if upcast else q.dtype
    vc = v.to(compute).repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    scores = masked_scores(q, k, sem, compute)
    lse = torch.logsumexp(scores.float(), dim=-1)
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(torch.isneginf(lse)[..., None], 0.0, probs)  # no key: 0, not NaN
    if keep is not None:
        probs = probs * keep / (1.0 - sem.dropout_p)
    return torch.einsum("bhqk,bkhd->bqhd", probs.to(vc.dtype), vc), lse


def reference_gradients(q, k, v, dout, sem: Semantics, keep, upcast: bool) -> list:
    """(dq, dk, dv) of attention_reference by autograd: float32 leaves for the float32 math,
    so its gradients are not rounded to the input dtype; q's dtype for the other."""
    leaves = [t.detach().to(torch.float32 if upcast else t.dtype).requires_grad_()
              for t in (q, k, v)]
    out, _ = attention_reference(*leaves, sem, keep, upcast)
    out.backward(dout.float() if upcast else dout)
    return [t.grad for t in leaves]


def keep_mask(seed: int, p: float, batch: int, heads: int, entry: int, seqlen_q: int,
              seqlen_k: int, device) -> Optional[torch.Tensor]:
    """(1, heads, seqlen_q, seqlen_k) bool: the weights batch entry (or packed sequence)
    ``entry`` of a dropout call keeps, from the kernels' random bytes rebuilt on the host;
    None where p rounds to no dropout (the kernels then drop nothing and scale nothing)."""
    cut = dropout_threshold(p)
    if cut == 0:
        return None
    if seqlen_q == 0 or seqlen_k == 0:
        return torch.ones(1, heads, seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    rows, cols = np.arange(seqlen_q)[:, None], np.arange(seqlen_k)[None, :]
    masks = [random8(seed, batch, heads, entry, h, rows, cols) >= cut for h in range(heads)]
    return torch.from_numpy(np.stack(masks)[None]).to(device)


def dropout_seed_after(manual_seed: int, device) -> int:
    """The seed a dropout call draws after torch.manual_seed(manual_seed): its first random
    op is one torch.randint on q's device (cudaflash/_dropout.py), so the same draw here
    gives the number (tests/test_gpu_dropout.py's seed_after)."""
    torch.manual_seed(manual_seed)
    return int(torch.randint(0, SEED_HIGH, (1,), dtype=torch.int64, device=device).item())


def rotate_reference(x, cos, sin, positions, interleaved: bool):
    """x (batch, seqlen, heads, d) with its first rotary_dim columns turned by the angles at
    ``positions`` (batch, seqlen): complex products in float32, rounded to x's dtype. Pairs
    (2i, 2i + 1) when interleaved (GPT-J), else (i, i + rotary_dim / 2) (GPT-NeoX)."""
    half = cos.shape[1]
    turn = torch.complex(cos.float()[positions], sin.float()[positions])[:, :, None, :]
    part = x[..., :2 * half].float()
    if interleaved:
        turned = torch.view_as_real(
            torch.view_as_complex(part.unflatten(-1, (half, 2)).contiguous()) * turn)
        turned = turned.flatten(-2)
    else:
        z = torch.complex(part[..., :half], part[..., half:]) * turn
        turned = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((turned.to(x.dtype), x[..., 2 * half:]), dim=-1)


# ---- checks -----------------------------------------------------------------------------------


def assert_within(what: str, ours, ref, lowp, atol: float = 1e-5, extra=None,
                  extra_name: str = "stored out") -> None:
    """FlashAttention's accuracy rule (tests/test_gpu_correctness.py): ours' error against the
    float32 reference at most twice the low-precision math's, plus one rounding step of the
    stored type (a tiny problem's lowp can land within half an ulp by luck), plus atol, plus
    twice ``extra``'s largest: what the kernels' design moves the value by where the rule's
    references do not share it (stored_out_error for gradients, approx_tanh_error for a
    capped forward)."""
    if ref.numel() == 0:
        return
    err = (ours.float() - ref.float()).abs().max().item()
    rounding = (ref.to(ours.dtype).float() - ref.float()).abs().max().item()
    base = (lowp.float() - ref.float()).abs().max().item()
    moved = 0.0 if extra is None else float(extra.abs().max())
    bound = 2 * base + 2 * rounding + 2 * moved + atol
    fail_unless(err <= bound, f"{what}: max|ours - fp32 ref| = {err:.4g} > {bound:.4g} = 2 * "
                              f"{base:.4g} (low-precision torch's error) + 2 * {rounding:.3g} "
                              f"(rounding) + 2 * {moved:.3g} ({extra_name}) + {atol:g}")


def check_attention(what: str, out, lse, q, k, v, sem: Semantics, keep=None) -> None:
    """One padded problem's out (batch, seqlen_q, nheads, d) and lse (batch, nheads,
    seqlen_q) or None, against both references."""
    with torch.no_grad():
        ref, ref_lse = attention_reference(q, k, v, sem, keep, upcast=True)
        low, low_lse = attention_reference(q, k, v, sem, keep, upcast=False)
    fail_unless(tuple(out.shape) == tuple(q.shape) and out.dtype == q.dtype,
                f"{what}out is {out.dtype} {tuple(out.shape)}, expected {q.dtype} "
                f"{tuple(q.shape)}")
    bad = (~torch.isfinite(out)).sum().item()
    fail_unless(bad == 0, f"{what}out has {bad} NaN/Inf elements (finite inputs)")
    tanh_out, tanh_lse = approx_tanh_error(q, k, v, ref, sem, keep)
    assert_within(f"{what}out", out, ref, low, 1e-3 if keep is not None else 1e-5,
                  extra=tanh_out, extra_name="tanh.approx")
    no_key = torch.isneginf(ref_lse)  # (batch, nheads, seqlen_q)
    fail_unless((out.transpose(1, 2)[no_key] == 0).all(),
                f"{what}rows that see no key must give out = 0")
    if lse is None:
        return
    fail_unless(tuple(lse.shape) == tuple(ref_lse.shape) and lse.dtype == torch.float32,
                f"{what}lse is {lse.dtype} {tuple(lse.shape)}, expected float32 "
                f"{tuple(ref_lse.shape)}")
    fail_unless(not (torch.isnan(lse) | torch.isposinf(lse)).any(), f"{what}lse has NaN/+inf")
    fail_unless(torch.equal(torch.isneginf(lse), no_key),
                f"{what}lse must be -inf exactly on the rows that see no key")
    assert_within(f"{what}lse", lse[~no_key], ref_lse[~no_key], low_lse[~no_key],
                  extra=None if tanh_lse is None else tanh_lse[~no_key], extra_name="tanh.approx")


# tanh.approx.f32's largest relative error (PTX ISA): the cap's tanh in cudaflash's kernels, as
# in flash-attn's (cutlass::fast_tanh).
TANH_APPROX_ERROR = 2.0 ** -10.9


def approx_tanh_error(q, k, v, out, sem: Semantics, keep):
    """(out's, lse's) bound on what an approximate tanh in the cap moves them by, or (None,
    None) without a cap: each capped score c_ij may be off by |c_ij| TANH_APPROX_ERROR, which
    moves out_i by sum_j P_ij d_ij (Z_ij v_j - out_i) (Z: dropout's keep / (1 - p)) and lse_i by
    sum_j P_ij d_ij. Neither reference has it: both take torch's exact tanh. ``out``: the
    float32 reference's."""
    if not sem.softcap:
        return None, None
    with torch.no_grad():
        capped = capped_scores(q, k, sem, torch.float32)
        probs = reference_probs(masked_scores(q, k, sem, torch.float32, capped))
        weights = probs * capped.abs() * TANH_APPROX_ERROR  # (b, h, sq, sk)
        vf = v.float().repeat_interleave(q.shape[2] // k.shape[2], dim=2)  # (b, sk, h, d)
        drop = keep / (1.0 - sem.dropout_p) if keep is not None else 1.0
        # sum_j w_ij |Z_ij v_jd - out_id| <= sum_j w_ij Z_ij |v_jd| + |out_id| sum_j w_ij
        spread = (torch.einsum("bhqk,bkhd->bqhd", weights * drop, vf.abs())
                  + out.abs() * weights.sum(-1).transpose(1, 2)[..., None])
        return spread, weights.sum(-1)


def stored_out_error(q, k, v, dout, sem: Semantics, keep) -> list:
    """(dq, dk, None): how far FlashAttention's backward moves dq and dk from the exact math by
    design. It takes D_i = sum_d dout_id * out_id from the out the forward stored, rounded to
    q's dtype, and dS_ij = P_ij * (dP_ij - D_i); autograd's softmax backward has the exact D.
    The difference dD_i = sum_d dout_id * (stored - exact)_id enters dS as -P_ij * dD_i, that
    is the gradient of -sum_i dD_i * lse_i (d lse_i / d s_ij = P_ij), through the cap and the
    scale to q and k. It is small unless dS cancels to about 0, where both references are
    exact and the rule would ask the kernel for exactness too: a sequence of one key (P = 1,
    dS = 0), or a row whose every weight is one value's."""
    leaves = [t.detach().float().requires_grad_() for t in (q, k)]
    out, lse = attention_reference(leaves[0], leaves[1], v.detach().float(), sem, keep)
    moved = (dout.float() * (out.detach().to(q.dtype).float() - out.detach())).sum(-1)
    seen = ~torch.isneginf(lse.detach())  # a row without keys has out = 0 and no gradient
    moved = torch.where(seen, moved.transpose(1, 2), 0.0)
    safe_lse = torch.where(seen, lse, 0.0)
    dq, dk = torch.autograd.grad(-(moved * safe_lse).sum(), leaves, allow_unused=True)
    # D and dP are float32 sums over d in different orders, so dS keeps their rounding where
    # it cancels: about 2^-24 sqrt(d) |dout_i * out_i| a row (dP's too, scaled by dropout's
    # 1 / (1 - p)), summed in quadrature over the keys (dq) or rows (dk), four times over.
    groups = q.shape[2] // k.shape[2]
    with torch.no_grad():
        probs = reference_probs(masked_scores(q, k, sem, torch.float32))
        grow = 1.0 + (1.0 / (1.0 - sem.dropout_p) if keep is not None else 1.0)
        row = (2.0 ** -24 * math.sqrt(q.shape[-1]) * grow
               * (dout.float() * out.detach()).norm(dim=-1).transpose(1, 2))  # (b, h, sq)
        weight = (probs * row[..., None]) ** 2  # (b, h, sq, sk)
        kf, qf = k.float().repeat_interleave(groups, dim=2), q.float()
        dq_sum = torch.einsum("bhqk,bkhd->bqhd", weight, kf ** 2).sqrt() * sem.scale
        dk_sum = torch.einsum("bhqk,bqhd->bkhd", weight, qf ** 2)
        dk_sum = dk_sum.unflatten(2, (k.shape[2], groups)).sum(3).sqrt() * sem.scale
    return [dq.abs() + 4 * dq_sum, dk.abs() + 4 * dk_sum, None]


def check_gradients(what: str, grads, q, k, v, dout, sem: Semantics, keep=None) -> None:
    ref = reference_gradients(q, k, v, dout, sem, keep, upcast=True)
    low = reference_gradients(q, k, v, dout, sem, keep, upcast=False)
    stored = stored_out_error(q, k, v, dout, sem, keep)
    for name, ours, r, lp, t, st in zip(("dq", "dk", "dv"), grads, ref, low, (q, k, v), stored):
        fail_unless(tuple(ours.shape) == tuple(t.shape) and ours.dtype == t.dtype,
                    f"{what}{name} is {ours.dtype} {tuple(ours.shape)}, expected {t.dtype} "
                    f"{tuple(t.shape)}")
        bad = (~torch.isfinite(ours)).sum().item()
        fail_unless(bad == 0, f"{what}{name} has {bad} NaN/Inf elements")
        assert_within(f"{what}{name}", ours, r, lp, extra=st)


def check_s_dmask_shape(what: str, probs, shape) -> None:
    fail_unless(probs is not None and tuple(probs.shape) == tuple(shape),
                f"{what}S_dmask is {None if probs is None else tuple(probs.shape)}, expected "
                f"{tuple(shape)}")


def check_s_dmask_signs(what: str, block, keep) -> None:
    """S_dmask, flash-attn's probabilities negated where dropped: its signs must be the keep
    mask wherever it is not 0 (0: a hidden or underflowed score)."""
    if keep is None:  # nothing dropped
        fail_unless((block >= 0).all(), f"{what}S_dmask has dropped weights, p drops none")
        return
    shown = block != 0
    fail_unless(torch.equal((block > 0)[shown], keep.to(block.device)[shown]),
                f"{what}S_dmask's signs differ from the keep mask rebuilt from the seed")


def check_same_bits(what: str, first, again) -> None:
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, again):
        if a is None and b is None:
            continue
        fail_unless(a is not None and b is not None and torch.equal(a, b),
                    f"{what}: a repeat of the call (fresh copies of the same inputs) gave "
                    f"another {name}")


def split_result(result, with_extras: bool, count: int):
    """(out, *extras) of a call that returns out alone unless asked for more."""
    if not with_extras:
        return (result,) + (None,) * (count - 1)
    fail_unless(isinstance(result, tuple) and len(result) == count,
                f"expected a tuple of {count}, got {type(result).__name__}")
    return result


def forward_call(function, *args, **kwargs):
    """The API call: a clean refusal here is a rejection, not a failure."""
    try:
        return function(*args, **kwargs)
    except REJECTION_TYPES as e:
        raise Rejection(e) from e


def options(case: dict, slopes) -> dict:
    """The keyword arguments all functions share, given only where they differ from the
    defaults (so the defaults' own fast paths run too)."""
    kwargs = {}
    if case["scale"] is not None:
        kwargs["softmax_scale"] = case["scale"]
    if case["causal"]:
        kwargs["causal"] = True
    if case["window"] is not None:
        w = case["window"]
        kwargs["window_size"] = list(w) if case["window_form"] == "list" else tuple(w)
    if case["softcap"]:
        kwargs["softcap"] = case["softcap"]
    if slopes is not None:
        kwargs["alibi_slopes"] = slopes
    return kwargs


def training_options(case: dict) -> dict:
    kwargs = {}
    if case["dropout_p"]:
        kwargs["dropout_p"] = case["dropout_p"]
    if case["deterministic"]:
        kwargs["deterministic"] = True
    if case["return_probs"]:
        kwargs["return_attn_probs"] = True
    return kwargs


def semantics(case: dict, keys_counted: int, slopes) -> Semantics:
    scale = case["d"] ** -0.5 if case["scale"] is None else case["scale"]
    return Semantics(scale, flash_window(case["window"], keys_counted, case["causal"]),
                     case["softcap"], slopes, case.get("dropout_p", 0.0))


# ---- flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func ---------------------


def func_inputs(case: dict, device) -> SimpleNamespace:
    src = TensorSource(case["tensor_seed"], device, DTYPES[case["dtype"]])
    b, sq, sk, h, hk, d = (case[x] for x in ("b", "sq", "sk", "h", "hk", "d"))
    ins = SimpleNamespace(laid={})
    if case["fn"] == "qkvpacked":
        ins.laid["qkv"] = Laid(src.randn(b, sq, 3, h, d), lambda t: t)
    else:
        ins.laid["q"] = src.laid_out((b, sq, h, d), case["layout_q"])
        if case["fn"] == "kvpacked":
            ins.laid["kv"] = Laid(src.randn(b, sk, 2, hk, d), lambda t: t)
        else:
            ins.laid["k"] = src.laid_out((b, sk, hk, d), case["layout_kv"])
            ins.laid["v"] = src.laid_out((b, sk, hk, d), case["layout_kv"])
    return finish_inputs(ins, src, case, b, (b, sq, h, d))


def finish_inputs(ins: SimpleNamespace, src, case: dict, batch: int,
                  q_shape: tuple) -> SimpleNamespace:
    """The slopes, dout and leaves' requires_grad every training call's inputs share."""
    ins.slopes = make_slopes(src, case, batch)
    ins.dout = make_dout(src, case, q_shape) if case["backward"] else None
    if case["backward"]:
        for laid in ins.laid.values():
            laid.base.requires_grad_()
    return ins


def call_tensors(case: dict, laid: dict, grads: bool = False) -> tuple:
    """(q, k, v) of a flash_attn_func or flash_attn_varlen_func call (packed forms included):
    its arguments' views, or with ``grads`` their gradients."""
    def of(name):
        return laid[name].grad(f"d{name}: ") if grads else laid[name].view

    pack_dim = 1 if case["fn"].startswith("varlen") else 2  # (the 3 or 2 of q, k, v)
    if case["fn"].endswith("qkvpacked"):
        return tuple(of("qkv").unbind(pack_dim))
    if case["fn"].endswith("kvpacked"):
        return (of("q"), *of("kv").unbind(pack_dim))
    return of("q"), of("k"), of("v")


def func_call(api, case: dict, ins: SimpleNamespace):
    kwargs = {**options(case, ins.slopes), **training_options(case)}
    if case["dropout_p"]:
        torch.manual_seed(case["manual_seed"])
    laid = ins.laid
    if case["fn"] == "qkvpacked":
        return forward_call(api.flash_attn_qkvpacked_func, laid["qkv"].view, **kwargs)
    if case["fn"] == "kvpacked":
        return forward_call(api.flash_attn_kvpacked_func, laid["q"].view, laid["kv"].view,
                            **kwargs)
    return forward_call(api.flash_attn_func, laid["q"].view, laid["k"].view, laid["v"].view,
                        **kwargs)


def func_run(api, case: dict, device) -> tuple:
    """One call with gradients if the case asks: (out, lse, dq, dk, dv), checked."""
    ins = func_inputs(case, device)
    q, k, v = (t.detach().contiguous() for t in call_tensors(case, ins.laid))
    seed = dropout_seed_after(case["manual_seed"], device) if case["dropout_p"] else None
    out, lse, probs = split_result(func_call(api, case, ins), case["return_probs"], 3)
    b, sq, sk, h = (case[x] for x in ("b", "sq", "sk", "h"))
    sem = semantics(case, sk, ins.slopes)
    keep = None
    if seed is not None:
        masks = [keep_mask(seed, case["dropout_p"], b, h, e, sq, sk, device) for e in range(b)]
        keep = None if masks[0] is None else torch.cat(masks)
    check_attention("", out.detach(), lse, q, k, v, sem, keep)
    if case["return_probs"]:
        if case["dropout_p"]:
            check_s_dmask_shape("", probs, (b, h, sq, sk))
            check_s_dmask_signs("", probs, keep)
        else:
            fail_unless(probs is None, "return_attn_probs without dropout: S_dmask must be None")
    grads = (None, None, None)
    if case["backward"]:
        fail_unless(out.grad_fn is not None, "inputs require grad but out has no grad_fn")
        out.backward(ins.dout)
        grads = call_tensors(case, ins.laid, grads=True)
        check_gradients("", grads, q, k, v, ins.dout, sem, keep)
    return (out.detach(), lse, *grads)


def run_func(api, case: dict, device) -> None:
    first = func_run(api, case, device)
    if case["recheck"]:
        again = repeat(func_run, api, case, device)
        check_same_bits("repeat", first[:2] + (first[2:] if case["deterministic"] else ()),
                        again[:2] + (again[2:] if case["deterministic"] else ()))


def repeat(run, api, case, device):
    """The call again on fresh copies of the same inputs (it takes the plans the first call
    recorded); a refusal now, after the same call ran, is a failure."""
    try:
        return run(api, case, device)
    except Rejection as r:
        raise CaseFailure(f"the repeat call was refused after the first ran: "
                          f"{type(r.error).__name__}: {r.error}") from None


# ---- flash_attn_varlen_func and its packed and paged forms ------------------------------------


def varlen_inputs(case: dict, device) -> SimpleNamespace:
    src = TensorSource(case["tensor_seed"], device, DTYPES[case["dtype"]])
    h, hk, d = case["h"], case["hk"], case["d"]
    cu_q = offsets(case["lens_q"], case["lead_q"])
    cu_k = offsets(case["lens_k"], case["lead_k"])
    total_q, total_k = cu_q[-1] + case["spare_q"], cu_k[-1] + case["spare_k"]
    ins = SimpleNamespace(laid={}, cu_q=cu_q, cu_k=cu_k, total_q=total_q, table=None)
    if case["fn"] == "varlen_qkvpacked":
        ins.laid["qkv"] = Laid(src.randn(total_q, 3, h, d), lambda t: t)
    else:
        ins.laid["q"] = src.laid_out((total_q, h, d), case["layout_q"])
        if case["fn"] == "varlen_kvpacked":
            ins.laid["kv"] = Laid(src.randn(total_k, 2, hk, d), lambda t: t)
        elif case["paged"]:
            n_pages = len(case["lens_k"]) * case["blocks"] + case["extra_pages"]
            ins.laid["k"] = Laid(src.randn(n_pages, case["page"], hk, d), lambda t: t)
            ins.laid["v"] = Laid(src.randn(n_pages, case["page"], hk, d), lambda t: t)
            order = src.randperm(n_pages)[:len(case["lens_k"]) * case["blocks"]]
            ins.table = order.view(len(case["lens_k"]), case["blocks"]).to(torch.int32)
            ins.table = ins.table.to(device)
        else:
            ins.laid["k"] = src.laid_out((total_k, hk, d), case["layout_kv"])
            ins.laid["v"] = src.laid_out((total_k, hk, d), case["layout_kv"])
    return finish_inputs(ins, src, case, len(case["lens_q"]), (total_q, h, d))


def varlen_maxima(case: dict) -> tuple[int, int]:
    return (max(case["lens_q"]) + case["slack_q"], max(case["lens_k"]) + case["slack_k"])


def varlen_call(api, case: dict, ins: SimpleNamespace):
    device = ins.laid["qkv" if "qkv" in ins.laid else "q"].base.device
    cu_q, cu_k = int32(ins.cu_q, device), int32(ins.cu_k, device)
    max_q, max_k = varlen_maxima(case)
    kwargs = {**options(case, ins.slopes), **training_options(case)}
    if ins.table is not None:
        kwargs["block_table"] = ins.table
    if case["dropout_p"]:
        torch.manual_seed(case["manual_seed"])
    laid = ins.laid
    if case["fn"] == "varlen_qkvpacked":
        return forward_call(api.flash_attn_varlen_qkvpacked_func, laid["qkv"].view, cu_q, max_q,
                            **kwargs)
    if case["fn"] == "varlen_kvpacked":
        return forward_call(api.flash_attn_varlen_kvpacked_func, laid["q"].view, laid["kv"].view,
                            cu_q, cu_k, max_q, max_k, **kwargs)
    return forward_call(api.flash_attn_varlen_func, laid["q"].view, laid["k"].view,
                        laid["v"].view, cu_q, cu_k, max_q, max_k, **kwargs)


def paged_keys(pool, table, b: int, length: int) -> torch.Tensor:
    """Keys 0 .. length - 1 of sequence b of a paged pool (num_blocks, page, heads, d)."""
    pos = torch.arange(length, device=pool.device)
    page = pool.shape[1]
    return pool[table[b].long()[pos // page], pos % page]


def varlen_run(api, case: dict, device) -> tuple:
    ins = varlen_inputs(case, device)
    q, k, v = (t.detach() for t in call_tensors(case, ins.laid))
    seed = dropout_seed_after(case["manual_seed"], device) if case["dropout_p"] else None
    out, lse, probs = split_result(varlen_call(api, case, ins), case["return_probs"], 3)
    nseq, h = len(case["lens_q"]), case["h"]
    max_q, max_k = varlen_maxima(case)
    sem = semantics(case, max_k, ins.slopes)  # flash-attn counts keys by max_seqlen_k here
    fail_unless(tuple(out.shape) == tuple(q.shape) and out.dtype == q.dtype,
                f"out is {out.dtype} {tuple(out.shape)}, expected {q.dtype} {tuple(q.shape)}")
    if lse is not None:
        fail_unless(tuple(lse.shape) == (h, ins.total_q),
                    f"lse has shape {tuple(lse.shape)}, expected {(h, ins.total_q)}")
    if case["return_probs"] and case["dropout_p"]:
        check_s_dmask_shape("", probs, (nseq, h, max_q, max_k))
    elif case["return_probs"]:
        fail_unless(probs is None, "return_attn_probs without dropout: S_dmask must be None")
    if case["backward"]:
        fail_unless(out.grad_fn is not None, "inputs require grad but out has no grad_fn")
        out.backward(ins.dout)
        grads = call_tensors(case, ins.laid, grads=True)
    else:
        grads = (None, None, None)
    for b in range(nseq):
        rows = slice(ins.cu_q[b], ins.cu_q[b + 1])
        len_q, len_k = case["lens_q"][b], case["lens_k"][b]
        if ins.table is not None:
            keys_k, keys_v = (paged_keys(t, ins.table, b, len_k) for t in (k, v))
        else:
            keys = slice(ins.cu_k[b], ins.cu_k[b + 1])
            keys_k, keys_v = k[keys], v[keys]
        what = f"sequence {b} ({len_q} rows, {len_k} keys): "
        keep = (None if seed is None else
                keep_mask(seed, case["dropout_p"], nseq, h, b, len_q, len_k, device))
        qb, kb, vb = q[rows][None], keys_k[None], keys_v[None]
        check_attention(what, out.detach()[rows][None], None if lse is None else
                        lse[:, rows][None], qb, kb, vb, sem.entry(b), keep)
        if case["return_probs"] and case["dropout_p"]:
            check_s_dmask_signs(what, probs[b:b + 1, :, :len_q, :len_k], keep)
        if case["backward"]:
            keys = slice(ins.cu_k[b], ins.cu_k[b + 1])
            check_gradients(what, (grads[0][rows][None], grads[1][keys][None],
                                   grads[2][keys][None]), qb, kb, vb,
                            ins.dout[rows][None], sem.entry(b), keep)
    if case["backward"]:  # rows and keys of no sequence: no gradient
        outside_q = torch.ones(q.shape[0], dtype=torch.bool, device=device)
        outside_q[ins.cu_q[0]:ins.cu_q[-1]] = False
        outside_k = torch.ones(k.shape[0], dtype=torch.bool, device=device)
        outside_k[ins.cu_k[0]:ins.cu_k[-1]] = False
        fail_unless(not grads[0][outside_q].any() and not grads[1][outside_k].any()
                    and not grads[2][outside_k].any(),
                    "rows outside every sequence got a gradient")
    # Rows of no sequence (before cu_seqlens_q[0], after cu_seqlens_q[-1]) are not written by
    # the forward, as in flash-attn (out is torch.empty there): a repeat compares the others.
    inside = slice(ins.cu_q[0], ins.cu_q[-1])
    return (out.detach()[inside], None if lse is None else lse[:, inside], *grads)


def run_varlen(api, case: dict, device) -> None:
    first = varlen_run(api, case, device)
    if case["recheck"]:
        again = repeat(varlen_run, api, case, device)
        check_same_bits("repeat", first[:2] + (first[2:] if case["deterministic"] else ()),
                        again[:2] + (again[2:] if case["deterministic"] else ()))


# ---- flash_attn_with_kvcache ------------------------------------------------------------------


def kvcache_inputs(case: dict, device) -> SimpleNamespace:
    src = TensorSource(case["tensor_seed"], device, DTYPES[case["dtype"]])
    b, sq, h, hk, d, new = (case[x] for x in ("b", "sq", "h", "hk", "d", "new"))
    ins = SimpleNamespace(table=None, page=0)
    ins.q = src.laid_out((b, sq, h, d), case["layout_q"])
    if case["paged"]:
        n_pages = b * case["blocks"] + case["extra_pages"]
        ins.page, ins.capacity = case["page"], case["blocks"] * case["page"]
        ins.k_cache = Laid(src.randn(n_pages, case["page"], hk, d), lambda t: t)
        ins.v_cache = Laid(src.randn(n_pages, case["page"], hk, d), lambda t: t)
        table = src.randperm(n_pages)[:b * case["blocks"]].view(b, case["blocks"])
        table = table.to(torch.int32)
        if case["table_garbage"]:  # pages past each sequence's end: indices no pool has
            for i, n in enumerate(case["lens"]):
                used = -(-(n + new) // case["page"])
                if used < case["blocks"]:
                    table[i, used:] = torch.where(torch.arange(case["blocks"] - used) % 2 == 0,
                                                  -7, n_pages + 5).to(torch.int32)
        ins.table = table.to(device)
    else:
        entries = case["entries"] if case["batch_idx"] is not None else b
        ins.capacity = case["sc"]
        ins.k_cache = src.laid_out((entries, case["sc"], hk, d), case["layout_cache"])
        ins.v_cache = src.laid_out((entries, case["sc"], hk, d), case["layout_cache"])
    ins.k_new = src.laid_out((b, new, hk, d), case["layout_new"]).view if new else None
    ins.v_new = src.laid_out((b, new, hk, d), case["layout_new"]).view if new else None
    ins.slopes = make_slopes(src, case, b)
    ins.cos = ins.sin = None
    if case["rotary"] is not None:
        angles = src.rand(case["rotary"]["seqlen_ro"], case["rotary"]["dim"] // 2) * 2 * math.pi
        ins.cos, ins.sin = angles.cos().to(src.dtype), angles.sin().to(src.dtype)
    kind = case["seqlens_kind"]
    ins.cache_seqlens = (None if kind == "none" else case["lens"][0] if kind == "int"
                         else int32(case["lens"], device))
    ins.batch_idx = None if case["batch_idx"] is None else int32(case["batch_idx"], device)
    ins.leftpad = None if case["leftpad"] is None else int32(case["leftpad"], device)
    return ins


def kvcache_call(api, case: dict, ins: SimpleNamespace):
    kwargs = options(case, ins.slopes)
    if ins.k_new is not None:
        kwargs["k"], kwargs["v"] = ins.k_new, ins.v_new
    if ins.cos is not None:
        kwargs.update(rotary_cos=ins.cos, rotary_sin=ins.sin,
                      rotary_interleaved=case["rotary"]["interleaved"])
    for name, value in (("cache_seqlens", ins.cache_seqlens), ("cache_batch_idx", ins.batch_idx),
                        ("cache_leftpad", ins.leftpad), ("block_table", ins.table)):
        if value is not None:
            kwargs[name] = value
    if case["num_splits"]:
        kwargs["num_splits"] = case["num_splits"]
    if case["return_lse"]:
        kwargs["return_softmax_lse"] = True
    return forward_call(api.flash_attn_with_kvcache, ins.q.view, ins.k_cache.view,
                        ins.v_cache.view, **kwargs)


def cache_slots(ins: SimpleNamespace, case: dict, b: int, positions: torch.Tensor):
    """(cache entry or page, row) indices of sequence b's positions in the caches' view."""
    if ins.table is not None:
        return ins.table[b].long()[positions // ins.page], positions % ins.page
    entry = b if case["batch_idx"] is None else case["batch_idx"][b]
    return torch.full_like(positions, entry), positions


def kvcache_run(api, case: dict, device) -> tuple:
    ins = kvcache_inputs(case, device)
    b, sq, new = case["b"], case["sq"], case["new"]
    before = [c.base.clone() for c in (ins.k_cache, ins.v_cache)]
    try:
        with torch.no_grad():
            result = kvcache_call(api, case, ins)
    except Rejection:
        fail_unless(all(torch.equal(c.base, x) for c, x in zip((ins.k_cache, ins.v_cache),
                                                               before)),
                    "the call was refused but changed the caches")
        raise
    out, lse = split_result(result, case["return_lse"], 2)
    lens = case["lens"]
    pads = case["leftpad"] or [0] * b
    sem = semantics(case, ins.capacity, ins.slopes)  # flash-attn counts the cache's capacity
    q = ins.q.view.detach().contiguous()
    rotary = case["rotary"]
    start = torch.tensor(lens, device=device)[:, None]
    new_values = [None if t is None else t.contiguous() for t in (ins.k_new, ins.v_new)]
    if rotary is not None:
        # flash-attn's rule: new keys at cache_seqlens[b] + i (their cache rows); the queries
        # likewise when the call is causal or keeps a bounded window side, else all at the
        # first new position.
        per_row = sem.window != (-1, -1)
        steps = torch.arange(sq, device=device)[None, :]
        q = rotate_reference(q, ins.cos, ins.sin, start + (steps if per_row else 0 * steps),
                             rotary["interleaved"])
        if new:
            positions = start + torch.arange(new, device=device)[None, :]
            new_values[0] = rotate_reference(new_values[0], ins.cos, ins.sin, positions,
                                             rotary["interleaved"])
    # The caches: the appended positions hold the new (rotated) keys and values, every other
    # byte of their buffers what it held before.
    for name, laid, old, fresh in zip(("k_cache", "v_cache"), (ins.k_cache, ins.v_cache),
                                      before, new_values):
        expected, written = old.clone(), torch.zeros(old.shape, dtype=torch.bool, device=device)
        for i in range(b if new else 0):
            slots = cache_slots(ins, case, i, torch.arange(lens[i], lens[i] + new, device=device))
            laid.view_of(expected)[slots] = fresh[i]
            laid.view_of(written)[slots] = True
        now = laid.base
        fail_unless(torch.equal(now[~written], expected[~written]),
                    f"{name}: the call changed positions it must not write")
        if not written.any():
            continue
        got, want = now[written].float(), expected[written].float()
        if rotary is not None and name == "k_cache":  # float32 rotations round alike, or 1 ulp
            fail_unless((got - want).abs().max().item() <= 1e-2 * want.abs().max().item() + 1e-6,
                        f"{name}: the appended keys are not the rotated new keys")
        else:
            fail_unless(torch.equal(got, want), f"{name}: the appended positions do not hold "
                                                "the new values")
    fail_unless(tuple(out.shape) == tuple(q.shape) and out.dtype == q.dtype,
                f"out is {out.dtype} {tuple(out.shape)}, expected {q.dtype} {tuple(q.shape)}")
    k_now, v_now = ins.k_cache.view, ins.v_cache.view
    for i in range(b):
        used = lens[i] + new
        slots = cache_slots(ins, case, i, torch.arange(pads[i], used, device=device))
        what = f"sequence {i} (keys {pads[i]}..{used}): "
        check_attention(what, out[i:i + 1], None if lse is None else lse[i:i + 1], q[i:i + 1],
                        k_now[slots][None], v_now[slots][None], sem.entry(i))
    return out, lse


def run_kvcache(api, case: dict, device) -> None:
    first = kvcache_run(api, case, device)
    if case["recheck"]:
        check_same_bits("repeat", first, repeat(kvcache_run, api, case, device))


RUNNERS = {"func": run_func, "qkvpacked": run_func, "kvpacked": run_func,
           "varlen": run_varlen, "varlen_qkvpacked": run_varlen, "varlen_kvpacked": run_varlen,
           "kvcache": run_kvcache}


# ---- the dry run's CPU stand-in for cudaflash -------------------------------------------------


class CpuStandIn:
    """What --dry-run calls in cudaflash's place, on the CPU: out from flash-attn's semantics
    in tests/_flash_reference.py (float32 math, differentiable; an implementation of its own,
    so the dry run also checks this script's reference against it), the appends and rotary
    embedding written out here, dropout from the host's keep mask. lse and S_dmask come from
    this script's reference: they check the plumbing only. A few of cudaflash's documented
    refusals are mirrored so that the rejection tally runs too."""

    @staticmethod
    def _refuse(q, k, v, dropout_p=0.0, softcap=0.0, copied=("q", "k", "v")):
        """cudaflash's layout refusals; ``copied``: the arguments it copies when their last
        stride is not 1 (as flash-attn does: q, k, v, never a cache)."""
        if dropout_p and softcap:
            raise NotImplementedError("dropout_p > 0 with softcap is not implemented")
        if q.shape[-1] not in BUILT_HEAD_DIMS:
            return  # cudaflash pads such head dims: a copy, whatever the layout
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.stride(-1) != 1:
                if name in copied:
                    continue  # a fresh, aligned copy
                raise ValueError(f"{name} has strides {t.stride()}; its last stride must be 1")
            if t.storage_offset() * t.element_size() % 16:
                raise ValueError(f"{name} is not 16-byte aligned")

    @staticmethod
    def _dropout(dropout_p, device):
        """(p, seed) as cudaflash draws it, or None for no dropout."""
        if not dropout_p:
            return None
        seed = int(torch.randint(0, SEED_HIGH, (1,), dtype=torch.int64, device=device).item())
        return None if dropout_threshold(dropout_p) == 0 else (dropout_p, seed)

    @staticmethod
    def _scale(softmax_scale, q):
        return q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale

    def flash_attn_func(self, q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                        window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                        deterministic=False, return_attn_probs=False):
        self._refuse(q, k, v, dropout_p, softcap)
        scale = self._scale(softmax_scale, q)
        window = flash_window(window_size, k.shape[1], False)  # the reference applies causal
        sem = Semantics(scale, flash_window(window_size, k.shape[1], causal), softcap,
                        alibi_slopes, dropout_p)
        drop = self._dropout(dropout_p, q.device)
        b, sq, h, _ = q.shape
        keep = None
        if drop is None:
            out = flash_reference.attention(q, k, v, scale, causal, window, float(softcap),
                                            alibi_slopes)
        else:
            keep = torch.cat([keep_mask(drop[1], drop[0], b, h, e, sq, k.shape[1], q.device)
                              for e in range(b)])
            out = attention_reference(q, k, v, sem, keep)[0].to(q.dtype)
        if not return_attn_probs:
            return out
        lse = attention_reference(q.detach(), k.detach(), v.detach(), sem)[1]
        probs = None if not dropout_p else (torch.ones(b, h, sq, k.shape[1]) if keep is None
                                            else keep.float() * 2 - 1)
        return out, lse, probs

    def flash_attn_qkvpacked_func(self, qkv, *args, **kwargs):
        return self.flash_attn_func(*qkv.unbind(2), *args, **kwargs)

    def flash_attn_kvpacked_func(self, q, kv, *args, **kwargs):
        return self.flash_attn_func(q, *kv.unbind(2), *args, **kwargs)

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, dropout_p=0.0, softmax_scale=None, causal=False,
                               window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               deterministic=False, return_attn_probs=False, block_table=None):
        self._refuse(q, k, v, dropout_p, softcap)
        starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        nseq = len(starts_q) - 1
        if block_table is not None:
            if dropout_p:
                raise NotImplementedError("dropout_p > 0 with block_table is not implemented")
            # The sequences' keys gathered from their pages into packed tensors.
            lengths = [b - a for a, b in zip(starts_k, starts_k[1:])]
            k, v = (torch.cat([paged_keys(t, block_table, b, n) for b, n in enumerate(lengths)])
                    for t in (k, v))
            starts_k = offsets(lengths)
        scale = self._scale(softmax_scale, q)
        window = flash_window(window_size, max_seqlen_k, False)
        sem = Semantics(scale, flash_window(window_size, max_seqlen_k, causal), softcap,
                        alibi_slopes, dropout_p)
        drop = self._dropout(dropout_p, q.device)
        h = q.shape[1]
        lse = torch.full((h, q.shape[0]), -math.inf)
        probs = torch.zeros(nseq, h, max_seqlen_q, max_seqlen_k) if dropout_p else None
        pieces = [q.new_zeros(starts_q[0], *q.shape[1:])]  # rows before the first sequence
        for b in range(nseq):
            rows, keys = slice(starts_q[b], starts_q[b + 1]), slice(starts_k[b], starts_k[b + 1])
            qb, kb, vb = q[rows][None], k[keys][None], v[keys][None]
            keep = None if drop is None else keep_mask(drop[1], drop[0], nseq, h, b,
                                                       qb.shape[1], kb.shape[1], q.device)
            if keep is None and not dropout_p:
                slopes = None if alibi_slopes is None else sem.entry(b).slopes
                pieces.append(flash_reference.attention(qb, kb, vb, scale, causal, window,
                                                        float(softcap), slopes)[0])
            else:
                pieces.append(attention_reference(qb, kb, vb, sem.entry(b), keep)[0][0]
                              .to(q.dtype))
                if keep is not None:
                    probs[b, :, :qb.shape[1], :kb.shape[1]] = keep[0].float() * 2 - 1
            lse[:, rows] = attention_reference(qb.detach(), kb.detach(), vb.detach(),
                                               sem.entry(b))[1][0]
        pieces.append(q.new_zeros(q.shape[0] - starts_q[-1], *q.shape[1:]))  # rows after
        out = torch.cat(pieces)
        return (out, lse, probs) if return_attn_probs else out

    def flash_attn_varlen_qkvpacked_func(self, qkv, cu_seqlens, max_seqlen, *args, **kwargs):
        return self.flash_attn_varlen_func(*qkv.unbind(1), cu_seqlens, cu_seqlens, max_seqlen,
                                           max_seqlen, *args, **kwargs)

    def flash_attn_varlen_kvpacked_func(self, q, kv, *args, **kwargs):
        return self.flash_attn_varlen_func(q, *kv.unbind(1), *args, **kwargs)

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                                rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                                cache_leftpad=None, block_table=None, softmax_scale=None,
                                causal=False, window_size=(-1, -1), softcap=0.0,
                                rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                                return_softmax_lse=False):
        from cudaflash import rotary_embedding  # cudaflash's torch rotation (no GPU needed)

        self._refuse(q, k_cache, v_cache, copied=("q",))
        b, sq, h, _ = q.shape
        page = k_cache.shape[1]
        capacity = block_table.shape[1] * page if block_table is not None else k_cache.shape[1]
        lengths = (torch.full((b,), capacity) if cache_seqlens is None else
                   torch.full((b,), cache_seqlens) if isinstance(cache_seqlens, int)
                   else cache_seqlens.long())
        pads = torch.zeros(b, dtype=torch.long) if cache_leftpad is None else cache_leftpad.long()
        new = 0 if k is None else k.shape[1]
        sem = Semantics(self._scale(softmax_scale, q), flash_window(window_size, capacity,
                                                                    causal),
                        softcap, alibi_slopes, 0.0)
        if rotary_cos is not None:
            rotary = rotary_embedding.Rotary(rotary_cos, rotary_sin, rotary_interleaved)
            q, k = rotary_embedding.apply(rotary, q, k, lengths.to(torch.int32),
                                          sem.window != (-1, -1))

        def slots(i, positions):
            if block_table is not None:
                return block_table[i].long()[positions // page], positions % page
            entry = i if cache_batch_idx is None else int(cache_batch_idx[i])
            return torch.full_like(positions, entry), positions

        for i in range(b if new else 0):
            where = slots(i, torch.arange(int(lengths[i]), int(lengths[i]) + new))
            k_cache[where], v_cache[where] = k[i], v[i]
        window = flash_window(window_size, capacity, False)
        outs, lses = [], []
        for i in range(b):
            where = slots(i, torch.arange(int(pads[i]), int(lengths[i]) + new))
            keys, values = k_cache[where][None], v_cache[where][None]
            slopes = None if alibi_slopes is None else sem.entry(i).slopes
            outs.append(flash_reference.attention(q[i:i + 1], keys, values, sem.scale, causal,
                                                  window, float(softcap), slopes))
            lses.append(attention_reference(q[i:i + 1], keys, values, sem.entry(i))[1])
        out = torch.cat(outs)
        return (out, torch.cat(lses)) if return_softmax_lse else out


# ---- running ----------------------------------------------------------------------------------


def message_prefix(error: BaseException) -> str:
    """A rejection's tally key: its type and the message's first clause, numbers elided."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = re.split(r"[;(:]", text, maxsplit=1)[0].strip()
    # Values vary from case to case; numbers inside words ("16-byte") do not.
    text = re.sub(r"(?<![\w-])[0-9]+(?![\w-])", "#", text)
    return f"{type(error).__name__}: {text[:80]}"


def run_case(api, case: dict, device) -> tuple[str, str]:
    """("pass" | "rejected" | "failed", detail) of one case."""
    try:
        RUNNERS[case["fn"]](api, case, device)
        return "pass", ""
    except Rejection as r:
        return "rejected", message_prefix(r.error)
    except CaseFailure as e:
        return "failed", str(e)
    except Exception as e:  # noqa: BLE001 (any other exception is a failure, with its trace)
        frames = "".join(traceback.format_exception(type(e), e, e.__traceback__)[-4:])
        return "failed", f"{type(e).__name__}: {e}\n{frames.rstrip()}"


def cuda_state() -> Optional[str]:
    """None while the CUDA context works; else why it does not (a sticky error)."""
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
        return None
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def repro_line(case: dict) -> str:
    """One line that reruns the case: by seed and index, or (should the drawing change) by
    its parameters."""
    return (f"REPRO case {case['index']}: PYTHONPATH=. python3 tools/fuzz_api.py --seed "
            f"{case['seed']} --only {case['index']}   # or --case '{json.dumps(case)}'")


def print_summary(title, ran, drawn, outcomes, elapsed, stopped_by) -> None:
    counts = {"pass": 0, "rejected": 0, "failed": 0}
    rejections, failures, by_function = {}, [], {}
    for case, (status, detail) in outcomes:
        counts[status] += 1
        per = by_function.setdefault(case["fn"], {"pass": 0, "rejected": 0, "failed": 0})
        per[status] += 1
        if status == "rejected":
            rejections[detail] = rejections.get(detail, 0) + 1
        elif status == "failed":
            failures.append((case, detail))
    print(f"\n=== {title}: ran {ran} of {drawn} cases in {elapsed:.1f} s"
          + (f" (stopped: {stopped_by})" if stopped_by else "") + " ===")
    print(f"passed   {counts['pass']}")
    print(f"rejected {counts['rejected']}")
    for prefix, n in sorted(rejections.items(), key=lambda item: -item[1]):
        print(f"  {n:5d}  {prefix}")
    print(f"failed   {counts['failed']}")
    for case, detail in failures:
        print(f"  case {case['index']} ({case['fn']}): {detail.splitlines()[0][:160]}")
    print("by function (pass/rejected/failed): " + ", ".join(
        f"{fn} {c['pass']}/{c['rejected']}/{c['failed']}" for fn, c in sorted(by_function.items())))


def selected_cases(args) -> list:
    if args.case:
        return [json.loads(args.case)]
    if args.only:
        return [draw_case(args.seed, int(i)) for i in args.only.split(",")]
    return [draw_case(args.seed, i) for i in range(args.cases)]


def gpu_run(args) -> int:
    import cudaflash

    if not torch.cuda.is_available():
        print("no CUDA GPU here (torch.cuda.is_available() is False); --dry-run runs without "
              "one", file=sys.stderr)
        return 2
    # The float32 reference must be float32: no TF32 in its matmuls (the tests' fixture).
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    device = torch.device("cuda", torch.cuda.current_device())
    cases = selected_cases(args)
    print(f"cudaflash API fuzz: seed {args.seed}, {len(cases)} cases, "
          f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    outcomes, started, stopped_by = [], time.monotonic(), None
    for n, case in enumerate(cases):
        if args.time_limit and time.monotonic() - started > args.time_limit:
            stopped_by = f"--time-limit {args.time_limit:g} s"
            break
        case_started = time.monotonic()
        status, detail = run_case(cudaflash, case, device)
        broken = cuda_state()
        if broken is not None and status != "failed":
            status, detail = "failed", f"CUDA error after the case: {broken}"
        outcomes.append((case, (status, detail)))
        if args.verbose or status == "failed":
            print(f"case {case['index']} {case['fn']}: {status} "
                  f"({time.monotonic() - case_started:.2f} s)"
                  + (f" {detail}" if status == "rejected" else ""))
        if status == "failed":
            print(f"  FAILED: {detail}")
            print(f"  {repro_line(case)}")
        if broken is not None:
            stopped_by = f"the CUDA context is broken after case {case['index']}: {broken}"
            print(f"  {stopped_by}")
            break
        if not args.verbose and (n + 1) % 25 == 0:
            done = [s for _, (s, _) in outcomes]
            print(f"[{n + 1}/{len(cases)}] {time.monotonic() - started:.1f} s  pass "
                  f"{done.count('pass')}  rejected {done.count('rejected')}  failed "
                  f"{done.count('failed')}", flush=True)
    print_summary(f"cudaflash API fuzz, seed {args.seed}", len(outcomes), len(cases), outcomes,
                  time.monotonic() - started, stopped_by)
    return 1 if any(status == "failed" for _, (status, _) in outcomes) else 0


def dry_run(args) -> int:
    """Draw and print the cases; build their inputs on the CPU and run each one's whole check
    pipeline against CpuStandIn (no CUDA is touched)."""
    torch.set_float32_matmul_precision("highest")
    cases = selected_cases(args)
    device = torch.device("cpu")
    api = CpuStandIn()
    outcomes, started = [], time.monotonic()
    for case in cases:
        print(f"case {case['index']}: {json.dumps(case)}")
        if case_scores(case) > args.dry_run_scores:
            print("  (drawn only: too big to check on the CPU)")
            continue
        status, detail = run_case(api, case, device)
        outcomes.append((case, (status, detail)))
        print(f"  stand-in: {status}" + (f": {detail}" if detail else ""))
        if status == "failed":
            print(f"  {repro_line(case)} --dry-run")
    print_summary(f"dry run (CPU stand-in), seed {args.seed}", len(outcomes), len(cases),
                  outcomes, time.monotonic() - started, None)
    families = {}
    for case in cases:
        families[case["fn"]] = families.get(case["fn"], 0) + 1
    print("drawn by function: " + ", ".join(f"{fn} {n}" for fn, n in sorted(families.items())))
    return 1 if any(status == "failed" for _, (status, _) in outcomes) else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=400, help="how many cases (default 400)")
    parser.add_argument("--seed", type=int, default=1, help="the run's seed (default 1)")
    parser.add_argument("--time-limit", type=float, default=None,
                        help="start no case after this many seconds")
    parser.add_argument("--only", help="run only these case indices of the seed (N or N,M,...)")
    parser.add_argument("--case", help="run one case given as its printed JSON dict")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: draw and print the cases, check the small ones against a "
                             "CPU stand-in for cudaflash")
    parser.add_argument("--dry-run-scores", type=int, default=DRY_RUN_SCORES,
                        help="--dry-run checks cases of at most this many attention scores "
                             f"(default {DRY_RUN_SCORES}: all), only prints bigger ones")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every case")
    args = parser.parse_args(argv)
    return dry_run(args) if args.dry_run else gpu_run(args)


if __name__ == "__main__":
    sys.exit(main())
