"""Backward pass timing: flash_attn_func's backward against SDPA's flash and cuDNN backends,
on the same tensors, FlashAttention's benchmark convention (batch = 16384 / S, nheads =
2048 / d). Backward TFLOP/s = 2.5 x the forward's FLOPs (five GEMMs to the forward's two) /
time, halved when causal; the time is autograd.grad of out with a fixed random dout (the
forward is not in it), CUDA events, the median of rounds where the backends take turns.
"cudaflash" is the default (atomic dq) scheme, "determ." flash_attn_func(deterministic=True).

    PYTHONPATH=. python3 tools/bwd_bench.py [--dtype bf16] [--seqlens 1024,4096] [--head-dims 64,128]
        [--backward-config NAME,...]   # time these backward configs instead of the shipped choice
        [--atomic-min-rows N]          # the small-call rule's threshold (backward.effective_scheme)
"""

import argparse
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cudaflash import backward, flash_attn_func, manifest

ROUNDS, CALLS = 5, 10


def sdpa(backend):
    def call(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                  v.transpose(1, 2),
                                                  is_causal=causal).transpose(1, 2)
    return call


BACKENDS = {
    "cudaflash": lambda q, k, v, causal: flash_attn_func(q, k, v, causal=causal),
    "determ.": lambda q, k, v, causal: flash_attn_func(q, k, v, causal=causal,
                                                       deterministic=True),
    "flash": sdpa(SDPBackend.FLASH_ATTENTION),
    "cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
}


def time_backward(fn, q, k, v, dout, causal):
    """Milliseconds per backward (one round of CALLS calls)."""
    out = fn(q, k, v, causal)
    for _ in range(3):
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(CALLS):
        torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / CALLS


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384")
    parser.add_argument("--head-dims", default="64,128")
    parser.add_argument("--backward-config", default=None,
                        help="comma-separated backward config names to use (one per dtype and "
                             "head dim, for both schemes) instead of the shipped choice")
    parser.add_argument("--atomic-min-rows", type=int, default=None,
                        help="override the small-call rule's thresholds (backward."
                             "_ATOMIC_MIN_ROWS_PER_CTA and ..._WGMMA; 0 runs every atomic "
                             "call on the atomic kernels)")
    args = parser.parse_args()
    if args.atomic_min_rows is not None:
        backward._ATOMIC_MIN_ROWS_PER_CTA = args.atomic_min_rows
        backward._ATOMIC_MIN_ROWS_PER_CTA_WGMMA = args.atomic_min_rows
        print(f"atomic calls with <= {args.atomic_min_rows} query rows per dK/dV CTA run the "
              "deterministic kernels")
    if args.backward_config:
        wanted = args.backward_config.split(",")
        entries = {e.name: e for e in manifest.load_manifest().backward}
        missing = [n for n in wanted if n not in entries]
        if missing:
            raise SystemExit(f"not in the manifest: {missing}; built: {sorted(entries)}")
        shipped = backward.find_entry

        def find_entry(index, dtype, d_head, scheme):
            for name in wanted:
                e = entries[name]
                if (e.config.dtype, e.config.d_head) == (backward._DTYPES[dtype], d_head):
                    usable = manifest.load_manifest().usable_backward(
                        *[getattr(backward._driver.device(index), a)
                          for a in ("arch", "smem_optin")])
                    return usable[name]
            return shipped(index, dtype, d_head, scheme)

        backward.find_entry = find_entry
        print(f"backward configs: {wanted}")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}; "
          "backward TFLOP/s (ratio = cudaflash / backend)")
    print(f"{'d':>4} {'causal':>6} {'S':>6} {'cudaflash':>10} {'determ.':>8} {'flash':>8} "
          f"{'cudnn':>8} {'vs flash':>9} {'vs cudnn':>9} {'determ. vs flash':>17}")
    for d in [int(x) for x in args.head_dims.split(",")]:
        for causal in (False, True):
            for s in [int(x) for x in args.seqlens.split(",")]:
                b, h = 16384 // s, 2048 // d
                g = torch.Generator(device="cuda").manual_seed(s + d)
                q, k, v, dout = (torch.randn((b, s, h, d), generator=g, device="cuda",
                                             dtype=dtype) for _ in range(4))
                for t in (q, k, v):
                    t.requires_grad_()
                times = {name: [] for name in BACKENDS}
                for _ in range(ROUNDS):
                    for name, fn in BACKENDS.items():
                        try:
                            times[name].append(time_backward(fn, q, k, v, dout, causal))
                        except RuntimeError as e:
                            times[name] = f"n/a ({str(e).splitlines()[0][:40]})"
                    if any(isinstance(t, str) for t in times.values()):
                        break
                flops = 2.5 * 4 * b * h * s * s * d / (2 if causal else 1)
                tflops = {name: (flops / statistics.median(t) / 1e9 if isinstance(t, list)
                                 and t else None) for name, t in times.items()}

                def cell(x):
                    return f"{x:.1f}" if x else "n/a"

                ratios = [f"{tflops[a] / tflops[n]:.2f}x" if tflops[a] and tflops[n] else "n/a"
                          for a, n in (("cudaflash", "flash"), ("cudaflash", "cudnn"),
                                       ("determ.", "flash"))]
                print(f"{d:>4} {str(causal):>6} {s:>6} {cell(tflops['cudaflash']):>10} "
                      f"{cell(tflops['determ.']):>8} {cell(tflops['flash']):>8} "
                      f"{cell(tflops['cudnn']):>8} {ratios[0]:>9} {ratios[1]:>9} "
                      f"{ratios[2]:>17}", flush=True)
                del q, k, v, dout


if __name__ == "__main__":
    main()
