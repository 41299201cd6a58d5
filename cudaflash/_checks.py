"""Boundary validation: every check of the public functions' arguments, host only (no GPU
state is touched). Each error names the argument, the value received and what is allowed;
no ``assert`` for user errors (asserts vanish under ``-O``)."""

import math
import numbers
import operator

import torch

from . import _dropout
from ._torch import is_grad_enabled
from .config import D_HEADS

DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}
GRID_YZ_MAX = 65535  # CUDA limit on grid.y (heads) and grid.z (batch)
INT32_MAX = 2**31 - 1  # Params sizes are int32
_DIMS = ("batch", "seqlen", "head")


def attention_options(dropout_p, window_size,
                      softcap) -> tuple[tuple[int, int], float, float]:
    """The options every attention entry checks alike before q, k, v: the window as checked
    (left, right) ints, the softcap and dropout_p as checked floats. (alibi_slopes needs q's
    shape: check_alibi_slopes, after check_qkv.)"""
    return check_window(window_size), check_softcap(softcap), _dropout.check_dropout_p(dropout_p)


def with_unit_last_stride(*tensors) -> tuple:
    """The tensors, each copied (.contiguous()) where its last (head dim) stride is not 1, as
    flash-attn's maybe_contiguous does for q, k and v (never for caches, which are written in
    place); anything that is not a tensor of at least one dim passes through for the checks
    to explain. The copy is differentiable: gradients reach the caller's tensors."""
    return tuple(t.contiguous() if isinstance(t, torch.Tensor) and t.dim() >= 1
                 and t.stride(-1) != 1 else t for t in tensors)


def check_alibi_slopes(alibi_slopes, batch: int, n_heads: int, device: torch.device):
    """flash-attn's alibi_slopes: None, or float32 slopes of shape (nheads,) or (batch,
    nheads) with a unit last stride on q's ``device`` (the kernels read them there, at
    batch * stride(0) + head). Returns it unchanged."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a float32 tensor of shape (nheads,) or (batch, "
                        f"nheads), or None; got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise ValueError(f"alibi_slopes has dtype {alibi_slopes.dtype}; it must be "
                         "torch.float32")
    shape = tuple(alibi_slopes.shape)
    if shape not in ((n_heads,), (batch, n_heads)):
        raise ValueError(f"alibi_slopes has shape {shape}; it must be (nheads,) = ({n_heads},) "
                         f"or (batch, nheads) = ({batch}, {n_heads})")
    strides = alibi_slopes.stride()
    if n_heads > 1 and strides[-1] != 1:
        raise ValueError(f"alibi_slopes has strides {strides}; it must have a unit last stride "
                         "(alibi_slopes.contiguous() gives such a copy)")
    if len(shape) == 2 and batch > 1 and not 0 <= strides[0] <= INT32_MAX:
        raise ValueError(f"alibi_slopes has strides {strides}; its batch stride must be in "
                         f"[0, 2**31) (alibi_slopes.contiguous() gives such a copy)")
    if alibi_slopes.device != device:
        raise ValueError(f"alibi_slopes is on {alibi_slopes.device}; it must be on q's device "
                         f"{device}")
    return alibi_slopes


def check_softcap(softcap) -> float:
    """flash-attn's softcap as a float: 0.0 (none) or a finite cap > 0."""
    if not (isinstance(softcap, numbers.Real) and not isinstance(softcap, bool)
            and math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap={softcap!r}; it must be a finite number >= 0 (0: no "
                         "softcapping; c > 0: scores become c * tanh(scores / c))")
    return float(softcap)


def _window_side(w) -> int | None:
    """One side of window_size as an int if it is integer-like (as flash-attn, which converts
    each side with int(): an int, a numpy integer, a 0-d or 1-element integer tensor; a
    tensor on the GPU is read on the host), else None. Booleans are not integers here."""
    if isinstance(w, bool) or isinstance(w, torch.Tensor) and w.dtype == torch.bool:
        return None
    try:
        return operator.index(w)
    except (TypeError, RuntimeError):  # a float, a string; a tensor of floats or of several
        return None                    # elements (torch raises RuntimeError for those)


def _is_pair(window_size) -> bool:
    """A tuple or list of two, or a 1-D tensor or array of two elements: what flash-attn reads
    as window_size[0] and window_size[1] (its tests pass torch.randint(0, n, (2,)))."""
    if isinstance(window_size, (tuple, list)):
        return len(window_size) == 2
    return getattr(window_size, "ndim", None) == 1 and len(window_size) == 2  # tensor, ndarray


def check_window(window_size) -> tuple[int, int]:
    """flash-attn's window_size as (left, right): each integer-like and >= -1, -1 meaning
    unbounded."""
    sides = [_window_side(w) for w in window_size] if _is_pair(window_size) else [None]
    if not all(w is not None and -1 <= w <= INT32_MAX for w in sides):
        raise ValueError(f"window_size={window_size!r}; it must be (left, right): two integers "
                         "(a tuple or list of ints, numpy integers or 1-element integer "
                         "tensors, or a 2-element integer tensor or array) in [-1, 2**31) "
                         "(-1: unbounded on that side; query i sees keys i + seqlen_k - "
                         "seqlen_q - left to i + seqlen_k - seqlen_q + right)")
    return sides[0], sides[1]


def wants_grad(q, k, v) -> bool:
    """Grad mode is on and q, k or v requires grad (getattr: the arguments are not checked
    yet and may not be tensors; the checks explain those)."""
    return is_grad_enabled() and (getattr(q, "requires_grad", False)
                                   or getattr(k, "requires_grad", False)
                                   or getattr(v, "requires_grad", False))


def check_qkv(q, k, v, varlen=False, names=("q", "k", "v"), same_batch=True):
    """Raise for anything about q, k, v that the kernels cannot take. ``varlen``: packed
    (total_seqlen, nheads, headdim) tensors of flash_attn_varlen_func. ``names``: the
    arguments' names in the caller's signature, for the messages. ``same_batch`` False: k and
    v's first dim is not the batch (flash_attn_with_kvcache's paged caches, or caches
    indexed through cache_batch_idx)."""
    dims, layout = (3, "(total_seqlen, nheads, headdim)") if varlen else (
        4, "(batch, seqlen, nheads, headdim)")
    qn, kn, vn = names
    for name, t in ((qn, q), (kn, k), (vn, v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {dims} dims {layout}")
    if q.dtype not in DTYPES:
        raise TypeError(f"{qn} has dtype {q.dtype}; cudaflash supports torch.float16 and "
                        "torch.bfloat16")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{qn}, {kn}, {vn} have dtypes {q.dtype}, {k.dtype}, {v.dtype}; they "
                        "must be the same")
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        # Returning an out without a grad_fn would silently drop the gradient.
        raise NotImplementedError(
            f"{qn}, {kn} or {vn} requires grad, but only flash_attn_func and "
            "flash_attn_varlen_func have a backward in cudaflash (not flash_attn_with_kvcache "
            "or cudaflash.forward); call this under torch.no_grad() or "
            "torch.inference_mode()")
    if k.shape != v.shape:
        raise ValueError(f"{kn} has shape {tuple(k.shape)} but {vn} has {tuple(v.shape)}; they "
                         "must be the same")
    seqlen_q, n_heads, d_head = q.shape[-3:]
    seqlen_k, n_heads_k, d_head_k = k.shape[-3:]
    batch = 1 if varlen else q.shape[0]
    if not varlen and same_batch and k.shape[0] != batch:
        raise ValueError(f"{qn} has batch size {batch} but {kn} and {vn} have {k.shape[0]}")
    if d_head_k != d_head:
        raise ValueError(f"{qn} has head dim {d_head} but {kn} and {vn} have {d_head_k}")
    if d_head not in D_HEADS:
        # flash_attn_func and friends pad head dims in [1, 256] to a built one before this.
        raise ValueError(f"head dim {d_head} is not supported; cudaflash has kernels for head "
                         f"dims {list(D_HEADS)} and runs the public functions at any head dim "
                         f"from 1 to {D_HEADS[-1]} (padded to the next kernel's)")
    if n_heads < 1 or n_heads_k < 1 or n_heads % n_heads_k:
        raise ValueError(f"{qn} has {n_heads} heads and {kn}, {vn} have {n_heads_k}; nheads "
                         "must be a positive multiple of nheads_k")
    if batch > GRID_YZ_MAX or n_heads > GRID_YZ_MAX:
        raise ValueError(f"batch={batch}, nheads={n_heads}: each must be <= {GRID_YZ_MAX} "
                         "(the CUDA grid limit); split the call")
    if seqlen_q > INT32_MAX or seqlen_k > INT32_MAX:
        what = "total_q, total_k" if varlen else "seqlen_q, seqlen_k"
        raise ValueError(f"{what} = {seqlen_q}, {seqlen_k}: each must be < 2**31")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"{qn}, {kn}, {vn} are on {q.device}, {k.device}, {v.device}; they "
                         "must be on the same device")
    for name, t in ((qn, q), (kn, k), (vn, v)):
        s = t.stride()
        if s[-1] != 1:  # (the public functions copy q, k, v first: with_unit_last_stride)
            raise ValueError(f"{name} has strides {s}; its last (head dim) stride must be 1. "
                             f"{name}.contiguous() gives such a copy")
        check_aligned(name, t, s)


def check_aligned(name: str, t: torch.Tensor, s: tuple) -> None:
    """16-byte aligned data and (batch,) seq and head strides (``s``) of whole 16-byte
    vectors (8 elements): the kernels move q/k/v/out in 16-byte vectors."""
    if t.data_ptr() % 16 == 0 and not any(x % 8 for x in s[:-1]):
        return
    if t.data_ptr() % 16:
        raise ValueError(f"{name} is not 16-byte aligned (data_ptr() % 16 = {t.data_ptr() % 16}"
                         f", storage_offset() = {t.storage_offset()}): cudaflash moves 16-byte "
                         f"vectors; pass a tensor starting on a 16-byte boundary, e.g. "
                         f"{name}.clone()")
    dims = _DIMS[-(len(s) - 1):]  # (batch,) seq, head
    for dim in range(len(s) - 1):
        # A stride of a size-1 dim is never multiplied by a non-zero index.
        if t.shape[dim] > 1 and s[dim] % 8:
            raise ValueError(f"{name} has strides {s}: its {dims[dim]} stride {s[dim]} is not a "
                             "multiple of 8 elements (16 bytes), which cudaflash needs for its "
                             f"16-byte vector loads; {name}.contiguous() fixes it")


def check_out(out, q, k, v) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out is a {tuple(out.shape)} {out.dtype} tensor on {out.device}; it "
                         f"must be like q: {tuple(q.shape)} {q.dtype} on {q.device}")
    s = out.stride()
    if s[3] != 1:
        raise ValueError(f"out has strides {s}; its last stride must be 1")
    check_aligned("out", out, s)
    if out.numel() == 0:
        return
    if internal_overlap(out):
        raise ValueError(f"out has shape {tuple(out.shape)} and strides {out.stride()}: some "
                         "of its elements share memory")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if overlaps(out, t):
            raise ValueError(f"out overlaps {name} in memory; the kernel would overwrite "
                             f"{name} while reading it. Pass a separate out tensor")


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first byte, end byte) that a non-empty tensor touches."""
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if b.numel() == 0:
        return False
    a0, a1 = _span(a)
    b0, b1 = _span(b)
    return a0 < b1 and b0 < a1


def internal_overlap(t: torch.Tensor) -> bool:
    """Whether two elements may share memory: sufficient test for non-overlap is that, with
    dims sorted by stride, each stride exceeds the extent of all smaller ones."""
    extent = 0
    for stride, size in sorted(zip(t.stride(), t.shape)):
        if size > 1:
            if stride <= extent:
                return True
            extent += (size - 1) * stride
    return False


def check_cu_seqlens(q, cu_seqlens_q, cu_seqlens_k) -> None:
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int32:
            raise TypeError(f"{name} has dtype {t.dtype}; it must be torch.int32")
        if t.dim() != 1 or t.numel() < 2:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; it must be (batch + 1,) with "
                             "batch >= 1")
        if t.stride(0) != 1:
            raise ValueError(f"{name} has stride {t.stride(0)}; it must be contiguous")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}; they must be on "
                             "the same device")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q has {cu_seqlens_q.numel()} entries and cu_seqlens_k "
                         f"{cu_seqlens_k.numel()}; both must be batch + 1")
    if cu_seqlens_q.numel() - 1 > GRID_YZ_MAX:
        raise ValueError(f"batch={cu_seqlens_q.numel() - 1} sequences: must be <= "
                         f"{GRID_YZ_MAX} (the CUDA grid limit); split the call")


def check_max_seqlen(name: str, value) -> int:
    if (not isinstance(value, numbers.Integral) or isinstance(value, bool)
            or not 0 <= value <= INT32_MAX):
        raise ValueError(f"{name}={value!r}; it must be an int in [0, 2**31) (the longest "
                         "sequence of the batch)")
    return int(value)


def check_offsets(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, max_seqlen_q: int,
                   max_seqlen_k: int) -> None:
    """CUDAFLASH_DEBUG: what the kernels trust about the offsets (costs a device-to-host copy)."""
    for name, t, total, most, most_name in (
            ("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q, "max_seqlen_q"),
            ("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k, "max_seqlen_k")):
        offsets = t.tolist()
        lengths = [b - a for a, b in zip(offsets, offsets[1:])]
        if offsets[0] < 0 or offsets[-1] > total or min(lengths) < 0:
            raise ValueError(f"{name}={offsets}: offsets must be non-decreasing and within [0, "
                             f"{total}] (the rows of the packed tensor)")
        if max(lengths) > most:
            raise ValueError(f"{name} holds a sequence of {max(lengths)} but {most_name}="
                             f"{most}; it must be at least the longest")


def check_on_gpu(q) -> None:
    if not q.is_cuda:
        why = "" if torch.cuda.is_available() else (
            f" (torch.cuda.is_available() is False: torch {torch.__version__} sees no CUDA "
            "GPU or driver)")
        raise ValueError(f"q, k, v are on {q.device}; cudaflash runs on CUDA GPUs only{why}")


def softmax_scale(softmax_scale, d_head: int) -> float:
    if softmax_scale is None:
        return d_head ** -0.5
    if (isinstance(softmax_scale, numbers.Real) and not isinstance(softmax_scale, bool)
            and math.isfinite(softmax_scale) and softmax_scale > 0):
        return float(softmax_scale)
    raise ValueError(f"softmax_scale={softmax_scale!r}; it must be a finite number > 0 or None "
                     f"(None means headdim ** -0.5 = {d_head ** -0.5:.6g})")


def check_new_kv(k, v, k_cache, batch: int) -> None:
    """The new keys and values of flash_attn_with_kvcache: a kernel copies them into the
    cache, so any layout with aligned rows will do; they must match q's ``batch`` and the
    cache's heads, head dim, dtype and device, and not share its memory."""
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected 4 dims (batch, "
                             "seqlen_new, nheads_k, headdim)")
        if t.dtype != k_cache.dtype or t.device != k_cache.device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}; it must be k_cache's "
                             f"{k_cache.dtype} on {k_cache.device}")
    if k.shape != v.shape:
        raise ValueError(f"k has shape {tuple(k.shape)} but v has {tuple(v.shape)}; they must "
                         "be the same")
    _, _, hk, d = k_cache.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (batch, hk, d):
        raise ValueError(f"k and v have shape {tuple(k.shape)}; they must be (batch, "
                         f"seqlen_new, nheads_k, headdim) with q's batch={batch} and "
                         f"k_cache's nheads_k={hk}, headdim={d}")
    if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
        raise NotImplementedError("k or v requires grad, but flash_attn_with_kvcache has no "
                                  "backward; call it under torch.no_grad() or "
                                  "torch.inference_mode()")


def unpack(name: str, packed, dims: int, parts: int, layout: str) -> tuple:
    """The ``parts`` views of a packed tensor along its pack dim (dims - 3), after checking
    that it is one."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
    pack_dim = dims - 3
    if packed.dim() != dims or packed.shape[pack_dim] != parts:
        raise ValueError(f"{name} has shape {tuple(packed.shape)}; expected {layout}")
    return packed.unbind(pack_dim)


def check_deterministic(deterministic) -> None:
    if deterministic not in (True, False):
        raise TypeError(f"deterministic={deterministic!r}; it must be a bool")
