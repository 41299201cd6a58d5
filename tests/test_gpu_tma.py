"""The forward's TMA loads (Params.tma_loads, cudaflash/_tma.py) on a GPU: the
warp-specialized kernel's producer and the wgmma (v6) kernel's thread 0.

A call big enough for tensor maps (_tma.worth_maps) has its producer load Q, K and V through
them; a smaller one, or any call with cache addressing, key counts or a packed batch, keeps
cp.async. Both producers fill the same shared-memory tiles (zeros past a sequence's end), so
the two paths must give bit-identical outputs and log-sum-exps: each case below runs once with
maps (MIN_SCORES and MIN_KEYS lowered to 0) and once without (MIN_SCORES out of reach),
checks that the maps were written (or not), compares the two bit for bit, and checks the TMA
result against the attention math (FlashAttention's accuracy rule, test_gpu_correctness).

The cases aim at what a map describes: tails of query and key blocks (TMA's out-of-bounds
zero fill), GQA (the K/V map's head), strided views of a packed qkv tensor (the maps'
strides), batch entries, causal masks, windows, softcap, ALiBi, dropout (the same mask
either way), new tensors on a repeat call (the launcher's cache of maps) and a grid of one
query row.
"""

import pytest
import torch

import _internals as internals
from cudaflash import _driver, _plans, _tma, flash_attn_func, forward, list_kernels
from test_gpu_correctness import (check_attention,
                                  fp32_reference_without_tf32,  # noqa: F401 (autouse fixture)
                                  make_qkv)
from test_gpu_window import check_window

pytestmark = pytest.mark.requires_gpu

WS = "fwd_{}_d128_br128_bc128_w8_async1_eager1_swz1_q0k0v0_dbuf0_osm1_ctas1_wgmma1_ws"
# The wgmma (v6) kernel's TMA path, one config per head dim it serves (d, name).
V6 = [(64, "fwd_{}_d64_br64_bc128_w4_async1_eager1_swz1_q0k0v0_dbuf0_osm1_ctas3_wgmma1"),
      (64, "fwd_{}_d64_br64_bc64_w4_async1_eager1_swz1_q0k0v0_dbuf0_osm1_ctas1_wgmma1"),
      (128, "fwd_{}_d128_br64_bc64_w4_async1_eager1_swz1_q0k0v0_dbuf0_osm1_ctas3_wgmma1"),
      (128, "fwd_{}_d128_br64_bc128_w4_async1_eager1_swz1_q0k0v0_dbuf0_osm1_ctas1_wgmma1"),
      (256, "fwd_{}_d256_br64_bc64_w4_async1_eager1_swz1_q0k0v0_dbuf0_osm1_ctas1_wgmma1")]
WS256 = "fwd_{}_d256_br128_bc64_w8_async1_eager1_swz1_q0k0v0_dbuf0_osm1_ctas1_wgmma1_ws"
WSP = WS + "_pers"  # persistent CTAs where maps are given
# d64 with three consumer warpgroups (B_r = 192: round-robin turns)
WS64 = "fwd_{}_d64_br192_bc128_w12_async1_eager1_swz1_q0k0v0_dbuf0_osm1_ctas1_wgmma1_ws"
V6C1_64 = "fwd_{}_d64_br64_bc128_w4_async1_eager1_swz1_q0k0v0_dbuf0_osm1_ctas1_wgmma1"
# d64 persistent, two consumer warpgroups (S <= 512 non-causal; no non-persistent twin)
WSP64 = "fwd_{}_d64_br128_bc128_w8_async1_eager1_swz1_q0k0v0_dbuf0_osm1_ctas1_wgmma1_ws_pers"
CONFIGS = [(128, WS), (128, WSP), (256, WS256), (64, WS64), (64, WSP64)] + V6
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(autouse=True)
def hopper_with_ws_kernel():
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("tensor-map loads: the sm_90a kernels only")
    names = {k.name for k in list_kernels(0)}
    missing = {c.format(t) for _, c in CONFIGS for t in DTYPES} - names
    if missing:
        pytest.fail(f"configs not built: {sorted(missing)}")


class MapWrites:
    """Counts TensorMaps.write calls (a launch that loads through maps)."""

    def __init__(self, monkeypatch):
        self.count = 0
        write = _tma.TensorMaps.write

        def counting(maps, *args):
            self.count += 1
            return write(maps, *args)

        monkeypatch.setattr(_tma.TensorMaps, "write", counting)


def both_paths(monkeypatch, call):
    """call() with tensor maps, then without (plans cleared in between: a plan keeps its
    launcher's choice); returns both results and asserts which path each took."""
    writes = MapWrites(monkeypatch)
    results = []
    monkeypatch.setattr(_tma, "MIN_KEYS", 0)
    for min_scores in (0, 1 << 62):
        _plans.plans.clear()
        monkeypatch.setattr(_tma, "MIN_SCORES", min_scores)
        before = writes.count
        results.append(call())
        torch.cuda.synchronize()
        took_maps = writes.count > before
        assert took_maps == (min_scores == 0), f"MIN_SCORES={min_scores}: maps {took_maps}"
    _plans.plans.clear()
    return results


def assert_identical(with_maps, without_maps):
    for a, b in zip(with_maps, without_maps):
        if a is None:
            assert b is None
            continue
        assert torch.equal(a, b), f"TMA and cp.async differ: max |diff| {(a - b).abs().max()}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_d256_ws_matches_cp_async(monkeypatch, dtype, causal):
    """The d256 warp-specialized config (two-stage ring, four slabs per box)."""
    q, k, v = make_qkv(2, 700, 900, 4, 2, 256, DTYPES[dtype], seed=4)
    (out, lse), (out_ref, lse_ref) = both_paths(
        monkeypatch, lambda: forward(WS256.format(dtype), q, k, v, causal=causal,
                                     num_splits=1))
    assert_identical((out, lse), (out_ref, lse_ref))
    check_attention(out, lse, q, k, v, causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,name", CONFIGS, ids=lambda x: x if isinstance(x, int) else
                         x.split("_", 2)[2][:40])
@pytest.mark.parametrize("b,sq,sk,h,hk,causal", [
    (2, 1000, 1000, 4, 4, False),  # tails of query and key blocks
    (2, 300, 700, 4, 4, True),  # bottom-right causal, unequal lengths
    (1, 512, 2048, 8, 2, False),  # GQA
    (3, 129, 129, 2, 1, True),  # MQA, one row past a block
    (1, 1, 5000, 4, 4, False),  # one query row: a Q box mostly zero fill
])
def test_forward_matches_cp_async(monkeypatch, dtype, d, name, b, sq, sk, h, hk, causal):
    q, k, v = make_qkv(b, sq, sk, h, hk, d, DTYPES[dtype], seed=sq + sk)
    config = name.format(dtype)
    (out, lse), (out_ref, lse_ref) = both_paths(
        monkeypatch, lambda: forward(config, q, k, v, causal=causal, num_splits=1))
    assert_identical((out, lse), (out_ref, lse_ref))
    check_attention(out, lse, q, k, v, causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,name", [(64, WS64), (128, WS)], ids=["ws_d64", "ws_d128"])
@pytest.mark.parametrize("sq,sk,causal,window", [
    # 192-row causal tiles over 128-key blocks: a tile's first two warpgroups skip its
    # diagonal block (even tiles) or the first one does (odd); the last tile (1000 = 5 * 192
    # + 40) gives the second and third warpgroups no rows (d128: 1000 = 7 * 128 + 104)
    (1000, 1000, True, (-1, -1)),
    (700, 1500, True, (-1, -1)),  # bottom-right causal, more keys than queries
    # a left bound: the blocks a warpgroup's rows do not see after its last are computed
    # and masked (only right bounds skip)
    (1000, 1000, False, (150, 0)),
    (1000, 1000, False, (100, 300)),  # both bounds
    (900, 600, True, (-1, -1)),  # more queries than keys: warpgroups whose rows see no key
], ids=["causal", "causal_more_keys", "window_left", "window_both", "rows_without_keys"])
def test_warpgroup_block_ranges(monkeypatch, dtype, d, name, sq, sk, causal, window):
    """With three consumer warpgroups each computes only the key blocks its own 64 rows
    see, passing the tile's other steps (their turns and ring stages) on; the two-warpgroup
    d128 kernel computes every block of the tile for both (the same cases as a control).
    Each matches the attention math, its TMA and cp.async paths bit-identical."""
    q, k, v = make_qkv(2, sq, sk, 4, 2, d, DTYPES[dtype], seed=sq + sk)
    (out, lse), (out_ref, lse_ref) = both_paths(
        monkeypatch, lambda: forward(name.format(dtype), q, k, v, causal=causal,
                                     window_size=window, num_splits=1))
    assert_identical((out, lse), (out_ref, lse_ref))
    check_window(out, lse, q, k, v, *window, causal)
    # split-KV (the split entry skips too; each split's tile range cut from the warpgroups')
    out, lse = forward(name.format(dtype), q, k, v, causal=causal, window_size=window,
                       num_splits=3)
    check_window(out, lse, q, k, v, *window, causal)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d,name", [(128, WSP), (64, WSP64)], ids=["d128", "d64"])
@pytest.mark.parametrize("b,sq,sk,h,hk,causal", [
    (4, 2048, 1024, 8, 4, True),  # 512 tiles: several per CTA, causal (heaviest first)
    # causal, K/V of 4 MB a head at d128: L2 groups of 4 heads and a last one of 2
    # (kL2GroupBytes; at d64, 2 MB a head, one group of all 6)
    (1, 4096, 8192, 6, 2, True),
    (3, 1000, 1500, 16, 2, False),  # 384 tiles with query tails, GQA, batch entries
])
def test_persistent_ctas_walk_several_tiles(monkeypatch, dtype, d, name, b, sq, sk, h, hk,
                                            causal):
    """The persistent configs with maps: one CTA per SM, each walking several tiles (its Q
    buffers alternating, the K/V ring running on across tiles; causal calls drawing them
    from a tile counter), bit-identical to the one-tile-per-CTA cp.async path of the same
    kernel, and within the rule."""
    q, k, v = make_qkv(b, sq, sk, h, hk, d, DTYPES[dtype], seed=sq)
    config = name.format(dtype)
    grids = []
    launcher = _driver.Launcher

    def recording(function, label, *, grid, **kwargs):
        grids.append(grid)
        return launcher(function, label, grid=grid, **kwargs)

    counters = []  # the tile counter each persistent launch packs (0: none)
    with_workspace = launcher.launch_with_workspace

    def counting(self, *args):
        counters.append(args[-1])
        return with_workspace(self, *args)

    monkeypatch.setattr(_driver, "Launcher", recording)
    monkeypatch.setattr(launcher, "launch_with_workspace", counting)
    (out, lse), (out_ref, lse_ref) = both_paths(
        monkeypatch, lambda: forward(config, q, k, v, causal=causal, num_splits=1))
    tiles = -(-sq // 128) * h * b
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    assert tiles > sms and grids[0] == (sms, 1, 1), grids  # with maps: one CTA per SM
    assert grids[-1] == (-(-sq // 128), h, b), grids  # without: the tile grid
    assert len(counters) == 1 and bool(counters[0]) == causal, counters  # with maps only
    assert_identical((out, lse), (out_ref, lse_ref))
    check_attention(out, lse, q, k, v, causal)
    monkeypatch.setattr(_tma, "MIN_SCORES", 0)  # repeats: a race would show as a difference
    for _ in range(5):
        _plans.plans.clear()
        again = forward(config, q, k, v, causal=causal, num_splits=1)
        assert_identical(again, (out, lse))


def test_persistent_causal_call_in_a_cuda_graph(monkeypatch):
    """A captured persistent causal call zeroes its tile counter on every replay (a counter
    left at the previous replay's count would skip tiles): replays match the eager call."""
    monkeypatch.setattr(_tma, "MIN_KEYS", 0)
    monkeypatch.setattr(_tma, "MIN_SCORES", 0)
    q, k, v = make_qkv(4, 1024, 1024, 8, 8, 128, torch.bfloat16, seed=5)
    config = WSP.format("bf16")
    _plans.plans.clear()
    expected = forward(config, q, k, v, causal=True, num_splits=1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the warm-up call PyTorch's graph docs ask for
        forward(config, q, k, v, causal=True, num_splits=1)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward(config, q, k, v, causal=True, num_splits=1)
    for _ in range(3):
        for t in captured:
            t.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert_identical(captured, expected)
    _plans.plans.clear()


@pytest.mark.parametrize("d,name", [(128, WS), V6[0], V6[2]], ids=["ws", "v6_d64", "v6_d128"])
def test_the_kernel_reads_the_maps(monkeypatch, d, name):
    """A negative control for the bit-for-bit comparisons: with K's and V's maps swapped
    (the launcher writes the maps of (q, v, k)), the TMA kernel must compute attention with
    the keys and values swapped, i.e. exactly the cp.async result of forward(q, v, k), and
    not the result of forward(q, k, v): so the kernel loads through the maps it is given."""
    q, k, v = make_qkv(2, 640, 640, 4, 4, d, torch.bfloat16, seed=21)
    config = name.format("bf16")
    monkeypatch.setattr(_tma, "MIN_KEYS", 0)
    monkeypatch.setattr(_tma, "MIN_SCORES", 1 << 62)
    _plans.plans.clear()
    swapped_ref = forward(config, q, v, k, num_splits=1)
    plain_ref = forward(config, q, k, v, num_splits=1)
    write = _tma.TensorMaps.write
    monkeypatch.setattr(_tma.TensorMaps, "write",
                        lambda maps, address, q_, k_, v_: write(maps, address, q_, v_, k_))
    monkeypatch.setattr(_tma, "MIN_SCORES", 0)
    out = forward(config, q, k, v, num_splits=1)
    torch.cuda.synchronize()
    assert_identical(out, swapped_ref)
    assert not torch.equal(out[0], plain_ref[0])
    _plans.plans.clear()


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_views_of_packed_qkv(monkeypatch, dtype):
    """q, k, v as views of one (batch, seqlen, 3, nheads, d) tensor: sequence stride 3 x
    nheads x d, batch stride 3 x seqlen x nheads x d; the maps take them as given."""
    g = torch.Generator(device="cuda").manual_seed(7)
    qkv = torch.randn(2, 777, 3, 4, 128, generator=g, device="cuda", dtype=DTYPES[dtype])
    q, k, v = qkv.unbind(2)
    (out, lse), (out_ref, lse_ref) = both_paths(
        monkeypatch, lambda: forward(WS.format(dtype), q, k, v, causal=True, num_splits=1))
    assert_identical((out, lse), (out_ref, lse_ref))
    check_attention(out, lse, q, k, v, True)


@pytest.mark.parametrize("d,name", [(128, WS), (128, WSP), (64, WSP64), V6[0], V6[4]],
                         ids=["ws_d128", "ws_d128_persistent", "ws_d64_persistent", "v6_d64",
                              "v6_d256"])
def test_score_modifiers(monkeypatch, d, name):
    """A window, softcap and ALiBi change only the consumers: same result either way (the
    *_softcap and *_alibi entries load through the maps too)."""
    q, k, v = make_qkv(2, 640, 900, 4, 2, d, torch.bfloat16, seed=3)
    slopes = torch.rand(4, device="cuda") * 0.5 + 0.1
    for kwargs in ({"window_size": (100, 50)}, {"softcap": 30.0},
                   {"alibi_slopes": slopes, "causal": True}):
        results = both_paths(monkeypatch, lambda: forward(name.format("bf16"), q, k, v,
                                                          num_splits=1, **kwargs))
        assert_identical(*results)


@pytest.mark.parametrize("d,causal", [(128, False), (64, False), (128, True)],
                         ids=["ws_d128", "v6_d64", "v6_d128_causal"])
def test_dropout_same_mask(monkeypatch, d, causal):
    """flash_attn_func with dropout: the same seed gives the same output with and without
    maps (the cudaflash_fwd_dropout entry also takes them; the shipped rules run these
    three on the ws kernel and on v6)."""
    q, k, v = make_qkv(2, 1024, 1024, 8, 8, d, torch.bfloat16, seed=5)

    def call():
        torch.manual_seed(11)
        return flash_attn_func(q, k, v, dropout_p=0.2, causal=causal), None

    assert_identical(*both_paths(monkeypatch, call))


def test_repeat_calls_with_new_tensors(monkeypatch):
    """flash_attn_func's plan keeps its launcher and the maps it encoded: new tensors of the
    same signature get their own maps, and the first tensors again take the cached ones."""
    monkeypatch.setattr(_tma, "MIN_SCORES", 0)
    monkeypatch.setattr(_tma, "MIN_KEYS", 0)
    writes = MapWrites(monkeypatch)
    _plans.plans.clear()
    first = make_qkv(2, 1024, 1024, 4, 4, 128, torch.bfloat16, seed=1)
    second = make_qkv(2, 1024, 1024, 4, 4, 128, torch.bfloat16, seed=2)
    outs = [flash_attn_func(*t, causal=False) for t in (first, second, first, second)]
    assert writes.count == 4
    for out, t in zip(outs, (first, second, first, second)):
        check_attention(out, None, *t, False)
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])
    _plans.plans.clear()


def test_autograd_forward_takes_the_layouts_maps(monkeypatch):
    """A forward that records for autograd loads through the layout's shared maps, encoding
    them only on the layout's first call (later calls replay the signature's plan, which
    writes the maps of each call's pointers), and its output and gradients are bit for bit
    those of the cp.async path (a new plan: MIN_SCORES now refuses maps)."""
    monkeypatch.setattr(_tma, "MIN_KEYS", 0)
    monkeypatch.setattr(_tma, "_layouts", {})
    writes = MapWrites(monkeypatch)
    encodes = []
    new_maps = _tma._new_maps
    monkeypatch.setattr(_tma, "_new_maps", lambda *a: encodes.append(1) or new_maps(*a))
    q, k, v = (t.requires_grad_() for t in make_qkv(2, 512, 512, 4, 4, 128, torch.bfloat16,
                                                     seed=9))
    dout = torch.randn(q.shape, dtype=q.dtype, device=q.device)
    results = []
    for min_scores in (0, 1 << 62):
        monkeypatch.setattr(_tma, "MIN_SCORES", min_scores)
        _plans.plans.clear()  # (a plan keeps the launch its first call chose)
        before = writes.count
        # deterministic=True: the default scheme adds dQ with float atomics, whose order (and
        # so dQ's last bits) varies from run to run with or without maps.
        outs = [flash_attn_func(q, k, v, deterministic=True)  # (the ws kernel's rule)
                for _ in range(3)]
        assert writes.count - before == (3 if min_scores == 0 else 0)
        results.append((outs[0], *torch.autograd.grad(outs[0], (q, k, v), dout)))
    assert len(encodes) == 1  # one layout, one first call
    assert_identical(*results)
    check_attention(results[0][0].detach(), None, q.detach(), k.detach(), v.detach(), False)


def test_cuda_graph_replays_the_captured_maps(monkeypatch):
    """A captured flash_attn_func keeps the maps of its static tensors: replays with new data
    in those tensors give the new answers."""
    monkeypatch.setattr(_tma, "MIN_SCORES", 0)
    monkeypatch.setattr(_tma, "MIN_KEYS", 0)
    writes = MapWrites(monkeypatch)
    _plans.plans.clear()
    static = make_qkv(2, 700, 700, 4, 2, 128, torch.bfloat16, seed=0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        flash_attn_func(*static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = flash_attn_func(*static)
    assert writes.count == 2  # the warm-up launch and the captured one
    for seed in (1, 2):
        for dst, src in zip(static, make_qkv(2, 700, 700, 4, 2, 128, torch.bfloat16,
                                             seed=seed)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        check_attention(static_out, None, *static, False)
    _plans.plans.clear()


def test_calls_without_maps_run_the_non_persistent_twin():
    """The rules pick the persistent config for d128 causal calls up to 2k keys; a call that
    gets no tensor maps (packed, cache addressing, too small: launch.run's `maps`) runs its
    three-stage twin instead, which walks no tiles either way."""
    from cudaflash import dispatch
    ctx = _driver.current_context(0)
    for maps, suffix in ((True, "_ws_pers)"), (False, "_ws)")):
        kernel = dispatch.auto_kernel(ctx, 0, torch.bfloat16, 128, True, 1024, 1024, maps=maps)
        assert kernel.label.endswith(suffix), kernel.label
        assert kernel.persistent == maps


def test_d64_short_calls_without_maps_pass_over_the_persistent_config():
    """The rules give d64 non-causal calls up to 512 keys with tensor maps to the persistent
    two-consumer config, whose non-persistent twin is not built: a call without maps takes
    the next rule's 64-row config, not the persistent kernel's one-tile-per-CTA form."""
    from cudaflash import dispatch
    ctx = _driver.current_context(0)
    for dtype in DTYPES.values():
        for maps, rows, persistent in ((True, 128, True), (False, 64, False)):
            kernel = dispatch.auto_kernel(ctx, 0, dtype, 64, False, 512, 512, maps=maps)
            assert (kernel.block_rows, kernel.persistent) == (rows, persistent), kernel.label


def assert_dropout_paths_follow_the_mask(monkeypatch, q, k, v, p, manual_seed, paths,
                                         causal=False):
    """flash_attn_func with dropout, with tensor maps and without (both_paths; ``paths`` names
    the two kernels for the messages): each output matches the math with the keep mask
    rebuilt on the host, within the accuracy rule."""
    from _dropout_reference import keep_mask
    from test_gpu_dropout import dropout_reference, seed_after
    seed = seed_after(manual_seed, q.device)

    def call():
        torch.manual_seed(manual_seed)
        return flash_attn_func(q, k, v, dropout_p=p, causal=causal), None

    results = [out for out, _ in both_paths(monkeypatch, call)]
    b, sq, h, _ = q.shape
    mask = torch.from_numpy(keep_mask(seed, p, b, h, sq, k.shape[1]))
    ref = dropout_reference(q, k, v, mask, p, causal)
    low = dropout_reference(q, k, v, mask, p, causal, upcast=False)
    base = (low - ref).abs().max().item()
    for out, path in zip(results, paths):
        err = (out.float() - ref).abs().max().item()
        assert err <= 2 * base + 1e-3, f"{path}: error {err} (low-precision math: {base})"


@pytest.mark.parametrize("dtype", DTYPES)
def test_dropout_on_the_d64_persistent_config(monkeypatch, dtype):
    """Dropout at d64 S = 512 non-causal: with maps the persistent config's dropout entry
    walks the tiles (256 of them: about two per CTA), without them a 64-row config runs;
    both match the math with the keep mask rebuilt on the host."""
    assert internals.selected_config(0, dtype, 64, False, 512, 512)[0] == WSP64.format(dtype)
    b, h = 4, 16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert 512 // 128 * h * b > sms  # several tiles for some CTA
    q, k, v = make_qkv(b, 512, 512, h, 8, 64, DTYPES[dtype], seed=23)
    assert_dropout_paths_follow_the_mask(monkeypatch, q, k, v, 0.17, 29,
                                         ("persistent (maps)", "64-row (no maps)"))


def test_calls_without_maps_pass_over_the_three_group_config():
    """The rules give d64 prefill (here 2k non-causal) to the three-warpgroup config; a call
    without tensor maps (packed, cache addressing: its *_kvcache entries trap) takes the
    next rule's 64-row config."""
    from cudaflash import dispatch
    ctx = _driver.current_context(0)
    for dtype in DTYPES.values():
        for maps, rows in ((True, 192), (False, 64)):
            kernel = dispatch.auto_kernel(ctx, 0, dtype, 64, False, 2048, 2048, maps=maps)
            assert kernel.block_rows == rows, (maps, kernel.label)


def test_kvcache_prefill_where_the_rules_pick_the_three_group_config():
    """flash_attn_with_kvcache at a size whose padded call runs the three-warpgroup config
    (2k non-causal; its kvcache entries trap): with key counts (no maps) or a paged cache
    (cache addressing) the call runs another config and gives the padded call's attention."""
    from cudaflash import flash_attn_with_kvcache
    assert internals.selected_config(0, "bf16", 64, False, 2048, 2048)[0] == WS64.format("bf16")
    q, k, v = make_qkv(1, 2048, 2048, 8, 8, 64, torch.bfloat16, seed=9)
    lengths = torch.full((1,), 2048, dtype=torch.int32, device=q.device)
    out = flash_attn_with_kvcache(q, k, v, cache_seqlens=lengths)
    check_attention(out, None, q, k, v, False)
    page = 256
    k_pages = k.reshape(8, page, 8, 64)
    v_pages = v.reshape(8, page, 8, 64)
    table = torch.arange(8, dtype=torch.int32, device=q.device)[None]
    paged = flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lengths, block_table=table)
    check_attention(paged, None, q, k, v, False)


def test_info_shows_where_dropout_calls_take_another_config(capsys):
    """`python -m cudaflash info` lists each (dtype, d_head, causal)'s config for dropout calls
    too: at d64 2k the rules give plain calls the three-warpgroup config and dropout calls the
    64-row one; at d128 both take the same."""
    from cudaflash.__main__ import main
    assert main(["info", "--seqlen", "2048"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["dtype", "d_head", "causal", "config", "kind", "chosen", "by", "with",
            "dropout"] in rows
    by_problem = {tuple(row[:3]): row for row in rows if len(row) >= 5}
    for dtype in DTYPES:
        d64 = by_problem[(dtype, "64", "False")]
        assert d64[3] == WS64.format(dtype) and d64[-1] == V6C1_64.format(dtype), d64
        assert by_problem[(dtype, "128", "False")][-1] == "same"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal,seqlen,heads_k,p,seeds", [
    (False, 2048, 2, 0.25, (13, 17)),
    # beyond 2560 keys causal calls take it too, its warpgroups skipping the blocks their rows
    # cannot see (2600 = 13 * 192 + 104: a tail tile where the third has no rows)
    (True, 2600, 1, 0.2, (31, 37)),
], ids=["2k", "causal_2600"])
def test_dropout_on_the_three_group_config(monkeypatch, tmp_path, dtype, causal, seqlen,
                                           heads_k, p, seeds):
    """Dropout at d64 where a plain call takes the three-warpgroup config: the shipped rules
    give it the 64-row config (its dropout forward is faster), and a user's rule can give it
    the three-warpgroup config, whose dropout entry then runs; every path (with maps and
    without) matches the math with the keep mask rebuilt on the host."""
    from cudaflash import dispatch
    ctx = _driver.current_context(0)

    def dropout_kernel_rows():  # the kernel a dropout call with maps loads (B_r)
        return dispatch.auto_kernel(ctx, 0, DTYPES[dtype], 64, causal, seqlen, seqlen,
                                    maps=True, dropout=True).block_rows

    assert internals.selected_config(0, dtype, 64, causal, seqlen, seqlen)[0] == \
        WS64.format(dtype)
    assert internals.selected_config(0, dtype, 64, causal, seqlen, seqlen, dropout=True)[0] == \
        V6C1_64.format(dtype)
    assert dropout_kernel_rows() == 64
    q, k, v = make_qkv(1, seqlen, seqlen, 2, heads_k, 64, DTYPES[dtype], seed=seeds[0])
    assert_dropout_paths_follow_the_mask(monkeypatch, q, k, v, p, seeds[1],
                                         ("64-row (maps)", "64-row (no maps)"), causal=causal)
    rules = tmp_path / "rules.yaml"
    rules.write_text("selection:\n  - {d_head: 64, dropout: true, config: "
                     f'"{WS64.format(dtype)}"}}\n')
    monkeypatch.setenv("CUDAFLASH_CONFIG", str(rules))
    internals.clear_caches()
    try:
        assert internals.selected_config(0, dtype, 64, causal, seqlen, seqlen,
                                         dropout=True)[0] == WS64.format(dtype)
        assert dropout_kernel_rows() == 192
        assert_dropout_paths_follow_the_mask(monkeypatch, q, k, v, p, seeds[1],
                                             ("three warpgroups (maps, the user's rule)",
                                              "64-row (no maps)"), causal=causal)
    finally:
        monkeypatch.delenv("CUDAFLASH_CONFIG")
        internals.clear_caches()
