"""Argument checks of flash_attn_with_kvcache that run on the host before the device check
(CPU tensors are enough); the cache_seqlens checks, which come after it, are GPU tests in
test_gpu_kvcache.py."""

import pytest
import torch

from cudaflash import flash_attn_with_kvcache
from test_api_errors import bad_alibi_slopes, good_alibi_slopes

F16 = torch.float16
CPU_ERROR = r"on cpu; cudaflash runs on CUDA GPUs only"


def tensors(b=2, sq=1, sc=16, h=4, hk=2, d=64, new=3):
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(F16)

    return (randn(b, sq, h, d), randn(b, sc, hk, d), randn(b, sc, hk, d),
            randn(b, new, hk, d), randn(b, new, hk, d))


def test_valid_cpu_call_reaches_the_device_check():
    q, kc, vc, k, v = tensors()
    with pytest.raises(ValueError, match=CPU_ERROR):
        flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=4)


I32 = torch.int32


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(rotary_cos=torch.zeros(16, 8, dtype=F16)), ValueError,
     "rotary_cos and rotary_sin go together"),
    (dict(rotary_cos=torch.zeros(16, 8), rotary_sin=torch.zeros(16, 8)), ValueError,
     "rotary_cos is torch.float32 on cpu; it must be q's torch.float16"),
    (dict(rotary_cos=torch.zeros(16, 8, dtype=F16), rotary_sin=torch.zeros(16, 4, dtype=F16)),
     ValueError, r"rotary_cos has shape \(16, 8\) but rotary_sin has \(16, 4\)"),
    (dict(rotary_cos=torch.zeros(16, 40, dtype=F16), rotary_sin=torch.zeros(16, 40, dtype=F16)),
     ValueError, r"rotary_dim = 80 must be in \[2, headdim=64\]"),
    (dict(rotary_cos=torch.zeros(15, 8, dtype=F16), rotary_sin=torch.zeros(15, 8, dtype=F16)),
     ValueError, r"rotary_cos has 15 positions; it must cover the caches' 16"),
    (dict(rotary_cos=torch.zeros(16, 8, dtype=F16), rotary_sin=torch.zeros(16, 8, dtype=F16),
          rotary_interleaved="yes"), TypeError, "rotary_interleaved=.yes.; it must be a bool"),
    (dict(cache_batch_idx=torch.zeros(2)), TypeError,
     "cache_batch_idx has dtype torch.float32; it must be torch.int32"),
    (dict(cache_batch_idx=torch.zeros(3, dtype=I32)), ValueError,
     r"cache_batch_idx has shape \(3,\); it must be \(batch,\) = \(2,\)"),
    (dict(cache_leftpad=[0, 1]), TypeError,
     "cache_leftpad must be None or a \\(batch,\\) torch.int32 tensor, got list"),
    (dict(block_table=torch.zeros(2, 4)), TypeError,
     "block_table has dtype torch.float32; it must be torch.int32"),
    (dict(block_table=torch.zeros(3, 4, dtype=I32)), ValueError,
     r"block_table has shape \(3, 4\); it must be \(batch, max_blocks_per_seq\)"),
    (dict(block_table=torch.zeros(2, 4, dtype=I32).t().contiguous().t()), ValueError,
     "block_table has strides .*; its last stride must be 1"),
    (dict(block_table=torch.zeros(2, 4, dtype=I32), cache_leftpad=torch.zeros(2, dtype=I32)),
     ValueError, "cache_leftpad is given with block_table; paged K/V takes neither"),
])
def test_cache_and_rotary_arguments_are_checked(kwargs, error, match):
    q, kc, vc, _, _ = tensors()
    with pytest.raises(error, match=match):
        flash_attn_with_kvcache(q, kc, vc, **kwargs)


@pytest.mark.parametrize("page", [8, 24, 100])
def test_unsupported_page_sizes_are_named(page):
    q, kc, vc, _, _ = tensors()
    pool = torch.zeros(4, page, 2, 64, dtype=F16)
    with pytest.raises(ValueError, match=f"k_cache has pages of {page} positions .*powers of "
                                         "two from 16"):
        flash_attn_with_kvcache(q, pool, pool.clone(), block_table=torch.zeros(2, 2, dtype=I32))


def test_paged_and_indexed_caches_need_not_have_the_batch():
    """With block_table or cache_batch_idx the caches' first dim is pages or cache entries:
    the call passes the checks (to the device check)."""
    q, kc, vc, k, v = tensors(sc=16)
    pages = torch.zeros(5, 16, 2, 64, dtype=F16)
    with pytest.raises(ValueError, match=CPU_ERROR):
        flash_attn_with_kvcache(q, pages, pages.clone(), k, v, cache_seqlens=4,
                                block_table=torch.zeros(2, 3, dtype=I32))
    with pytest.raises(ValueError, match=CPU_ERROR):
        flash_attn_with_kvcache(q, pages, pages.clone(), k, v, cache_seqlens=4,
                                cache_batch_idx=torch.tensor([4, 0], dtype=I32))


@pytest.mark.parametrize("kwargs,match", [
    (dict(window_size=(8, 0, 1)), r"window_size=\(8, 0, 1\); it must be \(left, right\)"),
    (dict(softcap=-1.0), r"softcap=-1.0; it must be a finite number >= 0"),
])
def test_bad_window_and_softcap(kwargs, match):
    q, kc, vc, _, _ = tensors()
    with pytest.raises(ValueError, match=match):
        flash_attn_with_kvcache(q, kc, vc, **kwargs)


@pytest.mark.parametrize("slopes, error, message", bad_alibi_slopes(2, 4, 2))
def test_bad_alibi_slopes(slopes, error, message):
    """Refused whatever the call's form: the whole cache, a decoding step (tensor lengths),
    an append, paged caches."""
    q, kc, vc, k, v = tensors()
    lengths = torch.tensor([4, 9], dtype=I32)
    pages = torch.zeros(5, 16, 2, 64, dtype=F16)
    for call in (lambda: flash_attn_with_kvcache(q, kc, vc, alibi_slopes=slopes),
                 lambda: flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths,
                                                 alibi_slopes=slopes),
                 lambda: flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=4,
                                                 alibi_slopes=slopes),
                 lambda: flash_attn_with_kvcache(q, pages, pages.clone(), cache_seqlens=lengths,
                                                 block_table=torch.zeros(2, 2, dtype=I32),
                                                 alibi_slopes=slopes)):
        with pytest.raises(error, match=message):
            call()


def test_valid_alibi_slopes_reach_the_device_check():
    q, kc, vc, k, v = tensors()
    lengths = torch.tensor([4, 9], dtype=I32)
    pages = torch.zeros(5, 16, 2, 64, dtype=F16)
    for slopes in good_alibi_slopes(2, 4):
        for kwargs in (dict(), dict(cache_seqlens=lengths, num_splits=3, causal=True),
                       dict(k=k, v=v, cache_seqlens=4, softcap=5.0, window_size=(3, 0)),
                       dict(cache_seqlens=lengths, cache_leftpad=torch.zeros(2, dtype=I32))):
            with pytest.raises(ValueError, match=CPU_ERROR):
                flash_attn_with_kvcache(q, kc, vc, alibi_slopes=slopes, **kwargs)
        with pytest.raises(ValueError, match=CPU_ERROR):
            flash_attn_with_kvcache(q, pages, pages.clone(), cache_seqlens=lengths,
                                    block_table=torch.zeros(2, 2, dtype=I32),
                                    alibi_slopes=slopes)


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_bad_num_splits(value):
    q, kc, vc, _, _ = tensors()
    with pytest.raises(ValueError, match=f"num_splits={value!r}; it must be an int >= 0"):
        flash_attn_with_kvcache(q, kc, vc, num_splits=value)


def test_cache_arguments_are_named_in_messages():
    q, kc, vc, _, _ = tensors()
    with pytest.raises(ValueError, match=r"k_cache has shape \(2, 16, 2, 64\) but v_cache has "
                                         r"\(2, 15, 2, 64\)"):
        flash_attn_with_kvcache(q, kc, vc[:, :15])
    with pytest.raises(ValueError, match="q has batch size 2 but k_cache and v_cache have 1"):
        flash_attn_with_kvcache(q, kc[:1], vc[:1])
    with pytest.raises(TypeError, match="k_cache must be a torch.Tensor, got list"):
        flash_attn_with_kvcache(q, [1], vc)


def test_k_and_v_come_together():
    q, kc, vc, k, v = tensors()
    with pytest.raises(ValueError, match="k is a tensor and v is None: give both"):
        flash_attn_with_kvcache(q, kc, vc, k=k, cache_seqlens=4)


def test_new_keys_need_the_cache_heads():
    q, kc, vc, _, _ = tensors()
    k = torch.zeros(2, 3, 4, 64, dtype=F16)  # 4 heads, the cache has 2
    with pytest.raises(ValueError, match=r"k and v have shape \(2, 3, 4, 64\); they must be "
                                         r"\(batch, seqlen_new, nheads_k, headdim\) with "
                                         "q's batch=2 and k_cache's nheads_k=2, headdim=64"):
        flash_attn_with_kvcache(q, kc, vc, k, k.clone(), cache_seqlens=4)


def test_new_keys_need_the_cache_dtype():
    q, kc, vc, k, v = tensors()
    with pytest.raises(ValueError, match="k is torch.float32 on cpu; it must be k_cache's "
                                         "torch.float16 on cpu"):
        flash_attn_with_kvcache(q, kc, vc, k.float(), v, cache_seqlens=4)


def test_new_keys_may_have_any_layout():
    """The append packs a copy of any layout its kernel cannot read: a non-contiguous k
    passes the checks (to the device check)."""
    q, kc, vc, k, v = tensors()
    k_strided = k.transpose(1, 3).contiguous().transpose(1, 3)  # last stride != 1
    with pytest.raises(ValueError, match=CPU_ERROR):
        flash_attn_with_kvcache(q, kc, vc, k_strided, v, cache_seqlens=4)


def test_new_keys_must_not_alias_the_cache():
    q, kc, vc, _, _ = tensors()
    with pytest.raises(ValueError, match="k or v shares memory with k_cache or v_cache"):
        flash_attn_with_kvcache(q, kc, vc, kc[:, :3], vc[:, :3].clone(), cache_seqlens=4)


def test_grad_mode_runs_the_call():
    """A q, new k/v or cache that requires grad: the call runs as without gradients (its out's
    backward raises: GPU test), here on to the device check."""
    q, kc, vc, k, v = tensors()
    with pytest.raises(ValueError, match=CPU_ERROR):
        flash_attn_with_kvcache(q.clone().requires_grad_(True), kc, vc)
    with pytest.raises(ValueError, match=CPU_ERROR):
        flash_attn_with_kvcache(q, kc, vc, k.clone().requires_grad_(True), v, cache_seqlens=4)
    with pytest.raises(ValueError, match=CPU_ERROR):
        flash_attn_with_kvcache(q, kc.clone().requires_grad_(True), vc)


def test_forward_only_output():
    """_autograd.ForwardOnly, the out of a call without a backward made in grad mode: it
    requires grad, takes in-place changes (flash-attn's out, without a grad_fn, would), and
    its backward raises naming the call."""
    from cudaflash import _autograd
    q = torch.randn(2, 3, requires_grad=True)
    out = torch.randn(2, 3, 8)[..., :5]  # a view, as a padded head dim's out is
    got = _autograd.ForwardOnly.apply(out, "flash_attn_with_kvcache", q, None, None)
    assert got.requires_grad and torch.equal(got, out)
    got.mul_(2)
    with pytest.raises(NotImplementedError, match="flash_attn_with_kvcache has no backward"):
        got.sum().backward()


@pytest.mark.parametrize("window, lengths, new, routed", [
    ((-1, 5), 4, 0, True),     # a side between the used keys (4) and the capacity (64)
    ((5, -1), 2, 2, True),
    ((-1, 3), 4, 0, False),    # within the used keys: the plain batch counts it alike
    ((-1, 64), 4, 0, False),   # the capacity on: unbounded for both
    ((-1, -1), 4, 0, False),
    ((-1, 5), torch.tensor([4]), 0, False),  # tensors take the per-sequence path anyway
    ((-1, 5), True, 0, False),
])
def test_int_lengths_route_windows_counted_from_the_capacity(window, lengths, new, routed):
    """flash-attn counts a window side as unbounded from the caches' length on; an int
    cache_seqlens call whose side lies between the used length and that takes the
    per-sequence path, whose kernel counts from the capacity (the GPU test checks the
    outputs)."""
    from cudaflash import kvcache
    assert kvcache._window_needs_the_capacity(window, lengths, new, 64) is routed


def test_numpy_int_lengths_route_like_ints():
    import numpy as np
    from cudaflash import kvcache
    assert kvcache._window_needs_the_capacity((-1, 5), np.int64(4), 0, 64)
