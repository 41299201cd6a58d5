"""Same-run A/B of the warp-specialized forward's producer: TMA loads (tensor maps,
cudaflash/_tma.py) against cp.async, with flash_attn_func's own choice (the shipped selection)
and SDPA's cuDNN backend as peers, at the FlashAttention sizes (batch = 16384 / S, nheads =
2048 / d), causal and not.

    PYTHONPATH=. python3 tools/tma_ab.py [--dtypes bf16,fp16] [--head-dims 128] \
        [--seqlens 512,...] [--iters 30]

Both cudaflash variants run the same explicit config through cudaflash.forward (no plans, so
each call encodes its maps afresh: host time that the L2 flush before each timed call hides);
the switch is _tma.MIN_SCORES (0, with MIN_KEYS 0: every call takes maps; out of reach: none
does). Prints
forward TFLOP/s and the ratios tma / cp.async, tma / default and tma / cuDNN per row, then
their ranges.
"""

import argparse
import contextlib

import torch

from cudaflash import _tma, api
from cudaflash.cli import timing

WS = "fwd_{dtype}_d{d}_br128_bc128_w8_async1_eager1_swz1_q0k0v0_dbuf0_osm1_ctas1_wgmma1_ws"
NEVER = 1 << 62


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="bf16,fp16")
    p.add_argument("--head-dims", default="128")
    p.add_argument("--config", default=WS,
                   help="the config both variants run, {dtype} and {d} filled in (default: "
                        "the warp-specialized kernel; a wgmma config runs v6's TMA path)")
    p.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    p.add_argument("--iters", type=int, default=30)
    args = p.parse_args()
    flush = timing.flush_buffer("cuda")
    shipped = (_tma.MIN_SCORES, _tma.MIN_KEYS)
    print(f"{torch.cuda.get_device_name()}; {timing.method_text(args.iters, 10)}")
    print("dtype   d causal     S   B   H   tma TF/s  cp.async TF/s  default TF/s  cudnn TF/s"
          "  tma/cp.async  tma/default  tma/cudnn")
    ratios: dict = {}
    for dtype, d in ((t, int(h)) for t in args.dtypes.split(",")
                     for h in args.head_dims.split(",")):
        config = args.config.format(dtype=dtype, d=d)
        for causal in (False, True):
            for seqlen in (int(s) for s in args.seqlens.split(",")):
                batch, heads = max(1, 16384 // seqlen), 2048 // d
                q, k, v = timing.make_qkv(batch, seqlen, heads, d, dtype, "cuda")

                def run(min_scores):
                    def call():  # the A/B is the producer's, at every size: MIN_KEYS 0
                        _tma.MIN_SCORES, _tma.MIN_KEYS = min_scores, 0
                        return api.forward(config, q, k, v, causal=causal, num_splits=1)
                    return call, contextlib.nullcontext

                default_fn, _ = timing.backend_call("cudaflash", q, k, v, causal)

                def default():  # flash_attn_func as shipped: its selection, its map rule
                    _tma.MIN_SCORES, _tma.MIN_KEYS = shipped
                    return default_fn()

                calls = {"tma": run(0), "cp.async": run(NEVER),
                         "default": (default, contextlib.nullcontext),
                         "cudnn": timing.backend_call("cudnn", q, k, v, causal)}
                got = timing.time_in_turns(calls, iters=args.iters, warmup=10, flush=flush)
                _tma.MIN_SCORES, _tma.MIN_KEYS = shipped
                flops = 4 * batch * heads * seqlen * seqlen * d / (2 if causal else 1)
                tf = {key: (flops / (t.median_ms * 1e-3) / 1e12 if not isinstance(t, str)
                            else float("nan")) for key, t in got.items()}
                row = {name: tf["tma"] / tf[name] for name in ("cp.async", "default", "cudnn")}
                for name, r in row.items():
                    ratios.setdefault((dtype, d, causal, "tma/" + name), []).append(r)
                print(f"{dtype:>5} {d:>3} {causal!s:>6} {seqlen:>5} {batch:>3} {heads:>3} "
                      f"{tf['tma']:>9.1f} {tf['cp.async']:>14.1f} {tf['default']:>13.1f} "
                      f"{tf['cudnn']:>11.1f} {row['cp.async']:>13.3f} {row['default']:>12.3f} "
                      f"{row['cudnn']:>10.3f}", flush=True)
    print("\nratio ranges (min, median, max):")
    for (dtype, d, causal, name), values in ratios.items():
        values = sorted(values)
        print(f"  {name:>13} {dtype} d={d} causal={causal}: {values[0]:.3f} "
              f"{values[len(values) // 2]:.3f} {values[-1]:.3f}")


if __name__ == "__main__":
    main()
