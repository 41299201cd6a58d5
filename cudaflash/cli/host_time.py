"""The host time per call: flash_attn_func and the SDPA backends at a size so small that the
GPU finishes each call before the host has issued the next, so a loop's time is the host's."""

from __future__ import annotations

import statistics
import time

import torch

from ._common import Progress
from .timing import attempt, backend_call, make_qkv

# Host overhead probe: a problem so small that the GPU finishes each call before the host has
# issued the next, so the loop time is the time the host spends per call.
HOST_BATCH, HOST_HEADS, HOST_SEQLEN, HOST_D_HEAD, HOST_DTYPE = 1, 1, 128, 64, "bf16"
HOST_CALLS = 400  # per round: few enough that the GPU queue never fills and throttles the host
HOST_ROUNDS = 7  # backends take turns, round by round: host-speed drift hits them all alike
HOST_WARMUP = 100


def host_round(fn, warmup: int, calls: int = HOST_CALLS) -> float:
    """Microseconds per call of ``calls`` back-to-back calls of ``fn`` (no sync inside the
    loop, one at the end), after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def measure_host(backends, *, device, progress: Progress) -> dict:
    """Microseconds per call at the tiny size (or why n/a), per backend: the median over
    ``HOST_ROUNDS`` rounds of ``HOST_CALLS`` calls with no sync inside the loop (one sync at
    the end), after warm-up. The backends take turns in every round, because this machine's
    host speed drifts over seconds and a backend timed last would carry all of the drift."""
    q, k, v = make_qkv(HOST_BATCH, HOST_SEQLEN, HOST_HEADS, HOST_D_HEAD, HOST_DTYPE, device)
    calls = {backend: backend_call(backend, q, k, v, causal=False) for backend in backends}

    samples: dict = {backend: [] for backend in backends}
    for round_index in range(HOST_ROUNDS):
        for backend, (fn, context) in calls.items():
            if isinstance(samples[backend], str):
                continue
            progress.step(f"host time {backend} (round {round_index + 1})")
            got = attempt(lambda: host_round(fn, HOST_WARMUP if round_index == 0 else 10),
                           context)
            if isinstance(got, str):
                samples[backend] = got  # n/a, with the reason
            else:
                samples[backend].append(got)
    return {backend: got if isinstance(got, str) else statistics.median(got)
            for backend, got in samples.items()}


def print_host(host: dict) -> None:
    print(f"\nhost time per call (B={HOST_BATCH} H={HOST_HEADS} S={HOST_SEQLEN} d={HOST_D_HEAD} "
          f"{HOST_DTYPE}; median of {HOST_ROUNDS} rounds of {HOST_CALLS} calls, backends "
          "taking turns, no sync inside a round; cudaflash = flash_attn_func):")
    for backend, us in host.items():
        print(f"  {backend}: " + (f"n/a ({us})" if isinstance(us, str) else f"{us:.1f} us"))
