"""How close the ring comes to one GPU doing the same work.

    torchrun --nproc-per-node 2 -m cudaflash.distributed.bench [--seqlen 65536] [--heads 16]
        [--heads-k 16] [--head-dim 128] [--dtype bf16] [--causal both] [--json PATH]

Each rank holds seqlen / W rows of q, k, v (the zigzag layout) and runs
``ring_flash_attn_func``: its queries against the whole sequence's keys, the K/V blocks coming
round the ring over NCCL. The baseline is the same work on the same GPU with no ring: the
rank's queries against the keys they see, as whole cudaflash calls on the rank's GPU
(``flash_attn_func``, the keys held locally, leaves of their own so no autograd glue is
timed). Causal: rank r's two chunks, r and 2W-1-r, each against the prefix of the sequence
up to it (bottom-right causal); not causal: all local queries against all keys. Both do the
same FLOPs, 4 * batch * heads * headdim * (visible query-key pairs) for the forward, 2.5x
that for the backward.

efficiency = baseline time / ring time, per phase: forward (under torch.no_grad) and
forward+backward (a forward that records, then torch.autograd.grad with a fixed dout).

Method: CUDA events around each call on the rank's current stream, the ranks lined up by a
barrier (and a device synchronize) before every call; after warm-up calls, the median of the
timed calls, taken in rounds in which ring and baseline take turns; each rank's medians are
gathered and the totals over ranks compared (sum of baseline medians / sum of ring
medians); per-rank figures in --json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

from .. import flash_attn_func
from .attention import ring_flash_attn_func
from .layout import zigzag_shard

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m cudaflash.distributed.bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlen", type=int, default=65536, help="tokens of the whole sequence")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--heads-k", type=int, default=None, help="K/V heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--causal", choices=("both", "true", "false"), default="both")
    p.add_argument("--iters", type=int, default=10, help="timed calls per variant")
    p.add_argument("--rounds", type=int, default=2, help="rounds the timed calls are split in")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", default=None, help="write the results here (rank 0)")
    return p.parse_args(argv)


def time_call(fn, *, iters: int) -> list:
    """Milliseconds of each of ``iters`` calls, every call started with the ranks lined up."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        dist.barrier(device_ids=[torch.cuda.current_device()])
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def baseline_calls(q, k_full, v_full, causal: bool, rank: int, world: int):
    """(q rows, keys, values) of the whole cudaflash calls that do this rank's work on one
    GPU: each chunk of queries against the prefix of keys it sees, or everything."""
    if not causal:
        return [(q, k_full, v_full)]
    c = q.shape[1] // 2
    calls = []
    for half, chunk in ((0, rank), (1, 2 * world - 1 - rank)):
        seen = (chunk + 1) * c  # bottom-right causal: the chunk's last row sees this prefix
        calls.append((q[:, half * c:(half + 1) * c], k_full[:, :seen], v_full[:, :seen]))
    return [tuple(t.detach().clone() for t in call) for call in calls]  # leaves of their own


def pairs(causal: bool, local: int, seqlen: int) -> int:
    """Visible (query, key) pairs of one rank: in the zigzag layout every rank sees half of
    its queries' full rows (2W c^2 = local * seqlen / 2 exactly)."""
    return local * seqlen // 2 if causal else local * seqlen


def measure(args, causal: bool, rank: int, world: int) -> dict:
    dtype, device = DTYPES[args.dtype], torch.device("cuda", torch.cuda.current_device())
    heads_k = args.heads_k or args.heads
    b, s, d = args.batch, args.seqlen, args.head_dim
    g = torch.Generator(device=device).manual_seed(0)  # the same sequence on every rank's GPU

    def randn(*shape):
        return torch.randn(shape, generator=g, device=device, dtype=dtype)

    q_full, k_full, v_full = randn(b, s, args.heads, d), randn(b, s, heads_k, d), \
        randn(b, s, heads_k, d)
    q, k, v = (zigzag_shard(t, rank, world).requires_grad_() for t in (q_full, k_full, v_full))
    dout = randn(*q.shape)
    del q_full

    def ring_forward():
        with torch.no_grad():
            ring_flash_attn_func(q, k, v, causal=causal)

    def ring_train():
        torch.autograd.grad(ring_flash_attn_func(q, k, v, causal=causal), (q, k, v), dout)

    calls = baseline_calls(q, k_full, v_full, causal, rank, world)
    leaves = [t.requires_grad_() for call in calls for t in call]
    douts = [dout[:, :c[0].shape[1]] if i == 0 else dout[:, -c[0].shape[1]:]
             for i, c in enumerate(calls)]

    def base_forward():
        with torch.no_grad():
            for qi, ki, vi in calls:
                flash_attn_func(qi, ki, vi, causal=causal)

    def base_train():
        outs = [flash_attn_func(qi, ki, vi, causal=causal) for qi, ki, vi in calls]
        torch.autograd.grad(outs, leaves, douts)

    variants = {("forward", "ring"): ring_forward, ("forward", "one GPU"): base_forward,
                ("fwd+bwd", "ring"): ring_train, ("fwd+bwd", "one GPU"): base_train}
    for fn in variants.values():
        for _ in range(args.warmup):
            fn()
    samples = {key: [] for key in variants}
    for r in range(args.rounds):
        n = args.iters // args.rounds + (r < args.iters % args.rounds)
        for key, fn in variants.items():
            samples[key] += time_call(fn, iters=n)
    medians = torch.tensor([statistics.median(samples[key]) for key in variants],
                           device=device, dtype=torch.float64)
    gathered = [torch.empty_like(medians) for _ in range(world)]
    dist.all_gather(gathered, medians)
    per_rank = [dict(zip(variants, t.tolist())) for t in gathered]
    flops_fwd = 4 * b * args.heads * d * pairs(causal, q.shape[1], s)
    result = {"causal": causal, "phases": {}}
    for phase, flop_factor in (("forward", 1.0), ("fwd+bwd", 3.5)):
        ring = [m[(phase, "ring")] for m in per_rank]
        base = [m[(phase, "one GPU")] for m in per_rank]
        result["phases"][phase] = {
            "ring_ms": ring, "one_gpu_ms": base,
            "efficiency": sum(base) / sum(ring),
            "efficiency_per_rank": [x / y for x, y in zip(base, ring)],
            "ring_tflops_per_gpu": [flop_factor * flops_fwd / (t * 1e-3) / 1e12 for t in ring],
        }
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    if "LOCAL_RANK" not in os.environ:
        print("run it under torchrun, one process per GPU: torchrun --nproc-per-node 2 -m "
              "cudaflash.distributed.bench", file=sys.stderr)
        return 2
    local = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=local)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.seqlen % (2 * world):
        raise SystemExit(f"--seqlen {args.seqlen} must be a multiple of 2 x {world} ranks")
    cases = {"both": (True, False), "true": (True,), "false": (False,)}[args.causal]
    results = [measure(args, causal, rank, world) for causal in cases]
    if rank == 0:
        name = torch.cuda.get_device_name()
        heads_k = args.heads_k or args.heads
        print(f"ring attention on {world} x {name} (NCCL), {args.dtype}, batch {args.batch}, "
              f"{args.seqlen} tokens ({args.seqlen // world} per GPU), {args.heads} heads "
              f"({heads_k} K/V), head dim {args.head_dim}")
        print("one GPU = the same queries and keys per rank as whole cudaflash calls, no ring; "
              "efficiency = one GPU time / ring time (sums over ranks); medians of "
              f"{args.iters} calls after {args.warmup} warm-up calls")
        print(f"{'causal':<8}{'phase':<9}{'ring ms':>18}{'one GPU ms':>18}{'efficiency':>12}"
              f"{'ring TFLOP/s/GPU':>18}")
        for r in results:
            for phase, m in r["phases"].items():
                ring = "/".join(f"{t:.2f}" for t in m["ring_ms"])
                base = "/".join(f"{t:.2f}" for t in m["one_gpu_ms"])
                tflops = statistics.mean(m["ring_tflops_per_gpu"])
                print(f"{str(r['causal']):<8}{phase:<9}{ring:>18}{base:>18}"
                      f"{m['efficiency']:>11.1%}{tflops:>18.0f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"gpu": name, "world_size": world, "args": vars(args),
                           "results": results}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
