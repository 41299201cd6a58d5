"""The packed-input wrappers (flash_attn_qkvpacked_func, flash_attn_kvpacked_func and their
varlen forms): a bad packed tensor is refused naming it; on a GPU each wrapper gives exactly
what the unpacked function gives on the same views, gradients included."""

import pytest
import torch

from cudaflash import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                       flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                       flash_attn_varlen_qkvpacked_func)

F16 = torch.float16


@pytest.mark.parametrize("call,shape,match", [
    (lambda t: flash_attn_qkvpacked_func(t), (1, 4, 2, 2, 64),
     r"qkv has shape \(1, 4, 2, 2, 64\); expected \(batch, seqlen, 3, nheads, headdim\)"),
    (lambda t: flash_attn_qkvpacked_func(t), (4, 3, 2, 64),
     r"qkv has shape \(4, 3, 2, 64\); expected \(batch, seqlen, 3, nheads, headdim\)"),
    (lambda t: flash_attn_kvpacked_func(torch.zeros(1, 4, 2, 64, dtype=F16), t),
     (1, 4, 3, 2, 64), r"kv has shape \(1, 4, 3, 2, 64\); expected \(batch, seqlen_k, 2, "),
    (lambda t: flash_attn_varlen_qkvpacked_func(t, None, 4), (4, 2, 2, 64),
     r"qkv has shape \(4, 2, 2, 64\); expected \(total, 3, nheads, headdim\)"),
    (lambda t: flash_attn_varlen_kvpacked_func(torch.zeros(4, 2, 64, dtype=F16), t, None,
                                               None, 4, 4),
     (4, 2, 64), r"kv has shape \(4, 2, 64\); expected \(total_k, 2, nheads_k, headdim\)"),
])
def test_bad_packed_tensor_is_named(call, shape, match):
    with pytest.raises(ValueError, match=match):
        call(torch.zeros(shape, dtype=F16))


def test_not_a_tensor():
    with pytest.raises(TypeError, match="qkv must be a torch.Tensor, got list"):
        flash_attn_qkvpacked_func([1, 2, 3])


gpu = pytest.mark.requires_gpu


@gpu
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_qkvpacked_is_flash_attn_func_on_the_views(causal):
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(2, 300, 3, 4, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    qkv.requires_grad_(True)
    out, lse, _ = flash_attn_qkvpacked_func(qkv, causal=causal, deterministic=True,
                                            return_attn_probs=True)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)

    leaf = qkv.detach().clone().requires_grad_(True)
    q, k, v = leaf.unbind(2)
    ref, ref_lse, _ = flash_attn_func(q, k, v, causal=causal, deterministic=True,
                                      return_attn_probs=True)
    (ref_dqkv,) = torch.autograd.grad(ref, leaf, dout)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert torch.equal(dqkv, ref_dqkv)


@gpu
def test_kvpacked_is_flash_attn_func_on_the_views():
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, 17, 8, 64, generator=g, device="cuda", dtype=F16)
    kv = torch.randn(2, 500, 2, 2, 64, generator=g, device="cuda", dtype=F16)
    out = flash_attn_kvpacked_func(q, kv, causal=True)
    assert torch.equal(out, flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], causal=True))


@gpu
def test_varlen_packed_forms_are_flash_attn_varlen_func_on_the_views():
    g = torch.Generator(device="cuda").manual_seed(2)
    cu = torch.tensor([0, 100, 101, 357], dtype=torch.int32, device="cuda")
    qkv = torch.randn(357, 3, 4, 128, generator=g, device="cuda", dtype=F16)
    out = flash_attn_varlen_qkvpacked_func(qkv, cu, 256, causal=True)
    q, k, v = qkv.unbind(1)
    assert torch.equal(out, flash_attn_varlen_func(q, k, v, cu, cu, 256, 256, causal=True))
    kv = qkv[:, 1:]
    out = flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 256, 256)
    assert torch.equal(out, flash_attn_varlen_func(q, k, v, cu, cu, 256, 256))
