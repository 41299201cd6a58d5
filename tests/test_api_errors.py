"""Argument checks of flash_attn_func and forward: every bad input is refused on the host with
a message naming the argument, the value and what is allowed.

CPU tensors are enough: every check runs before the device check, which comes last and is
tested too. The GPU-only ones (head dims built for this GPU, empty inputs) are in
test_gpu_correctness.py.
"""

import math

import numpy as np
import pytest
import torch

from cudaflash import (KernelConfig, flash_attn_func, flash_attn_kvpacked_func,
                       flash_attn_qkvpacked_func, forward)
from cudaflash.config import ConfigError

import _internals as internals

F16 = torch.float16
CPU_ERROR = r"on cpu; cudaflash runs on CUDA GPUs only"


def qkv(b=1, sq=4, sk=4, h=2, hk=2, d=64, dtype=F16):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, sq, h, d, generator=g).to(dtype),
            torch.randn(b, sk, hk, d, generator=g).to(dtype),
            torch.randn(b, sk, hk, d, generator=g).to(dtype))


def test_valid_cpu_call_reaches_the_device_check():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=CPU_ERROR) as e:
        flash_attn_func(q, k, v)
    if not torch.cuda.is_available():
        assert "torch.cuda.is_available() is False" in str(e.value)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_not_a_tensor(name):
    args = dict(zip("qkv", qkv()))
    args[name] = args[name].numpy()
    with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor, got ndarray"):
        flash_attn_func(**args)


def test_wrong_ndim():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"k has shape \(1, 4, 128\); expected 4 dims"):
        flash_attn_func(q, k.flatten(2), v)


def test_dtype():
    q, k, v = qkv(dtype=torch.float32)
    with pytest.raises(TypeError, match="q has dtype torch.float32; cudaflash supports "
                                        "torch.float16 and torch.bfloat16"):
        flash_attn_func(q, k, v)
    q, k, v = qkv()
    with pytest.raises(TypeError, match="dtypes torch.float16, torch.bfloat16, torch.float16"):
        flash_attn_func(q, k.bfloat16(), v)


@pytest.mark.parametrize("shapes, message", [
    (dict(k=(1, 4, 2, 64), v=(1, 5, 2, 64)), r"k has shape \(1, 4, 2, 64\) but v has "
                                             r"\(1, 5, 2, 64\)"),
    (dict(k=(2, 4, 2, 64), v=(2, 4, 2, 64)), "q has batch size 1 but k and v have 2"),
    (dict(k=(1, 4, 2, 128), v=(1, 4, 2, 128)), "q has head dim 64 but k and v have 128"),
    (dict(q=(1, 4, 3, 64)), "q has 3 heads and k, v have 2; nheads must be a positive "
                            "multiple of nheads_k"),
    (dict(q=(1, 4, 0, 64)), "q has 0 heads"),
    (dict(q=(1, 4, 2, 264), k=(1, 4, 2, 264), v=(1, 4, 2, 264)),
     r"head dim 264 is not supported; cudaflash has kernels for head dims \[64, 128, 256\] "
     r"and runs the public functions at any head dim from 1 to 256"),
])
def test_shape_mismatch(shapes, message):
    args = dict(zip("qkv", qkv()))
    for name, shape in shapes.items():
        args[name] = torch.randn(shape).half()
    with pytest.raises(ValueError, match=message):
        flash_attn_func(**args)


@pytest.mark.parametrize("d_head, padded", [
    (1, 64), (8, 64), (32, 64), (63, 64), (65, 128), (80, 128), (96, 128), (127, 128),
    (129, 256), (160, 256), (192, 256), (255, 256)])
def test_head_dims_without_a_kernel_are_padded_to_the_next_one(d_head, padded):
    assert internals.padded_head_dim(*qkv(d=d_head)) == padded


@pytest.mark.parametrize("shapes", [
    dict(d=64), dict(d=128), dict(d=256),  # built: no padding
    dict(d=264),  # above flash-attn's limit: _check_qkv refuses it
])
def test_no_padding_for_built_or_too_large_head_dims(shapes):
    assert internals.padded_head_dim(*qkv(**shapes)) is None


def test_no_padding_unless_three_tensors_share_the_head_dim():
    q, k, v = qkv(d=96)
    assert internals.padded_head_dim(q, k[..., :80], v) is None  # the shape check explains it
    assert internals.padded_head_dim(q, k, v[..., :80]) is None
    assert internals.padded_head_dim(q.numpy(), k, v) is None  # the type check explains it
    assert internals.padded_head_dim(q, None, v) is None


def test_padded_head_dim_reaches_the_device_check():
    # A head dim without a kernel takes the padded route, which ends at the same checks.
    with pytest.raises(ValueError, match=CPU_ERROR):
        flash_attn_func(*qkv(d=96))


def test_padded_head_dim_checks_the_scale_at_the_callers_head_dim():
    with pytest.raises(ValueError, match=r"softmax_scale=-1.0; .*headdim \*\* -0.5 = 0.102062"):
        flash_attn_func(*qkv(d=96), softmax_scale=-1.0)


def test_gradients_at_a_head_dim_padded_to_256_get_past_the_padding():
    """Head dims 129-255 run padded to 256, which has a backward since the two-pass d256
    kernel: with requires_grad the call is not refused at the padding (on this CPU it then
    fails at the device check, naming the device)."""
    q, k, v = (t.requires_grad_() for t in qkv(d=192))
    with pytest.raises(ValueError, match="cudaflash runs on CUDA GPUs only"):
        flash_attn_func(q, k, v)


def test_grid_limits():
    # expand() gives huge shapes without memory; stride 0 is aligned.
    q = torch.zeros(1, 1, 1, 64, dtype=F16).expand(65536, 1, 1, 64)
    with pytest.raises(ValueError, match=r"batch=65536, nheads=1: each must be <= 65535"):
        flash_attn_func(q, q, q)
    q = torch.zeros(1, 1, 1, 64, dtype=F16).expand(1, 1, 65536, 64)
    with pytest.raises(ValueError, match=r"batch=1, nheads=65536"):
        flash_attn_func(q, q[:, :, :1], q[:, :, :1])


def test_devices_differ():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="q, k, v are on cpu, meta, cpu; they must be on the "
                                         "same device"):
        flash_attn_func(q, k.to("meta"), v)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_misaligned_data_pointer(name):
    args = dict(zip("qkv", qkv()))
    t = args[name]
    args[name] = torch.empty(t.numel() + 1, dtype=F16)[1:].view(t.shape)  # 2 bytes off
    with pytest.raises(ValueError, match=f"{name} is not 16-byte aligned .*storage_offset\\(\\)"
                                         f" = 1.*{name}.clone\\(\\)"):
        flash_attn_func(**args)


def test_stride_not_a_multiple_of_8():
    q, k, v = qkv()
    q = torch.zeros(1, 4, 2, 68, dtype=F16)[..., :64]  # head stride 68
    with pytest.raises(ValueError, match=r"q has strides \(544, 136, 68, 1\): its head stride 68"
                                         r" is not a multiple of 8 elements"):
        flash_attn_func(q, k, v)


def test_stride_of_a_size_one_dim_is_ignored():
    q, k, v = qkv(sq=1)
    q = torch.zeros(1, 1, 2, 68, dtype=F16)[..., :64]  # seq stride 136, head stride 68
    q = q.as_strided(q.shape, (8, 3, 64, 1))  # size-1 seq dim with stride 3
    with pytest.raises(ValueError, match=CPU_ERROR):
        flash_attn_func(q, k, v)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_non_unit_last_stride_is_copied(name):
    """flash-attn copies a q, k or v whose head dim is strided (maybe_contiguous): such a call
    goes on (here to the device check) instead of being refused."""
    tensors = dict(zip("qkv", qkv()))
    t = tensors[name]
    tensors[name] = t.transpose(-1, -2).contiguous().transpose(-1, -2)  # stride(-1) == 4
    with pytest.raises(ValueError, match=CPU_ERROR):
        flash_attn_func(**tensors)


def test_with_unit_last_stride_copies_only_strided_tensors():
    q, k, _ = qkv()
    strided = q.transpose(-1, -2).contiguous().transpose(-1, -2)
    got = internals.with_unit_last_stride(strided, k, None)
    assert got[0].stride(-1) == 1 and torch.equal(got[0], strided)
    assert got[1] is k and got[2] is None


@pytest.mark.parametrize("p", [1.0, -0.1, float("nan"), "0.1", True])
def test_bad_dropout_p(p):
    with pytest.raises(ValueError, match=r"dropout_p=.*; it must be a number in \[0, 1\)"):
        flash_attn_func(*qkv(), dropout_p=p)


def test_dropout_parts_not_built_yet_are_refused():
    """Dropout with plain scores runs (the device check here); with softcap or ALiBi it
    raises NotImplementedError naming what is missing."""
    with pytest.raises(ValueError, match="cudaflash runs on CUDA GPUs only"):
        flash_attn_func(*qkv(), dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="dropout_p > 0 with softcap"):
        flash_attn_func(*qkv(), dropout_p=0.1, softcap=5.0)
    with pytest.raises(ValueError, match="cudaflash runs on CUDA GPUs only"):
        flash_attn_func(*qkv(), dropout_p=0.1, return_attn_probs=True)
    q, k, v = (t.requires_grad_() for t in qkv())
    with pytest.raises(ValueError, match="cudaflash runs on CUDA GPUs only"):
        flash_attn_func(q, k, v, dropout_p=0.1)  # gradients too: the device check


# ---- alibi_slopes ------------------------------------------------------------------------------


def bad_alibi_slopes(batch: int, nheads: int, nheads_k: int) -> list:
    """pytest params (slopes, error, message) of bad alibi_slopes for a call of ``batch``
    sequences, ``nheads`` query heads and ``nheads_k`` K/V heads (the varlen and kvcache error
    tests use them too). Each is bad in one way only, so the order of the checks does not
    matter."""
    shape = (rf"; it must be \(nheads,\) = \({nheads},\) or \(batch, nheads\) = "
             rf"\({batch}, {nheads}\)")
    return [
        pytest.param([0.5] * nheads, TypeError, r"alibi_slopes.*must be a float32 tensor",
                     id="list"),
        pytest.param(np.ones(nheads, dtype=np.float32), TypeError,
                     r"alibi_slopes.*must be a float32 tensor", id="ndarray"),
        pytest.param(0.5, TypeError, r"alibi_slopes.*must be a float32 tensor", id="float"),
        pytest.param(torch.ones(nheads, dtype=F16), ValueError,
                     r"alibi_slopes has dtype torch.float16; it must be torch.float32",
                     id="float16"),
        pytest.param(torch.ones(batch, nheads, dtype=torch.float64), ValueError,
                     r"alibi_slopes has dtype torch.float64; it must be torch.float32",
                     id="float64"),
        pytest.param(torch.ones(3, 5), ValueError, r"alibi_slopes has shape \(3, 5\)" + shape,
                     id="shape_3x5"),
        pytest.param(torch.ones(nheads_k), ValueError,
                     rf"alibi_slopes has shape \({nheads_k},\)" + shape, id="nheads_k"),
        pytest.param(torch.ones(nheads, batch), ValueError,
                     rf"alibi_slopes has shape \({nheads}, {batch}\)" + shape, id="transposed"),
        pytest.param(torch.ones(1, batch, nheads), ValueError,
                     rf"alibi_slopes has shape \(1, {batch}, {nheads}\)" + shape, id="3d"),
        pytest.param(torch.tensor(0.5), ValueError, r"alibi_slopes has shape \(\)" + shape,
                     id="0d"),
        pytest.param(torch.ones(2 * nheads)[::2], ValueError,
                     r"alibi_slopes.*unit last stride", id="head_stride_2"),
        pytest.param(torch.ones(nheads, batch).t(), ValueError,
                     r"alibi_slopes.*unit last stride", id="transposed_view"),
        pytest.param(torch.ones(nheads, device="meta"), ValueError,
                     r"alibi_slopes is on meta.*q's device", id="meta"),
        pytest.param(torch.ones(batch, nheads, device="meta"), ValueError,
                     r"alibi_slopes is on meta.*q's device", id="meta_batch"),
    ]


def good_alibi_slopes(batch: int, nheads: int) -> list:
    """Valid alibi_slopes: (nheads,), (batch, nheads), and (batch, nheads) with a batch stride
    of its own (only the last stride must be 1)."""
    return [torch.rand(nheads), torch.rand(batch, nheads),
            torch.rand(batch, 2 * nheads)[:, :nheads]]


@pytest.mark.parametrize("slopes, error, message", bad_alibi_slopes(2, 4, 2))
def test_bad_alibi_slopes(slopes, error, message):
    q, k, v = qkv(b=2, h=4, hk=2)
    with pytest.raises(error, match=message):
        flash_attn_func(q, k, v, alibi_slopes=slopes)
    q.requires_grad_()  # the autograd path checks them too
    with pytest.raises(error, match=message):
        flash_attn_func(q, k, v, alibi_slopes=slopes)


def test_bad_alibi_slopes_are_refused_on_every_path():
    """The head-dim padding, the packed forms, softcap and window calls and forward(config)
    pass the slopes to the same checks."""
    half = torch.ones(4, dtype=F16)
    message = "alibi_slopes has dtype torch.float16; it must be torch.float32"
    q, k, v = qkv(b=2, h=4, hk=4)
    calls = [
        lambda s: flash_attn_func(*qkv(b=2, h=4, hk=2, d=96), alibi_slopes=s),
        lambda s: flash_attn_func(q, k, v, softcap=30.0, alibi_slopes=s),
        lambda s: flash_attn_func(q, k, v, window_size=(8, 0), causal=True, alibi_slopes=s),
        lambda s: flash_attn_qkvpacked_func(torch.stack((q, k, v), 2), alibi_slopes=s),
        lambda s: flash_attn_kvpacked_func(q, torch.stack((k, v), 2), alibi_slopes=s),
        lambda s: forward(D64_NAME, q, k, v, alibi_slopes=s),
        lambda s: forward(D64_NAME, q, k, v, num_splits=3, alibi_slopes=s),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=message):
            call(half)
        for slopes in good_alibi_slopes(2, 4):
            with pytest.raises(ValueError, match=CPU_ERROR):
                call(slopes)


def test_valid_alibi_slopes_reach_the_device_check():
    q, k, v = qkv(b=2, h=4, hk=2)
    for slopes in good_alibi_slopes(2, 4):
        with pytest.raises(ValueError, match=CPU_ERROR):
            flash_attn_func(q, k, v, alibi_slopes=slopes)
        with pytest.raises(ValueError, match=CPU_ERROR):
            flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes, deterministic=True,
                            return_attn_probs=True)
        with pytest.raises(ValueError, match=CPU_ERROR):  # with gradients: autograd's path
            flash_attn_func(q.clone().requires_grad_(), k, v, alibi_slopes=slopes)


@pytest.mark.parametrize("window", [None, (128,), (1, 2, 3), (-2, 0), (1.5, 0), (True, 0),
                                    "ab", (2**31, 0), (torch.tensor(1.0), 0),
                                    (torch.tensor(True), 0), (torch.tensor([1, 2]), 0),
                                    (torch.tensor(-2), 0), torch.tensor([4, -2]),
                                    torch.tensor([1.0, 2.0]), torch.tensor([[4, 0]]),
                                    torch.tensor([True, False]), np.array([1, 2, 3]),
                                    torch.tensor(3)])
def test_bad_window_size(window):
    with pytest.raises(ValueError, match=r"window_size=.*; it must be \(left, right\): two "
                                         r"integers \(a tuple or list of ints, numpy integers "
                                         r"or 1-element integer tensors, or a 2-element integer "
                                         r"tensor or array\) in \[-1, 2\*\*31\)"):
        flash_attn_func(*qkv(), window_size=window)


@pytest.mark.parametrize("window", [(128, 0), [3, -1], (-1, 5), (torch.tensor(128), 0),
                                    (torch.tensor([3]), torch.tensor(-1, dtype=torch.int32)),
                                    (np.int64(16), np.int32(0)), (np.array(8), -1),
                                    torch.tensor([4, 0]), np.array([3, -1])])
def test_valid_window_reaches_the_device_check(window):
    """Integer-like sides, as flash-attn takes them; its local=True tests pass the pair as one
    tensor, torch.randint(0, seqlen_k, (2,))."""
    with pytest.raises(ValueError, match=CPU_ERROR):
        flash_attn_func(*qkv(), window_size=window)


@pytest.mark.parametrize("window, expected", [((torch.tensor(128), 0), (128, 0)),
                                              ((np.int64(16), torch.tensor([-1])), (16, -1)),
                                              ([np.array(3), 7], (3, 7)),
                                              (torch.tensor([6, 2]), (6, 2)),
                                              (torch.tensor([5, -1], dtype=torch.int32), (5, -1)),
                                              (np.array([0, 9]), (0, 9))])
def test_integer_like_window_sides_become_ints(window, expected):
    got = internals.check_window(window)
    assert got == expected and all(type(w) is int for w in got)


@pytest.mark.parametrize("cap", [-1.0, math.nan, math.inf, True, "30", torch.ones(1)])
def test_bad_softcap(cap):
    with pytest.raises(ValueError, match=r"softcap=.*; it must be a finite number >= 0 \(0: no "
                                         r"softcapping; c > 0: scores become c \* tanh"):
        flash_attn_func(*qkv(), softcap=cap)


@pytest.mark.parametrize("cap", [30.0, 5, 0.5])
def test_valid_softcap_reaches_the_device_check(cap):
    with pytest.raises(ValueError, match=CPU_ERROR):
        flash_attn_func(*qkv(), softcap=cap)


def test_softcap_with_gradients_reaches_the_device_check():
    q, k, v = qkv()
    q.requires_grad_()
    with pytest.raises(ValueError, match=CPU_ERROR):
        flash_attn_func(q, k, v, softcap=30.0)


def test_window_with_gradients_reaches_the_device_check():
    """A windowed call that records gradients goes through the autograd function (no
    refusal): on a CPU tensor it stops at the same device check as any other call."""
    q, k, v = qkv()
    q.requires_grad_()
    with pytest.raises(ValueError, match=CPU_ERROR):
        flash_attn_func(q, k, v, window_size=(8, 0))


def test_defaults_and_deterministic_are_accepted():
    with pytest.raises(ValueError, match=CPU_ERROR):
        flash_attn_func(*qkv(), dropout_p=0.0, window_size=[-1, -1], softcap=0.0,
                        alibi_slopes=None, deterministic=True, return_attn_probs=True)


@pytest.mark.parametrize("scale", [0, -1.0, math.nan, math.inf, "0.1", True, torch.ones(2)])
def test_bad_softmax_scale(scale):
    with pytest.raises(ValueError, match=r"softmax_scale=.*; it must be a finite number > 0 or "
                                         r"None \(None means headdim \*\* -0.5 = 0.125\)"):
        flash_attn_func(*qkv(), softmax_scale=scale)


def test_good_softmax_scale():
    with pytest.raises(ValueError, match=CPU_ERROR):
        flash_attn_func(*qkv(), softmax_scale=1)


def test_causal_must_be_bool():
    with pytest.raises(TypeError, match="causal='yes'; it must be a bool"):
        flash_attn_func(*qkv(), causal="yes")


def test_small_calls_take_the_deterministic_kernels():
    # group * seqlen_q (halved when causal) query rows per dK/dV CTA; at most 512: deterministic
    assert internals.effective_scheme("atomic", 512, 1, False) == "deterministic"
    assert internals.effective_scheme("atomic", 513, 1, False) == "atomic"
    assert internals.effective_scheme("atomic", 1024, 1, True) == "deterministic"
    assert internals.effective_scheme("atomic", 300, 2, False) == "atomic"
    assert internals.effective_scheme("deterministic", 16384, 8, False) == "deterministic"
    # wgmma modules: the limit is 256 rows.
    assert internals.effective_scheme("atomic", 256, 1, False, wgmma=True) == "deterministic"
    assert internals.effective_scheme("atomic", 257, 1, False, wgmma=True) == "atomic"
    assert internals.effective_scheme("atomic", 512, 1, True, wgmma=True) == "deterministic"
    assert internals.effective_scheme("atomic", 513, 1, False, wgmma=False) == "atomic"
    # A window bounded on both sides: a key is seen by at most left + right + 1 rows per head.
    assert internals.effective_scheme("atomic", 16384, 1, True, window=(511, 0)) == "deterministic"
    assert internals.effective_scheme("atomic", 16384, 2, True, window=(511, 0)) == "atomic"
    assert internals.effective_scheme("atomic", 16384, 1, False, window=(512, 0)) == "atomic"
    assert internals.effective_scheme("atomic", 16384, 1, False, window=(-1, 0)) == "atomic"
    assert internals.effective_scheme("atomic", 16384, 1, False, window=(100, 100), wgmma=True) == \
        "deterministic"


def test_deterministic_must_be_a_bool():
    q, k, v = (torch.randn(1, 8, 2, 64, dtype=torch.float16) for _ in range(3))
    with pytest.raises(TypeError, match=r"deterministic='yes'; it must be a bool"):
        flash_attn_func(q.requires_grad_(), k, v, deterministic="yes")


def test_requires_grad_goes_through_the_checks_and_only_flash_attn_func_has_a_backward():
    q, k, v = qkv()
    q.requires_grad_()
    # flash_attn_func takes the autograd path, which runs the same checks first.
    with pytest.raises(ValueError, match=CPU_ERROR):
        flash_attn_func(q, k, v)
    with pytest.raises(NotImplementedError, match=r"only flash_attn_func and "
                                                  r"flash_attn_varlen_func have a backward.*"
                                                  r"torch.no_grad\(\)"):
        forward(D64_NAME, q, k, v)
    with torch.no_grad(), pytest.raises(ValueError, match=CPU_ERROR):
        flash_attn_func(q, k, v)


# ---- forward(config, ...) --------------------------------------------------------------------

D64_NAME = "fwd_fp16_d64_br128_bc64_w4_async1_eager1_swz1_q0k0v0_dbuf0_osm1_ctas1_wgmma0"


def test_forward_config_forms():
    with pytest.raises(ValueError, match=CPU_ERROR):
        forward(D64_NAME, *qkv())
    with pytest.raises(ValueError, match=CPU_ERROR):
        forward(KernelConfig.from_name(D64_NAME), *qkv())
    with pytest.raises(ConfigError, match="not a canonical kernel config name"):
        forward("fwd_fp16_d64", *qkv())
    with pytest.raises(TypeError, match="config must be a KernelConfig or a canonical config "
                                        "name, got dict"):
        forward({}, *qkv())


def test_forward_config_must_fit_the_tensors():
    with pytest.raises(ValueError, match=f"config {D64_NAME} is for fp16 with d_head=64, but q "
                                         "is bf16 with head dim 64"):
        forward(D64_NAME, *qkv(dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="but q is fp16 with head dim 128"):
        forward(D64_NAME, *qkv(d=128))


def _out_error(out, q=None, k=None, v=None):
    q0, k0, v0 = qkv()
    return forward(D64_NAME, q if q is not None else q0, k if k is not None else k0,
                   v if v is not None else v0, out=out)


@pytest.mark.parametrize("out, message", [
    (torch.empty(1, 4, 2, 64, dtype=torch.bfloat16), r"out is a \(1, 4, 2, 64\) torch.bfloat16 "
                                                     r"tensor on cpu; it must be like q"),
    (torch.empty(1, 4, 3, 64, dtype=F16), r"out is a \(1, 4, 3, 64\)"),
    (torch.empty(1, 4, 2, 64, dtype=F16, device="meta"), "out is .* on meta"),
    (torch.empty(1, 4, 64, 2, dtype=F16).transpose(-1, -2), r"its last stride must be 1"),
    (torch.empty(1 * 4 * 2 * 64 + 1, dtype=F16)[1:].view(1, 4, 2, 64), "out is not 16-byte "
                                                                        "aligned"),
    (torch.empty(1, 1, 2, 64, dtype=F16).expand(1, 4, 2, 64), "some of its elements share "
                                                             "memory"),
    ([0.0], "out must be a torch.Tensor or None, got list"),
])
def test_bad_out(out, message):
    with pytest.raises((ValueError, TypeError), match=message):
        _out_error(out)


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_out_overlapping_an_input(name):
    args = dict(zip("qkv", qkv()))
    with pytest.raises(ValueError, match=f"out overlaps {name} in memory"):
        _out_error(args[name], **args)
    big = torch.empty(2, 4, 2, 64, dtype=F16)
    args[name], out = big[:1], big[:, :, :, :].view(8, 2, 64)[2:6].view(1, 4, 2, 64)
    with pytest.raises(ValueError, match=f"out overlaps {name}"):
        _out_error(out, **args)


def test_out_next_to_an_input_is_fine():
    big = torch.empty(2, 4, 2, 64, dtype=F16)
    q, k, v = qkv()
    with pytest.raises(ValueError, match=CPU_ERROR):
        _out_error(big[1:], q=big[:1], k=k, v=v)


@pytest.mark.parametrize("shape, strides, overlaps", [
    ((2, 3, 4, 64), (768, 256, 64, 1), False),  # contiguous
    ((2, 3, 4, 64), (768, 64, 192, 1), False),  # transposed view of a BHSD tensor
    ((2, 3, 4, 64), (0, 256, 64, 1), True),  # expanded batch
    ((2, 3, 4, 64), (768, 256, 32, 1), True),  # heads overlap by half
    ((1, 3, 1, 64), (5, 64, 7, 1), False),  # strides of size-1 dims do not matter
])
def test_internal_overlap(shape, strides, overlaps):
    t = torch.empty(4096, dtype=F16).as_strided(shape, strides)
    assert internals.internal_overlap(t) is overlaps


def test_varlen_padded_head_dim_keeps_dropout(monkeypatch):
    """A head dim without a kernel of its own (96) runs padded: dropout_p must reach the
    padded call (it did not: the padded call ran without dropout)."""
    from cudaflash import _padding, flash_attn_varlen_func

    seen = {}

    def padded_call(function, padded, q, k, v, softmax_scale, kwargs, caches=()):
        seen.update(kwargs)
        return "padded"

    monkeypatch.setattr(_padding, "with_padded_head_dim", padded_call)
    q = torch.randn(10, 2, 96, dtype=torch.float16)
    cu = torch.tensor([0, 10], dtype=torch.int32)
    assert flash_attn_varlen_func(q, q, q, cu, cu, 10, 10, dropout_p=0.3) == "padded"
    assert seen["dropout_p"] == 0.3
