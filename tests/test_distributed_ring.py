"""cudaflash.distributed's ring attention on the CPU: the zigzag layout, what each ring step
computes, the forward's merge, and the whole ring (forward and backward) on torch.distributed
with the gloo backend in 3 spawned processes (a ring of 3 on the default group and a ring of 2
on a subgroup whose ranks are not the global ones), with the PyTorch block attention
(TorchBlocks) standing in for cudaflash's kernels. Everything is compared with attention over
the whole sequence in one process, computed independently (torch.softmax and autograd, float64).
The same ring runs cudaflash's kernels over NCCL in test_gpu_ring.py."""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import _internals as internals
from _spawned_cases import read_outcomes, run_recorded, write_outcome
from cudaflash.distributed import (CudaflashBlocks, TorchBlocks, ring_flash_attn_func,
                                   zigzag_positions, zigzag_shard, zigzag_unshard)
from cudaflash.distributed.layout import Step, ring_step
from cudaflash.distributed.ring import merge_into, ring_forward

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available in this "
                                       "torch build")


# ---- the reference: attention over the whole sequence -----------------------------------------


def full_attention(q, k, v, scale, causal):
    """(out, lse) of softmax(scale q k^T) v over the whole sequence (GQA: query head h reads
    K/V head h // (nheads // nheads_k)), through torch.softmax, so autograd gives its
    gradients; causal is bottom-right aligned, as in flash_attn_func."""
    groups = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        mask = torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + sk - sq
        scores = scores.masked_fill(mask, -math.inf)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), v), scores.logsumexp(-1)


def random_qkv(b, sq, sk, h, hk, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=g, dtype=dtype)
                 for shape in ((b, sq, h, d), (b, sk, hk, d), (b, sk, hk, d), (b, sq, h, d)))


def assert_close(what, ours, ref, dtype):
    tol = {torch.float64: 1e-10, torch.float32: 2e-5}[dtype]
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)}, expected " \
                                    f"{tuple(ref.shape)}"
    err = (ours.double() - ref.double()).abs().max().item()
    assert err <= tol * (1 + ref.abs().max().item()), \
        f"{what}: max|ring - whole sequence| = {err:.3g} > {tol:g} x (1 + max|ref|)"


# ---- layout and steps, in one process -----------------------------------------------------------


def test_zigzag_shards_hold_chunk_r_and_its_mirror():
    x = torch.arange(12)[None, :, None]  # (1, 12, 1): rows are their positions
    assert zigzag_shard(x, 0, 3).flatten().tolist() == [0, 1, 10, 11]
    assert zigzag_shard(x, 1, 3).flatten().tolist() == [2, 3, 8, 9]
    assert zigzag_shard(x, 2, 3).flatten().tolist() == [4, 5, 6, 7]
    for rank in range(3):
        assert zigzag_positions(12, rank, 3).tolist() == zigzag_shard(x, rank, 3).flatten().tolist()
    assert torch.equal(zigzag_unshard([zigzag_shard(x, r, 3) for r in range(3)]), x)


@pytest.mark.parametrize("call, message", [
    (lambda: zigzag_shard(torch.zeros(1, 10, 1, 1), 0, 3), r"x.shape\[1\]=10: .* multiple of 6"),
    (lambda: zigzag_positions(8, 2, 2), r"rank=2; it must be in \[0, world_size=2\)"),
    (lambda: zigzag_unshard([torch.zeros(1, 4), torch.zeros(1, 6)]), r"shards\[1\] has shape"),
])
def test_zigzag_errors_name_the_value(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def step_mask(step: Step, local_len: int) -> torch.Tensor:
    """The (local query, block key) pairs a step computes, as a boolean matrix."""
    computed = torch.zeros(local_len, local_len, dtype=torch.bool)
    rows = torch.arange(local_len)[step.q_rows]
    keys = torch.arange(local_len)[step.kv_rows]
    sq, sk = len(rows), len(keys)
    seen = torch.ones(sq, sk, dtype=torch.bool)
    if step.causal:  # bottom-right aligned, as the kernels mask
        seen = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + sk - sq
    computed[rows[:, None], keys[None, :]] = seen
    return computed


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_each_causal_step_computes_exactly_the_visible_pairs(world):
    """For every (rank, source) pair, the rows and keys of the step and its mask give exactly
    the pairs where the key's position is at most the query's in the whole sequence: nothing
    visible is skipped, nothing hidden is computed. And every step is the same work."""
    chunk = 3
    seqlen = 2 * world * chunk
    work = set()
    for rank in range(world):
        queries = zigzag_positions(seqlen, rank, world)
        for source in range(world):
            keys = zigzag_positions(seqlen, source, world)
            visible = keys[None, :] <= queries[:, None]
            step = ring_step(rank, source, True, 2 * chunk)
            computed = step_mask(step, 2 * chunk)
            assert torch.equal(computed, visible), f"rank {rank}, source {source}: {step}"
            # the scores a kernel evaluates: a causal square counts its triangle
            work.add(int(computed.sum()) if not step.causal else (2 * chunk) ** 2 // 2)
    assert len(work) == 1, f"unbalanced steps: {work} scores"


def test_non_causal_steps_take_everything():
    assert ring_step(0, 2, False, 8) == Step(slice(None), slice(None), False)
    assert ring_step(2, 0, False, 8) == Step(slice(None), slice(None), False)


def test_merge_of_two_blocks_is_attention_over_both():
    q, k, v, _ = random_qkv(2, 5, 9, 4, 2, 8, torch.float64, seed=1)
    blocks = TorchBlocks()
    whole, whole_lse = full_attention(q, k, v, 0.3, False)
    out, lse = blocks.forward(q, k[:, :4], v[:, :4], 0.3, False)
    second, second_lse = blocks.forward(q, k[:, 4:], v[:, 4:], 0.3, False)
    merge_into(out, lse, second, second_lse)
    assert_close("out", out, whole, torch.float64)
    assert_close("lse", lse, whole_lse, torch.float64)


def test_merge_keeps_rows_that_saw_no_key():
    out, lse = torch.zeros(1, 2, 1, 3), torch.tensor([[[-math.inf, 0.0]]])
    block_out = torch.ones(1, 2, 1, 3)
    merge_into(out, lse, block_out, torch.tensor([[[-math.inf, 0.0]]]))
    assert out[0, 0].tolist() == [[0.0] * 3] and lse[0, 0, 0].item() == -math.inf
    assert out[0, 1].tolist() == [[0.5] * 3] and lse[0, 0, 1].item() == pytest.approx(math.log(2))


class SimulatedRing:
    """Rank ``rank`` of a ring whose K/V shards are all known here: each shift hands over the
    previous rank's block. Runs ring_forward's loop in one process."""

    def __init__(self, rank, kv_shards):
        self.rank, self.world_size, self._kv = rank, len(kv_shards), kv_shards
        self._held = rank

    def shift(self, tensors, tag):
        self._held = (self._held - 1) % self.world_size
        block = self._kv[self._held]
        return type("Done", (), {"wait": lambda self: block})()


def simulated_forward(world, causal, q, k, v, scale):
    kv = [(zigzag_shard(k, r, world), zigzag_shard(v, r, world)) for r in range(world)]
    outs, lses = zip(*(ring_forward(TorchBlocks(), SimulatedRing(r, kv), zigzag_shard(q, r, world),
                                    *kv[r], scale, causal) for r in range(world)))
    return zigzag_unshard(outs), zigzag_unshard(lses, dim=2)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_ring_forward_loop_in_one_process(world, causal):
    q, k, v, _ = random_qkv(2, 8 * world, 8 * world, 4, 2, 8, torch.float64, seed=world)
    out, lse = simulated_forward(world, causal, q, k, v, 0.4)
    ref, ref_lse = full_attention(q, k, v, 0.4, causal)
    assert_close("out", out, ref, torch.float64)
    assert_close("lse", lse, ref_lse, torch.float64)


def test_a_wrong_step_rule_is_caught(monkeypatch):
    """The checker rejects a ring whose steps mask wrongly: blocks before the diagonal
    treated as diagonal (causal) instead of fully visible."""
    def wrong(rank, source, causal, local_len):
        step = ring_step(rank, source, causal, local_len)
        return Step(step.q_rows, step.kv_rows, causal) if source < rank else step

    internals.replace_ring_step(monkeypatch, wrong)
    q, k, v, _ = random_qkv(1, 12, 12, 2, 2, 8, torch.float64, seed=0)
    out, _ = simulated_forward(3, True, q, k, v, 0.5)
    with pytest.raises(AssertionError, match="max|ring - whole sequence|"):
        assert_close("out", out, full_attention(q, k, v, 0.5, True)[0], torch.float64)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("world", [2, 3])
def test_the_benchmarks_one_gpu_baseline_does_the_ranks_work(world, causal):
    """cudaflash.distributed.bench times the ring against whole calls on one GPU: those calls
    must give exactly the rank's rows of the whole attention, with the FLOPs it reports."""
    from cudaflash.distributed.bench import baseline_calls, pairs

    q, k, v, _ = random_qkv(1, 6 * world, 6 * world, 2, 1, 8, torch.float64, seed=world)
    ref, _ = full_attention(q, k, v, 0.5, causal)
    for rank in range(world):
        calls = baseline_calls(zigzag_shard(q, rank, world), k, v, causal, rank, world)
        rows = torch.cat([full_attention(*call, 0.5, causal)[0] for call in calls], dim=1)
        assert_close(f"rank {rank}'s rows", rows, zigzag_shard(ref, rank, world), torch.float64)
        # bottom-right causal: row i of sq sees sk - sq + i + 1 keys
        seen = sum(qi.shape[1] * ki.shape[1] - (qi.shape[1] * (qi.shape[1] - 1) // 2
                                                if causal else 0) for qi, ki, _ in calls)
        local = 6  # rows per rank
        # the usual FLOP count halves the causal diagonal blocks: off by their half-diagonal
        assert abs(seen - pairs(causal, local, 6 * world)) <= (local if causal else 0)


# ---- in this process, a ring of one (gloo) ---------------------------------------------------


@pytest.fixture
def group_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def test_ring_of_one_is_plain_attention_with_gradients(group_of_one):
    q, k, v, dout = random_qkv(2, 6, 6, 4, 1, 8, torch.float64, seed=2)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = ring_flash_attn_func(*leaves, causal=True, blocks=TorchBlocks(),
                                       return_attn_probs=True)
    out.backward(dout)
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = full_attention(*ref_leaves, 8 ** -0.5, True)
    ref.backward(dout)
    assert not lse.requires_grad
    assert_close("out", out, ref, torch.float64)
    assert_close("lse", lse, ref_lse, torch.float64)
    for name, ours, theirs in zip(("dq", "dk", "dv"), leaves, ref_leaves):
        assert_close(name, ours.grad, theirs.grad, torch.float64)


def test_bad_arguments_are_named(group_of_one):
    q = torch.randn(1, 6, 2, 8, dtype=torch.float64)
    blocks = TorchBlocks()
    with pytest.raises(ValueError, match=r"causal=True: q has 6 local rows and k 4"):
        ring_flash_attn_func(q, q[:, :4], q[:, :4], causal=True, blocks=blocks)
    with pytest.raises(ValueError, match=r"the sequence length \(5 local rows x 1 ranks\)=5"):
        ring_flash_attn_func(q[:, :5], q[:, :5], q[:, :5], causal=True, blocks=blocks)
    with pytest.raises(ValueError, match=r"k has shape \(1, 6, 2, 8\) but v has \(1, 4, 2, 8\)"):
        ring_flash_attn_func(q, q, q[:, :4], blocks=blocks)
    with pytest.raises(TypeError, match="causal=2; it must be a bool"):
        ring_flash_attn_func(q, q, q, causal=2, blocks=blocks)
    # cudaflash's kernels (the default blocks) take CUDA fp16/bf16 tensors only
    with pytest.raises(ValueError, match=r"q has head dim 8; the ring runs cudaflash's kernels "
                                         r"at head dims \[64, 128, 256\]"):
        ring_flash_attn_func(q, q, q)
    h = torch.randn(1, 6, 2, 64, dtype=torch.float64)
    with pytest.raises(TypeError, match="q has dtype torch.float64"):
        ring_flash_attn_func(h, h, h)
    h = h.to(torch.bfloat16)
    with pytest.raises(ValueError, match="cudaflash runs on CUDA GPUs only"):
        ring_flash_attn_func(h, h, h)


def test_needs_an_initialized_process_group():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        ring_flash_attn_func(q, q, q, blocks=TorchBlocks())


def test_cudaflash_blocks_check_the_deterministic_flag():
    with pytest.raises(TypeError, match="deterministic='yes'"):
        CudaflashBlocks("yes")


# ---- the ring across processes (gloo) -----------------------------------------------------------


@dataclass(frozen=True)
class Case:
    world: int  # 3: the default group of 3; 2: the subgroup of global ranks 1 and 2
    dtype: str
    causal: bool
    heads: tuple  # (nheads, nheads_k)
    cross: bool = False  # q and k of different lengths (not causal), k split in plain chunks

    @property
    def id(self):
        kind = "cross" if self.cross else ("causal" if self.causal else "noncausal")
        return f"w{self.world}_{self.dtype}_{kind}_h{self.heads[0]}_hk{self.heads[1]}"


CASES = [Case(world, "fp64", causal, heads)
         for world in (3, 2) for causal in (True, False) for heads in ((2, 2), (4, 2))]
CASES += [Case(3, "fp32", True, (4, 1)), Case(2, "fp32", False, (4, 2)),
          Case(3, "fp64", False, (4, 2), cross=True), Case(2, "fp32", False, (2, 1), cross=True)]
DTYPE_NAMES = {"fp64": torch.float64, "fp32": torch.float32}


def run_case(case: Case, group, rank: int) -> None:
    """One case on this rank (``rank`` in ``group``): every rank builds the whole sequence
    from the same seed, runs the ring on its rows and compares them with the whole
    sequence's attention."""
    dtype, world = DTYPE_NAMES[case.dtype], case.world
    h, hk = case.heads
    seqlen = 4 * world  # two chunks of 2 rows per rank
    seqlen_k = 6 * world if case.cross else seqlen
    q, k, v, dout = random_qkv(2, seqlen, seqlen_k, h, hk, 8, dtype, seed=len(case.id))
    scale = 0.35

    def keys(t):  # this rank's K/V rows: zigzag, or plain chunks for cross attention
        return t.chunk(world, dim=1)[rank] if case.cross else zigzag_shard(t, rank, world)

    mine = [zigzag_shard(q, rank, world).requires_grad_(), keys(k).requires_grad_(),
            keys(v).requires_grad_()]
    out, lse, _ = ring_flash_attn_func(*mine, softmax_scale=scale, causal=case.causal,
                                       return_attn_probs=True, group=group, blocks=TorchBlocks())
    assert out.grad_fn is not None and not lse.requires_grad
    out.backward(zigzag_shard(dout, rank, world))

    whole = [t.double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = full_attention(*whole, scale, case.causal)
    ref.backward(dout.double())
    assert_close("out", out, zigzag_shard(ref, rank, world), dtype)
    assert_close("lse", lse, zigzag_shard(ref_lse, rank, world, dim=2), dtype)
    assert_close("dq", mine[0].grad, zigzag_shard(whole[0].grad, rank, world), dtype)
    assert_close("dk", mine[1].grad, keys(whole[1].grad), dtype)
    assert_close("dv", mine[2].grad, keys(whole[2].grad), dtype)
    assert out.dtype == dtype and mine[1].grad.dtype == dtype


def _worker(global_rank: int, world: int, store: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=global_rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    pair = dist.new_group([1, 2])  # every process takes part in creating it

    def run(case):
        group, rank = (None, global_rank) if case.world == 3 else (pair, global_rank - 1)
        run_case(case, group, rank)

    mine = [case for case in CASES if case.world == 3 or global_rank > 0]
    write_outcome(results, global_rank, run_recorded(mine, run))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory):
    """Every case's outcome on every rank, from one spawn of 3 gloo processes."""
    tmp = tmp_path_factory.mktemp("ring")
    world = 3
    mp.spawn(_worker, args=(world, str(tmp / "store"), str(tmp / "results")), nprocs=world,
             join=True)
    return read_outcomes(str(tmp / "results"), world)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_ring_on_gloo_matches_the_whole_sequence(ring_results, case):
    results = ring_results.get(case.id)
    assert results is not None and len(results) == case.world, \
        f"{case.id} ran on {len(results or [])} ranks, expected {case.world}"
    failures = [r for r in results if r != "ok"]
    assert not failures, "\n".join(failures)
