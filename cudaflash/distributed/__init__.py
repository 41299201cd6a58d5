"""Context parallelism: attention over a sequence split across GPUs (ring attention), on
torch.distributed process groups (NCCL between GPUs).

    torchrun --nproc-per-node 2 your_script.py

    import torch, torch.distributed as dist
    from cudaflash.distributed import ring_flash_attn_func, zigzag_shard

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    q = zigzag_shard(q_full, rank, world)   # (batch, seqlen / world, nheads, headdim)
    ...
    out = ring_flash_attn_func(q, k, v, causal=True)   # this rank's rows of the output

Modules: ``attention`` (the public function and its autograd node), ``ring`` (the forward
and backward loops, the K/V exchange), ``layout`` (the zigzag layout, what each ring step
computes), ``blocks`` (one step's attention: cudaflash's kernels, or a PyTorch stand-in),
``bench`` (``torchrun --nproc-per-node 2 -m cudaflash.distributed.bench``: the ring against
one GPU doing the same work). Importing this package needs no GPU.
"""

from .attention import ring_flash_attn_func
from .blocks import BlockAttention, CudaflashBlocks, TorchBlocks
from .layout import zigzag_positions, zigzag_shard, zigzag_unshard

__all__ = ["ring_flash_attn_func", "zigzag_shard", "zigzag_unshard", "zigzag_positions",
           "BlockAttention", "CudaflashBlocks", "TorchBlocks"]
