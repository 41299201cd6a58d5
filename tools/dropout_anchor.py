"""What dropout costs each backend: flash_attn_func, SDPA's cuDNN backend and SDPA's flash
backend (FlashAttention-2), each with dropout_p = 0.1 against itself without, bf16, the
FlashAttention sizes (batch = 16384 / S, nheads = 2048 / d), forward (no grad) and a training
step (forward + autograd.grad with a fixed upstream gradient), timed as `python -m cudaflash
bench` times (cudaflash.cli.timing: events, L2 flushed, medians, variants in turns). Prints
plain time / dropout time per backend, and SDPA-cuDNN's dropout time / cudaflash's.

    python3 tools/dropout_anchor.py      (docs/perf-log.md, "What dropout costs the other
                                          backends"; docs/bench/h200-s32-dropout-anchor.txt)
"""

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cudaflash import flash_attn_func
from cudaflash.cli import timing

CASES = [(64, False, 2048), (64, False, 4096), (64, True, 4096), (64, False, 8192),
         (128, False, 2048), (128, False, 4096), (128, True, 4096)]
SDPA = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def main() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    flush = timing.flush_buffer(dev)
    print("d causal S phase | cf drop/plain | cudnn drop/plain | flash drop/plain | "
          "cf-drop/cudnn-drop")
    for d, causal, seqlen in CASES:
        batch, heads = 16384 // seqlen, 2048 // d
        torch.manual_seed(0)
        q, k, v = (torch.randn(batch, seqlen, heads, d, device=dev, dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        dout = torch.randn(batch, seqlen, heads, d, device=dev, dtype=torch.bfloat16)
        for phase in ("forward", "train"):
            calls = {}
            for p in (0.0, 0.1):
                def ours(p=p):
                    return flash_attn_func(q, k, v, dropout_p=p, causal=causal)
                calls[("cf", p)] = (timing.phase_call(phase, ours, (q, k, v), dout),
                                    contextlib.nullcontext)
                for name, backend in SDPA.items():
                    def sdpa(p=p, backend=backend):
                        with sdpa_kernel(backend):
                            return F.scaled_dot_product_attention(
                                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                dropout_p=p, is_causal=causal)
                    calls[(name, p)] = (timing.phase_call(phase, sdpa, (q, k, v),
                                                          dout.transpose(1, 2)),
                                        contextlib.nullcontext)
            t = timing.time_in_turns(calls, iters=21, warmup=5, flush=flush)

            def ratio(name):
                plain, dropped = t[(name, 0.0)], t[(name, 0.1)]
                if isinstance(plain, str) or isinstance(dropped, str):
                    return f"n/a ({plain if isinstance(plain, str) else dropped})"[:40]
                return (f"{plain.median_ms / dropped.median_ms:.2f} "
                        f"({plain.median_ms:.3f}/{dropped.median_ms:.3f} ms)")
            cudnn, ours_t = t[("cudnn", 0.1)], t[("cf", 0.1)]
            cross = ("n/a" if isinstance(cudnn, str) or isinstance(ours_t, str)
                     else f"{cudnn.median_ms / ours_t.median_ms:.2f}")
            print(f"{d} {causal} {seqlen} {phase} | {ratio('cf')} | {ratio('cudnn')} | "
                  f"{ratio('flash')} | {cross}", flush=True)


if __name__ == "__main__":
    main()
