"""Argument checks of flash_attn_varlen_func on the host (CPU tensors: every check runs
before the device check, which comes last). GPU behaviour: test_gpu_varlen.py."""

import pytest
import torch

from cudaflash import (flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                       flash_attn_varlen_qkvpacked_func)
from test_api_errors import bad_alibi_slopes, good_alibi_slopes

F16 = torch.float16
CPU_ERROR = r"on cpu; cudaflash runs on CUDA GPUs only"


def args(lens_q=(3, 5), lens_k=(4, 6), h=2, hk=2, d=64, dtype=F16):
    """Valid CPU arguments: q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lens_q), h, d, generator=g).to(dtype)
    k = torch.randn(sum(lens_k), hk, d, generator=g).to(dtype)
    v = torch.randn(sum(lens_k), hk, d, generator=g).to(dtype)
    cu = [torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
          for lens in (lens_q, lens_k)]
    return [q, k, v, *cu, max(lens_q), max(lens_k)]


def call(a, **kwargs):
    return flash_attn_varlen_func(*a, **kwargs)


def test_valid_cpu_call_reaches_the_device_check():
    with pytest.raises(ValueError, match=CPU_ERROR):
        call(args(), causal=True, return_attn_probs=True)


def test_padded_batch_shape_is_refused():
    a = args()
    a[0] = a[0][None]
    with pytest.raises(ValueError, match=r"q has shape \(1, 8, 2, 64\); expected 3 dims "
                                         r"\(total_seqlen, nheads, headdim\)"):
        call(a)


@pytest.mark.parametrize("index, value, error, message", [
    (3, [0, 3, 8], TypeError, "cu_seqlens_q must be a torch.Tensor, got list"),
    (3, torch.tensor([0, 3, 8]), TypeError, "cu_seqlens_q has dtype torch.int64; it must be "
                                           "torch.int32"),
    (4, torch.tensor([[0, 4, 10]], dtype=torch.int32), ValueError,
     r"cu_seqlens_k has shape \(1, 3\); it must be \(batch \+ 1,\) with batch >= 1"),
    (4, torch.tensor([0], dtype=torch.int32), ValueError, r"cu_seqlens_k has shape \(1,\)"),
    (4, torch.tensor([0, 0, 4, 4, 10, 10], dtype=torch.int32)[::2], ValueError,
     "cu_seqlens_k has stride 2; it must be contiguous"),
    (4, torch.tensor([0, 10], dtype=torch.int32), ValueError,
     "cu_seqlens_q has 3 entries and cu_seqlens_k 2; both must be batch \\+ 1"),
    (5, -1, ValueError, r"max_seqlen_q=-1; it must be an int in \[0, 2\*\*31\)"),
    (5, 5.0, ValueError, r"max_seqlen_q=5.0; it must be an int"),
    (6, True, ValueError, r"max_seqlen_k=True; it must be an int"),
    (6, torch.tensor(6), ValueError, r"max_seqlen_k=tensor\(6\); it must be an int"),
])
def test_bad_offsets_and_maxima(index, value, error, message):
    a = args()
    a[index] = value
    with pytest.raises(error, match=message):
        call(a)


def test_shape_rules_shared_with_flash_attn_func():
    a = args(h=3, hk=2)
    with pytest.raises(ValueError, match="q has 3 heads and k, v have 2; nheads must be a "
                                         "positive multiple of nheads_k"):
        call(a)
    a = args()
    a[2] = a[2][:, :, :32]
    with pytest.raises(ValueError, match=r"k has shape \(10, 2, 64\) but v has \(10, 2, 32\)"):
        call(a)
    a = args(d=264)
    with pytest.raises(ValueError, match="head dim 264 is not supported"):
        call(a)


def test_seq_stride_not_a_multiple_of_8():
    a = args()
    a[0] = torch.randn(8, 2, 68).to(F16)[:, :, :64]  # seq stride 136, head stride 68
    with pytest.raises(ValueError, match=r"q has strides \(136, 68, 1\): its head stride 68 is "
                                         "not a multiple of 8"):
        call(a)


def test_paged_kv_arguments_are_checked():
    a = args()
    pool = torch.zeros(4, 16, 2, 64, dtype=F16)
    a[1], a[2] = pool, pool.clone()
    table = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=CPU_ERROR):  # valid: on to the device check
        call(a, block_table=table)
    with pytest.raises(ValueError, match=r"block_table has shape \(3, 1\); it must be \(batch, "
                                         r"max_blocks_per_seq\) with batch=2"):
        call(a, block_table=torch.zeros(3, 1, dtype=torch.int32))
    with pytest.raises(TypeError, match="block_table has dtype torch.int64"):
        call(a, block_table=table.long())
    b = args()
    with pytest.raises(ValueError, match=r"k has shape \(10, 2, 64\); expected 4 dims"):
        call(b, block_table=table)  # packed k is not a pool of pages
    a[0].requires_grad_(True)  # grad mode: the forward runs (its out's backward raises: GPU test)
    with pytest.raises(ValueError, match=CPU_ERROR):
        call(a, block_table=table)


def test_dropout_combinations_not_built_are_named():
    """dropout_p > 0 with softcap, or with paged K/V: NotImplementedError naming which, before
    any device work."""
    with pytest.raises(NotImplementedError, match="dropout_p > 0 with softcap is not "
                                                  "implemented"):
        call(args(), dropout_p=0.1, softcap=5.0)
    a = args()
    pool = torch.zeros(4, 16, 2, 64, dtype=F16)
    a[1], a[2] = pool, pool.clone()
    table = torch.zeros(2, 1, dtype=torch.int32)
    with pytest.raises(NotImplementedError, match=r"dropout_p > 0 with block_table \(paged "
                                                  r"K/V\) is not implemented"):
        call(a, dropout_p=0.1, block_table=table)


def test_bad_softcap_is_named():
    with pytest.raises(ValueError, match=r"softcap=-5.0; it must be a finite number >= 0"):
        call(args(), softcap=-5.0)


def test_causal_must_be_bool():
    with pytest.raises(TypeError, match="causal='yes'; it must be a bool"):
        call(args(), causal="yes")


# ---- alibi_slopes: (nheads,) or (batch, nheads), batch = the number of sequences -------------


@pytest.mark.parametrize("slopes, error, message", bad_alibi_slopes(2, 4, 2))
def test_bad_alibi_slopes(slopes, error, message):
    a = args(h=4, hk=2)
    with pytest.raises(error, match=message):
        call(a, alibi_slopes=slopes)
    a[0].requires_grad_(True)  # the autograd path checks them too
    with pytest.raises(error, match=message):
        call(a, alibi_slopes=slopes)


def test_valid_alibi_slopes_reach_the_device_check():
    for slopes in good_alibi_slopes(2, 4):
        with pytest.raises(ValueError, match=CPU_ERROR):
            call(args(h=4, hk=2), alibi_slopes=slopes, causal=True, return_attn_probs=True)
        a = args(h=4, hk=2)
        a[0].requires_grad_(True)
        with pytest.raises(ValueError, match=CPU_ERROR):
            call(a, alibi_slopes=slopes, softcap=5.0, window_size=(3, 0))


def test_alibi_slopes_batch_is_the_number_of_sequences():
    """Three sequences: (3, nheads) slopes are valid, (2, nheads) are not."""
    a = args(lens_q=(3, 5, 1), lens_k=(4, 6, 2), h=4, hk=2)
    with pytest.raises(ValueError, match=CPU_ERROR):
        call(a, alibi_slopes=torch.rand(3, 4))
    with pytest.raises(ValueError, match=r"alibi_slopes has shape \(2, 4\); it must be "
                                         r"\(nheads,\) = \(4,\) or \(batch, nheads\) = "
                                         r"\(3, 4\)"):
        call(a, alibi_slopes=torch.rand(2, 4))


def test_alibi_slopes_with_paged_kv_and_the_packed_forms():
    """flash_attn_varlen_func's paged branch and the packed forms check the slopes alike."""
    a = args(h=4, hk=2)
    pool = torch.zeros(4, 16, 2, 64, dtype=F16)
    a[1], a[2] = pool, pool.clone()
    table = torch.zeros(2, 1, dtype=torch.int32)
    half = torch.ones(4, dtype=F16)
    message = "alibi_slopes has dtype torch.float16; it must be torch.float32"
    with pytest.raises(ValueError, match=message):
        call(a, block_table=table, alibi_slopes=half)
    with pytest.raises(ValueError, match=CPU_ERROR):
        call(a, block_table=table, alibi_slopes=torch.rand(2, 4))
    q, k, v, cu_q, cu_k, max_q, max_k = args(lens_q=(3, 5), lens_k=(3, 5), h=4, hk=4)
    qkv = torch.stack((q, k, v), 1)
    with pytest.raises(ValueError, match=message):
        flash_attn_varlen_qkvpacked_func(qkv, cu_q, max_q, alibi_slopes=half)
    with pytest.raises(ValueError, match=CPU_ERROR):
        flash_attn_varlen_qkvpacked_func(qkv, cu_q, max_q, alibi_slopes=torch.rand(4))
    kv = torch.stack((k, v), 1)
    with pytest.raises(ValueError, match=message):
        flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, max_q, max_k, alibi_slopes=half)
    with pytest.raises(ValueError, match=CPU_ERROR):
        flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, max_q, max_k,
                                        alibi_slopes=torch.rand(2, 4))
