"""ALiBi (flash-attn 2.x's alibi_slopes) on a GPU: every built kernel config, whole and split,
then flash_attn_func (both slope shapes, GQA decoding, split decoding, padded head dims, the
packed forms, softcap and windows alongside, repeat calls and their plans, torch.compile),
flash_attn_varlen_func (contiguous and paged) and flash_attn_with_kvcache (cache lengths,
appends, left padding, cache_batch_idx, paged caches, num_splits, a CUDA graph), against the
attention math in PyTorch with the bias, under FlashAttention's accuracy rule
(test_gpu_correctness); gradients (both `deterministic` values, every backward module,
varlen, softcap and a window, torch.compile) against autograd through that math.

flash-attn's bias: query row i and key j of query head h in batch entry b get
-slope * |i + seqlen_k - seqlen_q - j| added to the scaled (and capped) score, slope =
alibi_slopes[h] or alibi_slopes[b, h]; seqlen_q and seqlen_k are each sequence's own (a
cache's: cache_seqlens[b] + the appended keys - cache_leftpad[b]).

Slopes are drawn from [0.1, 0.6) (or the ALiBi paper's 2**(-8 (h + 1) / nheads), down to
2**-8) over a few hundred keys, so the bias changes each answer far beyond the rule's bound;
the checks below assert that (assert_alibi_matters and friends), so a kernel that ignored the
slopes, or gave a head another head's slope, would fail here."""

import math

import pytest
import torch

from cudaflash import (flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func,
                       flash_attn_varlen_func, flash_attn_varlen_kvpacked_func,
                       flash_attn_varlen_qkvpacked_func, flash_attn_with_kvcache, forward)
import _internals as internals
from test_gpu_correctness import (COMBOS, DTYPES, KERNELS, _assert_within, _combo_id,
                                  _pick_combo, attention_ref, check_attention,
                                  fp32_reference_without_tf32,  # noqa: F401 (autouse fixture)
                                  make_qkv)
from test_gpu_backward import (BWD_COMBOS, assert_compiled_matches_eager, assert_grads_within,
                               for_each_backward_module, run_with_grad)
from test_gpu_kvcache import cache
from test_gpu_kvcache_paged import from_pages, to_pages
from test_gpu_varlen import offsets, packed
from test_gpu_window import window_ref

pytestmark = pytest.mark.requires_gpu
I32 = torch.int32


# ---- slopes, references and checks -------------------------------------------------------------


def random_slopes(*shape, seed=0):
    """float32 slopes in [0.1, 0.6) on cuda:0, shape (nheads,) or (batch, nheads)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.rand(shape, generator=g, device="cuda") * 0.5 + 0.1


def standard_slopes(nheads):
    """The ALiBi paper's slopes for a power-of-two head count: 2**(-8 (h + 1) / nheads)."""
    return torch.tensor([2.0 ** (-8 * (h + 1) / nheads) for h in range(nheads)],
                        dtype=torch.float32, device="cuda")


def slopes_of(slopes, b):
    """Batch entry b's slopes, for its batch-1 reference: (nheads,) as is, else row b."""
    return slopes if slopes is None or slopes.dim() == 1 else slopes[b:b + 1]


def _scale(q, scale):
    return q.shape[-1] ** -0.5 if scale is None else scale


def assert_alibi_matters(out, q, k, v, causal, scale=None, softcap=0.0, min_change=0.1):
    """out is far from the same attention without the bias (float32 reference): the slopes
    took effect."""
    plain, _ = attention_ref(q, k, v, causal, _scale(q, scale), True, softcap=softcap)
    change = (out.float() - plain).abs().max().item()
    assert change > min_change, (f"out is within {change:.3g} of the attention without ALiBi: "
                                 "the slopes had no visible effect")


def check_each(pieces, causal, slopes, scale=None, softcap=0.0, min_change=0.1):
    """Each sequence as its own batch-1 problem: ``pieces`` holds, per sequence b, (out, lse or
    None, q, k, v) in BSHD with batch 1, checked with batch entry b's slopes; and, over all
    sequences, far from the attention without the bias (unless ``slopes`` is None)."""
    change = 0.0
    for b, (out, lse, q, k, v) in enumerate(pieces):
        try:
            check_attention(out, lse, q, k, v, causal, scale, softcap=softcap,
                            alibi_slopes=slopes_of(slopes, b))
        except AssertionError as e:
            raise AssertionError(f"sequence {b}: {e}") from None
        if slopes is not None:
            plain, _ = attention_ref(q, k, v, causal, _scale(q, scale), True, softcap=softcap)
            change = max(change, (out.float() - plain).abs().max().item())
    if slopes is not None:
        assert change > min_change, (f"out is within {change:.3g} of the attention without "
                                     "ALiBi: the slopes had no visible effect")


def batch_pieces(out, lse, q, k_seqs, v_seqs):
    """check_each's pieces for a padded batch whose entry b sees keys k_seqs[b], v_seqs[b]
    ((n, hk, d) each)."""
    return [(out[b:b + 1], None if lse is None else lse[b:b + 1], q[b:b + 1], k_seqs[b][None],
             v_seqs[b][None]) for b in range(q.shape[0])]


def varlen_pieces(out, lse, q, k, v, cu_q, cu_k):
    """check_each's pieces for a packed batch (lse in flash-attn's (nheads, total_q))."""
    oq, ok = cu_q.tolist(), cu_k.tolist()
    pieces = []
    for b in range(len(oq) - 1):
        rows, keys = slice(oq[b], oq[b + 1]), slice(ok[b], ok[b + 1])
        pieces.append((out[rows][None], None if lse is None else lse[:, rows][None],
                       q[rows][None], k[keys][None], v[keys][None]))
    return pieces


def check_window_alibi(out, lse, q, k, v, window, causal, slopes, scale=None, softcap=0.0):
    """test_gpu_window's check with the bias: window_ref against the rule."""
    ref, ref_lse = window_ref(q, k, v, *window, causal, True, scale=scale, softcap=softcap,
                              alibi_slopes=slopes)
    lowp, lowp_lse = window_ref(q, k, v, *window, causal, False, scale=scale, softcap=softcap,
                                alibi_slopes=slopes)
    assert out.shape == q.shape and torch.isfinite(out).all()
    _assert_within("out", out, ref, lowp)
    no_key = torch.isneginf(ref_lse)
    assert (out.transpose(1, 2)[no_key] == 0).all(), "rows that see no key must be 0"
    if lse is not None:
        assert torch.equal(torch.isneginf(lse), no_key)
        _assert_within("lse", lse[~no_key], ref_lse[~no_key], lowp_lse[~no_key])
    plain, _ = window_ref(q, k, v, *window, causal, True, scale=scale, softcap=softcap)
    change = (out.float() - plain).abs().max().item()
    assert change > 0.1, f"out is within {change:.3g} of the windowed attention without ALiBi"


# ---- every config: cudaflash.forward ----------------------------------------------------------

# (batch, seqlen_q, seqlen_k, nheads, nheads_k, causal, slopes per (batch, head))
CONFIG_SHAPES = [
    (2, 113, 300, 3, 3, False, True),  # tails in both sequences
    (1, 300, 17, 2, 1, True, False),  # rows that see no key (out 0, lse -inf), MQA
    (2, 1, 1000, 8, 2, True, True),  # GQA decoding: query heads must keep their own slopes
    # Blocks wholly left of a row tile's diagonals, wholly right of them and across them:
    # the warp-specialized kernel adds the column part of the first two inside Q K^T.
    (1, 700, 650, 2, 2, False, False),
    (1, 650, 700, 2, 1, True, True),
]


@pytest.mark.parametrize("entry", KERNELS, ids=lambda e: e.name)
def test_config(entry):
    """Each config's ALiBi entries, whole (num_splits=1) and split into up to 3 runs plus the
    combine, on the shapes above; out pre-filled with NaN (every element must be written)."""
    cfg = entry.config
    for b, sq, sk, h, hk, causal, per_batch in CONFIG_SHAPES:
        q, k, v = make_qkv(b, sq, sk, h, hk, cfg.d_head, DTYPES[cfg.dtype], seed=sq + sk)
        slopes = random_slopes(*((b, h) if per_batch else (h,)), seed=sq + sk)
        for splits in (1, 3):
            out = torch.full_like(q, math.nan)
            _, lse = forward(cfg, q, k, v, out=out, causal=causal, num_splits=splits,
                             alibi_slopes=slopes)
            try:
                check_attention(out, lse, q, k, v, causal, alibi_slopes=slopes)
                assert_alibi_matters(out, q, k, v, causal)
            except AssertionError as e:
                raise AssertionError(f"(b={b}, sq={sq}, sk={sk}, h={h}, hk={hk}, causal="
                                     f"{causal}, splits={splits}) {e}") from None


def _check_every_config(dtype, causal, slopes, scale=None):
    """forward on every config built for ``dtype`` (whole and split), on one 400 x 400 head
    pair per config: check_attention and assert_alibi_matters."""
    for entry in KERNELS:
        cfg = entry.config
        if cfg.dtype != dtype:
            continue
        q, k, v = make_qkv(1, 400, 400, 2, 2, cfg.d_head, DTYPES[dtype], seed=5)
        for splits in (1, 3):
            out = torch.full_like(q, math.nan)
            _, lse = forward(cfg, q, k, v, out=out, causal=causal, num_splits=splits,
                             softmax_scale=scale, alibi_slopes=slopes)
            try:
                check_attention(out, lse, q, k, v, causal, scale, alibi_slopes=slopes)
                assert_alibi_matters(out, q, k, v, causal, scale)
            except AssertionError as e:
                raise AssertionError(f"{cfg.name}, splits={splits}: {e}") from None


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_steep_slopes(dtype, causal):
    """Slopes so steep that each row attends to its nearest key or few: the warp-specialized
    kernel's one-sided forms (the bias split into a column and a row part) would round each
    row's exponent offset at the row part's size, far off for such heads, so they take the
    bias per score (OnlineSoftmax::alibi_one_sided_fits). Before that rule the causal calls
    missed the math by an output ulp."""
    _check_every_config(dtype, causal, torch.tensor([5000.0, 30.0], device="cuda"))


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_fp16_coefficients_beyond_its_range(causal):
    """A kernel's ALiBi coefficient is slope / softmax_scale: with a small softmax_scale it
    leaves fp16's range, which ALiBi's column slice of Q K^T (the warp-specialized kernel)
    cannot carry in 16 bits: such heads take the per-score bias (the first head here,
    coefficient 50000), the others the slice (12500)."""
    _check_every_config("fp16", causal, torch.tensor([1.0, 0.25], device="cuda"), scale=2e-5)


@pytest.fixture
def every_call_banded(monkeypatch):
    """Every ALiBi call that can take the band takes it, whatever its size
    (heuristics.alibi_band_pays otherwise leaves it to calls of 4k keys and more)."""
    from cudaflash import heuristics
    monkeypatch.setattr(heuristics, "ALIBI_BAND_MIN_SCORES_PER_ROW", 0)


@pytest.mark.parametrize("entry", KERNELS, ids=lambda e: e.name)
def test_band_reads_no_key_beyond_it(entry, every_call_banded):
    """A detector for ALiBi's band on each config, whole and split: NaN in v's last key
    block, over 1400 keys from the first 512 rows' bands (slopes of at least 0.4 per batch
    entry and head: bands of at most (2 B + 40) / 0.4, about 240 keys at d256). Without the
    band every row reads those values (0 * NaN = NaN in P V); with it the first rows must be
    finite and meet the rule against the math with those values zeroed (their weights are
    under e^-40 of each row's largest)."""
    cfg = entry.config
    b, s, h, hk = 2, 2048, 4, 2
    q, k, v = make_qkv(b, s, s, h, hk, cfg.d_head, DTYPES[cfg.dtype], seed=7)
    slopes = random_slopes(b, h, seed=7) * 4
    poisoned, zeroed = v.clone(), v.clone()
    poisoned[:, -128:] = math.nan
    zeroed[:, -128:] = 0
    rows = slice(0, 512)
    for splits in (1, 3):
        out = torch.full_like(q, math.nan)
        _, lse = forward(cfg, q, k, poisoned, out=out, num_splits=splits, alibi_slopes=slopes)
        try:
            check_attention(out[:, rows], lse[:, :, rows], q[:, rows], k, zeroed, False,
                            seqlen_q=s, alibi_slopes=slopes)
        except AssertionError as e:
            raise AssertionError(f"splits={splits}: {e}") from None


# ---- flash_attn_func -----------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("sq, sk", [(2048, 2048), (2500, 2100), (600, 3000)])
def test_band_skips_only_keys_that_weigh_nothing(causal, sq, sk, monkeypatch,
                                                 every_call_banded):
    """Where heuristics.alibi_band_pays (here: always), flash_attn_func's ALiBi calls skip each
    head's keys beyond its band, (2 B + 40) / slope from a row's diagonal clamped into the
    keys (B bounds the scaled scores: launch.alibi_score_bound; fwd_range.cuh): with the
    paper's slopes for 8 heads (bands of a few hundred keys to beyond the sequence), one
    steep random head set, more queries than keys (rows whose diagonal lies before key 0:
    the clamp keeps their nearest keys) and fewer. out and lse must meet the full math's
    rule as every call does; every call took the band (its bound was computed)."""
    from cudaflash import launch
    bounds = []
    compute = launch.alibi_score_bound
    monkeypatch.setattr(launch, "alibi_score_bound",
                        lambda *a: bounds.append(compute(*a)) or bounds[-1])
    for slopes in (standard_slopes(8), random_slopes(8, seed=3) * 4):
        q, k, v = make_qkv(1, sq, sk, 8, 2, 64, torch.bfloat16, seed=sq + sk)
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes,
                                      return_attn_probs=True)
        check_attention(out, lse, q, k, v, causal, alibi_slopes=slopes)
        assert_alibi_matters(out, q, k, v, causal)
    assert len(bounds) == 2 and all(torch.isfinite(b).item() and b.item() > 0 for b in bounds)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("combo", COMBOS, ids=_combo_id)
def test_flash_attn_func(combo, causal):
    """Both slope shapes; fewer queries than keys (with GQA) and more (rows that see no key
    when causal)."""
    dtype, d = DTYPES[combo[0]], combo[1]
    for b, sq, sk, h, hk in ((2, 257, 300, 8, 2), (1, 300, 100, 4, 4)):
        q, k, v = make_qkv(b, sq, sk, h, hk, d, dtype, seed=sq)
        for slopes in (random_slopes(h, seed=1), random_slopes(b, h, seed=2)):
            out, lse, _ = flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes,
                                          return_attn_probs=True)
            check_attention(out, lse, q, k, v, causal, alibi_slopes=slopes)
            assert_alibi_matters(out, q, k, v, causal)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_with_softcap(causal):
    """cap * tanh(scale * qk / cap) + bias: both take effect (the scores are made large,
    softmax_scale = 4 / sqrt(d), so that the cap changes the answer)."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v = make_qkv(2, 200, 300, 4, 2, d, DTYPES[dtype], seed=5)
    scale, cap = 4.0 / math.sqrt(d), 2.0
    slopes = random_slopes(2, 4, seed=5)
    out, lse, _ = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, softcap=cap,
                                  alibi_slopes=slopes, return_attn_probs=True)
    check_attention(out, lse, q, k, v, causal, scale, softcap=cap, alibi_slopes=slopes)
    assert_alibi_matters(out, q, k, v, causal, scale, softcap=cap)
    uncapped, _ = attention_ref(q, k, v, causal, scale, True, alibi_slopes=slopes)
    change = (out.float() - uncapped).abs().max().item()
    assert change > 0.05, f"out is within {change:.3g} of the uncapped attention with ALiBi"


def test_with_a_window():
    """Windows mask as without ALiBi; the bias is added inside them."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v = make_qkv(2, 257, 300, 4, 2, d, DTYPES[dtype], seed=6)
    slopes = random_slopes(2, 4, seed=6)
    for window, causal in (((64, 0), True), ((32, 48), False), ((-1, 20), False),
                           ((100, -1), True)):
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, window_size=window,
                                      alibi_slopes=slopes, return_attn_probs=True)
        try:
            check_window_alibi(out, lse, q, k, v, window, causal, slopes)
        except AssertionError as e:
            raise AssertionError(f"window {window}, causal={causal}: {e}") from None


def test_packed_forms_pass_the_slopes_on():
    """flash_attn_qkvpacked_func and flash_attn_kvpacked_func give flash_attn_func's answer on
    the views, bitwise, gradients included; the varlen packed forms flash_attn_varlen_func's."""
    dtype, d = _pick_combo(("bf16", 128), *BWD_COMBOS)
    dtype = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(7)
    qkv = torch.randn(2, 300, 3, 4, d, generator=g, device="cuda", dtype=dtype)
    slopes = random_slopes(2, 4, seed=7)
    leaf = qkv.clone().requires_grad_(True)
    out = flash_attn_qkvpacked_func(leaf, causal=True, alibi_slopes=slopes, deterministic=True)
    dout = torch.randn_like(out)
    (dqkv,) = torch.autograd.grad(out, leaf, dout)
    ref_leaf = qkv.clone().requires_grad_(True)
    ref = flash_attn_func(*ref_leaf.unbind(2), causal=True, alibi_slopes=slopes,
                          deterministic=True)
    (ref_dqkv,) = torch.autograd.grad(ref, ref_leaf, dout)
    assert torch.equal(out, ref) and torch.equal(dqkv, ref_dqkv)
    check_attention(out.detach(), None, *qkv.unbind(2), True, alibi_slopes=slopes)

    q = qkv[:, :, 0]
    kv = qkv[:, :, 1:]
    assert torch.equal(flash_attn_kvpacked_func(q, kv, alibi_slopes=slopes),
                       flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], alibi_slopes=slopes))

    lens = [100, 1, 199]
    cu = offsets(lens)
    flat = qkv[:1].reshape(300, 3, 4, d)
    seq_slopes = random_slopes(3, 4, seed=8)
    q, k, v = flat.unbind(1)
    out = flash_attn_varlen_qkvpacked_func(flat, cu, max(lens), causal=True,
                                           alibi_slopes=seq_slopes)
    assert torch.equal(out, flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens),
                                                   causal=True, alibi_slopes=seq_slopes))
    check_each(varlen_pieces(out, None, q, k, v, cu, cu), True, seq_slopes)
    out = flash_attn_varlen_kvpacked_func(q, flat[:, 1:], cu, cu, max(lens), max(lens),
                                          alibi_slopes=seq_slopes)
    assert torch.equal(out, flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens),
                                                   alibi_slopes=seq_slopes))


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_gqa_decoding_gives_each_query_head_its_slope(causal):
    """One query row, 4 query heads per K/V head: without ALiBi cudaflash runs the group's
    heads as rows of one head; with it each head needs its own slope and the one query
    position, so it must not (or must keep both straight)."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v = make_qkv(2, 1, 300, 8, 2, d, DTYPES[dtype], seed=11)
    for slopes in (standard_slopes(8), random_slopes(2, 8, seed=11)):
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes,
                                      return_attn_probs=True)
        check_attention(out, lse, q, k, v, causal, alibi_slopes=slopes)
        assert_alibi_matters(out, q, k, v, causal)
    # The same decoding step against a cache.
    kc, vc = k.clone(), v.clone()
    lens = [300, 123]
    out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor(
        lens, dtype=I32, device="cuda"), causal=causal, alibi_slopes=slopes,
        return_softmax_lse=True)
    check_each(batch_pieces(out, lse, q, [kc[b, :n] for b, n in enumerate(lens)],
                            [vc[b, :n] for b, n in enumerate(lens)]), causal, slopes)


@pytest.mark.parametrize("dims", [(1, 1, 8193, 16, 1), (2, 1, 1000, 8, 2), (1, 4, 5000, 4, 4)],
                         ids=["mqa_long", "gqa", "four_rows"])
def test_decoding_splits(dims):
    """Decoding grids are split by flash_attn_func's own rule (split entries + combine); the
    paper's slopes reach down to 2**-8, so far keys still count."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v = make_qkv(*dims, d, DTYPES[dtype], seed=3)
    slopes = standard_slopes(dims[3])
    for causal in (False, True):
        out, lse, _ = flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes,
                                      return_attn_probs=True)
        check_attention(out, lse, q, k, v, causal, alibi_slopes=slopes)
        assert_alibi_matters(out, q, k, v, causal)


@pytest.mark.parametrize("d", [40, 96])
def test_padded_head_dim(d):
    """Head dims without a kernel run zero-padded (40 -> 64, 96 -> 128); the slopes go
    along, forward and backward."""
    padded = 64 if d <= 64 else 128
    dtype, _ = _pick_combo(("bf16", padded), ("fp16", padded))
    q, k, v = make_qkv(2, 130, 200, 4, 2, d, DTYPES[dtype], seed=9)
    slopes = random_slopes(2, 4, seed=9)
    out, lse, _ = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes,
                                  return_attn_probs=True)
    check_attention(out, lse, q, k, v, True, alibi_slopes=slopes)
    assert_alibi_matters(out, q, k, v, True)
    check_grads(q, k, v, torch.randn_like(q), True, slopes)


# ---- repeat calls: plans must not keep a call's slopes ------------------------------------------


def test_repeat_calls_read_each_calls_slopes():
    """A second call of a signature takes a plan: other slope tensors of the same shape (and
    one with another batch stride), slopes changed in place, and calls without ALiBi in
    between, each against its own reference."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v = make_qkv(2, 200, 300, 4, 2, d, DTYPES[dtype], seed=5)
    a, b = random_slopes(4, seed=1), random_slopes(4, seed=2)
    c = random_slopes(2, 4, seed=3)
    c_strided = random_slopes(2, 8, seed=4)[:, :4]  # unit last stride, batch stride 8
    internals.clear_caches()
    for slopes in (a, a, b, b, None, None, a, c, c_strided, c, None, b):
        out = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes)
        check_attention(out, None, q, k, v, True, alibi_slopes=slopes)
        out, lse, _ = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes,
                                      return_attn_probs=True)
        check_attention(out, lse, q, k, v, True, alibi_slopes=slopes)
    before = flash_attn_func(q, k, v, causal=True, alibi_slopes=a)
    a.mul_(0.25)  # the same tensor, new values
    after = flash_attn_func(q, k, v, causal=True, alibi_slopes=a)
    check_attention(after, None, q, k, v, True, alibi_slopes=a)
    assert (after.float() - before.float()).abs().max().item() > 0.1, \
        "slopes changed in place did not change the answer"


def test_repeat_varlen_calls_read_each_calls_slopes():
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    lens_q, lens_k = [100, 156], [300, 20]
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, 4, 2, d, DTYPES[dtype], seed=6)
    a, b = random_slopes(2, 4, seed=1), random_slopes(2, 4, seed=2)
    internals.clear_caches()
    for slopes in (a, a, b, None, b, a):
        out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 156, 300, causal=True,
                                             alibi_slopes=slopes, return_attn_probs=True)
        check_each(varlen_pieces(out, lse, q, k, v, cu_q, cu_k), True, slopes)
    a.copy_(random_slopes(2, 4, seed=3))
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 156, 300, causal=True, alibi_slopes=a)
    check_each(varlen_pieces(out, None, q, k, v, cu_q, cu_k), True, a)


# ---- flash_attn_varlen_func ----------------------------------------------------------------------

# (query lengths, key lengths, nheads, nheads_k)
VARLEN_SHAPES = [
    ([17, 200, 5, 40], [300, 50, 0, 40], 4, 2),  # cross lengths; no keys; rows that see none
    ([1, 1, 1], [4096, 17, 2049], 8, 2),  # decoding: the grid is small, so it splits
]


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("shape", VARLEN_SHAPES, ids=["prefill", "decode"])
def test_varlen(shape, causal):
    """Each sequence's bias from its own lengths, its slopes from its own row of (batch,
    nheads) slopes (or the shared (nheads,)); the second call of each takes the plan."""
    lens_q, lens_k, h, hk = shape
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, h, hk, d, DTYPES[dtype], seed=2)
    for slopes in (random_slopes(len(lens_q), h, seed=2), standard_slopes(h)):
        for _ in range(2):
            out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                                 causal=causal, alibi_slopes=slopes,
                                                 return_attn_probs=True)
            check_each(varlen_pieces(out, lse, q, k, v, cu_q, cu_k), causal, slopes)


def test_varlen_with_block_table():
    """flash_attn_varlen_func over paged caches: sequence b's bias from cu_seqlens_k's length."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    dtype = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(9)
    lens_q, lens_k = [3, 1, 5, 2], [100, 0, 256, 17]
    kc = torch.randn(4, 256, 2, d, generator=g, device="cuda", dtype=dtype)
    vc = torch.randn(4, 256, 2, d, generator=g, device="cuda", dtype=dtype)
    k_pool, table = to_pages(kc, 16, seed=16)
    v_pool, _ = to_pages(vc, 16, seed=16)
    q = torch.randn(sum(lens_q), 4, d, generator=g, device="cuda", dtype=dtype)
    cu_q, cu_k = offsets(lens_q), offsets(lens_k)
    slopes = random_slopes(4, 4, seed=9)
    for causal in (False, True):
        out, lse, _ = flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, 5, 256,
                                             causal=causal, alibi_slopes=slopes,
                                             return_attn_probs=True, block_table=table)
        oq = cu_q.tolist()
        check_each([(out[oq[b]:oq[b + 1]][None], lse[:, oq[b]:oq[b + 1]][None],
                     q[oq[b]:oq[b + 1]][None], kc[b, :n][None], vc[b, :n][None])
                    for b, n in enumerate(lens_k)], causal, slopes)


def test_varlen_under_torch_compile():
    """A compiled function around flash_attn_varlen_func with slopes (graph breaks allowed):
    the eager answer, bitwise, and the slopes are read per call."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v, cu_q, cu_k = packed([100, 1, 300], [100, 500, 250], 4, 2, d, DTYPES[dtype],
                                 seed=14)

    def attention(q, k, v, cu_q, cu_k, slopes):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, 300, 500, causal=True,
                                      alibi_slopes=slopes, return_attn_probs=True)[:2]

    torch._dynamo.reset()
    compiled = torch.compile(attention)
    for seed in (1, 2):
        slopes = random_slopes(3, 4, seed=seed)
        out, lse = compiled(q, k, v, cu_q, cu_k, slopes)
        eager_out, eager_lse = attention(q, k, v, cu_q, cu_k, slopes)
        assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)
        check_each(varlen_pieces(out, lse, q, k, v, cu_q, cu_k), True, slopes)


# ---- flash_attn_with_kvcache ---------------------------------------------------------------------

# (seqlen_q, seqlen_cache, nheads, nheads_k, cache lengths per sequence)
KVCACHE_SHAPES = [
    (1, 300, 8, 2, [0, 1, 299, 300, 77]),  # GQA decoding: an empty and a full cache
    (7, 257, 3, 3, [7, 100, 257, 3]),  # a chunk of queries; fewer keys than queries (row 3..)
]


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("shape", KVCACHE_SHAPES, ids=lambda s: f"q{s[0]}_c{s[1]}_h{s[2]}_hk{s[3]}")
def test_kvcache_cache_lengths(shape, causal):
    """seqlen_k of sequence b is cache_seqlens[b]: its bias and causal mask from it."""
    sq, sc, h, hk, lens = shape
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, kc, vc, _, _ = cache(len(lens), sq, sc, h, hk, d, DTYPES[dtype], seed=sc)
    seqlens = torch.tensor(lens, dtype=I32, device="cuda")
    for slopes in (random_slopes(len(lens), h, seed=sc), random_slopes(h, seed=sc + 1)):
        out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=causal,
                                           alibi_slopes=slopes, return_softmax_lse=True)
        check_each(batch_pieces(out, lse, q, [kc[b, :n] for b, n in enumerate(lens)],
                                [vc[b, :n] for b, n in enumerate(lens)]), causal, slopes)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_kvcache_append(causal):
    """The appended keys count: seqlen_k = cache_seqlens[b] + seqlen_new, with cache_seqlens a
    tensor and an int (every sequence's same prefix)."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    lens, new, sc = [0, 5, 40, 200, 253], 3, 256
    q, kc, vc, k, v = cache(len(lens), 2, sc, 4, 2, d, DTYPES[dtype], new=new, seed=1)
    slopes = random_slopes(len(lens), 4, seed=1)
    seqlens = torch.tensor(lens, dtype=I32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, causal=causal,
                                       alibi_slopes=slopes, return_softmax_lse=True)
    for b, n in enumerate(lens):
        assert torch.equal(kc[b, n:n + new], k[b]) and torch.equal(vc[b, n:n + new], v[b])
    check_each(batch_pieces(out, lse, q, [kc[b, :n + new] for b, n in enumerate(lens)],
                            [vc[b, :n + new] for b, n in enumerate(lens)]), causal, slopes)
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=150, causal=causal,
                                       alibi_slopes=slopes, return_softmax_lse=True)
    assert torch.equal(kc[:, 150:150 + new], k)
    check_each(batch_pieces(out, lse, q, kc[:, :150 + new], vc[:, :150 + new]), causal, slopes)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_kvcache_leftpad(causal):
    """With cache_leftpad key j counts from the padding's end: seqlen_k = cache_seqlens[b] +
    seqlen_new - cache_leftpad[b] (flash-attn's rule)."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    dtype = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(3)
    lens, pads, new = [40, 200, 7, 130], [5, 0, 7, 100], 3
    q = torch.randn(4, 4, 4, d, generator=g, device="cuda", dtype=dtype)
    kc = torch.randn(4, 256, 2, d, generator=g, device="cuda", dtype=dtype)
    vc = torch.randn(4, 256, 2, d, generator=g, device="cuda", dtype=dtype)
    k = torch.randn(4, new, 2, d, generator=g, device="cuda", dtype=dtype)
    v = torch.randn(4, new, 2, d, generator=g, device="cuda", dtype=dtype)
    slopes = random_slopes(4, 4, seed=3)
    out, lse = flash_attn_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=torch.tensor(lens, dtype=I32, device="cuda"),
        cache_leftpad=torch.tensor(pads, dtype=I32, device="cuda"), causal=causal,
        alibi_slopes=slopes, return_softmax_lse=True)
    check_each(batch_pieces(out, lse, q, [kc[b, p:n + new] for b, (n, p) in
                                          enumerate(zip(lens, pads))],
                            [vc[b, p:n + new] for b, (n, p) in enumerate(zip(lens, pads))]),
               causal, slopes)


def test_kvcache_cache_batch_idx():
    """Slopes follow q's batch entry b, not the cache entry cache_batch_idx[b] it reads."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    dtype = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(2)
    idx, lens, new = [4, 0, 2], [100, 0, 250], 2
    q = torch.randn(3, 1, 4, d, generator=g, device="cuda", dtype=dtype)
    kc = torch.randn(5, 256, 2, d, generator=g, device="cuda", dtype=dtype)
    vc = torch.randn(5, 256, 2, d, generator=g, device="cuda", dtype=dtype)
    k = torch.randn(3, new, 2, d, generator=g, device="cuda", dtype=dtype)
    v = torch.randn(3, new, 2, d, generator=g, device="cuda", dtype=dtype)
    slopes = random_slopes(3, 4, seed=2)
    out, lse = flash_attn_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=torch.tensor(lens, dtype=I32, device="cuda"),
        cache_batch_idx=torch.tensor(idx, dtype=I32, device="cuda"), alibi_slopes=slopes,
        return_softmax_lse=True)
    check_each(batch_pieces(out, lse, q, [kc[e, :n + new] for e, n in zip(idx, lens)],
                            [vc[e, :n + new] for e, n in zip(idx, lens)]), False, slopes)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_kvcache_paged_with_append(causal):
    """Paged caches (pages of 16 positions) with an append: sequence b's seqlen_k from its
    cache_seqlens and the new keys."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    dtype = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(16)
    sc, new = 512, 3
    lens = [0, 37, 256, 509 - new, 100]
    b = len(lens)
    q = torch.randn(b, 2, 8, d, generator=g, device="cuda", dtype=dtype)
    kc = torch.randn(b, sc, 2, d, generator=g, device="cuda", dtype=dtype)
    vc = torch.randn(b, sc, 2, d, generator=g, device="cuda", dtype=dtype)
    k = torch.randn(b, new, 2, d, generator=g, device="cuda", dtype=dtype)
    v = torch.randn(b, new, 2, d, generator=g, device="cuda", dtype=dtype)
    k_pool, table = to_pages(kc, 16, seed=16)
    v_pool, _ = to_pages(vc, 16, seed=16)
    slopes = random_slopes(b, 8, seed=16)
    out, lse = flash_attn_with_kvcache(q, k_pool, v_pool, k, v,
                                       cache_seqlens=torch.tensor(lens, dtype=I32, device="cuda"),
                                       block_table=table, causal=causal, alibi_slopes=slopes,
                                       return_softmax_lse=True)
    k_now, v_now = from_pages(k_pool, table), from_pages(v_pool, table)
    for i, n in enumerate(lens):
        assert torch.equal(k_now[i, n:n + new], k[i])
    check_each(batch_pieces(out, lse, q, [k_now[i, :n + new] for i, n in enumerate(lens)],
                            [v_now[i, :n + new] for i, n in enumerate(lens)]), causal, slopes)


def test_kvcache_num_splits():
    """Split-KV decoding (cudaflash's choice, 1, and several splits), contiguous and paged,
    and a full cache without cache_seqlens: the combine of runs whose keys the bias nearly
    zeroes."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    g = torch.Generator(device="cuda").manual_seed(1)
    dtype = DTYPES[dtype]
    kc = torch.randn(2, 4096, 2, d, generator=g, device="cuda", dtype=dtype)
    vc = torch.randn(2, 4096, 2, d, generator=g, device="cuda", dtype=dtype)
    q = torch.randn(2, 1, 8, d, generator=g, device="cuda", dtype=dtype)
    base = standard_slopes(8)
    slopes = torch.stack([base, 4.0 * base])
    lens = [4096, 1500]
    seqlens = torch.tensor(lens, dtype=I32, device="cuda")
    k_pool, table = to_pages(kc, 64, seed=3)
    v_pool, _ = to_pages(vc, 64, seed=3)
    k_seqs, v_seqs = [kc[0, :4096], kc[1, :1500]], [vc[0, :4096], vc[1, :1500]]
    for splits in (0, 1, 3, 7):
        for paged in (False, True):
            caches = (k_pool, v_pool) if paged else (kc, vc)
            out, lse = flash_attn_with_kvcache(q, *caches, cache_seqlens=seqlens,
                                               block_table=table if paged else None,
                                               num_splits=splits, alibi_slopes=slopes,
                                               return_softmax_lse=True)
            try:
                check_each(batch_pieces(out, lse, q, k_seqs, v_seqs), False, slopes)
            except AssertionError as e:
                raise AssertionError(f"num_splits={splits}, paged={paged}: {e}") from None
    out, lse = flash_attn_with_kvcache(q, kc, vc, alibi_slopes=slopes, causal=True,
                                       return_softmax_lse=True)
    check_each(batch_pieces(out, lse, q, kc, vc), True, slopes)


def test_kvcache_repeat_decoding_steps():
    """Decoding steps (a tensor cache_seqlens, no append) take a plan on their second call:
    each step must read its own slopes (other tensors, in-place changes, none) and lengths."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, kc, vc, _, _ = cache(3, 1, 600, 8, 2, d, DTYPES[dtype], seed=33)
    lens = [600, 37, 300]
    seqlens = torch.tensor(lens, dtype=I32, device="cuda")
    a, b = random_slopes(3, 8, seed=1), random_slopes(3, 8, seed=2)
    internals.clear_caches()

    def step(slopes, lens):
        out, lse = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, causal=True,
                                           alibi_slopes=slopes, return_softmax_lse=True)
        check_each(batch_pieces(out, lse, q, [kc[i, :n] for i, n in enumerate(lens)],
                                [vc[i, :n] for i, n in enumerate(lens)]), True, slopes)

    for slopes in (a, a, b, None, None, b, a):
        step(slopes, lens)
    a.copy_(random_slopes(3, 8, seed=3))
    step(a, lens)
    lens = [1, 599, 128]
    seqlens.copy_(torch.tensor(lens, dtype=I32))
    step(a, lens)
    step(a, lens)


def test_kvcache_decoding_step_in_a_cuda_graph():
    """A server's decoding step with ALiBi captured once: at replay the kernels read the
    lengths and the slopes as they are then."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, kc, vc, _, _ = cache(4, 1, 512, 8, 2, d, DTYPES[dtype], seed=8)
    seqlens = torch.tensor([1, 100, 300, 512], dtype=I32, device="cuda")
    slopes = random_slopes(4, 8, seed=8)
    flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, alibi_slopes=slopes)  # load
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, alibi_slopes=slopes)
    lens = [512, 7, 0, 64]
    seqlens.copy_(torch.tensor(lens, dtype=I32))
    slopes.copy_(random_slopes(4, 8, seed=9))
    graph.replay()
    torch.cuda.synchronize()
    check_each(batch_pieces(out, None, q, [kc[i, :n] for i, n in enumerate(lens)],
                            [vc[i, :n] for i, n in enumerate(lens)]), False, slopes)


def test_band_in_a_cuda_graph(every_call_banded):
    """A banded flash_attn_func call captured once: the bound is torch ops
    on the stream, so each replay takes it from q and k as they are then. q scaled up 8x
    before the replay widens every band (a bound kept from the capture would cut keys that
    now weigh); the replay must meet the math on the new inputs."""
    q, k, v = make_qkv(1, 2048, 2048, 8, 2, 64, torch.bfloat16, seed=11)
    slopes = random_slopes(8, seed=11) * 2
    flash_attn_func(q, k, v, alibi_slopes=slopes)  # load
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse, _ = flash_attn_func(q, k, v, alibi_slopes=slopes, return_attn_probs=True)
    q.mul_(8)
    graph.replay()
    torch.cuda.synchronize()
    check_attention(out, lse, q, k, v, False, alibi_slopes=slopes)
    eager_out, eager_lse, _ = flash_attn_func(q, k, v, alibi_slopes=slopes,
                                              return_attn_probs=True)
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)


# ---- torch.compile ----------------------------------------------------------------------------


def test_torch_compile_fullgraph():
    """flash_attn_func with slopes compiles into one graph; the slopes are a graph input, so
    other slopes through the same graph give their own answer."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v = make_qkv(2, 257, 300, 4, 2, d, DTYPES[dtype], seed=8)

    def attention(q, k, v, slopes):
        out, lse, _ = flash_attn_func(q, k, v, causal=True, alibi_slopes=slopes,
                                      return_attn_probs=True)
        return out, lse

    torch._dynamo.reset()
    compiled = torch.compile(attention, fullgraph=True)
    for seed in (1, 2):
        slopes = random_slopes(2, 4, seed=seed)
        out, lse = compiled(q, k, v, slopes)
        check_attention(out, lse, q, k, v, True, alibi_slopes=slopes)
        eager_out, eager_lse = attention(q, k, v, slopes)
        assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)


# ---- gradients ---------------------------------------------------------------------------------


def reference_grads(q, k, v, dout, causal, scale, upcast, slopes, window=(-1, -1),
                    softcap=0.0):
    """(dq, dk, dv) by autograd through the math with the bias (float32 or q's dtype); no
    gradient for the slopes (flash-attn gives none)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    if window == (-1, -1):
        out, _ = attention_ref(*leaves, causal, scale, upcast, softcap=softcap,
                               alibi_slopes=slopes)
    else:
        out, _ = window_ref(*leaves, *window, causal, upcast, scale=scale, softcap=softcap,
                            alibi_slopes=slopes)
    out.backward(dout.float() if upcast else dout)
    return [t.grad for t in leaves]


def check_grads(q, k, v, dout, causal, slopes, scale=None, window=(-1, -1), softcap=0.0,
                **kwargs):
    """flash_attn_func's out and gradients with the slopes against autograd through the math
    with the bias, and the gradients far from those without it (so a backward that ignored
    the slopes fails)."""
    scale_value = _scale(q, scale)
    out, grads = run_with_grad(q, k, v, dout, causal=causal, softmax_scale=scale,
                               window_size=window, softcap=softcap, alibi_slopes=slopes,
                               **kwargs)
    if window == (-1, -1):
        check_attention(out, None, q, k, v, causal, scale, softcap=softcap, alibi_slopes=slopes)
    else:
        check_window_alibi(out, None, q, k, v, window, causal, slopes, scale, softcap)
    ref = reference_grads(q, k, v, dout, causal, scale_value, True, slopes, window, softcap)
    lowp = reference_grads(q, k, v, dout, causal, scale_value, False, slopes, window, softcap)
    assert_grads_within(grads, ref, lowp, (q, k, v))
    plain = reference_grads(q, k, v, dout, causal, scale_value, True, None, window, softcap)
    change = max((g.float() - p).abs().max().item() for g, p in zip(grads, plain))
    assert change > 0.05, f"the gradients are within {change:.3g} of those without ALiBi"
    return out, grads


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic_asked", "deterministic"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("combo", BWD_COMBOS, ids=_combo_id)
def test_gradients(combo, causal, deterministic):
    """Gradients with either `deterministic` asked (ALiBi always runs the deterministic
    scheme): within the rule, and bitwise reproducible. Shapes: tails with GQA and (batch,
    nheads) slopes; more queries than keys (rows that see no key when causal) with (nheads,)
    slopes."""
    dtype, d = DTYPES[combo[0]], combo[1]
    for dims, per_batch in (((2, 257, 300, 4, 2), True), ((1, 300, 200, 2, 1), False)):
        b, h = dims[0], dims[3]
        q, k, v = make_qkv(*dims, d, dtype, seed=12)
        slopes = random_slopes(*((b, h) if per_batch else (h,)), seed=12)
        dout = torch.randn_like(q)
        try:
            _, grads = check_grads(q, k, v, dout, causal, slopes, deterministic=deterministic)
        except AssertionError as e:
            raise AssertionError(f"{dims}: {e}") from None
        _, again = run_with_grad(q, k, v, dout, causal=causal, alibi_slopes=slopes,
                                 deterministic=deterministic)
        for first, second in zip(grads, again):
            assert torch.equal(first, second), f"{dims}: two backward passes differ"


def test_gradients_with_softcap_and_a_window():
    dtype, d = _pick_combo(("bf16", 128), *BWD_COMBOS)
    q, k, v = make_qkv(1, 300, 300, 4, 2, d, DTYPES[dtype], seed=13)
    dout = torch.randn_like(q)
    slopes = random_slopes(4, seed=13)
    check_grads(q, k, v, dout, True, slopes, scale=4.0 / math.sqrt(d), softcap=2.0)
    check_grads(q, k, v, dout, True, slopes, window=(64, 0))
    check_grads(q, k, v, dout, False, slopes, scale=4.0 / math.sqrt(d), window=(30, 70),
                softcap=2.0)


def test_gradients_under_torch_compile_fullgraph_match_eager():
    dtype, d = _pick_combo(("bf16", 128), *BWD_COMBOS)
    q, k, v = make_qkv(2, 256, 256, 4, 2, d, DTYPES[dtype], seed=14)
    dout = torch.randn_like(q)
    slopes = random_slopes(2, 4, seed=14)
    check_grads(q, k, v, dout, True, slopes, deterministic=True)
    assert_compiled_matches_eager(q, k, v, dout, causal=True, alibi_slopes=slopes,
                                  deterministic=True)


def test_every_backward_module_that_runs_here(monkeypatch):
    """Each shipped backward module this GPU can run (not only the selected one): its ALiBi
    entries, on a shape with tails, GQA and several tiles."""
    def body(entry):
        cfg = entry.config
        q, k, v = make_qkv(2, 200, 300, 4, 2, cfg.d_head, DTYPES[cfg.dtype], seed=14)
        check_grads(q, k, v, torch.randn_like(q), True, random_slopes(2, 4, seed=14))

    for_each_backward_module(monkeypatch, body, plain=False)  # score modifiers


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
def test_varlen_gradients(causal):
    """Each sequence's dq, dk, dv with its own slopes and lengths."""
    lens_q, lens_k = [17, 200, 5, 40], [300, 50, 9, 40]
    dtype, d = _pick_combo(("bf16", 128), *BWD_COMBOS)
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, 4, 2, d, DTYPES[dtype], seed=15)
    dout = torch.randn_like(q)
    slopes = random_slopes(len(lens_q), 4, seed=15)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = flash_attn_varlen_func(*leaves, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                 alibi_slopes=slopes)
    out.backward(dout)
    scale = d ** -0.5
    oq, ok = cu_q.tolist(), cu_k.tolist()
    change = 0.0
    for b in range(len(lens_q)):
        rows, keys = slice(oq[b], oq[b + 1]), slice(ok[b], ok[b + 1])
        one = (q[rows][None], k[keys][None], v[keys][None])
        s = slopes_of(slopes, b)
        ref = reference_grads(*one, dout[rows][None], causal, scale, True, s)
        lowp = reference_grads(*one, dout[rows][None], causal, scale, False, s)
        ours = (leaves[0].grad[rows][None], leaves[1].grad[keys][None],
                leaves[2].grad[keys][None])
        try:
            assert_grads_within(ours, ref, lowp, one)
        except AssertionError as e:
            raise AssertionError(f"sequence {b}: {e}") from None
        plain = reference_grads(*one, dout[rows][None], causal, scale, True, None)
        change = max(change, max((g.float() - p).abs().max().item()
                                 for g, p in zip(ours, plain)))
    assert change > 0.05, f"the gradients are within {change:.3g} of those without ALiBi"


# ---- bad slopes on the GPU (the CPU checks: test_api_*errors.py) ---------------------------------

SLOPES_ON_CPU = r"alibi_slopes is on cpu.*q's device"


def test_slopes_on_another_device_are_refused_after_a_plan():
    """Slopes left on the CPU (the usual mistake) are refused by each function, also on a
    repeat signature (a plan must still check them) and with gradients; a refused append
    leaves the cache untouched."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    q, k, v = make_qkv(2, 64, 64, 4, 2, d, DTYPES[dtype], seed=1)
    good = random_slopes(2, 4, seed=1)
    flash_attn_func(q, k, v, alibi_slopes=good)
    flash_attn_func(q, k, v, alibi_slopes=good)
    with pytest.raises(ValueError, match=SLOPES_ON_CPU):
        flash_attn_func(q, k, v, alibi_slopes=good.cpu())
    with pytest.raises(ValueError, match="alibi_slopes has dtype torch.float16; it must be "
                                         "torch.float32"):
        flash_attn_func(q, k, v, alibi_slopes=good.half())
    with pytest.raises(ValueError, match=r"alibi_slopes has shape \(3, 4\); it must be "
                                         r"\(nheads,\) = \(4,\) or \(batch, nheads\) = \(2, 4\)"):
        flash_attn_func(q, k, v, alibi_slopes=random_slopes(3, 4))
    with pytest.raises(ValueError, match="alibi_slopes.*unit last stride"):
        flash_attn_func(q, k, v, alibi_slopes=random_slopes(2, 8)[:, ::2])
    with pytest.raises(ValueError, match=SLOPES_ON_CPU):
        flash_attn_func(q.clone().requires_grad_(), k, v, alibi_slopes=good.cpu())

    lens = [64, 64]
    qv, kv, vv, cu_q, cu_k = packed(lens, lens, 4, 2, d, DTYPES[dtype], seed=2)
    flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 64, 64, alibi_slopes=good)
    flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 64, 64, alibi_slopes=good)
    with pytest.raises(ValueError, match=SLOPES_ON_CPU):
        flash_attn_varlen_func(qv, kv, vv, cu_q, cu_k, 64, 64, alibi_slopes=good.cpu())

    q1, kc, vc, k1, v1 = cache(2, 1, 64, 4, 2, d, DTYPES[dtype], new=1, seed=3)
    seqlens = torch.tensor([10, 20], dtype=I32, device="cuda")
    flash_attn_with_kvcache(q1, kc, vc, cache_seqlens=seqlens, alibi_slopes=good)
    flash_attn_with_kvcache(q1, kc, vc, cache_seqlens=seqlens, alibi_slopes=good)
    with pytest.raises(ValueError, match=SLOPES_ON_CPU):
        flash_attn_with_kvcache(q1, kc, vc, cache_seqlens=seqlens, alibi_slopes=good.cpu())
    kc0, vc0 = kc.clone(), vc.clone()
    with pytest.raises(ValueError, match=SLOPES_ON_CPU):
        flash_attn_with_kvcache(q1, kc, vc, k1, v1, cache_seqlens=seqlens,
                                alibi_slopes=good.cpu())
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0), "a refused call wrote the cache"
