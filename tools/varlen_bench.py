"""Packed (varlen) vs padded attention on mixed sequence lengths: flash_attn_varlen_func on the
packed batch, flash_attn_func on the batch padded to the longest sequence, and SDPA flash on
the padded batch. TFLOP/s count only the real (unpadded) work. CUDA events, median of 20.

    python tools/varlen_bench.py               # forward
    python tools/varlen_bench.py --backward    # backward only (2.5x the forward's FLOPs)

The backward times torch.autograd.grad of (q, k, v) from one recorded forward: varlen runs
the deterministic kernels; padded flash_attn_func its default (atomic) scheme.
"""
import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cudaflash import flash_attn_func, flash_attn_varlen_func


def time_ms(fn, iters=20, warmup=5):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main(backward: bool):
    torch.manual_seed(0)
    what = "backward" if backward else "forward"
    print(f"{what}: {'case':38s} {'varlen':>14s} {'padded':>14s} {'SDPA flash padded':>18s}")
    for h, d in ((16, 128), (32, 64)):
        for causal in (False, True):
            lens = torch.randint(128, 4097, (16,)).tolist()
            total, longest = sum(lens), max(lens)
            q = torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16)
            k, v = torch.randn_like(q), torch.randn_like(q)
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                              device="cuda")
            pad = [torch.zeros(len(lens), longest, h, d, device="cuda", dtype=q.dtype)
                   for _ in range(3)]
            for p, x in zip(pad, (q, k, v)):
                for b, (s, n) in enumerate(zip(cu.tolist(), lens)):
                    p[b, :n] = x[s:s + n]
            flops = sum(4 * n * n * d * h for n in lens) / (2 if causal else 1)
            pt = [p.transpose(1, 2) for p in pad]

            def varlen(q, k, v):
                return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, causal=causal)

            def padded(q, k, v):
                return flash_attn_func(q, k, v, causal=causal)

            def sdpa(q, k, v):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            times = []
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                for fn, args in ((varlen, (q, k, v)), (padded, pad), (sdpa, pt)):
                    if not backward:
                        with torch.inference_mode():
                            times.append(time_ms(lambda: fn(*args)))
                        continue
                    leaves = [a.detach().clone().requires_grad_() for a in args]
                    out = fn(*leaves)
                    dout = torch.randn_like(out)
                    times.append(time_ms(lambda: torch.autograd.grad(out, leaves, dout,
                                                                     retain_graph=True)))
            if backward:
                flops *= 2.5
            name = f"B=16 S=128..4096 H={h} d={d} {'causal' if causal else 'non-causal'}"
            print(f"{what}: {name:38s} " + " ".join(
                f"{t:6.3f} ms {flops / t / 1e9:4.0f}T".rjust(14 if i < 2 else 18)
                for i, t in enumerate(times)), flush=True)
    # (Padded causal calls mask from the bottom-right of the padded square, so they do not
    # compute the same thing for short sequences; they are here for time only.)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backward", action="store_true", help="time the backward instead")
    main(parser.parse_args().backward)
