"""cudaflash behind F.scaled_dot_product_attention's flash backend (cudaflash.integrations.sdpa)
on the GPU: results and gradients against torch's math in float32 (FlashAttention's rule, the
baseline being torch's math in the same low precision), proof that cudaflash's kernels ran,
the hand-over of what it does not take to torch's own flash kernel, torch.compile, and
restore()."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cudaflash import api
from cudaflash.integrations import sdpa

pytestmark = pytest.mark.requires_gpu


@pytest.fixture
def activated(monkeypatch):
    """cudaflash active for SDPA's flash backend, its entries counted; restored after."""
    calls = []
    forward, backward = api.flash_attn_func, sdpa.cudaflash_backward

    def counted_forward(*args, **kwargs):
        calls.append("forward")
        return forward(*args, **kwargs)

    def counted_backward(*args, **kwargs):
        calls.append("backward")
        return backward(*args, **kwargs)

    monkeypatch.setattr(api, "flash_attn_func", counted_forward)
    monkeypatch.setattr(sdpa, "cudaflash_backward", counted_backward)
    sdpa.activate()
    yield calls
    sdpa.restore()


def inputs(batch, heads, seqlen, d, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(batch, heads, seqlen, d, device="cuda", dtype=torch.bfloat16,
                        generator=g).requires_grad_() for _ in range(3)]


def flash_sdpa(q, k, v, **kwargs):
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def math_sdpa(q, k, v, dtype, **kwargs):
    leaves = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*leaves, **kwargs), leaves


def check(what, ours, lowp, ref):
    """The project's pass rule (tests/test_gpu_correctness.py, _assert_within): twice the
    low-precision math's error, plus twice the rounding of the float32 reference to ours's
    dtype (a gradient's one rounding when it is stored)."""
    ref = ref.float()
    err = (ours.float() - ref).abs().max().item()
    base = (lowp.float() - ref).abs().max().item()
    rounding = (ref.to(ours.dtype).float() - ref).abs().max().item()
    bound = 2 * base + 2 * rounding + 1e-5
    assert err <= bound, (f"{what}: error {err:.3g} > 2 x math bf16's {base:.3g} + 2 x "
                          f"rounding {rounding:.3g}")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_forward_and_backward_run_cudaflash(d, causal, activated):
    q, k, v = inputs(2, 8, 1000, d)
    out = flash_sdpa(q, k, v, is_causal=causal, scale=0.1)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert activated == ["forward", "backward"]
    ref, ref_leaves = math_sdpa(q, k, v, torch.float32, is_causal=causal, scale=0.1)
    lowp, lowp_leaves = math_sdpa(q, k, v, torch.bfloat16, is_causal=causal, scale=0.1)
    check("out", out, lowp, ref)
    ref_grads = torch.autograd.grad(ref, ref_leaves, dout.float())
    lowp_grads = torch.autograd.grad(lowp, lowp_leaves, dout)
    for name, g, lg, rg in zip("qkv", grads, lowp_grads, ref_grads):
        check(f"d{name}", g, lg, rg)


def test_gqa_through_the_operator(activated):
    """4 query heads over 2 K/V heads, at the aten operator SDPA's flash backend calls."""
    q = inputs(1, 4, 256, 64)[0].detach()
    k, v = (x.detach() for x in inputs(1, 2, 256, 64, seed=1)[:2])
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, is_causal=True)[0]
    assert activated == ["forward"]
    ref, _ = math_sdpa(q, k, v, torch.float32, is_causal=True, enable_gqa=True)
    lowp, _ = math_sdpa(q, k, v, torch.bfloat16, is_causal=True, enable_gqa=True)
    check("gqa out", out, lowp, ref)


def test_padded_head_dim_and_dropout_reach_the_right_kernels(activated):
    """d=96: cudaflash's forward (padded), torch's backward; dropout: torch's kernel only."""
    if not hasattr(torch.library, "get_kernel"):
        pytest.skip(f"torch {torch.__version__} has no torch.library.get_kernel: such calls "
                    "raise instead (tests/test_sdpa_integration.py)")
    q, k, v = inputs(1, 4, 512, 96)
    out = flash_sdpa(q, k, v, is_causal=True)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    # cudaflash's forward served the call and its backward was never asked for d96. (On torch
    # 2.11 the backward ran cudaflash's forward once more: seen on the H200, cause not yet
    # read; the gradients below are checked either way.)
    assert activated[0] == "forward" and "backward" not in activated, activated
    ref, leaves = math_sdpa(q, k, v, torch.float32, is_causal=True)
    lowp, lowp_leaves = math_sdpa(q, k, v, torch.bfloat16, is_causal=True)
    check("d96 out", out, lowp, ref)
    for name, g, lg, rg in zip("qkv", grads,
                               torch.autograd.grad(lowp, lowp_leaves, torch.ones_like(lowp)),
                               torch.autograd.grad(ref, leaves, torch.ones_like(ref))):
        check(f"d96 d{name}", g, lg, rg)
    activated.clear()
    flash_sdpa(q, k, v, dropout_p=0.1).sum().backward()
    assert activated == []


def test_torch_compile_reaches_cudaflash(activated):
    q, k, v = (x.detach() for x in inputs(2, 8, 512, 128))
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: F.scaled_dot_product_attention(q, k, v,
                                                                             is_causal=True))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # read when the graph is compiled
        out = compiled(q, k, v)
    assert "forward" in activated
    ref, _ = math_sdpa(q, k, v, torch.float32, is_causal=True)
    lowp, _ = math_sdpa(q, k, v, torch.bfloat16, is_causal=True)
    check("compiled out", out, lowp, ref)


def test_restore_gives_torchs_kernel_back(activated):
    q, k, v = (x.detach() for x in inputs(1, 2, 128, 64))
    sdpa.restore()
    assert not sdpa.active()
    flash_sdpa(q, k, v)
    assert activated == []
    sdpa.activate()
    flash_sdpa(q, k, v)
    assert activated == ["forward"]
