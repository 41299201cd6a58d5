"""One backward call per head dim for ncu (the perf log's profiles): bf16, B = 4, S = 4096,
H = 2048 / d, non-causal, the shipped kernels. Run under ncu, e.g.

    ncu --clock-control none --kernel-name regex:cudaflash_bwd_dkdv_dq --launch-count 2 \\
        --section SpeedOfLight --section WarpStateStats python3 tools/profile_backward.py
"""

import torch

from cudaflash import flash_attn_func

for d in (128, 64):
    torch.manual_seed(0)
    q, k, v = (torch.randn(4, 4096, 2048 // d, d, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    out = flash_attn_func(q, k, v)
    out.backward(torch.randn_like(out))
    torch.cuda.synchronize()
    print(f"d{d}: backward done")
