"""Forward calls for ncu (issue 20's S = 1k gap): bf16 d128 non-causal, the FlashAttention
sizes (batch = 16384 / S, 16 heads) at S = 1024 and 8192 (or the lengths given as
arguments), cudaflash then SDPA's cuDNN backend on the same tensors, each called twice (the
first call loads, the second is the one to read). Run under ncu, e.g.

    ncu --clock-control none --kernel-name regex:"cudaflash_fwd|cudnn|fprop" \\
        --launch-skip-before-match 0 --section SpeedOfLight --section WarpStateStats \\
        --section Occupancy --section LaunchStats python3 tools/profile_forward.py
"""

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cudaflash import flash_attn_func

for seqlen in [int(a) for a in sys.argv[1:]] or (1024, 8192):
    torch.manual_seed(0)
    q, k, v = (torch.randn(16384 // seqlen, seqlen, 16, 128, device="cuda",
                           dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        for _ in range(2):
            flash_attn_func(q, k, v)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for _ in range(2):
                F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2))
    torch.cuda.synchronize()
    print(f"S={seqlen}: done")
