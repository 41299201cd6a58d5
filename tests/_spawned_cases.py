"""Test cases run in processes spawned for torch.distributed (test_distributed_ring.py on
gloo, test_gpu_ring.py on NCCL): each process records one text per case in a JSON file of
its rank, "ok", what run() returned instead (e.g. "skipped: why"), or the exception with its
last frames; the test process reads them back and asserts per case. An exception in one
case does not stop the others: every rank must still reach the same collectives.
"""

from __future__ import annotations

import json
import traceback
from pathlib import Path


def run_recorded(cases, run, frames: int = 3) -> dict:
    """{case.id: "ok", run(case)'s text, or the failure} for each case, in order."""
    outcome = {}
    for case in cases:
        try:
            result = run(case)
            outcome[case.id] = "ok" if result is None else result
        except Exception as e:  # reported per case; the comparisons run after all transfers
            outcome[case.id] = f"{type(e).__name__}: {e}\n" + \
                               "".join(traceback.format_tb(e.__traceback__)[-frames:])
    return outcome


def write_outcome(results: str, rank: int, outcome: dict) -> None:
    with open(f"{results}.{rank}", "w") as f:
        json.dump({case_id: f"rank {rank}: {text}" if text != "ok" and
                   not text.startswith("skipped: ") else text
                   for case_id, text in outcome.items()}, f)


def read_outcomes(results: str, world: int) -> dict:
    """{case id: [each rank's text]} from the files write_outcome wrote."""
    outcomes = {}
    for rank in range(world):
        for case_id, text in json.loads(Path(f"{results}.{rank}").read_text()).items():
            outcomes.setdefault(case_id, []).append(text)
    return outcomes
