"""flash_attn_with_kvcache's cache addressing and rotary embedding on a GPU: paged K/V
(block_table), cache_batch_idx, cache_leftpad, rotary_cos/rotary_sin, and a decoding loop with
all of them captured in one CUDA graph. Each output against the attention math in PyTorch
(test_gpu_correctness's checker) on the keys the arguments select; each append checked
position by position."""

import pytest
import torch

from cudaflash import flash_attn_varlen_func, flash_attn_with_kvcache

import _internals as internals

from test_gpu_correctness import (COMBOS, DTYPES, _combo_id, _pick_combo, check_attention,
                                  fp32_reference_without_tf32)  # noqa: F401 (autouse fixture)

pytestmark = pytest.mark.requires_gpu
I32 = torch.int32


def randn(g, dtype, *shape):
    return torch.randn(shape, generator=g, device="cuda", dtype=dtype)


def to_pages(kc, page, extra_pages=3, seed=0):
    """kc (b, sc, hk, d) laid out in pages of `page` positions, shuffled in a pool with
    `extra_pages` pages no sequence uses: (pool (n_pages, page, hk, d), block_table)."""
    b, sc = kc.shape[:2]
    per_seq = sc // page
    n_pages = b * per_seq + extra_pages
    g = torch.Generator(device="cpu").manual_seed(seed)
    order = torch.randperm(n_pages, generator=g)[:b * per_seq]
    table = order.view(b, per_seq).to(I32).cuda()
    pool = torch.randn((n_pages, page) + tuple(kc.shape[2:]), device="cuda", dtype=kc.dtype)
    pool[table.long().flatten()] = kc.reshape(b * per_seq, page, *kc.shape[2:])
    return pool, table


def from_pages(pool, table):
    """The (b, sc, hk, d) caches a paged pool holds for a block table."""
    b, per_seq = table.shape
    return pool[table.long().flatten()].reshape(b, per_seq * pool.shape[1], *pool.shape[2:])


def rotary_tables(n, rotary_dim, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    angle = torch.rand((n, rotary_dim // 2), generator=g, device="cuda") * 6.28
    return angle.cos().to(dtype), angle.sin().to(dtype)


def rotated(x, cos, sin, positions, interleaved):
    """x (b, s, h, d) rotated at positions (b, s), as complex multiplications (the reference:
    pairs (2i, 2i + 1) when interleaved, else (i, i + rotary_dim / 2))."""
    half = cos.shape[1]
    turn = torch.complex(cos.float()[positions], sin.float()[positions])[:, :, None, :]
    part = x[..., :2 * half].float()
    if interleaved:
        z = torch.view_as_complex(part.unflatten(-1, (half, 2)).contiguous()) * turn
        back = torch.view_as_real(z).flatten(-2)
    else:
        z = torch.complex(part[..., :half], part[..., half:]) * turn
        back = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((back.to(x.dtype), x[..., 2 * half:]), dim=-1)


def check_sequences(out, lse, q, k_seqs, v_seqs, causal):
    """Sequence b of out/lse against its own keys k_seqs[b], v_seqs[b] ((n, hk, d) each)."""
    for b in range(q.shape[0]):
        check_attention(out[b:b + 1], None if lse is None else lse[b:b + 1], q[b:b + 1],
                        k_seqs[b][None], v_seqs[b][None], causal)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("page", [16, 64, 256])
@pytest.mark.parametrize("combo", COMBOS, ids=_combo_id)
def test_paged_cache_with_append(combo, page, causal):
    dtype, d = combo
    dtype = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(page)
    sc, new = 512, 3
    lens = [0, 37, 256, 509 - new, 100]  # an empty cache, page boundaries, a nearly full one
    b = len(lens)
    q = randn(g, dtype, b, 2, 8, d)
    kc, vc = randn(g, dtype, b, sc, 2, d), randn(g, dtype, b, sc, 2, d)
    k, v = randn(g, dtype, b, new, 2, d), randn(g, dtype, b, new, 2, d)
    k_pool, table = to_pages(kc, page, seed=page)
    v_pool, _ = to_pages(vc, page, seed=page)
    unused = torch.ones(k_pool.shape[0], dtype=torch.bool, device="cuda")
    unused[table.long().flatten()] = False
    k_spare = k_pool[unused].clone()
    seqlens = torch.tensor(lens, dtype=I32, device="cuda")
    out, lse = flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=seqlens,
                                       block_table=table, causal=causal,
                                       return_softmax_lse=True)
    k_now, v_now = from_pages(k_pool, table), from_pages(v_pool, table)
    for b_, n in enumerate(lens):
        assert torch.equal(k_now[b_, n:n + new], k[b_]) and torch.equal(v_now[b_, n:n + new], v[b_])
        assert torch.equal(k_now[b_, :n], kc[b_, :n]) and torch.equal(k_now[b_, n + new:],
                                                                      kc[b_, n + new:])
    assert torch.equal(k_pool[unused], k_spare), "an append wrote into a page no one uses"
    check_sequences(out, lse, q, [k_now[i, :n + new] for i, n in enumerate(lens)],
                    [v_now[i, :n + new] for i, n in enumerate(lens)], causal)


def test_paged_decoding_splits_and_matches_contiguous():
    """One query row against long paged caches (the split-KV path), and without
    cache_seqlens (every position of the table's pages)."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    g = torch.Generator(device="cuda").manual_seed(1)
    kc, vc = randn(g, DTYPES[dtype], 2, 4096, 1, d), randn(g, DTYPES[dtype], 2, 4096, 1, d)
    q = randn(g, DTYPES[dtype], 2, 1, 8, d)
    k_pool, table = to_pages(kc, 64, seed=3)
    v_pool, _ = to_pages(vc, 64, seed=3)
    lens = [4096, 1500]
    seqlens = torch.tensor(lens, dtype=I32, device="cuda")
    for splits in (0, 1, 7):
        out, lse = flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens,
                                           block_table=table, num_splits=splits,
                                           return_softmax_lse=True)
        check_sequences(out, lse, q, [kc[0, :4096], kc[1, :1500]], [vc[0, :4096], vc[1, :1500]],
                        False)
    out, lse = flash_attn_with_kvcache(q, k_pool, v_pool, block_table=table,
                                       return_softmax_lse=True)
    check_sequences(out, lse, q, [kc[0], kc[1]], [vc[0], vc[1]], False)


def test_repeat_paged_decoding_steps_take_a_plan_and_read_each_table():
    """Decoding steps on paged caches (a tensor cache_seqlens, no append) take a plan on
    their second call, keyed by the block_table's address: each step must read its own
    table (another tensor, the same one rewritten in place) and lengths."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    g = torch.Generator(device="cuda").manual_seed(5)
    kc, vc = randn(g, DTYPES[dtype], 3, 1024, 2, d), randn(g, DTYPES[dtype], 3, 1024, 2, d)
    q = randn(g, DTYPES[dtype], 3, 1, 8, d)
    internals.clear_caches()
    k_pool, table_a = to_pages(kc, 64, seed=1)
    v_pool, _ = to_pages(vc, 64, seed=1)
    lens = [1024, 1, 517]
    seqlens = torch.tensor(lens, dtype=I32, device="cuda")

    def step(table):
        out, lse = flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens,
                                           block_table=table, causal=True,
                                           return_softmax_lse=True)
        k_now, v_now = from_pages(k_pool, table), from_pages(v_pool, table)
        check_sequences(out, lse, q, [k_now[i, :n] for i, n in enumerate(lens)],
                        [v_now[i, :n] for i, n in enumerate(lens)], True)

    step(table_a)
    step(table_a)
    assert len(internals.kvcache_plans) == 1  # the second step replayed the first's plan
    table_b = table_a.flip(1).contiguous()  # the same pool read in another page order
    step(table_b)
    step(table_b)
    step(table_a)
    assert len(internals.kvcache_plans) == 2
    table_a.copy_(table_a.roll(1, dims=0))  # sequence b now reads sequence b - 1's pages
    step(table_a)
    lens = [3, 1000, 64]
    seqlens.copy_(torch.tensor(lens, dtype=I32))
    step(table_a)


@pytest.mark.parametrize("combo", COMBOS, ids=_combo_id)
def test_cache_batch_idx_reads_and_appends_its_entries(combo):
    dtype, d = combo
    dtype = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(2)
    idx, lens, new = [4, 0, 2], [10, 0, 60], 2
    q = randn(g, dtype, 3, 1, 4, d)
    kc, vc = randn(g, dtype, 5, 64, 2, d), randn(g, dtype, 5, 64, 2, d)
    k, v = randn(g, dtype, 3, new, 2, d), randn(g, dtype, 3, new, 2, d)
    kc0 = kc.clone()
    out, lse = flash_attn_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=torch.tensor(lens, dtype=I32, device="cuda"),
        cache_batch_idx=torch.tensor(idx, dtype=I32, device="cuda"), return_softmax_lse=True)
    for b, (e, n) in enumerate(zip(idx, lens)):
        assert torch.equal(kc[e, n:n + new], k[b]) and torch.equal(kc[e, :n], kc0[e, :n])
    for e in (1, 3):
        assert torch.equal(kc[e], kc0[e]), "an entry no sequence uses was written"
    check_sequences(out, lse, q, [kc[e, :n + new] for e, n in zip(idx, lens)],
                    [vc[e, :n + new] for e, n in zip(idx, lens)], False)


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("combo", COMBOS, ids=_combo_id)
def test_cache_leftpad_skips_the_padding(combo, causal):
    dtype, d = combo
    dtype = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(3)
    lens, pads, new = [40, 200, 7, 130], [5, 0, 7, 129], 3
    q = randn(g, dtype, 4, 4, 4, d)
    kc, vc = randn(g, dtype, 4, 256, 2, d), randn(g, dtype, 4, 256, 2, d)
    k, v = randn(g, dtype, 4, new, 2, d), randn(g, dtype, 4, new, 2, d)
    out, lse = flash_attn_with_kvcache(
        q, kc, vc, k, v, cache_seqlens=torch.tensor(lens, dtype=I32, device="cuda"),
        cache_leftpad=torch.tensor(pads, dtype=I32, device="cuda"), causal=causal,
        return_softmax_lse=True)
    for b, n in enumerate(lens):
        assert torch.equal(kc[b, n:n + new], k[b])
    check_sequences(out, lse, q, [kc[b, p:n + new] for b, (n, p) in enumerate(zip(lens, pads))],
                    [vc[b, p:n + new] for b, (n, p) in enumerate(zip(lens, pads))], causal)


@pytest.mark.parametrize("leftpad", [False, True], ids=["", "leftpad"])
@pytest.mark.parametrize("interleaved", [False, True], ids=["neox", "interleaved"])
@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("combo", COMBOS, ids=_combo_id)
def test_rotary_on_queries_and_new_keys(combo, causal, interleaved, leftpad):
    """flash-attn's rule: new keys at position cache_seqlens[b] + i, their rows in the cache
    (left padding counts); queries likewise when causal (or windowed), else all at
    cache_seqlens[b]."""
    dtype, d = combo
    dtype = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(4)
    lens, new, sq, sc = [3, 50, 0], 4, 4, 128
    pads = [2, 17, 0] if leftpad else [0, 0, 0]
    rotary_dim = min(d, 64) if d != 64 else 32  # a partial rotation where the head allows
    cos, sin = rotary_tables(sc, rotary_dim, dtype)
    q = randn(g, dtype, 3, sq, 4, d)
    kc, vc = randn(g, dtype, 3, sc, 2, d), randn(g, dtype, 3, sc, 2, d)
    k, v = randn(g, dtype, 3, new, 2, d), randn(g, dtype, 3, new, 2, d)
    out, lse = flash_attn_with_kvcache(
        q, kc, vc, k, v, rotary_cos=cos, rotary_sin=sin,
        cache_seqlens=torch.tensor(lens, dtype=I32, device="cuda"),
        cache_leftpad=torch.tensor(pads, dtype=I32, device="cuda") if leftpad else None,
        causal=causal, rotary_interleaved=interleaved, return_softmax_lse=True)
    start = torch.tensor(lens, device="cuda")[:, None]
    k_ro = rotated(k, cos, sin, start + torch.arange(new, device="cuda"), interleaved)
    steps = torch.arange(sq, device="cuda") if causal else torch.zeros(sq, dtype=torch.long,
                                                                       device="cuda")
    q_pos = start + steps
    q_ro = rotated(q, cos, sin, q_pos, interleaved)
    for b, n in enumerate(lens):
        got = kc[b, n:n + new].float()
        want = k_ro[b].float()
        assert (got - want).abs().max().item() <= 1e-2 * want.abs().max().item()
    assert not torch.equal(kc[1, 50:54], k[1]), "the appended keys were not rotated"
    check_sequences(out, lse, q_ro, [kc[b, p:n + new] for b, (n, p) in enumerate(zip(lens, pads))],
                    [vc[b, p:n + new] for b, (n, p) in enumerate(zip(lens, pads))], causal)


def test_varlen_with_block_table_in_grad_mode():
    """flash-attn's tests call the paged flash_attn_varlen_func with a q that requires grad
    (and run no backward): the forward runs as without gradients, and its out's backward
    raises, since the call has none."""
    dtype, d = COMBOS[0]
    dtype = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(21)
    kc, vc = randn(g, dtype, 2, 256, 2, d), randn(g, dtype, 2, 256, 2, d)
    k_pool, table = to_pages(kc, 16, seed=3)
    v_pool, _ = to_pages(vc, 16, seed=3)
    q = randn(g, dtype, 7, 4, d)
    cu_q = torch.tensor([0, 3, 7], dtype=I32, device="cuda")
    cu_k = torch.tensor([0, 200, 256], dtype=I32, device="cuda")
    with torch.no_grad():
        want = flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, 4, 200, causal=True,
                                      block_table=table)
    got, lse, _ = flash_attn_varlen_func(q.clone().requires_grad_(), k_pool, v_pool, cu_q,
                                         cu_k, 4, 200, causal=True, block_table=table,
                                         return_attn_probs=True)
    assert torch.equal(got, want) and got.requires_grad and not lse.requires_grad
    with pytest.raises(NotImplementedError, match="with block_table has no backward"):
        got.float().sum().backward()


def test_kvcache_in_grad_mode():
    """flash_attn_with_kvcache with a q and new keys that require grad (an evaluation loop
    without torch.no_grad()): the same out and cache writes as without gradients, and out's
    backward raises (flash-attn would return an out without a grad_fn)."""
    dtype, d = COMBOS[0]
    dtype = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(22)
    q = randn(g, dtype, 2, 3, 4, d)
    kc, vc = randn(g, dtype, 2, 64, 2, d), randn(g, dtype, 2, 64, 2, d)
    k, v = randn(g, dtype, 2, 3, 2, d), randn(g, dtype, 2, 3, 2, d)
    lens = torch.tensor([10, 40], dtype=I32, device="cuda")
    kc2, vc2 = kc.clone(), vc.clone()
    with torch.no_grad():
        want = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=lens, causal=True)
    got, lse = flash_attn_with_kvcache(q.clone().requires_grad_(), kc2, vc2,
                                       k.clone().requires_grad_(), v, cache_seqlens=lens,
                                       causal=True, return_softmax_lse=True)
    assert torch.equal(got, want) and torch.equal(kc2, kc) and torch.equal(vc2, vc)
    assert got.requires_grad and not lse.requires_grad
    with pytest.raises(NotImplementedError, match="flash_attn_with_kvcache has no backward"):
        got.float().sum().backward()


@pytest.mark.parametrize("causal", [False, True], ids=["noncausal", "causal"])
@pytest.mark.parametrize("page", [16, 128])
@pytest.mark.parametrize("combo", COMBOS, ids=_combo_id)
def test_varlen_with_block_table(combo, page, causal):
    """flash_attn_varlen_func over paged caches: cu_seqlens_k gives each sequence's length,
    its keys are in its pages."""
    dtype, d = combo
    dtype = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(9)
    lens_q, lens_k = [3, 1, 5, 2], [100, 0, 256, 17]
    kc, vc = randn(g, dtype, 4, 256, 2, d), randn(g, dtype, 4, 256, 2, d)
    k_pool, table = to_pages(kc, page, seed=page)
    v_pool, _ = to_pages(vc, page, seed=page)
    q = randn(g, dtype, sum(lens_q), 4, d)
    cu_q = torch.tensor([0, 3, 4, 9, 11], dtype=I32, device="cuda")
    cu_k = torch.tensor([0, 100, 100, 356, 373], dtype=I32, device="cuda")
    out, lse, _ = flash_attn_varlen_func(q, k_pool, v_pool, cu_q, cu_k, 5, 256, causal=causal,
                                         return_attn_probs=True, block_table=table)
    for b, (q0, q1) in enumerate(zip(cu_q.tolist(), cu_q.tolist()[1:])):
        check_attention(out[q0:q1][None], lse[:, q0:q1][None], q[q0:q1][None],
                        kc[b, :lens_k[b]][None], vc[b, :lens_k[b]][None], causal)


def test_decoding_loop_with_append_rotary_and_pages_is_one_graph():
    """A server's decoding step (append one token with rotary into paged caches, attend, move
    the lengths on) captured once and replayed for many steps, each step checked against the
    math on a contiguous mirror of the caches."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    dtype = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(5)
    b, sc, page, h, hk = 3, 256, 16, 8, 2
    kc, vc = randn(g, dtype, b, sc, hk, d), randn(g, dtype, b, sc, hk, d)
    k_pool, table = to_pages(kc, page, seed=5)
    v_pool, _ = to_pages(vc, page, seed=5)
    cos, sin = rotary_tables(sc, d, dtype, seed=5)
    lens0 = [0, 31, 200]
    seqlens = torch.tensor(lens0, dtype=I32, device="cuda")
    q, k, v = (torch.zeros(b, 1, n, d, dtype=dtype, device="cuda") for n in (h, hk, hk))

    def step():
        out = flash_attn_with_kvcache(q, k_pool, v_pool, k, v, rotary_cos=cos, rotary_sin=sin,
                                      cache_seqlens=seqlens, block_table=table, causal=True,
                                      rotary_interleaved=False)
        seqlens.add_(1)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (loads the modules) on a side stream, as torch asks
        step()
    torch.cuda.current_stream().wait_stream(side)
    seqlens.copy_(torch.tensor(lens0, dtype=I32))
    k_pool, v_pool = to_pages(kc, page, seed=5)[0], to_pages(vc, page, seed=5)[0]
    k_mirror, v_mirror = kc.clone(), vc.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    torch.cuda.synchronize()
    assert seqlens.tolist() == lens0, "capturing ran the step"
    for i in range(12):
        for t, n in ((q, h), (k, hk), (v, hk)):
            t.copy_(randn(g, dtype, b, 1, n, d))
        lens = [n + i for n in lens0]
        graph.replay()
        torch.cuda.synchronize()
        pos = torch.tensor(lens, device="cuda")[:, None]
        k_ro = rotated(k, cos, sin, pos, False)
        for j, n in enumerate(lens):
            v_mirror[j, n] = v[j, 0]
        assert seqlens.tolist() == [n + 1 for n in lens]
        now = from_pages(k_pool, table)
        for j, n in enumerate(lens):
            assert (now[j, n].float() - k_ro[j, 0].float()).abs().max().item() < 0.05
            k_mirror[j, n] = now[j, n]  # the kernel's rounding of the rotated key
        check_sequences(out, None, rotated(q, cos, sin, pos, False),
                        [k_mirror[j, :n + 1] for j, n in enumerate(lens)],
                        [v_mirror[j, :n + 1] for j, n in enumerate(lens)], True)


def test_bad_indices_with_an_append_are_refused_and_write_nothing():
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    dtype = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(6)
    q = randn(g, dtype, 2, 1, 2, d)
    k, v = randn(g, dtype, 2, 1, 2, d), randn(g, dtype, 2, 1, 2, d)
    pool = randn(g, dtype, 4, 16, 2, d)
    pool0 = pool.clone()
    seqlens = torch.tensor([3, 20], dtype=I32, device="cuda")
    table = torch.tensor([[0, 1], [2, 4]], dtype=I32, device="cuda")  # page 4 of 4
    with pytest.raises(ValueError, match=r"block_table holds 1 page indices outside \[0, 4\)"):
        flash_attn_with_kvcache(q, pool, pool.clone(), k, v, cache_seqlens=seqlens,
                                block_table=table)
    assert torch.equal(pool, pool0)
    # The same table for a sequence that stops before the bad page: only used pages count.
    out = flash_attn_with_kvcache(q, pool, pool.clone(), k, v,
                                  cache_seqlens=torch.tensor([3, 10], dtype=I32, device="cuda"),
                                  block_table=table)
    assert torch.isfinite(out).all()
    caches = randn(g, dtype, 3, 32, 2, d)
    with pytest.raises(ValueError, match=r"cache_batch_idx holds values in \[0, 3\]; they must "
                                         r"be in \[0, 3\)"):
        flash_attn_with_kvcache(q, caches, caches.clone(), k, v, cache_seqlens=seqlens,
                                cache_batch_idx=torch.tensor([3, 0], dtype=I32, device="cuda"))
    with pytest.raises(ValueError, match="cache_leftpad holds 1 values outside"):
        flash_attn_with_kvcache(q, caches[:2], caches[:2].clone(), k, v, cache_seqlens=seqlens,
                                cache_leftpad=torch.tensor([4, 0], dtype=I32, device="cuda"))


def test_bad_indices_without_an_append_are_clamped_not_a_fault():
    """Nothing reads them on the host then (a decoding step stays free of host copies): the
    kernels clamp every page and entry index into the caches."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    dtype = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(7)
    q = randn(g, dtype, 2, 1, 2, d)
    pool = randn(g, dtype, 4, 16, 2, d)
    seqlens = torch.tensor([20, 32], dtype=I32, device="cuda")
    table = torch.tensor([[0, -7], [10**6, 3]], dtype=I32, device="cuda")
    out = flash_attn_with_kvcache(q, pool, pool, cache_seqlens=seqlens, block_table=table)
    out2 = flash_attn_with_kvcache(q, pool, pool, cache_seqlens=seqlens,
                                   cache_batch_idx=torch.tensor([-1, 9], dtype=I32, device="cuda"))
    torch.cuda.synchronize()
    assert torch.isfinite(out).all() and torch.isfinite(out2).all()


@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
def test_append_out_of_range_inside_a_graph_writes_nothing_outside():
    """A graph cannot raise: an append past the caches' end writes no position outside them,
    and the attention clamps its key count."""
    dtype, d = _pick_combo(("bf16", 128), *COMBOS)
    dtype = DTYPES[dtype]
    g = torch.Generator(device="cuda").manual_seed(8)
    q, k, v = randn(g, dtype, 2, 1, 2, d), randn(g, dtype, 2, 2, 2, d), randn(g, dtype, 2, 2, 2, d)
    big = randn(g, dtype, 2, 80, 2, d)
    kc = big[:, :64]  # each entry followed by 16 positions the call must not touch
    vc = randn(g, dtype, 2, 64, 2, d)
    seqlens = torch.tensor([63, 10], dtype=I32, device="cuda")
    flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens)  # load the module outside
    big0 = big.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(big[0, 63], k[0, 0]) and torch.equal(big[1, 10:12], k[1])
    assert torch.equal(big[:, 64:], big0[:, 64:]), "the append wrote past the cache"
    assert torch.isfinite(out).all()
