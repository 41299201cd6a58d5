"""Host time per flash_attn_func call at the bench's tiny size, with the plan's allocators
(torch's _empty_strided_cuda) and without them (torch.empty_like / new_empty), against SDPA
flash: interleaved rounds in one process, as bench.measure_host times them.

    PYTHONPATH=. python3 tools/host_ab.py [--processes N]
"""
import argparse
import dataclasses
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cudaflash import _plans, api
from cudaflash.cli import bench

CALLS, ROUNDS = 400, 9


def one_process() -> None:
    q, k, v = bench.make_qkv(1, 128, 1, 64, "bf16", "cuda")
    with torch.inference_mode():
        api.flash_attn_func(q, k, v)
        (key, fast), = _plans.plans.items()
        slow = dataclasses.replace(fast, new_out=None, new_lse=None)

        def with_plan(plan):
            def call():
                _plans.plans[key] = plan
                for _ in range(CALLS):
                    api.flash_attn_func(q, k, v)
            return call

        qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

        def sdpa():
            for _ in range(CALLS):
                F.scaled_dot_product_attention(qt, kt, vt)

        fns = {"fast alloc": with_plan(fast), "empty_like": with_plan(slow), "sdpa flash": sdpa}
        times = {name: [] for name in fns}
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            for r in range(ROUNDS + 1):
                for name, fn in fns.items():
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    fn()
                    torch.cuda.synchronize()
                    if r:  # round 0 warms up
                        times[name].append((time.perf_counter() - t0) / CALLS * 1e6)
    med = {name: statistics.median(t) for name, t in times.items()}
    sd = med["sdpa flash"]
    print("  ".join(f"{n} {m:5.2f} us" for n, m in med.items()),
          f"| ratio fast {med['fast alloc'] / sd:.3f}  empty_like {med['empty_like'] / sd:.3f}",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child or args.processes == 1:
        one_process()
        return
    for _ in range(args.processes):
        subprocess.run([sys.executable, __file__, "--child"], check=True)


if __name__ == "__main__":
    main()
