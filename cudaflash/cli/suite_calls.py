"""The GPU side of the suites (``suites``): random tensors for one row and the calls that
``timing.time_in_turns`` times, keyed (phase, variant). Every variant of a row runs on the
same tensors (SDPA on ``transpose(1, 2)`` views of them); nothing here prints or times."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from .. import api, kvcache
from .hf_calls import hf_calls
from .suites import DROPOUT_P, PAGE_SIZES, SOFTCAP, Options, Row
from .timing import TORCH_DTYPES, make_qkv, phase_call, sdpa_context

NO_CONTEXT = contextlib.nullcontext


def _sdpa(backend: str, q, k, v, causal: bool):
    """``(forward, context)`` of SDPA ``backend`` on BSHD q, k, v; out back in BSHD."""
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # views, no copy
    return ((lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
             .transpose(1, 2)), sdpa_context(backend))


def _leaves(*tensors):
    return tuple(t.requires_grad_() for t in tensors)


def train_forwards(row: Row, variants, q, k, v) -> dict:
    """variant -> (forward, context) for the train and backward suites."""
    causal = row.get("causal")
    forwards = {}
    for variant in variants:
        if variant == "cudaflash":
            forwards[variant] = (lambda: api.flash_attn_func(q, k, v, causal=causal)), NO_CONTEXT
        elif variant == "cudaflash-det":
            forwards[variant] = (lambda: api.flash_attn_func(q, k, v, causal=causal,
                                                             deterministic=True)), NO_CONTEXT
        else:
            forwards[variant] = _sdpa(variant, q, k, v, causal)
    return forwards


def paper_alibi_slopes(heads: int, device) -> torch.Tensor:
    """ALiBi's slopes as the ALiBi paper sets them: 2^(-8 (h + 1) / H) for head h of H."""
    return torch.exp2(-8.0 * torch.arange(1, heads + 1, device=device) / heads)


def modifier_forwards(row: Row, variants, q, k, v, deterministic: bool) -> dict:
    """The softcap, alibi and dropout suites: flash_attn_func plain, capped, with ALiBi's
    slopes (paper_alibi_slopes) or with dropout."""
    causal = row.get("causal")
    slopes = paper_alibi_slopes(q.shape[2], q.device)
    options = {"plain": {}, "softcap": {"softcap": SOFTCAP}, "alibi": {"alibi_slopes": slopes},
               "dropout": {"dropout_p": DROPOUT_P}}
    return {variant: ((lambda kwargs=options[variant]: api.flash_attn_func(
        q, k, v, causal=causal, deterministic=deterministic, **kwargs)), NO_CONTEXT)
        for variant in variants}


def window_forwards(row: Row, variants, q, k, v) -> dict:
    forwards = {}
    for variant in variants:
        if variant == "flash":
            forwards[variant] = _sdpa("flash", q, k, v, True)
        else:
            window = (-1, -1) if variant == "full" else (int(variant[1:]), 0)
            forwards[variant] = ((lambda w=window: api.flash_attn_func(
                q, k, v, causal=True, window_size=w)), NO_CONTEXT)
    return forwards


def fa_calls(opts: Options, row: Row, device) -> dict:
    """(phase, variant) -> (fn, context) for the suites on FlashAttention-sized rows."""
    q, k, v = _leaves(*make_qkv(row.get("B"), row.get("S"), row.get("H"), row.get("d"),
                                row.get("dtype"), device))
    dout = torch.randn_like(q)
    calls = {}
    for phase in opts.phases:
        if opts.suite.name in ("softcap", "alibi", "dropout"):
            # Softcap and ALiBi always run the deterministic backward: the plain side does too.
            # Dropout's ratio is against the plain call as users make it (default backward).
            deterministic = phase != "forward" and opts.suite.name != "dropout"
            forwards = modifier_forwards(row, opts.variants, q, k, v, deterministic)
        else:
            forwards = train_forwards(row, opts.variants, q, k, v)
        for variant, (forward, context) in forwards.items():
            calls[phase, variant] = phase_call(phase, forward, (q, k, v), dout), context
    return calls


def window_calls(opts: Options, row: Row, device) -> dict:
    q, k, v = _leaves(*make_qkv(1, row.get("S"), row.get("H"), row.get("d"), row.get("dtype"),
                                device))
    dout = torch.randn_like(q)
    forwards = window_forwards(row, opts.variants, q, k, v)
    return {(phase, variant): (phase_call(phase, forward, (q, k, v), dout), context)
            for phase in opts.phases for variant, (forward, context) in forwards.items()}


def varlen_calls(opts: Options, row: Row, device) -> dict:
    """The packed batch and the same sequences padded to the longest (zeros past each end)."""
    lengths, causal = list(row.lengths), row.get("causal")
    nheads, d, dtype = row.get("H"), row.get("d"), TORCH_DTYPES[row.get("dtype")]
    total, longest = sum(lengths), max(lengths)
    packed = [torch.randn(total, nheads, d, device=device, dtype=dtype) for _ in range(3)]
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    cu = torch.tensor(starts, dtype=torch.int32, device=device)
    padded = [torch.zeros(len(lengths), longest, nheads, d, device=device, dtype=dtype)
              for _ in range(3)]
    for p, x in zip(padded, packed):
        for b, (s, n) in enumerate(zip(starts, lengths)):
            p[b, :n] = x[s:s + n]
    q, k, v = _leaves(*packed)
    pq, pk, pv = _leaves(*padded)
    forwards = {
        "varlen": ((lambda: api.flash_attn_varlen_func(q, k, v, cu, cu, longest, longest,
                                                       causal=causal)), NO_CONTEXT, (q, k, v)),
        "padded": ((lambda: api.flash_attn_func(pq, pk, pv, causal=causal)), NO_CONTEXT,
                   (pq, pk, pv)),
        "flash-padded": (*_sdpa("flash", pq, pk, pv, causal), (pq, pk, pv)),
    }
    douts = {"packed": torch.randn_like(q), "padded": torch.randn_like(pq)}
    return {(phase, variant): (phase_call(phase, forward, inputs,
                                          douts["packed" if variant == "varlen" else "padded"]),
                               context)
            for phase in opts.phases for variant, (forward, context, inputs) in forwards.items()
            if variant in opts.variants}


def kvcache_calls(opts: Options, row: Row, device) -> dict:
    """Inference calls (no autograd) on one decoding step's tensors."""
    batch, cache, dtype = row.get("B"), row.get("cache"), row.get("dtype")
    heads, heads_k, d = row.get("H"), row.get("H_k"), row.get("d")
    q, kc, vc = make_qkv(batch, cache, heads, d, dtype, device, seqlen_q=1, nheads_k=heads_k)
    lengths = torch.tensor(row.lengths, device=device, dtype=torch.int32)
    keys = torch.arange(cache, device=device)
    mask = (keys[None, :] < lengths[:, None])[:, None, None, :]  # (b, 1, 1, s)
    qt = q.transpose(1, 2)
    kt = kc.transpose(1, 2).repeat_interleave(heads // heads_k, dim=1)
    vt = vc.transpose(1, 2).repeat_interleave(heads // heads_k, dim=1)

    def inference(fn):
        def call():
            with torch.inference_mode():
                return fn()
        return call

    if "copy" in opts.variants:  # the bandwidth peer: as many bytes moved as kvcache reads
        copy_src = torch.empty(row.bytes // 2, dtype=torch.uint8, device=device)
        copy_dst = torch.empty_like(copy_src)
    forwards = {
        "kvcache": (lambda: kvcache.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths),
                    NO_CONTEXT),
        "copy": ((lambda: copy_dst.copy_(copy_src)), NO_CONTEXT),
        **{f"paged{page}": (_paged_call(q, kc, vc, lengths, page), NO_CONTEXT)
           for page in PAGE_SIZES if f"paged{page}" in opts.variants},
        "full": (lambda: api.flash_attn_func(q, kc, vc), NO_CONTEXT),
        "sdpa-eff": ((lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)),
                     sdpa_context("efficient")),
    }
    return {("forward", variant): (inference(fn), context)
            for variant, (fn, context) in forwards.items() if variant in opts.variants}


def _paged_call(q, k_cache, v_cache, lengths, page: int):
    """flash_attn_with_kvcache on the caches' positions copied into shuffled pages of
    ``page`` positions (a pool of batch x cache / page pages and its block table)."""
    batch, cache, heads_k, d = k_cache.shape
    n_pages = batch * cache // page
    order = torch.randperm(n_pages, device=k_cache.device)
    table = order.view(batch, cache // page).to(torch.int32)
    k_pages = torch.empty((n_pages, page, heads_k, d), dtype=k_cache.dtype,
                          device=k_cache.device)
    v_pages = torch.empty_like(k_pages)
    k_pages[order] = k_cache.reshape(n_pages, page, heads_k, d)
    v_pages[order] = v_cache.reshape(n_pages, page, heads_k, d)
    return lambda: kvcache.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lengths,
                                                   block_table=table)


BUILDERS = {"train": fa_calls, "backward": fa_calls, "softcap": fa_calls, "alibi": fa_calls,
            "dropout": fa_calls,
            "window": window_calls, "varlen": varlen_calls, "kvcache": kvcache_calls,
            "hf": hf_calls}


def build_calls(opts: Options, row: Row, device) -> dict:
    return BUILDERS[opts.suite.name](opts, row, device)
