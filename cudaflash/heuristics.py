"""Choices that depend on the problem and the GPU, as pure functions: the GPU's facts (SM
count, CTA slots) come in as arguments, nothing here reads a device, a cache or torch.

- kernel_window: flash-attn's window_size as the kernels mask by it (forward and backward).
- kernel_problem: the problem a forward kernel runs for a call (GQA decoding packed as rows).
- split-KV: how many runs to cut each query block's keys into (max_splits, split_count,
  split_sizes).
- effective_scheme: which backward scheme runs a call.
"""

import math

from ._checks import GRID_YZ_MAX


def kernel_window(window: tuple[int, int], seqlen_k: int, causal: bool) -> tuple[int, int]:
    """Params' (window_left, window_right) for flash-attn's checked ``window``: a side at
    least ``seqlen_k`` long is unbounded (-1), and causal is a right bound of 0 (the kernels
    mask by the window alone). flash-attn normalises so too; besides matching it where
    seqlen_q > seqlen_k, the clamp keeps the kernels' sums of rows, keys and bounds far from
    int32 overflow. The one place this is written: the forward's and the backward's params
    of one call both come from here, so they mask alike."""
    left, right = window
    left = -1 if left >= seqlen_k else left
    right = -1 if right >= seqlen_k else right
    return left, 0 if causal else right


def kernel_problem(seqlen_q: int, n_heads: int, n_heads_k: int, seqlen_k: int, causal: bool,
                   window: tuple[int, int] = (-1, -1), alibi: bool = False
                   ) -> tuple[int, int, bool, tuple[int, int]]:
    """(query rows per head, heads, causal, kernel window) of the problem the forward kernel
    runs for a call; ``window``: flash-attn's checked (left, right); ``alibi``: whether the
    call has ALiBi slopes.

    Decoding with GQA/MQA (one query row, several query heads per K/V head): the query heads
    that share a K/V head become rows of one head (their data are consecutive heads of q and
    out), so each K/V block is read once for all of them instead of once per query head. One
    query row sees every key under the bottom-right causal mask, so the rows are not causal.
    Not with a sliding window (one that clamping by seqlen_k leaves bounded), whose bounds the
    kernel would apply to each of those rows as if it were another query position, nor with
    ALiBi or dropout (``alibi`` True for either), whose bias or random numbers depend on the
    query head and position.
    """
    group = n_heads // n_heads_k
    if (seqlen_q == 1 and group > 1 and not alibi
            and kernel_window(window, seqlen_k, False) == (-1, -1)):
        return group, n_heads_k, False, (-1, -1)
    return seqlen_q, n_heads, causal, kernel_window(window, seqlen_k, causal)


# Split-KV: a grid of fewer CTAs than the GPU holds at once leaves SMs idle for the whole call
# (decoding: one query row per sequence; a short chunk of queries against a long cache).
# Cutting each query block's KV blocks into runs, one CTA each, fills them; a second kernel
# combines the runs' partial results, at the price of writing and reading them in float32.
SPLIT_BELOW = 0.8  # split grids that fill less than this fraction of the GPU's CTA slots
MIN_BLOCKS_PER_SPLIT = 2
# A split writes and reads rows x d_head float32 partials (8 bytes per element) and reads
# keys x d_head of K and V (4 bytes per element): at >= 16 keys per row the partials are at
# most 1/8 of that traffic. With fewer (a 1024-query prefill), splitting measured slower
# (docs/perf-log.md, "Split-KV").
MIN_KEYS_PER_ROW = 16
MAX_SPLITS = 128


def visited_keys(seqlen_k: int, rows: int, block_rows: int, window: tuple[int, int]) -> int:
    """The keys one CTA of ``block_rows`` query rows (of a call's ``rows``) can visit: all
    ``seqlen_k``, or with a left window bound the window's span over its rows (``window``:
    the kernel's, heuristics.kernel_window)."""
    if window[0] < 0:
        return seqlen_k
    return min(seqlen_k, window[0] + min(rows, block_rows) + max(window[1], 0))


def max_splits(keys: int, kv_blocks: int, rows_per_cta: int, batch: int) -> int:
    """The most splits worth making: each keeps >= MIN_BLOCKS_PER_SPLIT KV blocks and
    >= MIN_KEYS_PER_ROW keys per query row of its CTA, and grid.z = batch x splits fits."""
    return min(MAX_SPLITS, kv_blocks // MIN_BLOCKS_PER_SPLIT, GRID_YZ_MAX // batch,
               keys // (MIN_KEYS_PER_ROW * rows_per_cta))


def split_count(ctas: int, slots: int, most: int) -> int:
    """How many runs to cut each query block's KV blocks into, for a grid of ``ctas`` CTAs on
    a GPU with ``slots`` CTA slots (SMs x CTAs per SM), at most ``most``: 1 when the grid
    fills the GPU; otherwise the fewest splits whose waves are about as full as the best
    count's (the fewest: every split adds partial results to write and combine)."""
    if ctas >= SPLIT_BELOW * slots or most < 2:
        return 1

    def wave_fill(splits: int) -> float:  # busy fraction of the CTA slots over all waves
        waves = ctas * splits / slots
        return waves / math.ceil(waves)

    best = max(wave_fill(s) for s in range(1, most + 1))
    return next(s for s in range(1, most + 1) if wave_fill(s) >= 0.85 * best)


def split_sizes(asked: int, kv_blocks: int, batch: int) -> tuple[int, int]:
    """(splits, KV blocks per split) for ``asked`` splits of ``kv_blocks`` blocks: each split
    keeps at least one block and grid.z = batch x splits fits."""
    splits = min(asked, kv_blocks, GRID_YZ_MAX // batch)
    per_split = (kv_blocks + splits - 1) // splits
    return (kv_blocks + per_split - 1) // per_split, per_split


# The atomic scheme's dK/dV CTAs (128 keys) pay their fixed costs (K/V loads, dK/dV stores)
# over the query rows they stream: group * seqlen_q, half of it when causal. At or below
# these many the deterministic kernels were faster, so such calls take them: never less
# reproducible than asked for. mma.sync modules: 1-14% faster up to 512 rows (H100, perf log
# "Backward v2"); wgmma modules (sm_90): only up to 256 rows, by ~4% at d64 (H200, perf log
# "Backward v3").
ATOMIC_MIN_ROWS_PER_CTA = 512
ATOMIC_MIN_ROWS_PER_CTA_WGMMA = 256


def effective_scheme(asked: str, seqlen_q: int, group: int, causal: bool,
                     wgmma: bool = False, window: tuple[int, int] = (-1, -1)) -> str:
    """The backward scheme that runs a call for which ``asked`` was chosen
    (backward.scheme); ``wgmma``: whether the atomic module for the call is a wgmma one;
    ``window``: the kernels' (left, right), whose span bounds the query rows that see a key."""
    rows = group * seqlen_q // (2 if causal else 1)
    left, right = window
    if left >= 0 and right >= 0:
        rows = min(rows, group * (left + right + 1))
    limit = ATOMIC_MIN_ROWS_PER_CTA_WGMMA if wgmma else ATOMIC_MIN_ROWS_PER_CTA
    if asked == "atomic" and rows <= limit:
        return "deterministic"
    return asked


# ALiBi's band (fwd_range.cuh, launch.alibi_score_bound): the bound is a pass over q and k
# (about 290 us for 2 x 64 MB on the H100: torch's row norms over a short last dim run far
# below the memory's speed), paid back by the key blocks the band skips. Measured on the H100
# (perf log, thirty-seventh session; ALiBi / plain, banded against full): at 1024 scores per
# row read (non-causal 2k, causal 4k) 0.60-0.89 against 0.85-0.93, at 2048 (non-causal 4k,
# causal 8k) 1.01-1.22 against 0.84-0.96, at 16k 1.7-2.2.
ALIBI_BAND_MIN_SCORES_PER_ROW = 2048


def visible_keys_per_row(seqlen_q: int, seqlen_k: int, window: tuple[int, int]) -> float:
    """About how many keys a query row sees under the kernel ``window`` (kernel_window's:
    causal is a right side of 0), bottom-right aligned as flash-attn aligns them: the count is
    piecewise linear in the row, so the first, middle and last rows' counts weighted 1:2:1."""
    left, right = window
    shift = seqlen_k - seqlen_q

    def count(row: int) -> int:
        diagonal = row + shift
        lo = 0 if left < 0 else max(0, diagonal - left)
        hi = seqlen_k - 1 if right < 0 else min(seqlen_k - 1, diagonal + right)
        return max(0, hi - lo + 1)

    return (count(0) + 2 * count(seqlen_q // 2) + count(seqlen_q - 1)) / 4


def alibi_band_pays(seqlen_q: int, seqlen_k: int, n_heads: int, n_heads_k: int,
                    window: tuple[int, int]) -> bool:
    """Whether an ALiBi forward should take the band: the scores it computes (rows times
    visible keys) per row the bound's pass reads (of q and of k) reach
    ALIBI_BAND_MIN_SCORES_PER_ROW."""
    scores = seqlen_q * n_heads * visible_keys_per_row(seqlen_q, seqlen_k, window)
    return scores >= ALIBI_BAND_MIN_SCORES_PER_ROW * (seqlen_q * n_heads + seqlen_k * n_heads_k)
