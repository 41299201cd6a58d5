"""cudaflash as an attention implementation of Hugging Face transformers.

    import cudaflash.integrations.transformers as cudaflash_hf
    model = AutoModelForCausalLM.from_pretrained(
        name, dtype=torch.bfloat16, attn_implementation=cudaflash_hf.register())

``register()`` adds cudaflash to transformers' registries under the name ``"cuda_fa"`` and
returns that name; ``model.set_attn_implementation(cudaflash_hf.register())`` switches a
model already loaded. Two traps of transformers' custom-attention interface, and what this
module does about each:

- Padding. A registered attention function gets the padding mask only if a mask function is
  registered under the same name (AttentionMaskInterface): without one, transformers builds
  no mask at all and padded tokens are attended to silently. ``register()`` registers both;
  the mask function hands the attention function a ``MaskLayout`` (which keys and queries
  are real, causal or not, the sliding window), from which padded batches run through
  flash_attn_varlen_func on their real tokens only.
- The name. transformers switches on its own flash-attention code paths (kernel loading,
  mask shortcuts, max-length host reads) for any implementation name containing "flash";
  "sdpa" and "flex_attention" likewise trigger those backends' checks, "paged|" and
  "org/repo" forms mean paged attention and Hub kernels. Hence "cuda_fa", and
  ``register(name)`` refuses names with those parts.

What runs: causal attention (bottom-right aligned, as transformers' masks are), GQA/MQA,
the model's scaling (Gemma's query_pre_attn_scalar arrives as ``scaling``), sliding windows
(per layer, as the mask says: transformers' window W lets a query see itself and W - 1 keys
before it, flash-attn's window_size=(W - 1, 0)), softcapping (Gemma 2's
attn_logit_softcapping), left and right padding, and the generation caches (decoding steps
are q_len 1 against the cache; a static cache's empty slots count as padding). Without an
attention_mask the batch runs flash_attn_func directly, with no host read; with one, the
first layer reads once per forward whether anything is masked (transformers' own
flash-attention path reads as much): if not, flash_attn_func on the batch as it is, else the
real tokens packed for flash_attn_varlen_func (padding rows of the output are zeros).
Under torch.compile the mask function traces (tensor ops only) and that read is a graph
break per layer. Mask patterns the kernels cannot express (packed sequences found in
position_ids, or/and mask functions such as image-token overlays, chunked attention,
bidirectional sliding windows, a 4D mask of the caller's) run on PyTorch math with the
materialized mask, with a warning naming the reason: correct, not fast. Note that traced
mask builders always add the packed-sequence overlay when no attention_mask is given, so a
compiled model should get one (README).
Attention dropout in training mode (the config's attention_dropout) reaches the kernels'
dropout_p (PyTorch's dropout on the materialized-mask path). Refused with
NotImplementedError: attention dropout together with softcapping, attention sinks (s_aux),
position biases, value head dims unlike the query's; float32 attention inputs outside
autocast raise TypeError (load the model in bfloat16 or float16).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .. import api
from . import _token_layout

try:
    import transformers
    from transformers import masking_utils  # the mask registry: transformers >= 4.53
except ImportError as e:  # an optional dependency: say which version
    raise ImportError("cudaflash.integrations.transformers needs transformers >= 4.53 (its "
                      f"masking_utils registers mask functions): {e}") from e

DEFAULT_NAME = "cuda_fa"
# Parts of an attn_implementation name that transformers interprets (see the module's
# docstring); a name with one of them would not reach cudaflash as a plain registered function.
RESERVED_PARTS = ("flash", "sdpa", "flex_attention", "eager", "paged", "|", "/", ":")
# The mask factories cudaflash recognises by identity (bidirectional_mask_function arrived in
# transformers 5.0; before it, bidirectional masks come as materialized ones).
CAUSAL = masking_utils.causal_mask_function
BIDIRECTIONAL = getattr(masking_utils, "bidirectional_mask_function", None)


# ---- what the mask function hands the attention function -------------------------------------


class _PreparedMask:
    """Both mask kinds below are prepared masks. generate() with a static cache builds the
    masks before the forward and passes them in as ``attention_mask``; transformers' mask
    builders then read ``attention_mask.ndim`` (2: a padding mask to process) before calling
    the mask function again, which hands the prepared mask back unchanged
    (``mask_interface``). Models with layer types (Gemma, Qwen2, Mistral) take such masks as
    a dict and never ask."""

    ndim = 4  # not a 2D padding mask


@dataclass(frozen=True)
class MaskLayout(_PreparedMask):
    """A mask cudaflash's kernels express: ``causal`` (aligned to the bottom-right, i.e. by
    absolute position), ``window`` (transformers' sliding window W: a query sees keys at
    positions > its own - W; None: none) and ``tokens`` (which keys and queries are real;
    None: all of them, and the keys end at the last query)."""

    causal: bool
    window: Optional[int]
    tokens: Optional[_token_layout.TokenLayout]


@dataclass(frozen=True)
class MaterializedMask(_PreparedMask):
    """A mask the kernels cannot express: the additive (batch, 1, q_length, kv_length) mask
    of transformers' eager implementation (0: attend, the dtype's minimum: masked; None:
    nothing masked, not causal), and why it is needed."""

    additive: Optional[torch.Tensor]
    reason: str


def _sliding_window_of(kwargs: dict) -> Optional[int]:
    """The window of a plain causal sliding-window mask, from the arguments
    ``create_sliding_window_causal_mask`` passes (``local_size``: the config's sliding
    window), or None. The chunked mask passes local_size too (the chunk size), hence the
    comparison with the config."""
    window = kwargs.get("local_size")
    config = kwargs.get("config")
    if (window is None or "allow_is_bidirectional_skip" in kwargs
            or window != getattr(config, "sliding_window", None)
            or window == getattr(config, "attention_chunk_size", None)):
        return None
    return int(window)


def _unsupported_pattern(kwargs: dict, q_length: int) -> Optional[str]:
    """Why the mask these arguments describe is beyond the kernels, or None when it is
    causal or bidirectional attention over padding, optionally with a sliding window."""
    mask_function = kwargs.get("mask_function")
    if kwargs.get("use_vmap", False):
        return "an or/and mask function (e.g. an image-token or bidirectional overlay)"
    if mask_function is CAUSAL or (BIDIRECTIONAL is not None and mask_function is BIDIRECTIONAL):
        return None
    if _sliding_window_of(kwargs) is not None:
        # The builder turns causal skipping off for packed sequences and block overlays;
        # a decoding step (q_length 1) with a compilable cache turns it off too.
        if kwargs.get("allow_is_causal_skip", True) or q_length == 1:
            return None
        return "a sliding window combined with packed sequences or a block overlay"
    if kwargs.get("local_size") is not None:
        return "chunked or bidirectional local attention"
    return "packed sequences (from position_ids) or a custom mask function"


def mask_interface(**kwargs):
    """transformers' mask function for cudaflash (registered with AttentionMaskInterface):
    called once per forward and layer type with the mask's geometry (batch_size, q_length
    and q_offset or cache_position, kv_length, kv_offset, mask_function, attention_mask, ...).
    Returns a ``MaskLayout``, or a ``MaterializedMask`` for patterns beyond the kernels."""
    if isinstance(kwargs.get("attention_mask"), _PreparedMask):
        return kwargs["attention_mask"]  # built by generate() for this very step
    cache_position = kwargs.get("cache_position")
    q_length = kwargs.get("q_length")
    if q_length is None:
        q_length = cache_position.shape[0]
    reason = _unsupported_pattern(kwargs, q_length)
    if reason is not None:
        return MaterializedMask(masking_utils.eager_mask(**kwargs), reason)

    causal = kwargs.get("mask_function") is not BIDIRECTIONAL
    window = _sliding_window_of(kwargs) if causal else None
    attention_mask = kwargs.get("attention_mask")
    kv_length, kv_offset = kwargs["kv_length"], kwargs.get("kv_offset", 0)
    q_offset = kwargs.get("q_offset", 0)
    if attention_mask is None and cache_position is None and isinstance(q_offset, int):
        # No padding, and where the keys end is known on the host: no mask, no host read.
        if not causal or kv_offset + kv_length == q_offset + q_length:
            return MaskLayout(causal, window, None)
    device = kwargs.get("device")
    if device is None:
        device = (cache_position if cache_position is not None else attention_mask).device
    q_positions = _token_layout.query_positions(device, q_length, q_offset, cache_position)
    # Tensor ops only: whether the batch is dense after all (no padding, keys ending at the
    # last query) is read on the host by the attention, once per forward (TokenLayout).
    tokens = _token_layout.token_layout(attention_mask, q_positions, kv_length, kv_offset,
                                        causal, kwargs["batch_size"])
    return MaskLayout(causal, window, tokens)


# ---- the attention function ------------------------------------------------------------------


def _kernel_window(window: Optional[int], causal: bool) -> tuple[int, int]:
    """flash-attn's window_size for transformers' sliding window W (a query sees itself and
    the W - 1 keys before it)."""
    if window is None:
        return (-1, -1)
    if not causal:
        raise NotImplementedError(f"sliding_window={window} without causality: transformers' "
                                  "bidirectional windows reach cudaflash only as a materialized "
                                  "mask, which this call did not bring")
    if window < 1:
        raise ValueError(f"sliding_window={window}; transformers' windows are >= 1 tokens")
    return (window - 1, 0)


def _half_precision(query, key, value):
    """q, k, v in float16 or bfloat16: float32 ones are cast to the autocast dtype where
    autocast is on (a float32 model under autocast feeds float32 rotary outputs here), and
    refused otherwise."""
    if query.dtype in (torch.float16, torch.bfloat16):
        return query, key, value
    device_type = query.device.type
    if query.dtype == torch.float32 and torch.is_autocast_enabled(device_type):
        get_dtype = getattr(torch, "get_autocast_dtype", None)
        dtype = (get_dtype(device_type) if get_dtype is not None
                 else torch.get_autocast_gpu_dtype())
        return query.to(dtype), key.to(dtype), value.to(dtype)
    raise TypeError(f"the attention inputs are {query.dtype}; cudaflash runs torch.float16 and "
                    "torch.bfloat16: load the model with dtype=torch.bfloat16 (or float16), or "
                    "run it under torch.autocast")


def _refuse_unsupported(module, query, value, dropout, softcap, kwargs) -> None:
    if dropout and softcap:
        raise NotImplementedError(
            f"attention dropout {dropout!r} with softcap {softcap!r} while training: cudaflash "
            "has no dropout with softcapping yet; set the config's attention_dropout to 0.0 "
            "(or use eval mode)")
    for name in ("s_aux", "position_bias"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"{type(module).__name__} passes {name}: cudaflash has no "
                                      "attention sinks or position biases; use "
                                      "attn_implementation='eager' for this model")
    if value.shape[-1] != query.shape[-1]:
        raise NotImplementedError(f"value head dim {value.shape[-1]} differs from the query's "
                                  f"{query.shape[-1]}: cudaflash needs them equal")
    if kwargs.get("output_attentions", False) and not torch.compiler.is_compiling():
        warnings.warn("cudaflash computes no attention weights (output_attentions=True "
                      "returns None for them); use attn_implementation='eager' to get them",
                      stacklevel=3)


@torch.compiler.disable  # reads the mask on the host; the packing's shapes depend on it
def _packed_attention(q, k, v, tokens: _token_layout.TokenLayout, causal: bool, scale,
                      window_size, softcap, dropout):
    """Attention of a padded (batch, seqlen, heads, head_dim) batch on its real tokens only:
    gathered, run by flash_attn_varlen_func, scattered back (zeros on padding rows); or
    flash_attn_func on the batch as it is where the mask turns out to hide nothing."""
    if tokens.key_valid.shape[1] != k.shape[1]:
        raise ValueError(f"the mask describes {tokens.key_valid.shape[1]} keys but the layer "
                         f"has {k.shape[1]}: the cache and the mask disagree")
    if tokens.dense():
        return api.flash_attn_func(q, k, v, dropout_p=dropout, softmax_scale=scale,
                                   causal=causal, window_size=window_size, softcap=softcap)
    p = tokens.packed()
    gather = _token_layout.gather
    out = api.flash_attn_varlen_func(
        gather(q, p.q_rows), gather(k, p.k_rows), gather(v, p.k_rows), p.cu_seqlens_q,
        p.cu_seqlens_k, p.max_seqlen_q, p.max_seqlen_k, dropout_p=dropout, softmax_scale=scale,
        causal=causal, window_size=window_size, softcap=softcap)
    return _token_layout.scatter(out, p.q_rows, q.shape[0], q.shape[1])


def _materialized_attention(module, query, key, value, additive, scale, softcap, dropout):
    """PyTorch attention under an additive mask, for the patterns the kernels cannot
    express; (batch, heads, seqlen, head_dim) inputs as transformers gives them, out as
    (batch, seqlen, heads, head_dim). ``dropout``: torch's, on the probabilities."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    if additive is not None:
        additive = additive.to(query.dtype) if additive.dtype != torch.bool else additive
    if not softcap:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=additive,
                                             scale=scale, dropout_p=dropout)
    else:
        scale = query.shape[-1] ** -0.5 if scale is None else scale
        scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * scale
        scores = softcap * torch.tanh(scores / softcap)
        if additive is not None:
            scores = (scores.masked_fill(~additive, float("-inf"))
                      if additive.dtype == torch.bool else scores + additive.float())
        out = torch.matmul(scores.softmax(-1), value.float()).to(query.dtype)  # (softcap:
        # no dropout, refused above)
    return out.transpose(1, 2)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      sliding_window=None, softcap=None, is_causal=None, **kwargs):
    """transformers' attention function for cudaflash (registered with AttentionInterface).

    query (batch, heads, q_len, head_dim), key and value (batch, kv_heads, kv_len, head_dim)
    as the model's attention module gives them (after the cache update); attention_mask
    what ``mask_interface`` returned (or None where the model built no mask, or a 4D mask
    the caller supplied). Returns (out (batch, q_len, heads, head_dim), None)."""
    _refuse_unsupported(module, query, value, dropout, softcap, kwargs)
    dropout = float(dropout) if dropout else 0.0  # transformers passes 0.0 in eval mode
    if isinstance(attention_mask, torch.Tensor):
        attention_mask = MaterializedMask(attention_mask, "a 4D mask given by the caller")
    if isinstance(attention_mask, MaterializedMask):
        if not torch.compiler.is_compiling():  # a warning would break the graph
            warnings.warn(f"cudaflash: {attention_mask.reason} is beyond its kernels; this "
                          "attention runs PyTorch math with the materialized mask (correct, "
                          "slower)", stacklevel=2)
        return _materialized_attention(module, query, key, value, attention_mask.additive,
                                       scaling, softcap, dropout), None
    if attention_mask is None:
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
        layout = MaskLayout(causal, sliding_window, None)
    elif isinstance(attention_mask, MaskLayout):
        layout = attention_mask
    else:
        raise TypeError(f"attention_mask is a {type(attention_mask).__name__}; the cudaflash "
                        "attention expects what its mask function returns: was the model "
                        "loaded with cudaflash's registered name (register())?")
    query, key, value = _half_precision(query, key, value)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)  # views
    window_size = _kernel_window(layout.window, layout.causal)
    cap = float(softcap) if softcap else 0.0
    if layout.tokens is None:
        out = api.flash_attn_func(q, k, v, dropout_p=dropout, softmax_scale=scaling,
                                  causal=layout.causal, window_size=window_size, softcap=cap)
    else:
        out = _packed_attention(q, k, v, layout.tokens, layout.causal, scaling, window_size,
                                cap, dropout)
    return out, None


# ---- registration ----------------------------------------------------------------------------


def check_name(name) -> str:
    """``name`` if transformers would hand it to a registered function as it is; raises
    ValueError naming the part it would interpret otherwise."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name={name!r}; it must be a non-empty str")
    for part in RESERVED_PARTS:
        if part in name:
            raise ValueError(f"name={name!r} contains {part!r}, which transformers interprets "
                             "(flash-attention, SDPA, flex, eager, paged or Hub-kernel code "
                             f"paths); choose a name without any of {list(RESERVED_PARTS)}, "
                             f"e.g. {DEFAULT_NAME!r}")
    return name


def register(name: str = DEFAULT_NAME) -> str:
    """Register cudaflash's attention and mask functions with transformers under ``name``
    and return it, for ``from_pretrained(..., attn_implementation=register())`` or
    ``model.set_attn_implementation(register())``. Repeat calls are harmless."""
    check_name(name)
    transformers.AttentionInterface.register(name, attention_forward)
    masking_utils.AttentionMaskInterface.register(name, mask_interface)
    return name
