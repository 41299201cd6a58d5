"""Split-KV on the GPU: flash_attn_func with its split rule ("auto") against the same call
never split ("whole": heuristics.split_count patched to 1) and SDPA's flash and cuDNN backends, for
decoding, chunked-prefill and prefill shapes. bf16; CUDA-event medians of 30 calls with the
L2 flushed (timing.time_gpu). SDPA gets K/V with the heads repeated for GQA, and is skipped
for causal with seqlen_q != seqlen_k (its causal mask is top-left aligned).

    python3 tools/split_vs_whole.py     (from the repo root, after build_cubins.py)
"""
import sys
sys.path.insert(0, ".")
import torch
import cudaflash
from cudaflash import _plans, heuristics
from cudaflash.cli import timing
dev = torch.device("cuda", 0)
flush = timing.flush_buffer(dev)
shapes = [  # B, Sq, H, Hk, Sk, d, causal
    (1, 1, 32, 32, 4096, 128, False), (1, 1, 32, 32, 32768, 128, False),
    (8, 1, 32, 32, 8192, 128, False), (32, 1, 32, 32, 4096, 128, False),
    (1, 1, 32, 8, 32768, 128, False), (8, 1, 32, 8, 8192, 128, False), (64, 1, 32, 8, 4096, 128, False),
    (1, 1, 16, 16, 16384, 64, False), (4, 1, 64, 8, 16384, 64, False),
    (1, 16, 32, 8, 8192, 128, True), (1, 128, 32, 32, 16384, 128, True),
    (1, 1024, 16, 16, 1024, 128, False), (1, 1024, 16, 16, 1024, 128, True), (1, 2048, 8, 8, 2048, 128, False),
    (2, 512, 16, 16, 512, 64, False), (1, 2048, 32, 32, 2048, 128, True), (1, 1024, 16, 16, 1024, 64, False),
    (1, 4096, 8, 8, 4096, 128, True),
]
def t(fn):
    r = timing.attempt(lambda: timing.time_gpu(fn, iters=30, warmup=10, flush=flush), __import__("contextlib").nullcontext)
    return None if isinstance(r, str) else r.median_ms * 1e3
from torch.nn.attention import sdpa_kernel, SDPBackend
import torch.nn.functional as F
print(f"{'B':>3} {'Sq':>5} {'H':>3} {'Hk':>3} {'Sk':>6} {'d':>4} {'causal':>6} {'splits':>6}  {'auto us':>8} {'whole us':>8} {'flash us':>8} {'cudnn us':>8}  auto/whole flash/auto")
with torch.inference_mode():
    for B, Sq, H, Hk, Sk, d, causal in shapes:
        q = torch.randn(B, Sq, H, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(B, Sk, Hk, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        auto = t(lambda: cudaflash.flash_attn_func(q, k, v, causal=causal))
        plan = next(p for key, p in _plans.plans.items() if key[0] == q.shape and key[2] == k.shape and key[13] == causal)
        launch = plan.launch
        splits = "split" if not hasattr(launch, "__self__") else "1"
        rule = heuristics.split_count
        heuristics.split_count = lambda *a: 1
        _plans.plans.clear()
        whole = t(lambda: cudaflash.flash_attn_func(q, k, v, causal=causal))
        heuristics.split_count = rule
        _plans.plans.clear()
        kk, vv = (k.repeat_interleave(H // Hk, 2), v.repeat_interleave(H // Hk, 2)) if H != Hk else (k, v)
        qt, kt, vt = q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2)
        res = []
        for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            try:
                with sdpa_kernel(be):
                    res.append(t(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)) if not (causal and Sq != Sk) else None)
            except Exception:
                res.append(None)
        f = lambda x: f"{x:8.1f}" if x is not None else "     n/a"
        print(f"{B:3d} {Sq:5d} {H:3d} {Hk:3d} {Sk:6d} {d:4d} {str(causal):>6} {splits:>6}  {f(auto)} {f(whole)} {f(res[0])} {f(res[1])}  "
              f"{auto / whole:9.2f} {(res[0] / auto) if res[0] else float('nan'):9.2f}", flush=True)
