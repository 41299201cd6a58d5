"""Same-run A/B of the warp-specialized forward's producer: TMA loads (tensor maps,
cudaflash/_tma.py) against cp.async, with SDPA's cuDNN backend as the peer, at the
FlashAttention sizes (batch = 16384 / S, nheads = 2048 / d), d 128, causal and not.

    PYTHONPATH=. python3 tools/tma_ab.py [--dtypes bf16,fp16] [--seqlens 512,...] [--iters 30]

Both cudaflash variants run the same explicit config through cudaflash.forward (no plans, so
each call encodes its maps afresh: host time that the L2 flush before each timed call hides);
the switch is _tma.MIN_SCORES (0, with MIN_KEYS 0: every call takes maps; out of reach: none
does). Prints
forward TFLOP/s and the ratios tma / cp.async and tma / cuDNN per row, then their ranges.
"""

import argparse
import contextlib

import torch

from cudaflash import _tma, api
from cudaflash.cli import timing

WS = "fwd_{}_d128_br128_bc128_w8_async1_eager1_swz1_q0k0v0_dbuf0_osm1_ctas1_wgmma1_ws"
NEVER = 1 << 62


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    flush = timing.flush_buffer("cuda")
    _tma.MIN_KEYS = 0  # the A/B is the producer's, at every size
    d = 128
    print(f"{torch.cuda.get_device_name()}; {timing.method_text(args.iters, 10)}")
    print("dtype causal     S   B   H   tma TF/s  cp.async TF/s  cudnn TF/s  tma/cp.async  "
          "tma/cudnn")
    ratios: dict = {}
    for dtype in args.dtypes.split(","):
        config = WS.format(dtype)
        for causal in (False, True):
            for seqlen in (int(s) for s in args.seqlens.split(",")):
                batch, heads = max(1, 16384 // seqlen), 2048 // d
                q, k, v = timing.make_qkv(batch, seqlen, heads, d, dtype, "cuda")

                def run(min_scores):
                    def call():
                        _tma.MIN_SCORES = min_scores
                        return api.forward(config, q, k, v, causal=causal, num_splits=1)
                    return call, contextlib.nullcontext

                calls = {"tma": run(0), "cp.async": run(NEVER),
                         "cudnn": timing.backend_call("cudnn", q, k, v, causal)}
                got = timing.time_in_turns(calls, iters=args.iters, warmup=10, flush=flush)
                _tma.MIN_SCORES = NEVER
                flops = 4 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)
                tf = {key: (flops / (t.median_ms * 1e-3) / 1e12 if not isinstance(t, str)
                            else float("nan")) for key, t in got.items()}
                r_cp, r_cudnn = tf["tma"] / tf["cp.async"], tf["tma"] / tf["cudnn"]
                ratios.setdefault((dtype, causal, "tma/cp.async"), []).append(r_cp)
                ratios.setdefault((dtype, causal, "tma/cudnn"), []).append(r_cudnn)
                print(f"{dtype:>5} {causal!s:>6} {seqlen:>5} {batch:>3} {heads:>3} "
                      f"{tf['tma']:>9.1f} {tf['cp.async']:>14.1f} {tf['cudnn']:>11.1f} "
                      f"{r_cp:>13.3f} {r_cudnn:>10.3f}", flush=True)
    print("\nratio ranges (min, median, max):")
    for (dtype, causal, name), values in ratios.items():
        values = sorted(values)
        print(f"  {name:>13} {dtype} causal={causal}: {values[0]:.3f} "
              f"{values[len(values) // 2]:.3f} {values[-1]:.3f}")


if __name__ == "__main__":
    main()
