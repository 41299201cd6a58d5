"""tools/sanitizer_sweep.py (the calls compute-sanitizer runs on the GPU machine): it lists
its calls without a GPU, and they reach every kernel family at every head dim with kernels."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def list_calls(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, str(REPO / "tools" / "sanitizer_sweep.py"), "--list",
                          *args], capture_output=True, text=True, env=env, check=True)
    return out.stdout.split("\n")[:-1]


def test_sweep_covers_every_kernel_family_and_head_dim():
    names = list_calls()
    assert len(names) == len(set(names))
    for d in (64, 128, 256):
        mine = [n for n in names if f" d{d} " in n + " "]
        for family in ("fwd+bwd", "causal", "window", "softcap", "alibi", "dropout",
                       "deterministic", "return_attn_probs", "varlen", "paged",
                       "kvcache", "rotary", "batch_idx", "leftpad", "splits"):
            assert any(family in n for n in mine), (d, family)
    # The tensor-map sizes (racecheck and synccheck run these: tools/device_check.sh sanitize).
    assert len(list_calls("--only", " S")) >= 12


def test_only_filters_by_substring():
    assert list_calls("--only", "kvcache d64") == [n for n in list_calls()
                                                   if "kvcache d64" in n]
