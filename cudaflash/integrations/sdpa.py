"""cudaflash behind ``torch.nn.functional.scaled_dot_product_attention``'s flash backend.

    import cudaflash.integrations.sdpa as cudaflash_sdpa
    cudaflash_sdpa.activate()    # SDPA's flash backend now runs cudaflash's kernels
    ...
    cudaflash_sdpa.restore()     # torch's own flash kernels again

How: SDPA's flash backend calls two aten operators, ``_scaled_dot_product_flash_attention``
and its backward. ``activate()`` registers Python kernels for them on the CUDA dispatch key
(``torch.library.Library("aten", "IMPL")``), which launch cudaflash (flash_attn_func for the
forward with its log-sum-exp, the ``cudaflash::bwd`` op for the backward). No C++ is
needed: a Python launcher satisfies the dispatcher's interface, and torch's own FA4 entry
does the same with a Python (CuTe DSL) kernel. Recent torch (2.13 has it) keeps a registry
of such implementations (``torch.nn.attention.register_flash_attention_impl``,
``activate_flash_attention_impl``, ``restore_flash_attention_impl``,
``list_flash_attention_impls``): where it exists, ``register()`` adds "cudaflash" to it and
``activate()`` goes through it; on older torch ``activate()`` installs the same kernels
itself.

What runs where: SDPA picks its flash backend by its own rules (fp16/bf16, no attn_mask,
head dim <= 256, ...); those calls then reach these kernels, which run cudaflash for what it
computes exactly as torch's flash kernel does: no dropout, no debug mask, nheads a multiple
of nheads_k, causal as the flash kernel aligns it (bottom-right; SDPA itself hands the flash
backend causal calls of square shape only), any head dim (cudaflash pads the others). The
backward runs cudaflash's kernels for head dims 64 and 128. Anything else goes to torch's
own flash kernel, fetched before the override with ``torch.library.get_kernel`` (2.13 has
it); without that function such calls raise RuntimeError naming why (``restore()`` gives
torch's kernels back). Other SDPA backends (cuDNN, efficient, math) are untouched.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import api

IMPL_NAME = "cudaflash"
FORWARD = "aten::_scaled_dot_product_flash_attention"
BACKWARD = "aten::_scaled_dot_product_flash_attention_backward"
BACKWARD_HEAD_DIMS = (64, 128)  # cudaflash's backward kernels
_HALF = (torch.float16, torch.bfloat16)


def forward_plan(query, key, dropout_p: float, return_debug_mask: bool) -> Optional[str]:
    """Why cudaflash cannot compute this flash-attention forward as torch's kernel would, or
    None when it can. query (batch, heads, seqlen_q, d), key (batch, heads_k, seqlen_k, d)."""
    if dropout_p:
        return f"dropout_p={dropout_p} (cudaflash has no dropout)"
    if return_debug_mask:
        return "return_debug_mask=True"
    if query.dtype not in _HALF:
        return f"dtype {query.dtype}"
    if query.dim() != 4 or key.dim() != 4:
        return f"{query.dim()}D query ({query.dim()}D tensors are nested or packed)"
    if query.shape[1] % key.shape[1]:
        return f"{query.shape[1]} query heads over {key.shape[1]} K/V heads"
    if query.shape[-1] > 256:
        return f"head dim {query.shape[-1]} > 256"
    return None


def backward_plan(query, key, dropout_p: float) -> Optional[str]:
    """Why cudaflash's backward cannot run this call, or None."""
    why = forward_plan(query, key, dropout_p, False)
    if why is None and query.shape[-1] not in BACKWARD_HEAD_DIMS:
        why = f"head dim {query.shape[-1]} (cudaflash's backward: {BACKWARD_HEAD_DIMS})"
    return why


def _bshd(x):
    """(batch, seqlen, heads, d) view of SDPA's (batch, heads, seqlen, d) tensor; a copy only
    where the last dim is strided (cudaflash wants it contiguous)."""
    x = x.transpose(1, 2)
    return x if x.stride(-1) == 1 else x.contiguous()


class _Kernels:
    """The two Python kernels, with torch's own flash kernels (or None) for the calls
    cudaflash does not take."""

    def __init__(self, original_forward, original_backward):
        self.original_forward = original_forward
        self.original_backward = original_backward

    def _original(self, kernel, what: str, why: str, keyset, *args, **kwargs):
        if kernel is None:
            raise RuntimeError(f"cudaflash's SDPA flash {what} cannot run this call ({why}) and "
                               f"torch {torch.__version__} has no torch.library.get_kernel to "
                               "reach its own flash kernel; call "
                               "cudaflash.integrations.sdpa.restore() for such calls")
        return kernel.call_boxed(keyset, *args, **kwargs)

    def forward(self, keyset, query, key, value, dropout_p=0.0, is_causal=False,
                return_debug_mask=False, *, scale=None):
        why = forward_plan(query, key, dropout_p, return_debug_mask)
        if why is not None:
            return self._original(self.original_forward, "forward", why, keyset, query, key,
                                  value, dropout_p, is_causal, return_debug_mask, scale=scale)
        with torch.no_grad():
            out, lse, _ = api.flash_attn_func(_bshd(query), _bshd(key), _bshd(value),
                                              softmax_scale=scale, causal=bool(is_causal),
                                              return_attn_probs=True)
        device = query.device
        rng_state = torch.zeros(2, dtype=torch.uint64, device=device)  # no dropout: unused
        unused = torch.zeros((), dtype=torch.uint64, device=device)
        debug_mask = torch.empty(0, dtype=query.dtype, device=device)
        return (out.transpose(1, 2), lse, None, None, query.shape[2], key.shape[2], rng_state,
                unused, debug_mask)

    def backward(self, keyset, grad_out, query, key, value, out, logsumexp, cum_seq_q,
                 cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                 scale=None):
        why = backward_plan(query, key, dropout_p)
        if why is not None:
            return self._original(self.original_backward, "backward", why, keyset, grad_out,
                                  query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                                  max_q, max_k, dropout_p, is_causal, philox_seed,
                                  philox_offset, scale=scale)
        dq, dk, dv = cudaflash_backward(_bshd(grad_out), _bshd(query), _bshd(key),
                                        _bshd(value), _bshd(out), logsumexp.contiguous(), scale,
                                        bool(is_causal))
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def cudaflash_backward(dout, q, k, v, out, lse, scale, causal):
    """dq, dk, dv of flash_attn_func's forward from its out and lse, (batch, seqlen, heads, d)
    tensors: the ``cudaflash::bwd`` op (the scheme follows torch's deterministic switch)."""
    return torch.ops.cudaflash.bwd(dout, q, k, v, out, lse, scale, causal, False)


def _original_kernel(op: str):
    get_kernel = getattr(torch.library, "get_kernel", None)
    if get_kernel is None:
        return None
    try:
        return get_kernel(op, "CUDA")
    except RuntimeError:  # no CUDA kernel (a CPU-only torch build)
        return None


class Handle:
    """The installed kernels; ``remove()`` gives torch's back (the Library deregisters them
    when it goes)."""

    def __init__(self, library):
        self.library = library

    def remove(self) -> None:
        library, self.library = self.library, None
        if library is not None and hasattr(library, "_destroy"):
            library._destroy()


def install() -> Handle:
    """Register cudaflash's kernels for SDPA's flash operators on the CUDA dispatch key (the
    ``register_fn`` torch's registry calls). Prefer ``activate()``."""
    with_keyset = hasattr(torch.library, "get_kernel")
    kernels = _Kernels(_original_kernel(FORWARD), _original_kernel(BACKWARD))
    forward, backward = kernels.forward, kernels.backward
    if not with_keyset:  # older torch: no keyset argument (and no original to hand it to)
        forward = _without_keyset(kernels.forward)
        backward = _without_keyset(kernels.backward)
    library = torch.library.Library("aten", "IMPL")
    options = {"with_keyset": True} if with_keyset else {}
    library.impl(FORWARD.split("::")[1], forward, "CUDA", **options)
    library.impl(BACKWARD.split("::")[1], backward, "CUDA", **options)
    return Handle(library)


def _without_keyset(kernel):
    def call(*args, **kwargs):
        return kernel(None, *args, **kwargs)
    return call


def _registry():
    """torch.nn.attention's flash-implementation registry functions, or None (older torch)."""
    import torch.nn.attention as attention

    names = ("register_flash_attention_impl", "activate_flash_attention_impl",
             "restore_flash_attention_impl", "current_flash_attention_impl")
    if not all(hasattr(attention, n) for n in names):
        return None
    return attention


_installed: Optional[Handle] = None  # activate()'s own install, where torch has no registry


def register() -> str:
    """Add cudaflash to torch's flash-attention registry (``list_flash_attention_impls()``)
    and return its name; activating it stays the user's call (``activate()`` or
    ``torch.nn.attention.activate_flash_attention_impl("cudaflash")``). Raises RuntimeError
    where torch has no registry."""
    attention = _registry()
    if attention is None:
        raise RuntimeError(f"torch {torch.__version__} has no flash-attention registry "
                           "(torch.nn.attention.register_flash_attention_impl); "
                           "cudaflash.integrations.sdpa.activate() installs cudaflash without it")
    attention.register_flash_attention_impl(IMPL_NAME, register_fn=install)
    return IMPL_NAME


def activate() -> str:
    """Make SDPA's flash backend run cudaflash (through torch's registry where it exists);
    returns the implementation's name."""
    global _installed
    attention = _registry()
    if attention is not None:
        register()
        attention.activate_flash_attention_impl(IMPL_NAME)
    elif _installed is None:
        _installed = install()
    return IMPL_NAME


def restore() -> None:
    """Give SDPA's flash backend torch's own kernels back."""
    global _installed
    attention = _registry()
    if attention is not None:
        if attention.current_flash_attention_impl() == IMPL_NAME:
            attention.restore_flash_attention_impl()
    elif _installed is not None:
        _installed.remove()
        _installed = None


def active() -> bool:
    attention = _registry()
    if attention is not None:
        return attention.current_flash_attention_impl() == IMPL_NAME
    return _installed is not None


