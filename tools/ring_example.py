"""Ring attention across GPUs with cudaflash.distributed: the README's example, checked
against cudaflash on one GPU.

    torchrun --standalone --nproc-per-node 2 tools/ring_example.py

Every rank builds the same sequence, keeps its rows in the zigzag layout (chunks r and
2W-1-r of 2W), runs causal attention over the whole sequence through the ring with a
backward, and compares its rows of out and of the gradients with flash_attn_func on the
whole sequence on its own GPU.
"""

import os

import torch
import torch.distributed as dist

from cudaflash import flash_attn_func
from cudaflash.distributed import ring_flash_attn_func, zigzag_shard


def main():
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()

    # The whole sequence, the same on every rank (drawn on the CPU from one seed).
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16384, 16, 128, generator=g).to(device, torch.bfloat16)
               for _ in range(3))

    # This rank's rows, then attention over the whole sequence through the ring.
    q_local, k_local, v_local = (zigzag_shard(t, rank, world).requires_grad_()
                                 for t in (q, k, v))
    out = ring_flash_attn_func(q_local, k_local, v_local, causal=True)
    out.sum().backward()  # q_local.grad, k_local.grad, v_local.grad

    # The same on one GPU, the whole sequence.
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = flash_attn_func(*leaves, causal=True)
    ref.sum().backward()
    errors = {name: (ours - zigzag_shard(theirs, rank, world)).abs().max().item()
              for name, ours, theirs in (("out", out, ref), ("dq", q_local.grad, leaves[0].grad),
                                         ("dk", k_local.grad, leaves[1].grad),
                                         ("dv", v_local.grad, leaves[2].grad))}
    print(f"rank {rank} of {world}: local out {tuple(out.shape)}; max |ring - one GPU|: "
          + ", ".join(f"{name} {err:.3g}" for name, err in errors.items()), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
