"""Dropout's random numbers on the host (numpy), the same function of (seed, batch, head,
query, key) as the kernels' (cuda_src/philox.cuh), so GPU tests can rebuild a call's keep mask
exactly (docs/design-notes.md, "Dropout").

Philox4x32 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011): a
counter-based generator; rounds of two 32x32 -> 64-bit multiplications and xors with a key
that is bumped by two Weyl constants each round, 7 of them as the kernels run it (flash-attn
2's count; the paper's default is 10). Written here from the paper's description, importing
nothing from cudaflash so that it checks the package rather than repeats it; the
known-answer vectors in test_dropout_reference.py check it at 7 and 10 rounds.
"""

from __future__ import annotations

import numpy as np

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)  # round multipliers
_W0, _W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)  # key bumps (Weyl constants)
_LO = np.uint64(0xFFFFFFFF)

# The kernels' round count: it must equal kPhiloxRounds in cuda_src/philox.cuh (and
# PHILOX_ROUNDS in cudaflash/_dropout.py; test_dropout_reference.py checks both).
PHILOX_ROUNDS = 7


def philox4x32(counter, key, rounds: int = PHILOX_ROUNDS):
    """Philox4x32 with ``rounds`` rounds of uint32 arrays: counter (..., 4), key (..., 2),
    broadcast together; returns (..., 4) uint32."""
    c = np.asarray(counter, dtype=np.uint32)
    k = np.asarray(key, dtype=np.uint32)
    c, k = np.broadcast_arrays(c, k[..., [0, 1, 0, 1]])  # shape match; k's last 2 unused
    c0, c1, c2, c3 = (c[..., i].astype(np.uint64) for i in range(4))
    k0, k1 = k[..., 0].copy(), k[..., 1].copy()
    with np.errstate(over="ignore"):
        for _ in range(rounds):
            p0, p1 = _M0 * c0, _M1 * c2  # full 64-bit products of 32-bit values
            hi0, lo0 = p0 >> np.uint64(32), p0 & _LO
            hi1, lo1 = p1 >> np.uint64(32), p1 & _LO
            c0, c1, c2, c3 = (hi1 ^ c1 ^ k0.astype(np.uint64), lo1,
                              hi0 ^ c3 ^ k1.astype(np.uint64), lo0)
            k0 = (k0 + _W0).astype(np.uint32)
            k1 = (k1 + _W1).astype(np.uint32)
    return np.stack([c0, c1, c2, c3], axis=-1).astype(np.uint32)


def random8(seed: int, batch: int, heads: int, b: int, h: int, q_idx, k_idx):
    """The random byte of score (query q_idx, key k_idx) of head h of batch entry b (numpy
    int arrays, broadcast), for a call with `seed` (a 64-bit int) over `heads` heads.
    Counter: (query block of 16, key block of 16, b * heads + h, 4 * (q % 8 // 2) + k % 8 //
    2); of the call's 16 bytes (little-endian words), the one at 4 * qi + kj with qi = q % 2 +
    2 * (q % 16 // 8) and kj = k % 2 + 2 * (k % 16 // 8)."""
    q_idx, k_idx = np.broadcast_arrays(np.asarray(q_idx, dtype=np.int64),
                                       np.asarray(k_idx, dtype=np.int64))
    counter = np.stack([q_idx // 16, k_idx // 16,
                        np.full_like(q_idx, b * heads + h),
                        4 * (q_idx % 8 // 2) + k_idx % 8 // 2], axis=-1).astype(np.uint32)
    key = np.array([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF], dtype=np.uint32)
    words = philox4x32(counter, key)
    qi = q_idx % 2 + 2 * (q_idx % 16 // 8)
    kj = k_idx % 2 + 2 * (k_idx % 16 // 8)
    word = np.take_along_axis(words, qi[..., None], axis=-1)[..., 0]
    return ((word >> (8 * kj).astype(np.uint32)) & 0xFF).astype(np.uint32)


def threshold(dropout_p: float) -> int:
    """The kernels' 8-bit threshold: a score is dropped when its byte is below it."""
    return min(round(dropout_p * 256), 255)


def keep_mask(seed: int, dropout_p: float, batch: int, heads: int, seqlen_q: int,
              seqlen_k: int) -> np.ndarray:
    """(batch, heads, seqlen_q, seqlen_k) bool: the scores a call keeps (random8 >= the
    8-bit threshold round(p * 256))."""
    t = threshold(dropout_p)
    q_idx = np.arange(seqlen_q)[:, None]
    k_idx = np.arange(seqlen_k)[None, :]
    return np.stack([np.stack([random8(seed, batch, heads, b, h, q_idx, k_idx) >= t
                               for h in range(heads)]) for b in range(batch)])
