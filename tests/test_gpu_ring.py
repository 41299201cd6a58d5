"""cudaflash.distributed's ring attention on two GPUs: two spawned processes, one per GPU,
a NCCL process group, cudaflash's kernels in every ring step. Each rank's out, lse and
gradients are checked against the attention math over the whole sequence with
FlashAttention's accuracy rule (test_gpu_correctness: error against the float32 math at most
twice that of the same math in the input dtype, plus rounding), and against cudaflash's own
single-GPU result on the whole sequence (flash_attn_func, computed on the rank's GPU) within
the same budget. Needs two GPUs; skipped with the reason otherwise. The ring's logic on CPU
processes (gloo, float64) is test_distributed_ring.py."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _spawned_cases import read_outcomes, run_recorded, write_outcome
from cudaflash import flash_attn_func
from cudaflash.backward_config import BWD_D_HEADS
from cudaflash.distributed import ring_flash_attn_func, zigzag_shard
from test_gpu_backward import reference_grads
from test_gpu_correctness import COMBOS, DTYPES, _assert_within, attention_ref

WORLD = 2

pytestmark = [
    pytest.mark.requires_gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < WORLD,
                       reason=f"needs {WORLD} CUDA GPUs; torch sees "
                              f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}"),
    pytest.mark.skipif(not dist.is_available() or not dist.is_nccl_available(),
                       reason="torch.distributed with NCCL is not available in this torch build"),
]


@dataclass(frozen=True)
class Case:
    dtype: str
    d: int
    causal: bool
    heads: tuple  # (nheads, nheads_k)
    local: int  # query rows per rank
    local_k: Optional[int] = None  # key rows per rank when not local (cross attention)
    deterministic: bool = False

    @property
    def id(self):
        kind = "cross" if self.local_k else ("causal" if self.causal else "noncausal")
        det = "_det" if self.deterministic else ""
        return (f"{self.dtype}_d{self.d}_{kind}_h{self.heads[0]}_hk{self.heads[1]}_"
                f"s{self.local}x{WORLD}{det}")


CASES = [
    Case("bf16", 128, True, (4, 4), 1024),
    Case("bf16", 128, False, (8, 2), 1024),  # GQA
    Case("bf16", 128, True, (4, 2), 1024, deterministic=True),  # also bitwise repeatable
    Case("fp16", 64, True, (4, 1), 600),  # MQA; chunks of 300 rows: tails in every block
    Case("bf16", 128, False, (4, 4), 512, local_k=768),  # q and k split differently
]


def _shard(t, rank, dim=1):
    return zigzag_shard(t, rank, WORLD, dim=dim)


def run_case(case: Case, rank: int) -> str:
    """Runs one case on this rank; returns "ok" or why it was skipped, raises on a failure."""
    if (case.dtype, case.d) not in COMBOS:
        return f"skipped: {case.dtype} d{case.d} is not built for this GPU (built: {COMBOS})"
    if case.d not in BWD_D_HEADS:
        return f"skipped: no backward for head dim {case.d}"
    dtype, device = DTYPES[case.dtype], torch.device("cuda", rank)
    h, hk = case.heads
    seqlen, seqlen_k = case.local * WORLD, (case.local_k or case.local) * WORLD
    g = torch.Generator().manual_seed(len(case.id))  # on the CPU: the same tensors on each rank
    q, k, v = (torch.randn(shape, generator=g).to(device, dtype) for shape in
               ((1, seqlen, h, case.d), (1, seqlen_k, hk, case.d), (1, seqlen_k, hk, case.d)))
    dout = torch.randn((1, seqlen, h, case.d), generator=g).to(device, dtype)

    def keys(t):  # this rank's K/V rows: zigzag, or plain halves for cross attention
        return t.chunk(WORLD, dim=1)[rank] if case.local_k else _shard(t, rank)

    # cudaflash on one GPU, the whole sequence
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    single, single_lse, _ = flash_attn_func(*leaves, causal=case.causal, return_attn_probs=True,
                                            deterministic=case.deterministic)
    single.backward(dout)
    single_grads = [t.grad for t in leaves]

    def ring():
        mine = [_shard(q, rank).requires_grad_(), keys(k).requires_grad_(),
                keys(v).requires_grad_()]
        out, lse, _ = ring_flash_attn_func(*mine, causal=case.causal, return_attn_probs=True,
                                           deterministic=case.deterministic)
        out.backward(_shard(dout, rank))
        return out, lse, [t.grad for t in mine]

    out, lse, grads = ring()
    with torch.no_grad():  # the inference path: the same forward
        out_no_grad = ring_flash_attn_func(_shard(q, rank), keys(k), keys(v), causal=case.causal)
    assert torch.equal(out_no_grad, out), "the forward without gradients differs"
    if case.deterministic:
        again = ring()
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads),
                              (again[0], again[1], *again[2])):
            assert torch.equal(a, b), f"deterministic=True: {name} differs between two runs"

    scale = case.d ** -0.5
    ref, ref_lse = attention_ref(q, k, v, case.causal, scale, True)
    lowp, lowp_lse = attention_ref(q, k, v, case.causal, scale, False)
    ref_grads = reference_grads(q, k, v, dout, case.causal, scale, True)
    lowp_grads = reference_grads(q, k, v, dout, case.causal, scale, False)
    checks = [("out", out, _shard(ref, rank), _shard(lowp, rank), _shard(single, rank)),
              ("lse", lse, _shard(ref_lse, rank, 2), _shard(lowp_lse, rank, 2),
               _shard(single_lse, rank, 2))]
    for i, name in enumerate(("dq", "dk", "dv")):
        part = (lambda t: _shard(t, rank)) if name == "dq" else keys
        checks.append((name, grads[i], part(ref_grads[i]), part(lowp_grads[i]),
                       part(single_grads[i])))
    for name, ours, r, lp, one_gpu in checks:
        assert ours.dtype == one_gpu.dtype and ours.shape == one_gpu.shape, \
            f"{name}: {ours.dtype} {tuple(ours.shape)}, expected {one_gpu.dtype} " \
            f"{tuple(one_gpu.shape)}"
        bad = (~torch.isfinite(ours)).sum().item()
        assert bad == 0, f"{name} has {bad} NaN/inf elements"
        _assert_within(f"{name} (ring vs the fp32 math)", ours, r, lp)
        # the same budget around cudaflash's single-GPU result
        _assert_within(f"{name} (ring vs cudaflash on one GPU)", ours, one_gpu.float(), lp)
    return "ok"


def _worker(rank: int, store: str, results: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=90))
    torch.set_float32_matmul_precision("highest")  # the fp32 reference without TF32
    write_outcome(results, rank, run_recorded(CASES, lambda case: run_case(case, rank), frames=4))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory):
    """Every case's outcome on both ranks, from one spawn of two NCCL processes."""
    tmp = tmp_path_factory.mktemp("gpu_ring")
    mp.spawn(_worker, args=(str(tmp / "store"), str(tmp / "results")), nprocs=WORLD,
             join=True)
    return read_outcomes(str(tmp / "results"), WORLD)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_ring_on_two_gpus_matches_one_gpu(ring_results, case):
    results = ring_results.get(case.id, [])
    assert len(results) == WORLD, f"{case.id} ran on {len(results)} ranks, expected {WORLD}"
    skipped = [r for r in results if r.startswith("skipped: ")]
    if skipped:
        pytest.skip(skipped[0][len("skipped: "):])
    failures = [r for r in results if r != "ok"]
    assert not failures, "\n".join(failures)
