"""Forward calls for ncu: the FlashAttention sizes (batch = 16384 / S, nheads = 2048 / d,
bf16) at each S given (default 1024 and 8192), cudaflash then SDPA's cuDNN backend on the
same tensors, each called twice (the first call loads, the second is the one to read). With
--dropout P or --alibi, cudaflash runs the plain call first and then the modified one (cuDNN
is left out: compare the two cudaflash kernels). --config NAME (repeatable) runs those
kernel configs (cudaflash.forward, no split) instead of flash_attn_func's choice, in the order
given, before cuDNN. Run under ncu, e.g.

    ncu --clock-control none --kernel-name regex:"cudaflash_fwd|cudnn|fprop|sm90" \\
        --section SpeedOfLight --section WarpStateStats --section InstructionStats \\
        --section Occupancy --section LaunchStats python3 tools/profile_forward.py 1024

(docs/perf-log.md: "The S = 1k forward, profiled", "The dropout forward's cost, profiled",
"The ALiBi forward's cost, profiled", "The d64 causal 2k forward, profiled".)
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cudaflash import flash_attn_func, forward
from cudaflash.cli.suite_calls import paper_alibi_slopes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("seqlens", type=int, nargs="*", default=[1024, 8192])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--dropout", type=float, default=0.0, metavar="P",
                        help="also run flash_attn_func with dropout_p=P (after the plain call)")
    parser.add_argument("--alibi", action="store_true",
                        help="also run flash_attn_func with the ALiBi paper's slopes")
    parser.add_argument("--config", action="append", default=[], metavar="NAME",
                        help="run this kernel config (cudaflash.forward) instead of "
                             "flash_attn_func's choice; repeatable")
    args = parser.parse_args()
    if args.config and (args.dropout > 0 or args.alibi):
        parser.error("--config runs plain calls only (no --dropout or --alibi)")
    d, heads = args.head_dim, 2048 // args.head_dim
    slopes = paper_alibi_slopes(heads, "cuda")
    modified = args.dropout > 0 or args.alibi
    for seqlen in args.seqlens:
        torch.manual_seed(0)
        q, k, v = (torch.randn(16384 // seqlen, seqlen, heads, d, device="cuda",
                               dtype=torch.bfloat16) for _ in range(3))
        with torch.no_grad():
            if args.config:
                for config in args.config:
                    for _ in range(2):
                        forward(config, q, k, v, causal=args.causal, num_splits=1)
            else:
                for _ in range(2):
                    flash_attn_func(q, k, v, causal=args.causal)
            if modified:
                for _ in range(2):
                    flash_attn_func(q, k, v, causal=args.causal, dropout_p=args.dropout,
                                    alibi_slopes=slopes if args.alibi else None)
            else:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    for _ in range(2):
                        F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                       v.transpose(1, 2), is_causal=args.causal)
        torch.cuda.synchronize()
        print(f"d={d} causal={args.causal} S={seqlen}: done")


if __name__ == "__main__":
    main()
