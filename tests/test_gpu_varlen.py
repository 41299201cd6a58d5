"""flash_attn_varlen_func on a GPU: each packed sequence against the attention math in
PyTorch (test_gpu_correctness's checker), and against flash_attn_func where the batch is
uniform."""

import math

import pytest
import torch

from cudaflash import flash_attn_func, flash_attn_varlen_func

import _internals as internals
from test_gpu_correctness import (COMBOS, DTYPES, _combo_id, _pick_combo, check_attention,
                                  fp32_reference_without_tf32)  # noqa: F401 (autouse fixture)

pytestmark = pytest.mark.requires_gpu


def packed(lens_q, lens_k, h, hk, d, dtype, seed=0):
    """randn q (sum(lens_q), h, d), k and v (sum(lens_k), hk, d) and their int32 offsets."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn((sum(lens_q), h, d), generator=g, device="cuda", dtype=dtype)
    k = torch.randn((sum(lens_k), hk, d), generator=g, device="cuda", dtype=dtype)
    v = torch.randn((sum(lens_k), hk, d), generator=g, device="cuda", dtype=dtype)
    return q, k, v, offsets(lens_q), offsets(lens_k)


def offsets(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")


def check_varlen(out, lse, q, k, v, cu_q, cu_k, causal, scale=None):
    """Each sequence of the packed batch, as its own batch-1 problem."""
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    oq, ok = cu_q.tolist(), cu_k.tolist()
    for b in range(len(oq) - 1):
        rows, keys = slice(oq[b], oq[b + 1]), slice(ok[b], ok[b + 1])
        check_attention(out[rows][None], lse[:, rows][None], q[rows][None], k[keys][None],
                        v[keys][None], causal, scale)


# (query lengths, key lengths, nheads, nheads_k)
VARLEN_SHAPES = [
    ([113, 1, 300, 0, 64], [113, 1, 300, 0, 64], 4, 2),  # self-attention, an empty sequence
    ([17, 200, 5, 40], [1000, 50, 0, 40], 3, 3),  # cross lengths; no keys; rows that see none
    ([1, 1, 1, 1], [4096, 17, 2049, 1], 8, 2),  # decoding: the grid is small, so it splits
    ([129, 2000], [2100, 2000], 2, 1),  # long enough for several blocks on the diagonal
]


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("shape", VARLEN_SHAPES, ids=lambda s: f"b{len(s[0])}_h{s[2]}_hk{s[3]}")
@pytest.mark.parametrize("combo", COMBOS, ids=_combo_id)
def test_varlen(combo, shape, causal):
    lens_q, lens_k, h, hk = shape
    dtype, d = combo
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, h, hk, d, DTYPES[dtype], seed=len(lens_q))
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                         causal=causal, return_attn_probs=True)
    check_varlen(out, lse, q, k, v, cu_q, cu_k, causal)
    # Without the lse: the same out.
    assert torch.equal(flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                              causal=causal), out)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("dims", [(3, 200, 300, 4, 2), (4, 1, 3000, 8, 2)],
                         ids=["prefill", "decode_split"])
def test_uniform_batch_matches_flash_attn_func(dims, causal):
    """Equal lengths: the same kernel, the same splits, so the same bits as the padded call."""
    b, sq, sk, h, hk = dims
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v, cu_q, cu_k = packed([sq] * b, [sk] * b, h, hk, d, DTYPES[dtype])
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, sq, sk, causal=causal,
                                         return_attn_probs=True)
    ref, ref_lse, _ = flash_attn_func(q.view(b, sq, h, d), k.view(b, sk, hk, d),
                                      v.view(b, sk, hk, d), causal=causal,
                                      return_attn_probs=True)
    if sq == 1 and h != hk:
        # flash_attn_func runs GQA decoding as rows of one K/V head, a different kernel problem.
        check_varlen(out, lse, q, k, v, cu_q, cu_k, causal)
        torch.testing.assert_close(out.view(b, sq, h, d), ref, atol=2e-2, rtol=0)
        return
    assert torch.equal(out.view(b, sq, h, d), ref)
    assert torch.equal(lse, ref_lse.permute(1, 0, 2).reshape(h, b * sq))


def test_packed_qkv_view_and_scale():
    """q, k, v as views into one (total, 3, h, d) tensor (seq stride 3 * h * d)."""
    dtype, d = _pick_combo(("fp16", 64), *COMBOS)
    lens = [70, 3, 256]
    qkv = torch.randn((sum(lens), 3, 4, d), device="cuda", dtype=DTYPES[dtype])
    q, k, v = qkv.unbind(1)
    cu = offsets(lens)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True,
                                         softmax_scale=0.3, return_attn_probs=True)
    check_varlen(out, lse, q, k, v, cu, cu, True, scale=0.3)


@pytest.mark.parametrize("lens_q", [[1, 1, 1], [300, 20, 500]], ids=["decode", "prefill"])
def test_understated_max_seqlen_k_still_sees_every_key(lens_q):
    """max_seqlen_k only sizes the split-KV runs; the last run takes every block left."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    lens_k = [5000, 100, 3000]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, 8, 2, d, DTYPES[dtype])
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), 200, causal=True,
                                         return_attn_probs=True)
    check_varlen(out, lse, q, k, v, cu_q, cu_k, True)


def test_offsets_out_of_range_are_clamped_not_a_fault():
    """Without CUDAFLASH_DEBUG nothing checks the offsets on the host; the kernel clamps them
    into the packed tensors, so the call runs (on the clamped ranges) and the GPU stays fine."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v, _, _ = packed([100], [100], 2, 2, d, DTYPES[dtype])
    bad = torch.tensor([-50, 10**9], dtype=torch.int32, device="cuda")
    out, lse, _ = flash_attn_varlen_func(q, k, v, bad, bad, 100, 100, return_attn_probs=True)
    torch.cuda.synchronize()
    cu = offsets([100])
    check_varlen(out, lse, q, k, v, cu, cu, False)


@pytest.fixture
def debug_mode(monkeypatch):
    """CUDAFLASH_DEBUG=1 for one test; caches cleared around it (they hold the debug flag)."""
    monkeypatch.setenv("CUDAFLASH_DEBUG", "1")
    internals.clear_caches()
    yield
    monkeypatch.delenv("CUDAFLASH_DEBUG")
    internals.clear_caches()


def test_debug_checks_the_offsets(debug_mode):
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v, cu_q, cu_k = packed([10, 20], [10, 20], 2, 2, d, DTYPES[dtype])
    with pytest.raises(ValueError, match="max_seqlen_q=19; it must be at least the longest"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 19, 20)
    decreasing = torch.tensor([0, 20, 10], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=r"cu_seqlens_k=\[0, 20, 10\]: offsets must be "
                                         "non-decreasing"):
        flash_attn_varlen_func(q, k, v, cu_q, decreasing, 20, 20)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 20)
    check_varlen(out, flash_attn_varlen_func(q, k, v, cu_q, cu_k, 20, 20,
                                             return_attn_probs=True)[1],
                 q, k, v, cu_q, cu_k, False)


def test_no_keys_at_all():
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v, cu_q, cu_k = packed([5, 7], [0, 0], 2, 2, d, DTYPES[dtype])
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 7, 0, return_attn_probs=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_torch_compile_fullgraph():
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    lens_q, lens_k = [30, 1, 250], [300, 40, 250]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, 4, 2, d, DTYPES[dtype])

    def attention(q, k, v, cu_q, cu_k):
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 250, 300, causal=True,
                                             return_attn_probs=True)
        return out, lse

    out, lse = torch.compile(attention, fullgraph=True)(q, k, v, cu_q, cu_k)
    check_varlen(out, lse, q, k, v, cu_q, cu_k, True)
    eager_out, eager_lse = attention(q, k, v, cu_q, cu_k)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)


def test_repeat_calls_take_the_plan_and_read_new_offsets(monkeypatch):
    """The second call of a signature skips the checked path; the offsets are data, so new
    values (same shapes) must be honoured; a tensor that requires grad is still refused."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v, cu_q, cu_k = packed([100, 156], [300, 20], 4, 2, d, DTYPES[dtype])
    flash_attn_varlen_func(q, k, v, cu_q, cu_k, 200, 300, causal=True)
    flash_attn_varlen_func(q, k, v, cu_q, cu_k, 200, 300, causal=True, return_attn_probs=True)
    assert internals.varlen_plan_key(q, k, v, cu_q, cu_k, 200, 300, None, True, False) in \
        internals.varlen_plans

    def checked_path(*args, **kwargs):
        raise AssertionError("the repeat call took the checked path")

    internals.replace_run_varlen(monkeypatch, checked_path)
    cu_q2, cu_k2 = offsets([200, 56]), offsets([20, 300])
    out = flash_attn_varlen_func(q, k, v, cu_q2, cu_k2, 200, 300, causal=True)
    lse = flash_attn_varlen_func(q, k, v, cu_q2, cu_k2, 200, 300, causal=True,
                                 return_attn_probs=True)[1]
    check_varlen(out, lse, q, k, v, cu_q2, cu_k2, True)
    monkeypatch.undo()
    # With gradients the call takes the autograd path, not the plan.
    out = flash_attn_varlen_func(q.clone().requires_grad_(), k, v, cu_q, cu_k, 200, 300)
    assert out.grad_fn is not None
