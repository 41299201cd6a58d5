"""flash_attn_with_kvcache on decoding steps: device time against the alternatives a user has
without it, and host time per call.

    PYTHONPATH=. python3 tools/kvcache_bench.py [--dtype bf16]

Per case (one query row per sequence, GQA 32/8 heads, d128; cache lengths drawn uniformly
in [1, seqlen_cache]):
  kvcache  flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths)
  full     flash_attn_func over the whole padded cache: the work of the longest sequence for
           every sequence (and wrong answers where a cache is not full: an upper bound)
  sdpa-eff SDPA's efficient backend with a key-padding mask (the correct equivalent in torch)
Timing as `cudaflash bench`: CUDA events around each call, L2 flushed before each, median of
30 calls in 3 rounds, randn inputs. Host time: calls back to back without sync at B=1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cudaflash import flash_attn_func, flash_attn_with_kvcache  # noqa: E402
from cudaflash.cli import bench  # noqa: E402
from cudaflash.cli.timing import TORCH_DTYPES  # noqa: E402

CASES = ((1, 16384), (8, 8192), (32, 4096), (64, 16384))  # (batch, seqlen_cache)
HEADS, HEADS_K, D_HEAD = 32, 8, 128


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=sorted(TORCH_DTYPES), default="bf16")
    args = p.parse_args()
    dtype = TORCH_DTYPES[args.dtype]
    device = torch.device("cuda", torch.cuda.current_device())
    flush = bench.flush_buffer(device)
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name(device)}, {args.dtype}, nheads {HEADS}/{HEADS_K}, "
          f"d {D_HEAD}, one query row per sequence; median ms (us where noted)")
    rows = []
    with torch.inference_mode():
        for batch, seqlen_cache in CASES:
            q = torch.randn(batch, 1, HEADS, D_HEAD, device=device, dtype=dtype)
            kc = torch.randn(batch, seqlen_cache, HEADS_K, D_HEAD, device=device, dtype=dtype)
            vc = torch.randn_like(kc)
            lengths = torch.randint(1, seqlen_cache + 1, (batch,), device=device,
                                    dtype=torch.int32)
            keys = torch.arange(seqlen_cache, device=device)
            mask = (keys[None, :] < lengths[:, None])[:, None, None, :]  # (b, 1, 1, s)
            qt, kt, vt = (t.transpose(1, 2) for t in (q, kc, vc))
            kt = kt.repeat_interleave(HEADS // HEADS_K, dim=1)
            vt = vt.repeat_interleave(HEADS // HEADS_K, dim=1)
            calls = {
                "kvcache": lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths),
                "full": lambda: flash_attn_func(q, kc, vc),
                "sdpa-eff": lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask),
            }
            samples = {name: [] for name in calls}
            with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
                for r in range(bench.CASE_ROUNDS):
                    for name, fn in calls.items():
                        samples[name] += bench.time_calls(fn, iters=10, warmup=5 if r == 0
                                                          else 1, flush=flush)
            ms = {name: statistics.median(t) for name, t in samples.items()}
            used = int(lengths.sum())
            bytes_moved = 2 * used * HEADS_K * D_HEAD * q.element_size()  # K and V read once
            rows.append((batch, seqlen_cache, used // batch, f"{ms['kvcache']:.3f}",
                         f"{bytes_moved / ms['kvcache'] / 1e6:.0f}", f"{ms['full']:.3f}",
                         f"{ms['sdpa-eff']:.3f}", f"{ms['sdpa-eff'] / ms['kvcache']:.2f}"))
    print(bench.format_table(("batch", "cache", "mean len", "kvcache", "GB/s", "full",
                              "sdpa-eff", "sdpa/kvc"), rows))

    q = torch.randn(1, 1, HEADS, D_HEAD, device=device, dtype=dtype)
    kc = torch.randn(1, 128, HEADS_K, D_HEAD, device=device, dtype=dtype)
    vc = torch.randn_like(kc)
    lengths = torch.tensor([100], device=device, dtype=torch.int32)
    host = {"kvcache (tensor lengths)":
            lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths),
            "kvcache (int length)": lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=100),
            "flash_attn_func": lambda: flash_attn_func(q, kc, vc)}
    print("\nhost time per call (B=1, cache 128; median of 5 rounds of 200 calls, no sync):")
    with torch.inference_mode():
        for name, fn in host.items():
            for _ in range(50):
                fn()
            per_call = []
            for _ in range(5):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(200):
                    fn()
                per_call.append((time.perf_counter() - t0) / 200 * 1e6)
            torch.cuda.synchronize()
            print(f"  {name}: {statistics.median(per_call):.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
