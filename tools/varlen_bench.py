"""Packed (varlen) vs padded attention on mixed sequence lengths: flash_attn_varlen_func on the
packed batch, flash_attn_func on the batch padded to the longest sequence, and SDPA flash on
the padded batch. TFLOP/s count only the real (unpadded) work. CUDA events, median of 20.

    python tools/varlen_bench.py
"""
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


def main():
    torch.manual_seed(0)
    print(f"{'case':38s} {'varlen':>14s} {'padded':>14s} {'SDPA flash padded':>18s}")
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
            t_var = time_ms(lambda: flash_attn_varlen_func(q, k, v, cu, cu, longest, longest,
                                                           causal=causal))
            t_pad = time_ms(lambda: flash_attn_func(*pad, causal=causal))
            pt = [p.transpose(1, 2) for p in pad]
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                t_sdpa = time_ms(lambda: F.scaled_dot_product_attention(*pt, is_causal=causal))
            name = f"B=16 S=128..4096 H={h} d={d} {'causal' if causal else 'non-causal'}"
            print(f"{name:38s} " + " ".join(f"{t:6.3f} ms {flops / t / 1e9:4.0f}T".rjust(14 if i < 2 else 18)
                                            for i, t in enumerate((t_var, t_pad, t_sdpa))),
                  flush=True)
    # (Padded causal calls mask from the bottom-right of the padded square, so they do not
    # compute the same thing for short sequences; they are here for time only.)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
