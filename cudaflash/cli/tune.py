"""``python -m cudaflash tune``: the fastest built config per problem class on this GPU.

For each (dtype, head dim, causal, seqlen bucket) it times every config built for this GPU
(the manifest's kernels usable here with that dtype and head dim) through
``cudaflash.forward`` at both ends of the bucket (FlashAttention convention: batch =
16384 / S, nheads = 2048 / d), with the timing method of ``bench``; and per (dtype, head dim)
a decoding bucket (at most DECODE_MAX_ROWS query rows, timed on DECODE_CASES). The config with the best
mean time relative to the fastest at each size wins the bucket and becomes a selection rule; the rules go to ``_env.tuned_table_path(arch)`` (or
``--out``) as yaml with a top-level ``selection:`` list, the format of configs.yaml's. The
runtime picks that file up by itself: its rules come after CUDAFLASH_CONFIG's and before the
shipped ones (``CUDAFLASH_DEBUG=1`` names the rule that chose each config).

torch and the timing code are imported inside ``run`` so that the argument parser stays cheap.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from pathlib import Path
from typing import NamedTuple, Optional

from .._env import tuned_table_path
from ..config import D_HEADS, DTYPES
from ._common import comma_list


class Bucket(NamedTuple):
    max_seqlen_k: Optional[int]  # the rule's bound; None for the last bucket (no bound)
    seqlens: tuple  # the sizes timed for the bucket (seqlen_q = seqlen_k)
    label: str


# Buckets by max seqlen, each timed at both ends of the FlashAttention sweep's lengths
# (512..16384) inside it: one size alone picked configs that tie there and lose at the
# bucket's other end (d64 at S=2048 vs 4096, docs/perf-log.md).
BUCKETS = (
    Bucket(1024, (512, 1024), "S<=1024"),
    Bucket(4096, (2048, 4096), "1024<S<=4096"),
    Bucket(None, (8192, 16384), "S>4096"),
)
QUICK_ITERS, QUICK_WARMUP = 5, 1

# Decoding: calls with at most this many query rows (GQA decoding counts the query heads of a
# K/V head as rows) get their own rule, placed before the others. Timed on one sequence with
# four query heads per K/V head and on a batch of 8 without GQA, one query row each:
# (batch, query heads per K/V head, keys).
DECODE_MAX_ROWS = 16
DECODE_CASES = ((1, 4, 16384), (8, 1, 4096))


class Winner(NamedTuple):
    """The config that won one bucket."""

    dtype: str
    d_head: int
    causal: Optional[bool]  # None: the decoding bucket (either mask)
    max_seqlen_k: Optional[int]
    config: str  # canonical name
    max_seqlen_q: Optional[int] = None  # DECODE_MAX_ROWS for the decoding bucket


def selection_rules(arch: int, winners) -> list[dict]:
    """One selection rule per winner, ordered for first-match semantics: the decoding rules
    (bounded seqlen_q) first; then within a (dtype, d_head, causal), the smaller max_seqlen_k
    first and the unbounded bucket last (a rule without a bound matches every length, so
    anything after it would never be reached)."""

    def order(w: Winner):
        return (w.max_seqlen_q is None, w.dtype, w.d_head, bool(w.causal),
                math.inf if w.max_seqlen_k is None else w.max_seqlen_k)

    rules = []
    for w in sorted(winners, key=order):
        rule = {"arch": [arch], "dtype": w.dtype, "d_head": w.d_head}
        if w.causal is not None:
            rule["causal"] = w.causal
        if w.max_seqlen_q is not None:
            rule["max_seqlen_q"] = w.max_seqlen_q
        if w.max_seqlen_k is not None:
            rule["max_seqlen_k"] = w.max_seqlen_k
        rule["config"] = w.config
        rules.append(rule)
    return rules


def render_table(rules: list[dict], header_lines: list[str]) -> str:
    """yaml text: comment header, then ``selection:`` with one flow mapping per rule, as in
    configs.yaml. Values are written with json.dumps: JSON scalars and lists of numbers are
    valid yaml, so no yaml library is needed to write it."""
    lines = [f"# {line}" for line in header_lines]
    if not rules:
        return "\n".join([*lines, "selection: []"]) + "\n"
    lines.append("selection:")
    for rule in rules:
        lines.append("  - {" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in rule.items()) + "}")
    return "\n".join(lines) + "\n"


def write_table(path: Path, text: str) -> None:
    """Write atomically, so that a runtime reading the file never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ---- command line ----------------------------------------------------------------------------


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "tune", help="time every built config on this GPU and write the fastest as selection "
                     "rules",
        description="For each (dtype, head dim, causal, seqlen bucket: <= 1024, <= 4096, "
                    "longer) and each (dtype, head dim) decoding, time every config built for "
                    "this GPU and write the fastest as selection rules (yaml, the format of "
                    "configs.yaml's selection:).")
    p.add_argument("--dtypes", type=comma_list(str, DTYPES), default=list(DTYPES),
                   help="comma-separated dtypes (default %(default)s)")
    p.add_argument("--head-dims", type=comma_list(int, D_HEADS), default=None,
                   help="comma-separated head dims (default: every head dim with kernels for "
                        "this GPU)")
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK_ITERS} timed calls per candidate instead of the default: a "
                        "smoke test, not a table to rely on")
    p.add_argument("--out", type=Path, default=None, metavar="PATH",
                   help="write the table here instead of "
                        "$XDG_CACHE_HOME/cudaflash/tuned-sm<arch>.yaml")
    p.set_defaults(run=run)
    return p


def run(args) -> int:
    import torch

    from .. import __version__, dispatch, heuristics, manifest, selection
    from . import bench, timing
    from ._common import Progress, format_table

    if not torch.cuda.is_available():
        print(f"cudaflash tune: no CUDA GPU (torch {torch.__version__}: "
              "torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    index = torch.cuda.current_device()
    device = torch.device("cuda", index)
    dk = dispatch.device_kernels(index)  # the kernels flash_attn_func can run there
    arch, gpu, usable = dk.device.arch, dk.device.name, dk.usable
    shipped_rules = manifest.load_manifest().selection
    head_dims = args.head_dims or sorted({e.config.d_head for e in usable.values()})
    iters, warmup = ((QUICK_ITERS, QUICK_WARMUP) if args.quick
                     else (timing.DEFAULT_ITERS, timing.DEFAULT_WARMUP))

    tasks = []  # (cases of the bucket, bucket, candidate configs)
    for dtype in args.dtypes:
        for d_head in head_dims:
            candidates = [e.config for e in usable.values()
                          if (e.config.dtype, e.config.d_head) == (dtype, d_head)]
            if not candidates:
                print(f"no {dtype} d_head={d_head} kernels are built for {gpu} (sm_{arch}); "
                      "skipped")
                continue
            decode = [bench.decode_case(dtype, d_head, batch, group, keys)
                      for batch, group, keys in DECODE_CASES]
            tasks.append((decode, None, candidates))
            for causal in (False, True):
                for bucket in BUCKETS:
                    cases = [bench.fa_case(dtype, d_head, causal, seqlen)
                             for seqlen in bucket.seqlens]
                    tasks.append((cases, bucket, candidates))
    if not tasks:
        print("cudaflash tune: nothing to time", file=sys.stderr)
        return 1
    print(f"{gpu} (sm_{arch}): {len(tasks)} buckets, {len(usable)} configs usable; timing: "
          f"{timing.method_text(iters, warmup)}")

    progress = Progress(sum(len(cs) * len(c) for cs, _, c in tasks), "tune")
    flush = timing.flush_buffer(device)
    rows, winners, changes = [], [], []
    with torch.inference_mode():
        for cases, bucket, candidates in tasks:
            case = cases[0]
            where = (f"{case.dtype} d={case.d_head} decode (<= {DECODE_MAX_ROWS} rows)"
                     if bucket is None else
                     f"{case.dtype} d={case.d_head} causal={case.causal} {bucket.label}")
            # Score: the mean over the bucket's sizes of (this time / the best time at that
            # size); a config that fails at any size is out.
            score = {cfg.name: 0.0 for cfg in candidates}
            for case in cases:
                q, k, v = timing.make_qkv(case.batch, case.seqlen, case.nheads, case.d_head,
                                         case.dtype, device, seqlen_q=case.seqlen_q,
                                         nheads_k=case.kv_heads)
                results = {}  # config name -> Timing, or why it failed
                for cfg in candidates:  # all on the same tensors
                    progress.step(f"{where} S={case.seqlen} {cfg.name}")
                    results[cfg.name] = timing.time_backend(
                        "cudaflash", q, k, v, case.causal, config=cfg, iters=iters,
                        warmup=warmup, flush=flush)
                timed = {n: t for n, t in results.items() if not isinstance(t, str)}
                fastest = min(t.median_ms for t in timed.values()) if timed else None
                for name, t in results.items():
                    if isinstance(t, str):
                        score.pop(name, None)
                        rows.append((where, name, case.seqlen, "n/a", "n/a", "n/a",
                                     f"failed: {t}"))
                        continue
                    if name in score:
                        score[name] += t.median_ms / fastest / len(cases)
                    rows.append((where, name, case.seqlen, f"{t.median_ms:.3f}",
                                 f"{case.flops / t.median_ms / 1e9:.1f}",
                                 f"{fastest / t.median_ms:.2f}", ""))
            last = cases[-1]
            query_rows, _, causal, _ = heuristics.kernel_problem(
                last.seqlen_q, last.nheads, last.kv_heads, last.seqlen, last.causal)
            shipped, _ = selection.select(shipped_rules, usable, arch=arch, dtype=last.dtype,
                                          d_head=last.d_head, causal=causal,
                                          seqlen_q=query_rows, seqlen_k=last.seqlen)
            if not score:
                changes.append(f"{where}: no candidate ran at every size; no rule written")
                continue
            best = min(score, key=score.get)
            rows.append((where, f"winner: {best}", "-", "-", "-", f"{1 / score[best]:.2f}",
                         "best" + (", shipped" if best == shipped else "")))
            if bucket is None:
                winners.append(Winner(case.dtype, case.d_head, None, None, best,
                                      max_seqlen_q=DECODE_MAX_ROWS))
            else:
                winners.append(Winner(case.dtype, case.d_head, case.causal,
                                      bucket.max_seqlen_k, best))
            if best == shipped:
                changes.append(f"{where}: {shipped} (unchanged)")
            elif shipped in score:
                changes.append(f"{where}: {shipped} -> {best} "
                               f"({score[shipped] / score[best]:.2f}x)")
            else:
                changes.append(f"{where}: {shipped} -> {best} (shipped config failed)")
    progress.close()

    print("\ncandidates per bucket (time: median ms; vs best: best time / this time):")
    print(format_table(("bucket", "config", "S", "ms", "TFLOP/s", "vs best", "note"),
                             rows, left=(0, 1, 6)))
    print("\nchanges vs the shipped selection (speedup: the shipped config's mean time "
          "relative to the best over the bucket's sizes, divided by the winner's):")
    for line in changes:
        print(f"  {line}")
    if not winners:
        print("cudaflash tune: no config ran; no table written", file=sys.stderr)
        return 1

    path = args.out if args.out is not None else tuned_table_path(arch)
    header = [
        f"cudaflash tuned selection for {gpu} (sm_{arch}), {datetime.date.today()}, "
        f"cudaflash {__version__}",
        "written by `python -m cudaflash tune" + (" --quick`: a smoke test" if args.quick
                                                  else "`"),
        f"winner per (dtype, d_head, causal, seqlen bucket); timing: median of {iters} calls "
        f"at batch = {bench.FA_TOKENS} / S, nheads = {bench.FA_HIDDEN} / d",
        f"and per (dtype, d_head) for decoding (<= {DECODE_MAX_ROWS} query rows), timed at "
        "(batch, query heads per K/V head, keys) = "
        + ", ".join(str(c) for c in DECODE_CASES),
        "the first rule that matches a call wins: decoding first, shorter max_seqlen_k first",
    ]
    write_table(path, render_table(selection_rules(arch, winners), header))
    print(f"\nwrote {len(winners)} rules to {path}"
          + ("" if args.out is not None else
             " (flash_attn_func now uses them on this GPU; delete the file to go back)"))
    return 0
