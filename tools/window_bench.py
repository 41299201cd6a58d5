"""Sliding-window attention (window_size=(w, 0), causal) against full causal attention:
device time and TFLOP/s of the work inside the window. CUDA events, L2 flushed, median of 30.

    PYTHONPATH=. python3 tools/window_bench.py [--backward | --host]

--backward times a training step instead: the forward with gradients and the backward
(torch.autograd.grad, default scheme), counted as 3.5 forwards of FLOPs (the backward's five
GEMMs to the forward's two), against SDPA flash's step over the full causal mask.
--host measures the host time per call of repeat windowed calls at the bench's tiny size
(flash_attn_func, and a decoding step of flash_attn_with_kvcache) against unwindowed ones.
"""

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cudaflash import flash_attn_func, flash_attn_with_kvcache  # noqa: E402
from cudaflash.cli import bench  # noqa: E402


def window_flops(seqlen: int, window: int, nheads: int, d: int) -> float:
    """4 * d per (query, visible key) pair: row i sees min(i, window) + 1 keys."""
    pairs = sum(min(i, window) + 1 for i in range(seqlen)) if window >= 0 else \
        seqlen * (seqlen + 1) // 2
    return 4.0 * pairs * d * nheads


def training_step(q, k, v, dout, window: int):
    """One forward with gradients and its backward; ``window`` None: SDPA flash, full causal
    (q, k, v in BSHD, viewed as BHSD for SDPA)."""
    if window is None:
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).transpose(1, 2)
    else:
        out = flash_attn_func(q, k, v, causal=True, window_size=(window, 0))
    return torch.autograd.grad(out, (q, k, v), dout)


def main_backward(device, flush) -> int:
    print(f"{torch.cuda.get_device_name(device)}, bf16, causal, batch 1; forward + backward, "
          "median ms over 30 steps; TFLOP/s = 3.5 x the forward's FLOPs inside the window")
    rows = []
    for seqlen, nheads, d in ((16384, 16, 128), (32768, 16, 128), (16384, 32, 64)):
        q, k, v = (t.requires_grad_() for t in bench.make_qkv(1, seqlen, nheads, d, "bf16",
                                                                device))
        dout = torch.randn_like(q)
        for window in (-1, 4096, 1024, 256):
            ms = statistics.median(bench.time_calls(
                lambda w=window: training_step(q, k, v, dout, w), iters=30, warmup=5,
                flush=flush))
            flops = 3.5 * window_flops(seqlen, window, nheads, d)
            rows.append((seqlen, nheads, d, "full" if window < 0 else window, f"{ms:.3f}",
                         f"{flops / ms / 1e9:.0f}"))
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ms = statistics.median(bench.time_calls(
                lambda: training_step(q, k, v, dout, None), iters=30, warmup=5, flush=flush))
        rows.append((seqlen, nheads, d, "SDPA flash full", f"{ms:.3f}",
                     f"{3.5 * window_flops(seqlen, -1, nheads, d) / ms / 1e9:.0f}"))
    print(bench.format_table(("S", "H", "d", "window", "ms", "TFLOP/s"), rows))
    return 0


def host_us(fn, rounds: int = 7) -> float:
    """Median over rounds of bench.host_round (400 back-to-back calls, no sync inside)."""
    return statistics.median(bench.host_round(fn, warmup=10) for _ in range(rounds))


def main_host(device) -> int:
    print(f"{torch.cuda.get_device_name(device)}: host time per call, us (median of 7 rounds "
          "of 400 calls, no sync inside a round)")
    rows = []
    with torch.inference_mode():
        q, k, v = bench.make_qkv(1, 128, 1, 64, "bf16", device)
        for window in ((-1, -1), (32, 0)):
            us = host_us(lambda w=window: flash_attn_func(q, k, v, causal=True, window_size=w))
            rows.append(("flash_attn_func S=128 d=64 causal", str(window), f"{us:.1f}"))
        # Small enough that the GPU keeps up with the host.
        q = torch.randn(1, 1, 8, 128, device=device, dtype=torch.bfloat16)
        kc = torch.randn(1, 512, 2, 128, device=device, dtype=torch.bfloat16)
        vc = torch.randn_like(kc)
        lens = torch.full((1,), 500, dtype=torch.int32, device=device)
        for window in ((-1, -1), (128, 0)):
            us = host_us(lambda w=window: flash_attn_with_kvcache(
                q, kc, vc, cache_seqlens=lens, causal=True, window_size=w))
            rows.append(("with_kvcache decode B=1 H=8/2 cache 512", str(window), f"{us:.1f}"))
    print(bench.format_table(("call", "window", "us"), rows))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backward", action="store_true",
                        help="time forward + backward steps instead of the forward")
    parser.add_argument("--host", action="store_true",
                        help="host time per call of repeat windowed calls")
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    flush = bench.flush_buffer(device)
    if args.backward:
        return main_backward(device, flush)
    if args.host:
        return main_host(device)
    print(f"{torch.cuda.get_device_name(device)}, bf16, causal, batch 1; median ms over 30 "
          "calls; TFLOP/s of the pairs inside the window")
    rows = []
    with torch.inference_mode():
        for seqlen, nheads, d in ((16384, 16, 128), (32768, 16, 128), (16384, 32, 64)):
            q, k, v = bench.make_qkv(1, seqlen, nheads, d, "bf16", device)
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            for window in (-1, 4096, 1024, 256):
                fn = (lambda w=window: flash_attn_func(q, k, v, causal=True,
                                                       window_size=(w, 0)))
                ms = statistics.median(bench.time_calls(fn, iters=30, warmup=5, flush=flush))
                flops = window_flops(seqlen, window, nheads, d)
                rows.append((seqlen, nheads, d, "full" if window < 0 else window,
                             f"{ms:.3f}", f"{flops / ms / 1e9:.0f}"))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                ms = statistics.median(bench.time_calls(
                    lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True),
                    iters=30, warmup=5, flush=flush))
            rows.append((seqlen, nheads, d, "SDPA flash full", f"{ms:.3f}",
                         f"{window_flops(seqlen, -1, nheads, d) / ms / 1e9:.0f}"))
    print(bench.format_table(("S", "H", "d", "window", "ms", "TFLOP/s"), rows))

    # Decoding: one query row against a long cache, 32 query heads on 8 K/V heads, d 128.
    print("\ndecoding (batch 1, one query row, 32/8 heads, d 128, cache 131072; median ms):")
    rows = []
    with torch.inference_mode():
        q = torch.randn(1, 1, 32, 128, device=device, dtype=torch.bfloat16)
        k = torch.randn(1, 131072, 8, 128, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        for window in (-1, 4096):
            fn = (lambda w=window: flash_attn_func(q, k, v, causal=True, window_size=(w, 0)))
            ms = statistics.median(bench.time_calls(fn, iters=30, warmup=5, flush=flush))
            rows.append(("full" if window < 0 else window, f"{ms:.3f}"))
    print(bench.format_table(("window", "ms"), rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
