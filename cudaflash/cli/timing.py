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


def method_text(iters: int, warmup: int) -> str:
    return (f"CUDA events around each single call, after {warmup} warm-up calls; median of "
            f"{iters} calls, taken in {CASE_ROUNDS} rounds with the backends taking turns "
            f"(min and max kept in --json); L2 flushed before every timed call "
            f"by zeroing a {L2_FLUSH_BYTES // 2**20} MiB buffer, outside the events; inputs "
            "torch.randn (BSHD for cudaflash, transpose(1, 2) views of the same tensors for "
            "SDPA); torch.inference_mode()")


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
