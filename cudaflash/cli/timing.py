"""How the CLI times a call: CUDA events around each single call after warm-up, L2 flushed
before each, medians (``method_text`` says it in words). ``bench`` and ``tune`` share it; the
functions here return numbers and print nothing."""

from __future__ import annotations

import contextlib
import statistics
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import api
from ..config import KernelConfig

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}
BACKENDS = ("cudaflash", *SDPA_BACKENDS)

DEFAULT_ITERS = 30
MIN_ITERS = 20  # fewer timed calls make the median too noisy to compare backends
DEFAULT_WARMUP = 10
# Larger than the L2 of any current GPU (H100: 50 MB): zeroing it evicts the inputs, so every
# timed call reads them from device memory, as a call inside a model would.
L2_FLUSH_BYTES = 256 * 2**20

CASE_ROUNDS = 3  # timed calls per case are taken in this many rounds, backends taking turns


def make_qkv(batch: int, seqlen: int, nheads: int, d_head: int, dtype: str, device,
             seqlen_q: Optional[int] = None, nheads_k: Optional[int] = None):
    """Random BSHD q (seqlen_q rows, default seqlen) and k, v (nheads_k heads, default
    nheads): never zeros, which hide wrong indexing and can run faster."""
    q_shape = (batch, seqlen if seqlen_q is None else seqlen_q, nheads, d_head)
    kv_shape = (batch, seqlen, nheads if nheads_k is None else nheads_k, d_head)
    return tuple(torch.randn(shape, dtype=TORCH_DTYPES[dtype], device=device)
                 for shape in (q_shape, kv_shape, kv_shape))


# ---- timing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    iters: int


def flush_buffer(device) -> torch.Tensor:
    return torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)


def method_text(iters: int, warmup: int, grad: bool = False, model: bool = False) -> str:
    """The timing method in words; ``grad``: the suites with gradients (phase_call);
    ``model``: the hf suite's whole-model calls."""
    inputs = ("the same tensors for every variant of a row, leaves requiring grad, and a "
              "fixed torch.randn dout; phases as timing.phase_call says" if grad
              else "torch.inference_mode()")
    if model:
        return (f"CUDA events around each single call (a whole-model step, host time "
                f"included), after {warmup} warm-up calls; median of {iters} calls, taken in "
                f"{CASE_ROUNDS} rounds with the variants taking turns; L2 flushed before every "
                "timed call; one model per variant with the same weights (one seed) and the "
                "same random token ids")
    return (f"CUDA events around each single call, after {warmup} warm-up calls; median of "
            f"{iters} calls, taken in {CASE_ROUNDS} rounds with the backends taking turns "
            f"(min and max kept in --json); L2 flushed before every timed call "
            f"by zeroing a {L2_FLUSH_BYTES // 2**20} MiB buffer, outside the events; inputs "
            "torch.randn (BSHD for cudaflash, transpose(1, 2) views of the same tensors for "
            f"SDPA); {inputs}")


def time_gpu(fn: Callable[[], object], *, iters: int, warmup: int,
             flush: torch.Tensor) -> Timing:
    """Device time of ``fn()``: events around each call, L2 flushed before each (see
    ``method_text``)."""
    times = time_calls(fn, iters=iters, warmup=warmup, flush=flush)
    return Timing(statistics.median(times), min(times), max(times), iters)


def time_calls(fn: Callable[[], object], *, iters: int, warmup: int,
               flush: torch.Tensor) -> list:
    """Milliseconds of each of ``iters`` calls of ``fn()`` after ``warmup`` untimed ones."""
    for _ in range(warmup):  # module loads, kernel selection, cuDNN plan building
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in zip(starts, ends)]


def time_in_turns(calls: dict, *, iters: int, warmup: int, flush: torch.Tensor,
                  announce: Optional[Callable[[object], None]] = None,
                  rounds: int = CASE_ROUNDS) -> dict:
    """Time every ``key -> (fn, context)`` of ``calls`` (``fn()`` runs inside ``context()``)
    with ``time_calls``: ``iters`` calls each, taken in ``rounds`` rounds in which the
    keys take turns, ``warmup`` untimed calls before a key's first round and one before each
    later round. Returns ``key -> Timing``, or the reason (a string) for a key whose call
    failed (it is not tried again). ``announce(key)`` is called before each key's first round.

    Why turns: this H100 has slow spells of some tens of ms (perf log, "Final run at the
    varlen HEAD"); timed in one block, a backend could spend all of its calls in one. Taking
    turns, a spell reaches one round of one backend, which the median over all rounds
    outvotes."""
    samples: dict = {key: [] for key in calls}
    errors: dict = {}
    for round_index in range(rounds):
        n = iters // rounds + (round_index < iters % rounds)
        for key, (fn, context) in calls.items():
            if key in errors:
                continue
            if round_index == 0 and announce is not None:
                announce(key)
            got = attempt(lambda: time_calls(fn, iters=n, warmup=warmup if round_index == 0
                                              else 1, flush=flush), context)
            if isinstance(got, str):
                errors[key] = got
            else:
                samples[key] += got
    return {key: errors[key] if key in errors
            else Timing(statistics.median(t), min(t), max(t), len(t))
            for key, t in samples.items()}


def phase_call(phase: str, forward: Callable[[], torch.Tensor], inputs: tuple,
               dout: torch.Tensor) -> Callable[[], object]:
    """What one timed call of ``phase`` runs, given ``forward()`` (the attention op on the
    leaves ``inputs``, which require grad) and the fixed upstream gradient ``dout``:

    forward   ``forward()`` under torch.no_grad(): the kernel as inference runs it (the
              forward that saves for the backward is inside ``train``);
    backward  ``torch.autograd.grad(out, inputs, dout, retain_graph=True)`` of one ``out``
              recorded by the first (warm-up) call: the forward is outside the events;
    train     a training step of the op: ``forward()`` with autograd recording, then
              ``torch.autograd.grad`` of it with ``dout``.
    """
    if phase == "forward":
        def run_forward():
            with torch.no_grad():
                return forward()
        return run_forward
    if phase == "train":
        return lambda: torch.autograd.grad(forward(), inputs, dout)
    if phase != "backward":
        raise ValueError(f"unknown phase {phase!r}")
    recorded: list = []

    def run_backward():
        if not recorded:  # the first call (a warm-up one, never timed) records the forward
            recorded.append(forward())
        return torch.autograd.grad(recorded[0], inputs, dout, retain_graph=True)
    return run_backward


def sdpa_context(backend: str):
    """A context that restricts SDPA to ``backend`` ("flash", "cudnn", "efficient")."""
    return lambda: sdpa_kernel(SDPA_BACKENDS[backend])


def backend_call(backend: str, q, k, v, causal: bool,
                 config: Optional[KernelConfig] = None):
    """``(fn, context)``: ``fn()`` runs one forward of ``backend`` and must run inside
    ``context()``. The context is separate so that a timing loop enters it once: entering
    ``sdpa_kernel`` per call would add its own host cost to SDPA's.

    For cudaflash, ``config`` None means ``flash_attn_func`` (the runtime's selection); a
    config runs that kernel through ``cudaflash.forward``.
    """
    if backend == "cudaflash":
        if config is None:
            return (lambda: api.flash_attn_func(q, k, v, causal=causal)), contextlib.nullcontext
        return (lambda: api.forward(config, q, k, v, causal=causal)), contextlib.nullcontext
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # views, no copy
    if k.shape[2] != q.shape[2]:  # GQA: SDPA's own option, where the backend has it
        return ((lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                        enable_gqa=True)),
                lambda: sdpa_kernel(SDPA_BACKENDS[backend]))
    return ((lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)),
            lambda: sdpa_kernel(SDPA_BACKENDS[backend]))


def attempt(measure: Callable[[], object], context) -> Union[object, str]:
    """``measure()`` inside ``context()``; on failure the reason as a string (the backend is
    n/a for this problem). Any exception counts: one backend failing on one shape must not
    lose the rest of the sweep. SDPA explains a refusal in warnings, so those are kept."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with context():
                return measure()
        except Exception as e:
            lines = str(e).strip().splitlines() or [type(e).__name__]
            why = [str(w.message).strip().splitlines()[0] for w in caught
                   if str(w.message).strip()]
            return "; ".join([f"{type(e).__name__}: {lines[0]}", *dict.fromkeys(why)])


def time_backend(backend: str, q, k, v, causal: bool, *, config: Optional[KernelConfig],
                 iters: int, warmup: int, flush: torch.Tensor) -> Union[Timing, str]:
    """``time_gpu`` of one backend on (q, k, v), or why it cannot run them."""
    fn, context = backend_call(backend, q, k, v, causal, config)
    return attempt(lambda: time_gpu(fn, iters=iters, warmup=warmup, flush=flush), context)
