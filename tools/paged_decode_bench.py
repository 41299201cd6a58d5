"""Paged against contiguous K/V caches in a decoding step (one query row per sequence), and
the K/V bandwidth against a device copy, on one GPU, in one process (issue "Every flash-attn
2.x argument works", item 7).

    python3 tools/paged_decode_bench.py [--dtype bf16] [--d 128] [--pages 16,64,256]

For each (batch, cache length): flash_attn_with_kvcache with contiguous caches and with the
same caches in shuffled pages of each size, timed in turns (cudaflash.cli.timing: CUDA events,
L2 flushed, medians); GB/s = K and V bytes read per call / time. The copy's GB/s: a
torch copy of a buffer of the caches' size (read + write bytes / time).
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cudaflash import flash_attn_with_kvcache  # noqa: E402
from cudaflash.cli import timing  # noqa: E402

CASES = [(32, 8192), (128, 4096), (8, 32768), (64, 16384)]  # (batch, cache length)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bf16", choices=list(timing.TORCH_DTYPES))
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--heads-k", type=int, default=8)
    p.add_argument("--pages", default="16,64,256")
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    dtype = timing.TORCH_DTYPES[args.dtype]
    pages = [int(x) for x in args.pages.split(",")]
    flush = timing.flush_buffer("cuda")
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy = timing.time_gpu(lambda: dst.copy_(src), iters=args.iters, warmup=5, flush=flush)
    copy_gbs = 2 * src.numel() / copy.median_ms / 1e6
    print(f"device copy of 1 GiB: {copy_gbs:.0f} GB/s (read + write)")
    print(f"{'batch':>6} {'cache':>6} {'layout':>10} {'ms':>8} {'GB/s':>7} {'of copy':>8} "
          f"{'vs contiguous':>14}")
    for batch, length in CASES:
        q = torch.randn(batch, 1, args.heads, args.d, dtype=dtype, device="cuda")
        kc = torch.randn(batch, length, args.heads_k, args.d, dtype=dtype, device="cuda")
        vc = torch.randn_like(kc)
        seqlens = torch.full((batch,), length, dtype=torch.int32, device="cuda")
        calls = {"contiguous": (lambda kc=kc, vc=vc: flash_attn_with_kvcache(
            q, kc, vc, cache_seqlens=seqlens), torch.no_grad)}
        ref = calls["contiguous"][0]()
        for page in pages:
            n = batch * length // page
            perm = torch.randperm(n, device="cuda")
            table = perm.view(batch, length // page).to(torch.int32)
            kp = torch.empty((n, page, args.heads_k, args.d), dtype=dtype, device="cuda")
            vp = torch.empty_like(kp)
            kp[perm] = kc.view(n, page, args.heads_k, args.d)
            vp[perm] = vc.view(n, page, args.heads_k, args.d)
            calls[f"page {page}"] = (
                lambda kp=kp, vp=vp, table=table: flash_attn_with_kvcache(
                    q, kp, vp, cache_seqlens=seqlens, block_table=table), torch.no_grad)
            got = calls[f"page {page}"][0]()
            if not torch.equal(ref, got):
                print(f"WARNING: page {page}: max |paged - contiguous| = "
                      f"{(ref.float() - got.float()).abs().max().item():.3g}")
        times = timing.time_in_turns(calls, iters=args.iters, warmup=5, flush=flush)
        kv_bytes = 2 * kc.numel() * kc.element_size()
        base = times["contiguous"].median_ms
        for name, t in times.items():
            gbs = kv_bytes / t.median_ms / 1e6
            print(f"{batch:>6} {length:>6} {name:>10} {t.median_ms:>8.3f} {gbs:>7.0f} "
                  f"{gbs / copy_gbs:>8.2f} {base / t.median_ms:>14.3f}")
        del kc, vc, calls
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
