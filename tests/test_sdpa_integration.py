"""cudaflash.integrations.sdpa on the CPU: which calls cudaflash takes, the kernels' argument
and result plumbing (with flash-attn's semantics in torch standing in for cudaflash's
kernels), the hand-over of the rest to torch's own kernel, and activation through torch's
registry or without it. On the GPU, through F.scaled_dot_product_attention itself:
tests/test_gpu_sdpa.py."""

import pytest
import torch
import torch.nn.functional as F

import _flash_reference as reference
from cudaflash import api
from cudaflash.integrations import sdpa


def bhsd(batch, heads, seqlen, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seqlen, heads, d, generator=g).to(dtype).transpose(1, 2)


@pytest.fixture
def reference_kernels(monkeypatch):
    """cudaflash's forward and backward -> flash-attn's semantics in torch."""
    def forward(q, k, v, softmax_scale=None, causal=False, return_attn_probs=False):
        out = reference.attention(q, k, v, softmax_scale, causal)
        groups = q.shape[2] // k.shape[2]
        scores = (q.float().transpose(1, 2)
                  @ k.float().repeat_interleave(groups, 2).permute(0, 2, 3, 1))
        scores = scores * (q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale)
        if causal:
            sq, sk = q.shape[1], k.shape[1]
            hidden = torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1)
            scores = scores.masked_fill(hidden, float("-inf"))
        return out, scores.logsumexp(-1), None

    def backward(dout, q, k, v, out, lse, scale, causal):
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        again = reference.attention(*leaves, scale, causal)
        return torch.autograd.grad(again, leaves, dout)

    monkeypatch.setattr(api, "flash_attn_func", forward)
    monkeypatch.setattr(sdpa, "cudaflash_backward", backward)


def gqa(qkv):
    """q, k, v with k and v's heads repeated to q's (SDPA's enable_gqa is torch >= 2.5)."""
    q, k, v = qkv
    groups = q.shape[1] // k.shape[1]
    return q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)


class RecordingKernel:
    """A stand-in for torch's own flash kernel (torch.library.get_kernel's result)."""

    def __init__(self):
        self.calls = []

    def call_boxed(self, keyset, *args, **kwargs):
        self.calls.append((keyset, args, kwargs))
        return "torch's kernel"


@pytest.mark.parametrize("args, why", [
    (dict(dropout_p=0.1), "dropout_p=0.1 (cudaflash has no dropout)"),
    (dict(return_debug_mask=True), "return_debug_mask=True"),
    (dict(dtype=torch.float32), "dtype torch.float32"),
    (dict(heads_k=3), "4 query heads over 3 K/V heads"),
])
def test_forward_plan_names_what_cudaflash_does_not_take(args, why):
    q = bhsd(1, 4, 8, 64, args.get("dtype", torch.bfloat16))
    k = bhsd(1, args.get("heads_k", 2), 8, 64, q.dtype)
    assert sdpa.forward_plan(q, k, args.get("dropout_p", 0.0),
                             args.get("return_debug_mask", False)) == why


def test_plans_for_what_cudaflash_takes():
    q, k = bhsd(2, 8, 16, 96), bhsd(2, 2, 32, 96)
    assert sdpa.forward_plan(q, k, 0.0, False) is None  # any head dim: cudaflash pads
    assert "head dim 96" in sdpa.backward_plan(q, k, 0.0)  # backward kernels: 64, 128
    q, k = bhsd(2, 8, 16, 128), bhsd(2, 2, 32, 128)
    assert sdpa.backward_plan(q, k, 0.0) is None


@pytest.mark.parametrize("causal", [False, True])
def test_kernels_compute_sdpa_flash(causal, reference_kernels):
    """The forward's nine results and the backward's three gradients, in SDPA's (batch,
    heads, seqlen, d) layout, as torch's math computes them (GQA: 4 heads over 2)."""
    kernels = sdpa._Kernels(None, None)
    q, k, v = bhsd(2, 4, 16, 64, seed=1), bhsd(2, 2, 16, 64, seed=2), bhsd(2, 2, 16, 64, seed=3)
    got = kernels.forward("keyset", q, k, v, 0.0, causal, False, scale=0.2)
    out, lse, cum_q, cum_k, max_q, max_k, rng_state, unused, debug = got
    want = F.scaled_dot_product_attention(*gqa(x.float() for x in (q, k, v)),
                                          is_causal=causal, scale=0.2)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=0)
    assert out.shape == q.shape and lse.shape == (2, 4, 16) and lse.dtype == torch.float32
    assert (cum_q, cum_k, max_q, max_k) == (None, None, 16, 16)
    assert rng_state.dtype == unused.dtype == torch.uint64 and debug.numel() == 0

    dout = bhsd(2, 4, 16, 64, seed=4)
    dq, dk, dv = kernels.backward("keyset", dout, q, k, v, out, lse, None, None, 16, 16, 0.0,
                                  causal, rng_state, unused, scale=0.2)
    leaves = [x.float().requires_grad_() for x in (q, k, v)]
    want_grads = torch.autograd.grad(
        F.scaled_dot_product_attention(*gqa(leaves), is_causal=causal, scale=0.2),
        leaves, dout.float())
    for name, g, w in zip("qkv", (dq, dk, dv), want_grads):
        assert g.shape == w.shape, name
        torch.testing.assert_close(g.float(), w, atol=5e-2, rtol=0, msg=f"d{name}")


def test_calls_cudaflash_does_not_take_go_to_torchs_kernel(reference_kernels):
    forward, backward = RecordingKernel(), RecordingKernel()
    kernels = sdpa._Kernels(forward, backward)
    q = bhsd(1, 2, 8, 64)
    assert kernels.forward("ks", q, q, q, 0.1, True, False, scale=None) == "torch's kernel"
    assert forward.calls == [("ks", (q, q, q, 0.1, True, False), {"scale": None})]
    q96 = bhsd(1, 2, 8, 96)
    assert kernels.backward("ks", q96, q96, q96, q96, q96, "lse", None, None, 8, 8, 0.0, False,
                            "seed", "offset", scale=0.5) == "torch's kernel"
    assert backward.calls[0][1][5] == "lse" and backward.calls[0][2] == {"scale": 0.5}


def test_without_torchs_kernel_the_refusal_says_how_out():
    kernels = sdpa._Kernels(None, None)
    q = bhsd(1, 2, 8, 64)
    with pytest.raises(RuntimeError, match=r"dropout_p=0\.5.*restore\(\)"):
        kernels.forward(None, q, q, q, 0.5, False, False)


def test_activation_through_torchs_registry():
    attention = pytest.importorskip("torch.nn.attention")
    if sdpa._registry() is None:
        pytest.skip(f"torch {torch.__version__} has no flash-attention registry")
    assert sdpa.register() == "cudaflash" in attention.list_flash_attention_impls()
    try:
        sdpa.activate()
        assert attention.current_flash_attention_impl() == "cudaflash" and sdpa.active()
    finally:
        sdpa.restore()
    assert attention.current_flash_attention_impl() is None and not sdpa.active()


def test_activation_without_a_registry(monkeypatch):
    monkeypatch.setattr(sdpa, "_registry", lambda: None)
    with pytest.raises(RuntimeError, match="no flash-attention registry"):
        sdpa.register()
    try:
        sdpa.activate()
        assert sdpa.active() and sdpa._installed.library is not None
        first = sdpa._installed
        sdpa.activate()  # a second activation keeps the first install
        assert sdpa._installed is first
    finally:
        sdpa.restore()
    assert not sdpa.active() and first.library is None
