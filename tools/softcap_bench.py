"""Forward speed with and without softcapping, same tensors, backends taking turns.

    PYTHONPATH=. python tools/softcap_bench.py [--cap 30] [--rounds 5] [--backward]

bf16, the bench's default sweep shape rule (batch = 16384 / S, nheads = 2048 / d) at a few
lengths; TFLOP/s from CUDA events, median over rounds of 10 timed calls each. --backward
times a training step (forward + backward, deterministic=True on both sides: a cap always
runs the deterministic backward) and counts 2.5x the forward's FLOPs, as flash-attn does.
"""

import argparse
import statistics

import torch

from cudaflash import flash_attn_func


def time_ms(fn, calls=10):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cap", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backward", action="store_true")
    args = parser.parse_args()
    print(f"{'d':>4} {'causal':>6} {'S':>6}  plain TFLOP/s  softcap TFLOP/s  ratio")
    for d in (64, 128):
        for causal in (False, True):
            for s in (1024, 4096, 16384):
                b, h = 16384 // s, 2048 // d
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16,
                                       requires_grad=args.backward) for _ in range(3))
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                if args.backward:
                    flops *= 3.5  # forward + backward (2.5x)
                    dout = torch.randn_like(q)

                    def step(cap):
                        out = flash_attn_func(q, k, v, causal=causal, softcap=cap,
                                              deterministic=True)
                        out.backward(dout)
                    runs = {"plain": lambda: step(0.0), "softcap": lambda: step(args.cap)}
                else:
                    runs = {"plain": lambda: flash_attn_func(q, k, v, causal=causal),
                            "softcap": lambda: flash_attn_func(q, k, v, causal=causal,
                                                               softcap=args.cap)}
                for fn in runs.values():
                    fn()
                times = {name: [] for name in runs}
                for _ in range(args.rounds):
                    for name, fn in runs.items():
                        times[name].append(time_ms(fn))
                tf = {name: flops / statistics.median(t) / 1e9 for name, t in times.items()}
                print(f"{d:>4} {str(causal):>6} {s:>6}  {tf['plain']:13.1f}  "
                      f"{tf['softcap']:15.1f}  {tf['softcap'] / tf['plain']:5.2f}")


if __name__ == "__main__":
    main()
