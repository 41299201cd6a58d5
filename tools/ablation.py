"""Knob ablations of the forward kernel: each of the seed's optimizations switched off, one at
a time, against a base config, timed on the same tensors (docs/perf-log.md, "Knob ablations").

The variants are not shipped; they are built into their own kernel directory:

    python3 tools/ablation.py yaml .dev/ablation.yaml
    python3 build_cubins.py -j16 --configs .dev/ablation.yaml --out .dev/ablation --archs 90
    CUDAFLASH_KERNEL_DIR=.dev/ablation PYTHONPATH=. python3 tools/ablation.py bench --json x.json

``bench`` times every base and its variants in rounds, taking turns (as ``cudaflash bench``
does with backends), on random inputs at the FlashAttention sizes (batch = 16384 / S, nheads =
2048 / d); it also checks each variant's output against its base's (the same attention up to
rounding), so a variant that computes something else cannot pass as fast. The same directory
serves the GPU correctness tests: CUDAFLASH_KERNEL_DIR=.dev/ablation pytest -k test_config.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cudaflash.config import ConfigError, KernelConfig  # noqa: E402

# Bases: what the H100 runs (the warp-specialized v8 at d128, wgmma at d128 and d64) and the
# seed's design on mma.sync (what sm_80/86 run; its d128 variant is the seed's A100 winner
# with V in slices too).
BASES = (
    "fwd_bf16_d128_br128_bc128_w8_async1_eager1_swz1_q0k0v0_dbuf0_osm1_ctas1_wgmma1_ws",
    "fwd_bf16_d128_br64_bc64_w4_async1_eager1_swz1_q0k0v0_dbuf0_osm1_ctas1_wgmma1",
    "fwd_bf16_d64_br64_bc128_w4_async1_eager1_swz1_q0k0v0_dbuf0_osm1_ctas1_wgmma1",
    "fwd_bf16_d128_br128_bc64_w4_async1_eager1_swz1_q2k2v2_dbuf1_osm1_ctas1_wgmma0",
    "fwd_bf16_d64_br128_bc64_w4_async1_eager1_swz1_q0k0v0_dbuf0_osm1_ctas1_wgmma0",
)

# (label, the seed's step in seed-study.md 3.7, the fields that switch the knob off). A
# variant that breaks a config rule for some base (no swizzle with wgmma) is reported as not
# applicable there, with the rule.
KNOBS = (
    ("no swizzle", 2, {"swizzled": False}),
    ("lazy K/V loads", 3, {"eager_load_blocks": False}),
    ("whole operands (no slice interleave)", 4,
     {"Q_mma_load_K_fragments": 0, "K_mma_load_K_fragments": 0, "V_mma_load_K_fragments": 0,
      "mma_double_buffer_loads": False}),
    ("no smem->reg double buffer", 5, {"mma_double_buffer_loads": False}),
    ("natural exp (no folded exp2)", 6, {"exp2_softmax": False}),
    ("generic first iteration", 10, {"optimized_softmax": False}),
    ("KV blocks first to last", 13, {"kv_reverse": False}),
    ("O stores .cs (streaming)", 14, {"o_store_cache": "streaming"}),
    ("O stores L1::no_allocate", 14, {"o_store_cache": "no_allocate"}),
    ("untiled d_head rows", 15, {"d_head_tiled": False}),
)

SEQLENS = (1024, 4096, 16384)
ROUNDS = 5
CONTROL = "control (the base again)"
CALLS_PER_ROUND = 6
WARMUP = 5


def variants(base: KernelConfig):
    """(label, step, config or why not) per knob; knobs already off in ``base`` are left out."""
    out = []
    for label, step, change in KNOBS:
        if all(getattr(base, f) == v for f, v in change.items()):
            continue
        data = {**base.to_dict(), **change}
        try:
            out.append((label, step, KernelConfig.from_dict(data, where=label)))
        except ConfigError as e:
            out.append((label, step, str(e).split(": ", 1)[-1]))
    return out


def bases(only: str | None) -> list[str]:
    """BASES, or those whose name contains ``only``."""
    return [name for name in BASES if only is None or only in name]


def write_yaml(path: Path, only: str | None = None) -> int:
    configs = []
    for name in bases(only):
        base = KernelConfig.from_name(name)
        configs.append(base)
        configs += [v for _, _, v in variants(base) if isinstance(v, KernelConfig)]
    lines = ["# Written by tools/ablation.py: the knob ablation configs (not shipped).",
             "# Build with --archs 90 (no PTX).", "archs: [90]", "ptx_arch: 80", "configs:"]
    for cfg in dict.fromkeys(configs):
        lines.append("  - " + json.dumps(cfg.to_dict()))
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(set(configs))} configs to {path}")
    return 0


def bench(args) -> int:
    import torch

    from cudaflash.cli import bench as cfbench
    from cudaflash.cli import timing

    device = torch.device("cuda", torch.cuda.current_device())
    flush = cfbench.flush_buffer(device)
    rows, records = [], []
    torch.manual_seed(0)
    with torch.inference_mode():
        for name in bases(args.only):
            base = KernelConfig.from_name(name)
            found = variants(base)
            runnable = [(label, step, v) for label, step, v in found if isinstance(v, KernelConfig)]
            for label, step, why in found:
                if isinstance(why, str):
                    rows.append((name, f"{label} (step {step})", "-", "-", "-", "-", "-",
                                 f"n/a: {why}"))
            for causal in (False, True):
                for seqlen in args.seqlens:
                    case = cfbench.fa_case(base.dtype, base.d_head, causal, seqlen)
                    q, k, v = cfbench.make_qkv(case.batch, seqlen, case.nheads, case.d_head,
                                               case.dtype, device)
                    # The base runs twice: "control" is the base under another label, so its
                    # ratio to the base shows the noise floor of the measurement.
                    entries = ([("base", "-", base), (CONTROL, "-", base)] + runnable)
                    ref = cudaflash_forward(base, q, k, v, causal).float()
                    scale = ref.abs().max().item()
                    err = {label: (cudaflash_forward(cfg, q, k, v, causal).float() - ref).abs()
                           .max().item() / scale for label, _, cfg in entries}
                    # Taking turns, round by round (a slow spell hits one round): the bench's
                    # own loop, timing.time_in_turns.
                    got = timing.time_in_turns(
                        {label: ((lambda c=cfg: cudaflash_forward(c, q, k, v, causal)),
                                 contextlib.nullcontext) for label, _, cfg in entries},
                        iters=CALLS_PER_ROUND * args.rounds, warmup=WARMUP, flush=flush,
                        rounds=args.rounds)
                    failed = {label: t for label, t in got.items() if isinstance(t, str)}
                    if failed:
                        raise RuntimeError(f"{name} {causal=} S={seqlen}: {failed}")
                    ms = {label: t.median_ms for label, t in got.items()}
                    where = f"causal={causal} S={seqlen}"
                    for label, step, cfg in entries:
                        tflops = case.flops / ms[label] / 1e9
                        ratio = ms["base"] / ms[label]
                        rows.append((name, label if step == "-" else f"{label} (step {step})",
                                     where, f"{ms[label]:.3f}", f"{tflops:.1f}",
                                     f"{ratio:.3f}", f"{err[label]:.2e}", ""))
                        records.append({"base": name, "knob": label, "step": step,
                                        "config": cfg.name, "causal": causal,
                                        "seqlen": seqlen, "batch": case.batch,
                                        "nheads": case.nheads, "median_ms": ms[label],
                                        "tflops": tflops, "vs_base": ratio,
                                        "rel_diff_vs_base": err[label]})
    print(f"{torch.cuda.get_device_name(device)}; median of {args.rounds} rounds x "
          f"{CALLS_PER_ROUND} calls per config, configs taking turns; L2 flushed before each "
          "call; vs base = variant TFLOP/s / base TFLOP/s; diff = max |O - O_base| / max |O_base|")
    print(cfbench.format_table(("base", "knob", "problem", "ms", "TFLOP/s", "vs base",
                                "diff", "note"), rows, left=(0, 1, 2, 7)))
    print("\ngeometric mean of vs base over the sizes and both masks, per base and knob:")
    groups = {}
    for rec in records:
        if rec["knob"] != "base":
            groups.setdefault((rec["base"], rec["knob"], rec["step"]), []).append(rec["vs_base"])
    for (name, knob, step), ratios in groups.items():
        knob = knob if step == "-" else f"{knob} (step {step})"
        print(f"  {name}  {knob}: {statistics.geometric_mean(ratios):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    bad = [rec for rec in records if rec["rel_diff_vs_base"] > args.max_diff]
    for rec in bad:
        print(f"WRONG: {rec['config']} causal={rec['causal']} S={rec['seqlen']} differs from "
              f"its base by {rec['rel_diff_vs_base']:.3e} > {args.max_diff}")
    if args.json:
        Path(args.json).write_text(json.dumps({"records": records}, indent=1))
        print(f"wrote {args.json}")
    return 1 if bad else 0


def cudaflash_forward(cfg, q, k, v, causal):
    """O of one forward with config ``cfg`` (cudaflash.forward also returns the lse)."""
    from cudaflash import api
    return api.forward(cfg, q, k, v, causal=causal)[0]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    y = sub.add_parser("yaml", help="write the ablation configs as a configs.yaml")
    y.add_argument("path", type=Path)
    y.add_argument("--only", default=None, help="only the bases whose name contains this")
    b = sub.add_parser("bench", help="time the ablations (CUDAFLASH_KERNEL_DIR: their build)")
    b.add_argument("--seqlens", type=lambda s: [int(x) for x in s.split(",")],
                   default=list(SEQLENS))
    b.add_argument("--rounds", type=int, default=ROUNDS,
                   help=f"rounds of {CALLS_PER_ROUND} calls per config (default %(default)s)")
    b.add_argument("--max-diff", type=float, default=2e-2,
                   help="largest max |O - O_base| / max |O_base| accepted (default "
                        "%(default)s: bf16 rounding of another summation order is ~4e-3)")
    b.add_argument("--json", default=None)
    b.add_argument("--only", default=None, help="only the bases whose name contains this")
    args = p.parse_args()
    return write_yaml(args.path, args.only) if args.cmd == "yaml" else bench(args)


if __name__ == "__main__":
    sys.exit(main())
