"""Dropout's forward on a GPU (work in progress: flash_attn_func under torch.no_grad(), plain
scores): out against the attention math in PyTorch with the keep mask rebuilt on the host from
the call's seed (tests/_dropout_reference.py: the kernels' Philox counters), under
FlashAttention's accuracy rule; one torch.manual_seed reproduces a call bitwise, another
seed changes it.

The seed: flash_attn_func draws it with one torch.randint on q's device as its first random
op, so after torch.manual_seed(s) the test draws the same number the same way."""

import pytest
import torch

from cudaflash import flash_attn_func
from cudaflash._dropout import SEED_HIGH
from _dropout_reference import keep_mask
from test_gpu_correctness import DTYPES, make_qkv

pytestmark = pytest.mark.requires_gpu


def seed_after(manual_seed: int, device) -> int:
    torch.manual_seed(manual_seed)
    return int(torch.randint(0, SEED_HIGH, (1,), dtype=torch.int64, device=device).item())


def dropout_reference(q, k, v, mask, p, causal, upcast=True, window=(-1, -1),
                      alibi_slopes=None):
    """(batch, seqlen_q, heads, d): softmax(scale q k^T) with the causal mask (bottom-right),
    dropped where mask is False, scaled by 1 / (1 - p) (flash-attn's scale; the mask's rate
    is p rounded to the kernels' 1/256 steps), times v; in float32 (upcast) or in q's dtype
    (the low-precision reference of the accuracy rule)."""
    dtype = torch.float32 if upcast else q.dtype
    qf, kf, vf = (t.to(dtype).transpose(1, 2) for t in (q, k, v))
    groups = qf.shape[1] // kf.shape[1]
    kf, vf = kf.repeat_interleave(groups, 1), vf.repeat_interleave(groups, 1)
    scores = (qf @ kf.transpose(-1, -2)).float() * q.shape[-1] ** -0.5
    sq, sk = scores.shape[-2:]
    if alibi_slopes is not None:  # flash-attn's bias: -slope * |i + sk - sq - j|
        from cudaflash import _dropout
        scores = scores + _dropout.alibi_bias(alibi_slopes, q.shape[0], q.shape[2], sq, sk)
    row = torch.arange(sq, device=q.device)[:, None] + sk - sq
    col = torch.arange(sk, device=q.device)[None, :]
    left, right = window[0], 0 if causal else window[1]
    if right >= 0:
        scores = scores.masked_fill(col > row + right, float("-inf"))
    if left >= 0:
        scores = scores.masked_fill(col < row - left, float("-inf"))
    probs = scores.softmax(-1).nan_to_num(0.0)
    probs = probs * mask.to(q.device) / (1 - p)
    return (probs.to(dtype) @ vf).float().transpose(1, 2)


@pytest.mark.parametrize("p", [0.17, 0.5])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_forward_matches_the_mask_rebuilt_on_the_host(dtype, d, causal, p):
    b, sq, sk, h, hk = 2, 200, 333, 4, 2
    q, k, v = make_qkv(b, sq, sk, h, hk, d, DTYPES[dtype], seed=d + sq)
    seed = seed_after(5, q.device)
    torch.manual_seed(5)
    with torch.no_grad():
        out = flash_attn_func(q, k, v, dropout_p=p, causal=causal)
    mask = torch.from_numpy(keep_mask(seed, p, b, h, sq, sk))
    kept = mask.float().mean().item()
    assert abs(kept - (1 - p)) < 0.01, f"keep rate {kept} for p={p}"
    ref = dropout_reference(q, k, v, mask, p, causal)
    low = dropout_reference(q, k, v, mask, p, causal, upcast=False)
    err, base = (out.float() - ref).abs().max().item(), (low - ref).abs().max().item()
    assert err <= 2 * base + 1e-3, f"error {err} against the float32 math (bf16/fp16 math: {base})"
    undropped = dropout_reference(q, k, v, torch.ones_like(mask), 0.0, causal)
    assert (out.float() - undropped).abs().max().item() > 0.1, "dropout had no visible effect"


def test_one_manual_seed_reproduces_a_call():
    q, k, v = make_qkv(1, 128, 256, 4, 4, 128, torch.bfloat16, seed=3)
    with torch.no_grad():
        torch.manual_seed(11)
        a = flash_attn_func(q, k, v, dropout_p=0.3)
        torch.manual_seed(11)
        b = flash_attn_func(q, k, v, dropout_p=0.3)
        torch.manual_seed(12)
        c = flash_attn_func(q, k, v, dropout_p=0.3)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_gqa_decoding_is_not_packed_as_rows():
    """One query row with 8 heads on 2 K/V heads: each query head draws its own numbers."""
    q, k, v = make_qkv(2, 1, 300, 8, 2, 128, torch.float16, seed=9)
    seed = seed_after(3, q.device)
    torch.manual_seed(3)
    with torch.no_grad():
        out = flash_attn_func(q, k, v, dropout_p=0.25)
    mask = torch.from_numpy(keep_mask(seed, 0.25, 2, 8, 1, 300))
    ref = dropout_reference(q, k, v, mask, 0.25, False)
    low = dropout_reference(q, k, v, mask, 0.25, False, upcast=False)
    err, base = (out.float() - ref).abs().max().item(), (low - ref).abs().max().item()
    assert err <= 2 * base + 1e-3


def reference_grads(q, k, v, dout, mask, p, causal, upcast, **mods):
    """dq, dk, dv of dropout_reference by autograd (float32, or q's dtype); ``mods``: its
    window and alibi_slopes."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = dropout_reference(*leaves, mask, p, causal, upcast=upcast, **mods)
    out.backward(dout.float())
    return [t.grad for t in leaves]


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("d", [64, 128, 256])  # 256: the mma.sync module (plain_calls_only)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_gradients_match_the_mask_rebuilt_on_the_host(dtype, d, causal):
    """The backward rebuilds the forward's mask from the saved seed (dV from the dropped P,
    dS = P o (keep o dPd / (1 - p) - delta)): dq, dk, dv against autograd through the
    torch math with the host's mask, for the call's seed."""
    from test_gpu_backward import assert_grads_within, run_with_grad

    p, b, sq, sk, h, hk = 0.2, 2, 160, 224, 4, 2
    q, k, v = make_qkv(b, sq, sk, h, hk, d, DTYPES[dtype], seed=d)
    dout = torch.randn_like(q)
    seed = seed_after(21, q.device)
    torch.manual_seed(21)
    out, grads = run_with_grad(q, k, v, dout, dropout_p=p, causal=causal)
    mask = torch.from_numpy(keep_mask(seed, p, b, h, sq, sk))
    ref = dropout_reference(q, k, v, mask, p, causal)
    low = dropout_reference(q, k, v, mask, p, causal, upcast=False)
    assert (out.float() - ref).abs().max().item() <= 2 * (low - ref).abs().max().item() + 1e-3
    assert_grads_within(grads, reference_grads(q, k, v, dout, mask, p, causal, True),
                        reference_grads(q, k, v, dout, mask, p, causal, False), (q, k, v))


def run_checked_backward(monkeypatch, dtype, b, sq, sk, h, hk, d, causal, seed, **kwargs):
    """flash_attn_func(dropout_p=0.2, causal, **kwargs) with gradients after
    torch.manual_seed(seed): the backward roles it launched, its grads (checked against
    autograd through the torch math with the host's mask) and its inputs (q, k, v, dout)."""
    from test_gpu_backward import assert_grads_within, launched_backward_modules, run_with_grad

    p = 0.2
    q, k, v = make_qkv(b, sq, sk, h, hk, d, DTYPES[dtype], seed=d + sq)
    dout = torch.randn_like(q)
    mask_seed = seed_after(seed, q.device)
    torch.manual_seed(seed)
    launched = launched_backward_modules(monkeypatch)
    _, grads = run_with_grad(q, k, v, dout, dropout_p=p, causal=causal, **kwargs)
    mask = torch.from_numpy(keep_mask(mask_seed, p, b, h, sq, sk))
    assert_grads_within(grads, reference_grads(q, k, v, dout, mask, p, causal, True),
                        reference_grads(q, k, v, dout, mask, p, causal, False), (q, k, v))
    return [role for _, role in launched], grads, (q, k, v, dout)


@pytest.mark.parametrize("b,sq,sk,h,hk,causal", [
    (2, 600, 520, 4, 2, False),  # query and key tails, GQA
    (1, 700, 300, 2, 1, True),  # MQA, more query rows than keys, bottom-right causal
    (2, 300, 700, 4, 2, True),  # more keys than query rows: the diagonal shifted right
])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_fused_backward_rebuilds_the_mask(monkeypatch, dtype, d, b, sq, sk, h, hk, causal):
    """The atomic scheme's fused kernel with dropout (dkdv_dq_dropout, warp-specialized
    modules: sm_90), at sizes the atomic scheme keeps (enough query rows per CTA): it is the
    kernel that runs, and dq, dk, dv match the torch math with the host's mask."""
    from test_gpu_backward import warp_specialized_backward

    warp_specialized_backward(DTYPES[dtype], d)  # else skip: no fused dropout kernel
    roles, _, _ = run_checked_backward(monkeypatch, dtype, b, sq, sk, h, hk, d, causal, 23)
    assert roles == ["preprocess", "dkdv_dq_dropout", "dq_convert"], roles


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_deterministic_dropout_keeps_the_deterministic_kernels(monkeypatch, dtype):
    """deterministic=True with dropout at a size the atomic scheme would take: the
    deterministic scheme's dK/dV and dQ kernels run (bitwise reproducible), not the fused
    one, and the gradients match the host's mask."""
    from test_gpu_backward import run_with_grad

    roles, grads, (q, k, v, dout) = run_checked_backward(
        monkeypatch, dtype, 2, 600, 520, 4, 2, 64, False, 29, deterministic=True)
    assert roles == ["preprocess", "dkdv_scoremod", "dq_scoremod"], roles
    torch.manual_seed(29)
    _, again = run_with_grad(q, k, v, dout, dropout_p=0.2, deterministic=True)
    assert all(torch.equal(x, y) for x, y in zip(grads, again))


def test_varlen_forward_and_gradients_per_sequence():
    """flash_attn_varlen_func: sequence b draws the numbers of batch entry b of the padded
    layout (its rows and keys counted within the sequence)."""
    from test_gpu_backward import assert_grads_within

    from cudaflash import flash_attn_varlen_func

    p, h, hk, d = 0.3, 4, 2, 64
    lens_q, lens_k = [37, 130, 1], [90, 130, 17]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(4)
    q = torch.randn(sum(lens_q), h, d, device="cuda", dtype=torch.float16, generator=gen)
    k = torch.randn(sum(lens_k), hk, d, device="cuda", dtype=torch.float16, generator=gen)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    seed = seed_after(8, q.device)
    torch.manual_seed(8)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = flash_attn_varlen_func(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), dropout_p=p,
                                 causal=True)
    out.backward(dout)
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(int(cu_k[b]), int(cu_k[b + 1]))
        mask = torch.from_numpy(keep_mask(seed, p, len(lens_q), h, sq, sk)[b:b + 1])
        qb, kb, vb = q[None, rows], k[None, keys], v[None, keys]
        ref = dropout_reference(qb, kb, vb, mask, p, True)
        low = dropout_reference(qb, kb, vb, mask, p, True, upcast=False)
        assert (out[None, rows].float() - ref).abs().max().item() <= \
            2 * (low - ref).abs().max().item() + 1e-3
        grads = (leaves[0].grad[None, rows], leaves[1].grad[None, keys],
                 leaves[2].grad[None, keys])
        assert_grads_within(grads,
                            reference_grads(qb, kb, vb, dout[None, rows], mask, p, True, True),
                            reference_grads(qb, kb, vb, dout[None, rows], mask, p, True, False),
                            (qb, kb, vb))


# (head dim, the key block flash-attn 2.8.3's _get_block_size_n gives a dropout call)
S_DMASK_BLOCKS = [(64, 64), (128, 32), (160, 64)]


@pytest.mark.parametrize("d, block", S_DMASK_BLOCKS, ids=[f"d{d}" for d, _ in S_DMASK_BLOCKS])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_return_attn_probs_gives_flash_attns_s_dmask(causal, d, block):
    """(out, lse, S_dmask) as flash-attn returns them with dropout: S_dmask's signs are the
    keep mask, and its blocks of flash-attn 2.8.3's size scaled by exp(M_n - lse) (its tests'
    normalization) are the softmax probabilities."""
    q, k, v = make_qkv(2, 96, 200, 4, 4, d, torch.float16, seed=1)
    seed = seed_after(2, q.device)
    torch.manual_seed(2)
    with torch.no_grad():
        out, lse, s_dmask = flash_attn_func(q, k, v, dropout_p=0.2, causal=causal,
                                            return_attn_probs=True)
    mask = torch.from_numpy(keep_mask(seed, 0.2, 2, 4, 96, 200)).to(q.device)
    assert s_dmask.shape == (2, 4, 96, 200)
    visible = s_dmask != 0
    assert torch.equal((s_dmask > 0)[visible], mask[visible])
    scores = (q.float().transpose(1, 2) @ k.float().transpose(1, 2).transpose(-1, -2)) / d**0.5
    if causal:
        row = torch.arange(96, device=q.device)[:, None] + 200 - 96
        scores = scores.masked_fill(torch.arange(200, device=q.device)[None, :] > row,
                                    float("-inf"))
    blocks = scores.split(block, -1)
    block_max = torch.stack([b.amax(-1) for b in blocks], -1)
    running = torch.cummax(block_max.flip(-1), -1).values.flip(-1)
    probs = torch.cat([p * torch.exp(running[..., n, None] - lse[..., None])
                       for n, p in enumerate(s_dmask.abs().split(block, -1))], -1)
    assert torch.allclose(probs, scores.softmax(-1), atol=1e-4)
    ref = dropout_reference(q, k, v, mask.cpu(), 0.2, causal)
    low = dropout_reference(q, k, v, mask.cpu(), 0.2, causal, upcast=False)
    assert (out.float() - ref).abs().max().item() <= 2 * (low - ref).abs().max().item() + 1e-3


@pytest.mark.parametrize("d", [32, 40, 96, 256])
def test_forward_at_other_head_dims(d):
    """Head dims with kernels of their own (32, 96, 256) and one padded to the next (40)."""
    p, b, sq, sk, h = 0.3, 2, 130, 257, 2
    q, k, v = make_qkv(b, sq, sk, h, h, d, torch.bfloat16, seed=d)
    seed = seed_after(6, q.device)
    torch.manual_seed(6)
    with torch.no_grad():
        out = flash_attn_func(q, k, v, dropout_p=p, causal=True)
    mask = torch.from_numpy(keep_mask(seed, p, b, h, sq, sk))
    ref = dropout_reference(q, k, v, mask, p, True)
    low = dropout_reference(q, k, v, mask, p, True, upcast=False)
    assert (out.float() - ref).abs().max().item() <= 2 * (low - ref).abs().max().item() + 1e-3


@pytest.mark.parametrize("deterministic", [False, True])
def test_sliding_window_forward_and_gradients(deterministic):
    from test_gpu_backward import assert_grads_within, run_with_grad

    p, b, sq, sk, h, d, window = 0.15, 2, 200, 300, 4, 64, (50, 20)
    q, k, v = make_qkv(b, sq, sk, h, h, d, torch.float16, seed=12)
    dout = torch.randn_like(q)
    seed = seed_after(31, q.device)
    torch.manual_seed(31)
    out, grads = run_with_grad(q, k, v, dout, dropout_p=p, window_size=window,
                               deterministic=deterministic)
    mask = torch.from_numpy(keep_mask(seed, p, b, h, sq, sk))
    ref = dropout_reference(q, k, v, mask, p, False, window=window)
    low = dropout_reference(q, k, v, mask, p, False, upcast=False, window=window)
    assert (out.float() - ref).abs().max().item() <= 2 * (low - ref).abs().max().item() + 1e-3

    assert_grads_within(grads, reference_grads(q, k, v, dout, mask, p, False, True,
                                               window=window),
                        reference_grads(q, k, v, dout, mask, p, False, False, window=window),
                        (q, k, v))


def test_a_captured_graph_draws_a_new_mask_each_replay():
    """flash_attn_func with dropout inside a CUDA graph: the seed is a torch RNG op, so each
    replay drops other scores (torch advances the captured generator's offset), and the
    replays average to the undropped attention."""
    q, k, v = make_qkv(1, 64, 128, 2, 2, 64, torch.float16, seed=5)
    with torch.no_grad():
        flash_attn_func(q, k, v, dropout_p=0.5)  # load the kernels outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = flash_attn_func(q, k, v, dropout_p=0.5)
        outs = []
        for _ in range(200):
            graph.replay()
            outs.append(out.float().clone())
    assert not torch.equal(outs[0], outs[1])
    mean = torch.stack(outs).mean(0)
    undropped = flash_attn_func(q, k, v).float()
    assert (mean - undropped).abs().mean().item() < 0.02


def test_grad_of_a_gqa_call():
    """Query heads sharing a K/V head each draw their own mask; dk, dv sum the group's."""
    from test_gpu_backward import assert_grads_within, run_with_grad

    p, b, sq, sk, h, hk, d = 0.25, 1, 96, 160, 6, 2, 128
    q, k, v = make_qkv(b, sq, sk, h, hk, d, torch.bfloat16, seed=17)
    dout = torch.randn_like(q)
    seed = seed_after(41, q.device)
    torch.manual_seed(41)
    out, grads = run_with_grad(q, k, v, dout, dropout_p=p, causal=True)
    mask = torch.from_numpy(keep_mask(seed, p, b, h, sq, sk))
    assert_grads_within(grads, reference_grads(q, k, v, dout, mask, p, True, True),
                        reference_grads(q, k, v, dout, mask, p, True, False), (q, k, v))


def test_custom_op_with_a_given_seed_and_its_gradients():
    """torch.compile's op (cudaflash::fwd with dropout_p and a seed tensor) and its
    registered autograd: out and grads against the host's mask for that seed."""
    from test_gpu_backward import assert_grads_within

    p, b, sq, sk, h, hk, d = 0.3, 2, 100, 180, 4, 2, 64
    q, k, v = make_qkv(b, sq, sk, h, hk, d, torch.bfloat16, seed=23)
    dout = torch.randn_like(q)
    seed = 0x0123_4567_89AB_CDEF
    seed_tensor = torch.tensor([seed], dtype=torch.int64, device=q.device)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, _ = torch.ops.cudaflash.fwd(*leaves, None, True, False, -1, -1, 0.0, None, p,
                                     seed_tensor)
    out.backward(dout)
    mask = torch.from_numpy(keep_mask(seed, p, b, h, sq, sk))
    ref = dropout_reference(q, k, v, mask, p, True)
    low = dropout_reference(q, k, v, mask, p, True, upcast=False)
    assert (out.float() - ref).abs().max().item() <= 2 * (low - ref).abs().max().item() + 1e-3
    assert_grads_within([t.grad for t in leaves],
                        reference_grads(q, k, v, dout, mask, p, True, True),
                        reference_grads(q, k, v, dout, mask, p, True, False), (q, k, v))


def test_torch_compile_fullgraph_draws_a_mask_per_run():
    """flash_attn_func with dropout compiles into one graph (the seed a traced randint):
    each run drops other weights, runs average to the undropped attention, and the
    backward (through the op) uses the forward's mask."""
    torch._dynamo.reset()
    q, k, v = make_qkv(1, 64, 128, 2, 2, 64, torch.float16, seed=6)
    compiled = torch.compile(lambda q, k, v: flash_attn_func(q, k, v, dropout_p=0.5),
                             fullgraph=True)
    with torch.no_grad():
        outs = [compiled(q, k, v).float() for _ in range(200)]
    assert not torch.equal(outs[0], outs[1])
    undropped = flash_attn_func(q, k, v).float()
    assert (torch.stack(outs).mean(0) - undropped).abs().mean().item() < 0.02
    # The backward must rebuild the forward's mask: out = A v with A the dropped, scaled
    # probabilities, so dv = A^T dout and <out, dout> = <v, dv> exactly (a backward with
    # another mask breaks the identity by far more than rounding).
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = compiled(*leaves)
    dout = torch.randn_like(out)
    out.backward(dout)
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves)
    lhs = (out.float() * dout.float()).sum().item()
    rhs = (v.float() * leaves[2].grad.float()).sum().item()
    assert abs(lhs - rhs) <= 2e-2 * max(abs(lhs), 1.0), (lhs, rhs)


def test_varlen_under_torch_compile_runs_eagerly():
    from cudaflash import flash_attn_varlen_func

    torch._dynamo.reset()
    lens = [30, 70]
    cu = torch.tensor([0, 30, 100], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(100, 2, 64, device="cuda", dtype=torch.float16,
                           requires_grad=True) for _ in range(3))
    compiled = torch.compile(lambda q, k, v: flash_attn_varlen_func(
        q, k, v, cu, cu, max(lens), max(lens), dropout_p=0.2, causal=True))
    out = compiled(q, k, v)
    out.sum().backward()
    assert out.shape == q.shape
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def assert_out_follows_s_dmask(out, s_dmask, q, k, v, p, causal):
    """out is the dropout attention with the keep mask S_dmask's signs give (a hidden or
    underflowed score, 0 in S_dmask, counts as kept: its weight is 0 or negligible)."""
    mask = (s_dmask >= 0).cpu()
    ref = dropout_reference(q, k, v, mask, p, causal)
    low = dropout_reference(q, k, v, mask, p, causal, upcast=False)
    assert (out.float() - ref).abs().max().item() <= 2 * (low - ref).abs().max().item() + 1e-3


def test_return_attn_probs_under_torch_compile():
    """flash_attn_func's (out, lse, S_dmask) with dropout in one compiled graph: S_dmask is
    built from the graph's own seed (torch ops on the seed tensor), so out follows its
    signs; the next run draws another mask for both."""
    torch._dynamo.reset()
    q, k, v = make_qkv(2, 96, 200, 4, 4, 64, torch.float16, seed=1)
    compiled = torch.compile(lambda q, k, v: flash_attn_func(
        q, k, v, dropout_p=0.2, causal=True, return_attn_probs=True), fullgraph=True)
    with torch.no_grad():
        out, lse, s_dmask = compiled(q, k, v)
        out2, _, s_dmask2 = compiled(q, k, v)
    assert s_dmask.shape == (2, 4, 96, 200) and lse.shape == (2, 4, 96)
    assert_out_follows_s_dmask(out, s_dmask, q, k, v, 0.2, True)
    assert_out_follows_s_dmask(out2, s_dmask2, q, k, v, 0.2, True)
    assert not torch.equal(s_dmask > 0, s_dmask2 > 0)


def test_varlen_return_attn_probs_under_torch_compile_runs_eagerly():
    """flash_attn_varlen_func's (out, lse, S_dmask) with dropout under torch.compile: the
    call runs eagerly (a graph break) and returns the triple."""
    from cudaflash import flash_attn_varlen_func

    torch._dynamo.reset()
    cu = torch.tensor([0, 30, 100], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(100, 2, 64, device="cuda", dtype=torch.float16) for _ in range(3))
    compiled = torch.compile(lambda q, k, v: flash_attn_varlen_func(
        q, k, v, cu, cu, 70, 70, dropout_p=0.2, causal=True, return_attn_probs=True))
    with torch.no_grad():
        out, lse, s_dmask = compiled(q, k, v)
    assert out.shape == q.shape and lse.shape == (2, 100) and s_dmask.shape == (2, 2, 70, 70)
    for b, (start, n) in enumerate(((0, 30), (30, 70))):
        rows = slice(start, start + n)
        assert_out_follows_s_dmask(out[None, rows], s_dmask[b:b + 1, :, :n, :n],
                                   q[None, rows], k[None, rows], v[None, rows], 0.2, True)


def test_varlen_return_attn_probs_gives_each_sequences_s_dmask():
    """flash_attn_varlen_func's (out, lse, S_dmask) with dropout: sequence b's block of
    S_dmask has the signs of batch entry b's mask and its out is consistent with it."""
    from cudaflash import flash_attn_varlen_func

    p, h, d = 0.25, 2, 64
    lens_q, lens_k = [20, 64], [50, 64]
    cu_q = torch.tensor([0, 20, 84], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 50, 114], dtype=torch.int32, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(9)
    q = torch.randn(84, h, d, device="cuda", dtype=torch.float16, generator=gen)
    k = torch.randn(114, h, d, device="cuda", dtype=torch.float16, generator=gen)
    v = torch.randn_like(k)
    seed = seed_after(13, q.device)
    torch.manual_seed(13)
    with torch.no_grad():
        out, lse, s_dmask = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 64, 64, dropout_p=p,
                                                   causal=True, return_attn_probs=True)
    assert s_dmask.shape == (2, h, 64, 64) and lse.shape == (h, 84)
    for b, (sq, sk) in enumerate(zip(lens_q, lens_k)):
        mask = torch.from_numpy(keep_mask(seed, p, 2, h, sq, sk)[b:b + 1])
        block = s_dmask[b:b + 1, :, :sq, :sk]
        visible = block != 0
        assert torch.equal((block > 0)[visible].cpu(), mask.to(visible.device)[visible].cpu())
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        ref = dropout_reference(q[None, rows], k[None, keys], v[None, keys], mask, p, True)
        low = dropout_reference(q[None, rows], k[None, keys], v[None, keys], mask, p, True,
                                upcast=False)
        assert (out[None, rows].float() - ref).abs().max().item() <= \
            2 * (low - ref).abs().max().item() + 1e-3


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("slopes_shape", ["heads", "batch_heads"])
def test_alibi_with_dropout_forward_and_gradients(causal, slopes_shape):
    """Dropout with ALiBi (cudaflash_fwd_dropout_alibi; the backward's scoremod entries):
    out and grads against the torch math with the bias and the host's mask."""
    from test_gpu_backward import assert_grads_within, run_with_grad

    p, b, sq, sk, h, hk, d = 0.2, 2, 150, 200, 4, 2, 128
    q, k, v = make_qkv(b, sq, sk, h, hk, d, torch.bfloat16, seed=51)
    shape = (h,) if slopes_shape == "heads" else (b, h)
    slopes = torch.rand(shape, device="cuda", dtype=torch.float32) * 0.5
    dout = torch.randn_like(q)
    seed = seed_after(61, q.device)
    torch.manual_seed(61)
    out, grads = run_with_grad(q, k, v, dout, dropout_p=p, causal=causal, alibi_slopes=slopes)
    mask = torch.from_numpy(keep_mask(seed, p, b, h, sq, sk))
    ref = dropout_reference(q, k, v, mask, p, causal, alibi_slopes=slopes)
    low = dropout_reference(q, k, v, mask, p, causal, upcast=False, alibi_slopes=slopes)
    assert (out.float() - ref).abs().max().item() <= 2 * (low - ref).abs().max().item() + 1e-3

    assert_grads_within(grads, reference_grads(q, k, v, dout, mask, p, causal, True,
                                               alibi_slopes=slopes),
                        reference_grads(q, k, v, dout, mask, p, causal, False,
                                        alibi_slopes=slopes), (q, k, v))
