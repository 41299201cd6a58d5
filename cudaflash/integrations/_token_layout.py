"""Which tokens of a padded batch are real, and the packed batch cudaflash runs instead.

transformers describes a layer's attention by a 2D padding mask (batch, past + new tokens:
True where a token is real) and the absolute positions of the layer's queries and keys;
cudaflash's flash_attn_varlen_func wants the real rows gathered into one packed tensor and
per-sequence offsets. This module does that conversion with torch ops only (no transformers,
no GPU), so the CPU tests check it directly.

Why dropping tokens is exact (causal attention): every query position is also a key position
(the cache always holds the new tokens), and a position is real or padding for both roles
alike. So after removing the padding keys and queries of sequence b, the keys a kept query
at position p may see (real keys at positions <= p) are exactly the first
``n_keys(b) - (kept queries after p)`` kept keys: flash-attn's causal mask aligned to the
bottom-right corner of each packed sequence. Keys past the last query (empty slots of a
static cache) are dropped as padding. Without causality every real key is visible and every
query row is kept.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Union

import torch
import torch.nn.functional as F


class Packed(NamedTuple):
    """A padded batch packed for flash_attn_varlen_func: ``q_rows``/``k_rows`` index the
    (batch, seqlen) positions kept (as ``nonzero(as_tuple=True)`` gives them), sequence b
    being packed rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` (int32 offsets)."""

    q_rows: tuple  # (batch index, position index) of each kept query, in packed order
    k_rows: tuple
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int


class TokenLayout:
    """The real keys and queries of one layer type of a batch: ``key_valid`` (batch,
    kv_length) and ``query_valid`` (batch, q_length), bool; ``dense_flag`` a 0-dim bool
    tensor, True when every key is real and the keys end at the last query (the batch then
    needs no packing). Built with tensor ops only (it may be traced by torch.compile); the
    host reads happen in ``dense()`` and ``packed()``, once per object: one object serves
    every layer that shares the mask, so once per forward, not once per layer."""

    def __init__(self, key_valid: torch.Tensor, query_valid: torch.Tensor,
                 dense_flag: torch.Tensor):
        self.key_valid = key_valid
        self.query_valid = query_valid
        self.dense_flag = dense_flag
        self._dense: Optional[bool] = None
        self._packed: Optional[Packed] = None

    def dense(self) -> bool:
        if self._dense is None:
            self._dense = bool(self.dense_flag)
        return self._dense

    def packed(self) -> Packed:
        if self._packed is None:
            self._packed = pack(self.key_valid, self.query_valid)
        return self._packed


def offsets(lengths: torch.Tensor) -> torch.Tensor:
    """(batch + 1,) int32 cumulative offsets of per-sequence lengths, starting at 0."""
    return F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))


def pack(key_valid: torch.Tensor, query_valid: torch.Tensor) -> Packed:
    """The packed batch of the real tokens (two host reads: the nonzero indices and the
    longest lengths, which flash_attn_varlen_func takes as ints)."""
    q_lengths = query_valid.sum(1, dtype=torch.int32)
    k_lengths = key_valid.sum(1, dtype=torch.int32)
    max_q, max_k = torch.stack([q_lengths.max(), k_lengths.max()]).tolist()
    return Packed(query_valid.nonzero(as_tuple=True), key_valid.nonzero(as_tuple=True),
                  offsets(q_lengths), offsets(k_lengths), int(max_q), int(max_k))


def query_positions(device, q_length: Optional[int] = None,
                    q_offset: Union[int, torch.Tensor] = 0,
                    cache_position: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(q_length,) absolute positions of a layer's queries, from transformers' two
    conventions: ``cache_position`` (up to 5.0) or ``q_offset`` and ``q_length`` (later; a
    static cache gives q_offset as a tensor)."""
    if cache_position is not None:
        return cache_position.to(device=device, dtype=torch.long)
    return torch.arange(q_length, device=device) + q_offset


def token_layout(attention_mask: Optional[torch.Tensor], q_positions: torch.Tensor,
                 kv_length: int, kv_offset: int, causal: bool, batch_size: int) -> TokenLayout:
    """The real keys and queries of a layer whose keys sit at absolute positions
    ``kv_offset .. kv_offset + kv_length - 1`` and whose queries at ``q_positions``.

    ``attention_mask``: transformers' 2D mask (batch, past + new), True/1 for real tokens,
    or None (every token real). Positions past its end count as padding, as in
    transformers' own masks (a static cache's empty slots). Causal: keys after the last
    query are dropped too (a static cache holds them as zeros), and a query is kept where its
    own position is real. Not causal: every query is kept (a padded query's row is computed
    and ignored, as in SDPA; cross-attention's queries are not positions of the mask).
    """
    device = q_positions.device
    key_positions = torch.arange(kv_length, device=device) + kv_offset  # (kv_length,)
    if attention_mask is None:
        key_valid = torch.ones(batch_size, kv_length, dtype=torch.bool, device=device)
        real_queries = None
    else:
        mask = attention_mask.to(device=device, dtype=torch.bool)
        short = kv_offset + kv_length - mask.shape[1]
        if short > 0:
            mask = F.pad(mask, (0, short))
        key_valid = mask[:, key_positions]
        real_queries = mask
    dense_flag = key_valid.all()
    if causal:
        dense_flag = dense_flag & (q_positions[-1] == kv_offset + kv_length - 1)
        key_valid = key_valid & (key_positions <= q_positions[-1])
        query_valid = (torch.ones(batch_size, q_positions.shape[0], dtype=torch.bool,
                                  device=device) if real_queries is None
                       else real_queries[:, q_positions])
    else:
        query_valid = torch.ones(batch_size, q_positions.shape[0], dtype=torch.bool,
                                 device=device)
    return TokenLayout(key_valid, query_valid, dense_flag)


def gather(x: torch.Tensor, rows: tuple) -> torch.Tensor:
    """(total, heads, head_dim) packed rows of a (batch, seqlen, heads, head_dim) tensor (any
    strides; the result is contiguous)."""
    return x[rows]


def scatter(packed: torch.Tensor, rows: tuple, batch: int, seqlen: int) -> torch.Tensor:
    """The (batch, seqlen, heads, head_dim) tensor holding ``packed``'s rows at ``rows`` and
    zeros elsewhere (dropped rows: padding, whose output no one reads). Differentiable."""
    full = packed.new_zeros((batch, seqlen, *packed.shape[1:]))
    return full.index_put(rows, packed)
