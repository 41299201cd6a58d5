"""The bench's suites beyond the forward sweep: ``train`` and ``backward`` (cudaflash against
SDPA's cuDNN and flash backends, forward / backward / training step), ``varlen`` (packed
against padded), ``window`` (sliding windows against full causal), ``softcap`` (capped
against plain), ``alibi`` (ALiBi against plain), ``dropout`` (dropout against none),
``kvcache`` (decoding steps of flash_attn_with_kvcache) and ``hf`` (a
transformers model's prefill, decoding and training step, in tokens per second; its calls
in ``hf_calls``).

A suite is a list of rows (one problem each, sizes only: built here, on the CPU), a set of
variants (the backends or call forms it compares), the phases it times (forward, backward,
training step) and the speed ratios it shows. ``suite_calls`` turns a row into the calls
the GPU runs; ``timing.time_in_turns`` times them (one timing loop for every suite). Tables,
JSON and the plot are built here from the numbers, so that all of it runs without a GPU.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from ._common import format_table
from .timing import Timing, time_in_turns

FA_TOKENS = 16384  # FlashAttention's benchmark convention, as in bench.py
FA_HIDDEN = 2048

PHASES = ("forward", "backward", "train")
# FLOPs of a phase per FLOP of the forward, as FlashAttention counts them: the backward runs
# five GEMMs to the forward's two (2.5x); a training step is one forward and one backward.
PHASE_FLOPS = {"forward": 1.0, "backward": 2.5, "train": 3.5}
PHASE_TEXT = {
    "forward": "forward without autograd (torch.no_grad(); kvcache: torch.inference_mode()), "
               "as inference runs it",
    "backward": "torch.autograd.grad of one recorded output with a fixed random dout "
                "(the forward outside the events)",
    "train": "forward with autograd recording + torch.autograd.grad with a fixed random "
             "dout (a training step of the attention op)",
}

# The hf suite's model: Llama-like, small enough that a step takes milliseconds; its phases
# are whole-model steps, timed in tokens/s.
HF_MODEL = dict(layers=8, hidden=2048, heads=16, kv_heads=4, d_head=128, intermediate=5632,
                vocab=32000)
HF_BATCH = 4
HF_DECODE_STEPS = 16
HF_PHASES = ("prefill", "decode", "train")
HF_PHASE_TEXT = {
    "prefill": "the model's forward over the prompt under torch.inference_mode(), filling a "
               "DynamicCache, logits of the last position only (as generate()'s prefill)",
    "decode": f"{HF_DECODE_STEPS} greedy decoding steps (one token per sequence against the "
              "DynamicCache of the prompt, argmax of the logits fed back), the cache cropped "
              "back to the prompt after each call",
    "train": "forward with labels (the inputs) and loss.backward() over the whole model (no "
             "optimizer step), gradients accumulating",
}
ALL_PHASES = PHASES + HF_PHASES[:2]  # every phase name --phases accepts

SOFTCAP = 30.0  # Gemma 2's attention cap
DROPOUT_P = 0.1  # the dropout suite's rate (BERT's and GPT-2's attention dropout)
WINDOWS = (4096, 1024, 256)  # left windows of the window suite (right 0, causal)
VARLEN_SEQUENCES = 16  # sequences per packed batch, lengths uniform in [VARLEN_MIN, S]
VARLEN_MIN = 128
# kvcache: (batch, cache length) with GQA 32/8 heads, d128, lengths uniform in [1, cache]
KVCACHE_CASES = ((1, 16384), (8, 8192), (32, 4096), (64, 16384))
KVCACHE_HEADS, KVCACHE_HEADS_K, KVCACHE_D_HEAD = 32, 8, 128
PAGE_SIZES = (16, 64, 256)  # the kvcache suite's paged variants (vLLM's 16; flash-attn's 256)
PAGED_VARIANTS = tuple(f"paged{page}" for page in PAGE_SIZES)
SEED = 0
CAUSAL_CHOICES = {"both": (False, True), "yes": (True,), "no": (False,)}


def attention_flops(batch: int, nheads: int, seqlen_q: int, seqlen_k: int, d_head: int,
                    causal: bool) -> float:
    """FLOPs of one forward, as FlashAttention counts them: two matmuls (QK^T, PV) of
    2 * Sq * Sk * d each per head; causal does half of them."""
    flops = 4 * batch * nheads * seqlen_q * seqlen_k * d_head
    return flops / 2 if causal else flops


def phase_flops(phase: str, forward_flops: float) -> float:
    return PHASE_FLOPS[phase] * forward_flops


def window_pairs(seqlen: int, window: Optional[int]) -> int:
    """(query, key) pairs a causal square of ``seqlen`` computes with a left window
    (query i sees keys max(0, i - window)..i; None: no window)."""
    if window is None or window >= seqlen - 1:
        return seqlen * (seqlen + 1) // 2
    w = window
    return (w + 1) * (w + 2) // 2 + (seqlen - 1 - w) * (w + 1)


def varlen_lengths(max_seqlen: int, seed: int = SEED) -> list:
    """The packed batch of the varlen suite: VARLEN_SEQUENCES lengths uniform in
    [min(VARLEN_MIN, S), S], the same for every run (a fixed seed, drawn on the CPU)."""
    import torch

    low = min(VARLEN_MIN, max_seqlen)
    g = torch.Generator().manual_seed(seed + max_seqlen)
    return torch.randint(low, max_seqlen + 1, (VARLEN_SEQUENCES,), generator=g).tolist()


def kvcache_lengths(batch: int, cache: int, seed: int = SEED) -> list:
    """Cache lengths of one kvcache row: uniform in [1, cache], a fixed seed."""
    import torch

    g = torch.Generator().manual_seed(seed + batch * 100003 + cache)
    return torch.randint(1, cache + 1, (batch,), generator=g).tolist()


# ---- rows ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One problem of a suite. ``fields`` are the table's leading columns, in order, and
    what ``suite_calls`` builds the tensors from; ``flops`` is the useful work of one
    forward (per variant where they differ: ``variant_flops``); ``bytes`` what one call
    must read at least (kvcache: K and V of the used cache), or None; ``tokens`` the tokens
    one call of each phase processes (the hf suite, whose unit is tokens/s)."""

    fields: tuple  # ((name, value), ...)
    flops: float
    variant_flops: tuple = ()  # ((variant, flops), ...)
    bytes: Optional[int] = None
    lengths: tuple = ()  # varlen: the sequence lengths; kvcache: the cache lengths
    tokens: tuple = ()  # hf: ((phase, tokens per call), ...)

    def get(self, name: str):
        return dict(self.fields)[name]

    def forward_flops(self, variant: str) -> float:
        return dict(self.variant_flops).get(variant, self.flops)


def fa_row(dtype: str, d_head: int, causal: bool, seqlen: int) -> Row:
    """The FlashAttention convention's problem: batch = 16384 / S, nheads = 2048 / d."""
    batch, nheads = max(1, FA_TOKENS // seqlen), FA_HIDDEN // d_head
    return Row((("dtype", dtype), ("d", d_head), ("causal", causal), ("S", seqlen),
                ("B", batch), ("H", nheads)),
               attention_flops(batch, nheads, seqlen, seqlen, d_head, causal))


def fa_rows(opts) -> list:
    return [fa_row(dtype, d, causal, s) for dtype in opts.dtypes for d in opts.head_dims
            for causal in opts.causals for s in opts.seqlens]


def varlen_rows(opts) -> list:
    rows = []
    for dtype in opts.dtypes:
        for d in opts.head_dims:
            for causal in opts.causals:
                for s in opts.seqlens:
                    lengths = varlen_lengths(s)
                    nheads = FA_HIDDEN // d
                    # Only the real (unpadded) work counts, for every variant.
                    flops = sum(attention_flops(1, nheads, n, n, d, causal) for n in lengths)
                    rows.append(Row((("dtype", dtype), ("d", d), ("causal", causal),
                                     ("S", s), ("B", len(lengths)), ("H", nheads),
                                     ("tokens", sum(lengths))), flops,
                                    lengths=tuple(lengths)))
    return rows


def window_rows(opts) -> list:
    """Causal, batch 1, nheads = 2048 / d; each window's FLOPs count the pairs inside it."""
    rows = []
    for dtype in opts.dtypes:
        for d in opts.head_dims:
            for s in opts.seqlens:
                nheads = FA_HIDDEN // d
                full = 4.0 * window_pairs(s, None) * d * nheads
                per_window = tuple((f"w{w}", 4.0 * window_pairs(s, w) * d * nheads)
                                   for w in WINDOWS)
                rows.append(Row((("dtype", dtype), ("d", d), ("S", s), ("B", 1),
                                 ("H", nheads)), full, per_window))
    return rows


def kvcache_rows(opts) -> list:
    rows = []
    for dtype in opts.dtypes:
        for batch, cache in KVCACHE_CASES:
            lengths = kvcache_lengths(batch, cache)
            used = sum(lengths)
            flops = sum(attention_flops(1, KVCACHE_HEADS, 1, n, KVCACHE_D_HEAD, False)
                        for n in lengths)
            rows.append(Row((("dtype", dtype), ("d", KVCACHE_D_HEAD), ("B", batch),
                             ("cache", cache), ("mean len", used // batch),
                             ("H", KVCACHE_HEADS), ("H_k", KVCACHE_HEADS_K)), flops,
                            bytes=2 * used * KVCACHE_HEADS_K * KVCACHE_D_HEAD * 2,
                            lengths=tuple(lengths)))
    return rows


def hf_rows(opts) -> list:
    """The hf suite's model at each prompt length (HF_BATCH sequences)."""
    m = HF_MODEL
    return [Row((("dtype", dtype), ("S", s), ("B", HF_BATCH), ("layers", m["layers"]),
                 ("hidden", m["hidden"]), ("H", m["heads"]), ("H_k", m["kv_heads"]),
                 ("d", m["d_head"])), 0.0,
                tokens=(("prefill", HF_BATCH * s), ("decode", HF_BATCH * HF_DECODE_STEPS),
                        ("train", HF_BATCH * s)))
            for dtype in opts.dtypes for s in opts.seqlens]


# ---- suites ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Suite:
    name: str
    help: str  # one line: what it compares
    variants: tuple  # every variant it knows, in table order
    default_variants: tuple
    phases: tuple  # the phases it can time
    default_phases: tuple
    ratios: tuple  # ((label, a, b), ...): b's time / a's time (how much faster a ran)
    build_rows: Callable
    options: frozenset  # which sweep options apply: seqlens, head_dims, causal
    default_seqlens: tuple = ()
    default_head_dims: tuple = (64, 128)
    unit: str = "tflops"  # "tflops", "us" (kvcache: microseconds and GB/s) or "tokens" (hf)
    x_field: str = "S"  # the plot's x axis
    note: str = ""
    phase_text: tuple = ()  # ((phase, text), ...) where the suite's phases differ from PHASE_TEXT

    def describe(self, phase: str) -> str:
        return dict(self.phase_text).get(phase) or PHASE_TEXT[phase]

    def group_key(self, row: Row) -> tuple:
        """Rows that one plot panel and one summary line cover: all fields but the x axis
        and the sizes that follow from it."""
        return tuple((k, v) for k, v in row.fields
                     if k not in (self.x_field, "B", "H", "tokens", "mean len", "H_k"))


TRAIN_BACKENDS = ("cudaflash", "cudaflash-det", "cudnn", "flash", "efficient")
SWEEP = frozenset({"seqlens", "head_dims", "causal"})
SUITES = {
    s.name: s for s in (
        Suite("train", "forward, backward and training step: cudaflash vs SDPA cuDNN and "
              "flash", TRAIN_BACKENDS, ("cudaflash", "cudnn", "flash"), PHASES, PHASES,
              (("cf/cudnn", "cudaflash", "cudnn"), ("cf/flash", "cudaflash", "flash"),
               ("det/cudnn", "cudaflash-det", "cudnn")),
              fa_rows, SWEEP, (512, 1024, 2048, 4096, 8192, 16384), (64, 128, 256),
              note="cudaflash-det = flash_attn_func(deterministic=True)"),
        Suite("backward", "the backward alone: cudaflash vs SDPA cuDNN and flash",
              TRAIN_BACKENDS, ("cudaflash", "cudaflash-det", "cudnn", "flash"), PHASES,
              ("backward",),
              (("cf/cudnn", "cudaflash", "cudnn"), ("cf/flash", "cudaflash", "flash"),
               ("det/cudnn", "cudaflash-det", "cudnn"), ("det/flash", "cudaflash-det",
                                                         "flash")),
              fa_rows, SWEEP, (512, 1024, 2048, 4096, 8192, 16384), (64, 128, 256),
              note="cudaflash-det = flash_attn_func(deterministic=True)"),
        Suite("varlen", "flash_attn_varlen_func on a packed batch vs the batch padded to its "
              "longest sequence", ("varlen", "padded", "flash-padded"),
              ("varlen", "padded", "flash-padded"), PHASES, ("forward", "backward"),
              (("varlen/padded", "varlen", "padded"),
               ("varlen/flash", "varlen", "flash-padded")),
              varlen_rows, SWEEP, (4096,), (64, 128),
              note=f"{VARLEN_SEQUENCES} sequences of {VARLEN_MIN}..S tokens (fixed seed); "
                   "padded = flash_attn_func on the padded batch, flash-padded = SDPA flash "
                   "on it; TFLOP/s count the real tokens only (padded causal calls mask from "
                   "the padded square's corner: timed, not compared for values)"),
        Suite("window", "sliding windows (window_size=(w, 0), causal) vs full causal",
              ("full", *(f"w{w}" for w in WINDOWS), "flash"),
              ("full", *(f"w{w}" for w in WINDOWS), "flash"), PHASES, ("forward", "train"),
              (*((f"w{w}/full", f"w{w}", "full") for w in WINDOWS),
               ("full/flash", "full", "flash")),
              window_rows, frozenset({"seqlens", "head_dims"}), (16384, 32768), (64, 128),
              note="TFLOP/s count the (query, key) pairs inside the window; flash = SDPA "
                   "flash, full causal"),
        Suite("softcap", f"softcap={SOFTCAP:g} vs no cap, flash_attn_func",
              ("plain", "softcap"), ("plain", "softcap"), ("forward", "train"),
              ("forward", "train"), (("cap/plain", "softcap", "plain"),),
              fa_rows, SWEEP, (1024, 4096, 16384), (64, 128),
              note="train runs deterministic=True on both sides (a cap always runs the "
                   "deterministic backward)"),
        Suite("alibi", "ALiBi (alibi_slopes, one per head) vs none, flash_attn_func",
              ("plain", "alibi"), ("plain", "alibi"), ("forward", "train"),
              ("forward", "train"), (("alibi/plain", "alibi", "plain"),),
              fa_rows, SWEEP, (1024, 4096, 16384), (64, 128),
              note="slopes 2^(-8 (h + 1) / H), ALiBi's; train runs deterministic=True on both "
                   "sides (ALiBi always runs the deterministic backward)"),
        Suite("dropout", f"dropout_p={DROPOUT_P:g} vs none, flash_attn_func",
              ("plain", "dropout"), ("plain", "dropout"), ("forward", "train"),
              ("forward", "train"), (("drop/plain", "dropout", "plain"),),
              fa_rows, SWEEP, (1024, 4096, 16384), (64, 128),
              note="train: each side with flash_attn_func's default backward (on Hopper "
                   "d64/d128 both the fused atomic kernel, dropout's entry regenerating the "
                   "mask); TFLOP/s count every score, dropped or not"),
        Suite("kvcache", "decoding steps: flash_attn_with_kvcache vs the alternatives",
              ("kvcache", "full", "sdpa-eff", *PAGED_VARIANTS, "copy"),
              ("kvcache", "full", "sdpa-eff", *PAGED_VARIANTS, "copy"),
              ("forward",), ("forward",),
              (("kvc/full", "kvcache", "full"), ("kvc/sdpa", "kvcache", "sdpa-eff"),
               *((f"p{page}/kvc", f"paged{page}", "kvcache") for page in PAGE_SIZES),
               ("kvc/copy", "kvcache", "copy")),
              kvcache_rows, frozenset(), unit="us", x_field="cache",
              note="one query row per sequence, cache lengths uniform in [1, cache] (fixed "
                   "seed); kvcache = flash_attn_with_kvcache(cache_seqlens=lengths), full = "
                   "flash_attn_func over the whole cache (an upper bound: wrong where a cache "
                   "is not full), sdpa-eff = SDPA efficient with a key-padding mask, pagedN = "
                   "kvcache's call on the same caches in shuffled pages of N positions "
                   "(block_table), copy = a device copy (Tensor.copy_) that moves as many "
                   "bytes as kvcache reads (half read, half written), so kvc/copy is "
                   "kvcache's share of the bandwidth the GPU reaches copying; GB/s = K/V "
                   "bytes of the used cache / kvcache's time"),
        Suite("hf", "a Llama-like transformers model (8 layers, hidden 2048, 16 heads of 128, "
              "4 K/V heads, batch 4): prefill, decoding and training step with "
              "attn_implementation cudaflash vs sdpa and flash_attention_2, tokens/s",
              ("cudaflash", "sdpa", "flash_attention_2"),
              ("cudaflash", "sdpa", "flash_attention_2"), HF_PHASES, HF_PHASES,
              (("cf/sdpa", "cudaflash", "sdpa"), ("cf/fa2", "cudaflash", "flash_attention_2")),
              hf_rows, frozenset({"seqlens"}), (2048, 4096), unit="tokens",
              phase_text=tuple(HF_PHASE_TEXT.items()),
              note="random weights, bf16, no padding; cudaflash = "
                   "cudaflash.integrations.transformers.register(); flash_attention_2 needs the "
                   "flash-attn package (n/a without it); tokens/s = tokens of one call / its "
                   f"time (decode: {HF_BATCH} x {HF_DECODE_STEPS} new tokens per call)"),
    )
}


@dataclass(frozen=True)
class Options:
    """A suite's resolved sweep (``bench.resolve_suite`` builds it from the arguments)."""

    suite: Suite
    dtypes: tuple
    head_dims: tuple
    causals: tuple
    seqlens: tuple
    variants: tuple
    phases: tuple

    def rows(self) -> list:
        return self.suite.build_rows(self)

    def ratios(self) -> tuple:
        """The suite's ratios whose two variants are both timed."""
        return tuple(r for r in self.suite.ratios
                     if r[1] in self.variants and r[2] in self.variants)


FIXED_BY_SUITE = {"window": "always causal, window_size=(w, 0)",
                  "hf": "a fixed Llama-like model, causal, head dim 128",
                  "kvcache": f"fixed decoding cases {KVCACHE_CASES} (batch, cache), "
                             f"d{KVCACHE_D_HEAD}"}


def resolve(args, name: str) -> "Options":
    """The sweep of suite ``name`` (not forward or decode) from the bench's arguments; raises
    ValueError naming an option that does not apply to it, or a variant it does not have.
    (--no-host is accepted: these suites measure no host time, so there is nothing to skip,
    and a script may pass the same flags to every suite.)"""
    suite = SUITES[name]
    if args.config is not None:
        raise ValueError(f"--config applies to the forward and decode suites, not {suite.name}")
    for option, given in (("seqlens", args.seqlens), ("head_dims", args.head_dims),
                          ("causal", args.causal != "both")):
        if given and option not in suite.options:
            raise ValueError(f"--{option.replace('_', '-')} does not apply to the "
                             f"{suite.name} suite ({FIXED_BY_SUITE[suite.name]})")
    variants = tuple(args.backends or suite.default_variants)
    bad = [v for v in variants if v not in suite.variants]
    if bad:
        raise ValueError(f"--backends {','.join(bad)}: the {suite.name} suite has "
                         f"{','.join(suite.variants)}")
    phases = tuple(args.phases or suite.default_phases)
    bad = [p for p in phases if p not in suite.phases]
    if bad:
        raise ValueError(f"--phases {','.join(bad)}: the {suite.name} suite times "
                         f"{','.join(suite.phases)}")
    return Options(
        suite=suite, dtypes=tuple(args.dtype or ["bf16"]),
        head_dims=tuple(args.head_dims or suite.default_head_dims),
        causals=CAUSAL_CHOICES[args.causal], seqlens=tuple(args.seqlens or suite.default_seqlens),
        variants=tuple(v for v in suite.variants if v in variants),  # table order
        phases=tuple(p for p in suite.phases if p in phases))



# ---- results ---------------------------------------------------------------------------------


@dataclass
class RowResult:
    row: Row
    got: dict = field(default_factory=dict)  # (phase, variant) -> Timing, or why n/a (str)

    def timing(self, phase: str, variant: str) -> Optional[Timing]:
        t = self.got.get((phase, variant))
        return t if isinstance(t, Timing) else None

    def error(self, phase: str, variant: str) -> Optional[str]:
        t = self.got.get((phase, variant))
        return t if isinstance(t, str) else None

    def flops(self, phase: str, variant: str) -> float:
        return phase_flops(phase, self.row.forward_flops(variant))

    def tflops(self, phase: str, variant: str) -> Optional[float]:
        t = self.timing(phase, variant)
        return None if t is None else self.flops(phase, variant) / t.median_ms / 1e9

    def us(self, phase: str, variant: str) -> Optional[float]:
        t = self.timing(phase, variant)
        return None if t is None else t.median_ms * 1e3

    def tokens_per_s(self, phase: str, variant: str) -> Optional[float]:
        t = self.timing(phase, variant)
        tokens = dict(self.row.tokens).get(phase)
        return None if t is None or tokens is None else tokens / t.median_ms * 1e3

    def gbps(self, phase: str, variant: str) -> Optional[float]:
        t = self.timing(phase, variant)
        return None if t is None or self.row.bytes is None else \
            self.row.bytes / t.median_ms / 1e6

    def ratio(self, phase: str, a: str, b: str) -> Optional[float]:
        """How many times faster ``a`` ran than ``b``: b's time / a's time."""
        ta, tb = self.timing(phase, a), self.timing(phase, b)
        return None if ta is None or tb is None else tb.median_ms / ta.median_ms


def measure_rows(opts: "Options", rows: list, *, device, iters: int, warmup: int,
                 flush, progress, build: Callable, timer=time_in_turns) -> list:
    """``RowResult`` per row: the suite's calls (``build(opts, row, device)``:
    ``suite_calls.build_calls`` on the GPU, stand-ins in the tests) timed with ``timer``,
    variants and phases taking turns. A row whose tensors cannot be made (out of memory)
    gets that reason for every call."""
    results = []
    for row in rows:
        what = " ".join(f"{k}={v}" for k, v in row.fields)
        try:
            calls = build(opts, row, device)
        except Exception as e:  # one row failing must not lose the rest of the sweep
            why = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
            for _ in range(len(opts.phases) * len(opts.variants)):
                progress.step(f"{what} (n/a)")
            results.append(RowResult(row, {(p, v): why for p in opts.phases
                                                  for v in opts.variants}))
            continue
        got = timer(calls, iters=iters, warmup=warmup, flush=flush,
                    announce=lambda key: progress.step(f"{what} {key[0]} {key[1]}"))
        results.append(RowResult(row, got))
        del calls, got
    return results


def _num(x: Optional[float], fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_results(opts: Options, results: list) -> str:
    """One table per phase (TFLOP/s, or microseconds for kvcache, per variant, then the
    ratios), the reasons for every '-', and min/median of each ratio per group of rows."""
    suite, out = opts.suite, []
    labels = [label for label, _, _ in opts.ratios()]
    for phase in opts.phases:
        fields = [k for k, _ in results[0].row.fields] if results else []
        if suite.unit == "us":
            header = (*fields, *(f"{v} us" for v in opts.variants),
                      f"{opts.variants[0]} GB/s", *labels)
            rows = [(*(v for _, v in r.row.fields),
                     *(_num(r.us(phase, v), ".1f") for v in opts.variants),
                     _num(r.gbps(phase, opts.variants[0]), ".0f"),
                     *(_num(r.ratio(phase, a, b), ".2f") for _, a, b in opts.ratios()))
                    for r in results]
            unit = "microseconds per call"
        elif suite.unit == "tokens":
            header = (*fields, *(f"{v} tok/s" for v in opts.variants), *labels)
            rows = [(*(v for _, v in r.row.fields),
                     *(_num(r.tokens_per_s(phase, v), ".0f") for v in opts.variants),
                     *(_num(r.ratio(phase, a, b), ".2f") for _, a, b in opts.ratios()))
                    for r in results]
            unit = (f"tokens per second ({dict(results[0].row.tokens)[phase]} tokens per call"
                    " on the first row)" if results else "tokens per second")
        else:
            header = (*fields, *opts.variants, *labels)
            rows = [(*(v for _, v in r.row.fields),
                     *(_num(r.tflops(phase, v), ".1f") for v in opts.variants),
                     *(_num(r.ratio(phase, a, b), ".2f") for _, a, b in opts.ratios()))
                    for r in results]
            unit = f"TFLOP/s ({PHASE_FLOPS[phase]:g} x the forward's FLOPs)"
        out += [f"{suite.name} suite, {phase}: {suite.describe(phase)}; {unit}; a/b = b's time / "
                "a's time; - = n/a (reason below)", format_table(header, rows), ""]
    if suite.note:
        out.append(f"note: {suite.note}")

    failures: dict = {}  # (phase, variant) -> [number of rows, the first reason]
    for r in results:
        for key, got in r.got.items():
            if isinstance(got, str):
                failures.setdefault(key, [0, got])[0] += 1
    for (phase, variant), (n, why) in failures.items():
        out.append(f"-: {variant} {phase} on {n} row(s); the first: {why}")

    if opts.ratios() and results:
        out.append("\nratios over rows (min, median):")
        groups: dict = {}
        for r in results:
            groups.setdefault(suite.group_key(r.row), []).append(r)
        for phase in opts.phases:
            for label, a, b in opts.ratios():
                for key, group in groups.items():
                    values = [x for x in (r.ratio(phase, a, b) for r in group) if x is not None]
                    if values:
                        out.append(f"  {phase} {label} {_group_title(key)}: min "
                                   f"{min(values):.2f}, median {statistics.median(values):.2f}"
                                   f" ({len(values)} of {len(group)} rows)")
    return "\n".join(out)


def _group_title(key: tuple) -> str:
    return " ".join(f"{k}={v}" for k, v in key)


def to_json(opts: Options, env: dict, method: dict, results: list) -> dict:
    """Every number: per row its fields, per phase and variant the FLOPs counted and the
    timing (or the reason it is n/a), and the ratios."""

    tokens = opts.suite.unit == "tokens"

    def entry(r: RowResult, phase: str, variant: str) -> dict:
        got = ({"tokens": dict(r.row.tokens)[phase]} if tokens
               else {"flops": r.flops(phase, variant)})
        if r.error(phase, variant) is not None:
            return {**got, "error": r.error(phase, variant)}
        t = r.timing(phase, variant)
        if t is None:
            return {**got, "error": "not measured"}
        if tokens:
            got.update(tokens_per_s=r.tokens_per_s(phase, variant), **dataclasses.asdict(t))
        else:
            got.update(tflops=r.tflops(phase, variant), **dataclasses.asdict(t))
        if r.row.bytes is not None:
            got["gbps"] = r.gbps(phase, variant)
        return got

    return {
        "suite": opts.suite.name,
        "env": env,
        "method": {**method, "phases": {p: opts.suite.describe(p) for p in opts.phases},
                   "phase_flops": None if tokens else {p: PHASE_FLOPS[p] for p in opts.phases},
                   "note": opts.suite.note},
        "variants": list(opts.variants),
        "phases": list(opts.phases),
        "results": [{**dict(r.row.fields), "forward_flops": r.row.flops,
                     "bytes": r.row.bytes, "lengths": list(r.row.lengths) or None,
                     "phases": {p: {v: entry(r, p, v) for v in opts.variants}
                                for p in opts.phases},
                     "ratios": {p: {label: r.ratio(p, a, b) for label, a, b in opts.ratios()}
                                for p in opts.phases}}
                    for r in results],
    }


def write_json(path: Path, opts: Options, env: dict, method: dict, results: list) -> None:
    path.write_text(json.dumps(to_json(opts, env, method, results), indent=1) + "\n")


def plot(path: Path, opts: Options, results: list, pyplot) -> None:
    """One panel per group of rows and phase, x = the suite's x field, one line per
    variant (TFLOP/s; kvcache: microseconds; hf: tokens/s)."""
    groups: dict = {}
    for r in results:
        groups.setdefault(opts.suite.group_key(r.row), []).append(r)
    panels = [(key, phase, group) for key, group in groups.items() for phase in opts.phases]
    fig, axes = pyplot.subplots(len(panels), 1, figsize=(7, 3.2 * len(panels)), squeeze=False)
    for ax, (key, phase, group) in zip(axes[:, 0], panels):
        xs = [r.row.get(opts.suite.x_field) for r in group]
        get = {"us": RowResult.us, "tokens": RowResult.tokens_per_s}.get(opts.suite.unit,
                                                                       RowResult.tflops)
        for variant in opts.variants:
            ax.plot(xs, [get(r, phase, variant) or float("nan") for r in group], marker="o",
                    label=variant)
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_title(f"{opts.suite.name} {phase} {_group_title(key)}")
        ax.set_xlabel(opts.suite.x_field)
        ax.set_ylabel({"us": "us", "tokens": "tokens/s"}.get(opts.suite.unit, "TFLOP/s"))
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    pyplot.close(fig)
