"""Every kernel family once, at small odd sizes (tails in every dimension), for
compute-sanitizer: the forward (plain, causal, window, softcap, ALiBi, dropout, GQA, the
head dims with kernels and a padded one), its backward (atomic, deterministic, dropout), the
packed batch (varlen) both ways, the K/V cache (append, rotary, paged, indexed, left padding,
split keys), and calls big enough for the tensor-map and persistent kernels.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --report-api-errors no \\
        python3 tools/sanitizer_sweep.py [--only SUBSTRING] [--list]

Without PyTorch's caching allocator each tensor is its own allocation, so memcheck sees an
access past a tensor's end (inside a cached block it would not). Prints one line per call and
checks nothing itself (the reference tests do that): the sanitizer's ERROR SUMMARY is the
result (API errors off: cuda-bindings' loader probes the driver's symbols, and each failed
probe would count). tools/device_check.sh sanitize runs memcheck over all of it, then
racecheck and synccheck over the warp-specialized kernels.
"""

import argparse

import torch

import cudaflash

DEVICE = "cuda"


def rand(*shape, dtype=torch.bfloat16, grad=False):
    t = torch.randn(*shape, device=DEVICE, dtype=dtype)
    return t.requires_grad_(grad)


def attention(b, sq, sk, h, hk, d, dtype=torch.bfloat16, backward=True, **kwargs):
    q = rand(b, sq, h, d, dtype=dtype, grad=backward)
    k = rand(b, sk, hk, d, dtype=dtype, grad=backward)
    v = rand(b, sk, hk, d, dtype=dtype, grad=backward)
    out = cudaflash.flash_attn_func(q, k, v, **kwargs)
    if backward:
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))


def cu_seqlens(lens):
    return torch.tensor([0] + lens, device=DEVICE).cumsum(0).to(torch.int32)


def paged_cache(entries, seqs, blocks, page, hk, d):
    """K and V caches of `entries` x `blocks` pages of `page` positions, and a block table
    giving each of `seqs` sequences `blocks` of them, shuffled (no sequence's pages are
    contiguous)."""
    k_cache = rand(entries * blocks, page, hk, d)
    v_cache = rand(entries * blocks, page, hk, d)
    table = torch.randperm(entries * blocks, device=DEVICE, dtype=torch.int32)
    return k_cache, v_cache, table[: seqs * blocks].view(seqs, blocks)


def varlen(lens_q, lens_k, h, hk, d, backward=True, **kwargs):
    q = rand(sum(lens_q), h, d, grad=backward)
    k = rand(sum(lens_k), hk, d, grad=backward)
    v = rand(sum(lens_k), hk, d, grad=backward)
    out = cudaflash.flash_attn_varlen_func(q, k, v, cu_seqlens(lens_q), cu_seqlens(lens_k),
                                           max(lens_q), max(lens_k), **kwargs)
    if backward:
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))


def paged_varlen(lens_q, lens_k, h, hk, d, page=16, **kwargs):
    """flash_attn_varlen_func with a paged K/V (block_table)."""
    k_cache, v_cache, table = paged_cache(len(lens_q), len(lens_q),
                                          -(-max(lens_k) // page), page, hk, d)
    cudaflash.flash_attn_varlen_func(rand(sum(lens_q), h, d), k_cache, v_cache,
                                     cu_seqlens(lens_q), cu_seqlens(lens_k), max(lens_q),
                                     max(lens_k), block_table=table, **kwargs)


def kvcache(b, sq, cache_len, h, hk, d, lens, new=0, page=0, rotary=False, batch_idx=False,
            leftpad=False, **kwargs):
    """A cache of `cache_len` positions per sequence (paged in `page`-position blocks when
    page > 0), holding lens[i] positions, with `new` positions appended by the call."""
    n_cache = b + 1 if batch_idx else b  # one spare entry that the call does not read
    if page:
        k_cache, v_cache, kwargs["block_table"] = paged_cache(n_cache, b, cache_len // page,
                                                              page, hk, d)
    else:
        k_cache = rand(n_cache, cache_len, hk, d)
        v_cache = rand(n_cache, cache_len, hk, d)
    kwargs["cache_seqlens"] = torch.tensor(lens, device=DEVICE, dtype=torch.int32)
    if new:
        kwargs["k"] = rand(b, new, hk, d)
        kwargs["v"] = rand(b, new, hk, d)
    if rotary:
        angles = torch.rand(cache_len, d // 4, device=DEVICE)
        kwargs["rotary_cos"] = angles.cos().to(torch.bfloat16)
        kwargs["rotary_sin"] = angles.sin().to(torch.bfloat16)
    if batch_idx:
        kwargs["cache_batch_idx"] = torch.arange(b, 0, -1, device=DEVICE, dtype=torch.int32)
    if leftpad:
        kwargs["cache_leftpad"] = torch.tensor([min(3, n) for n in lens], device=DEVICE,
                                               dtype=torch.int32)
    cudaflash.flash_attn_with_kvcache(rand(b, sq, h, d), k_cache, v_cache, **kwargs)


def slopes(h, b=None):
    shape = (h,) if b is None else (b, h)
    return torch.rand(*shape, device=DEVICE, dtype=torch.float32)


# name -> (function, arguments, keyword arguments; a callable one is called for its value
# when the call runs). Sizes: 131 query rows and 257 keys put a partial block at every tile size.
CALLS = {}
for d in (64, 128, 256, 80):
    for dtype in (torch.bfloat16, torch.float16):
        tag = "bf16" if dtype is torch.bfloat16 else "fp16"
        CALLS[f"fwd+bwd d{d} {tag}"] = (attention, (2, 131, 257, 4, 2, d), dict(dtype=dtype))
    CALLS[f"fwd+bwd d{d} causal"] = (attention, (2, 257, 131, 4, 4, d), dict(causal=True))
    CALLS[f"fwd+bwd d{d} window"] = (attention, (1, 200, 300, 2, 1, d),
                                     dict(window_size=(37, 5)))
    CALLS[f"fwd+bwd d{d} softcap causal"] = (attention, (1, 131, 131, 2, 2, d),
                                             dict(softcap=20.0, causal=True))
    CALLS[f"fwd+bwd d{d} alibi"] = (attention, (2, 131, 257, 4, 1, d),
                                    dict(alibi_slopes=lambda: slopes(4, 2)))
    CALLS[f"fwd+bwd d{d} dropout"] = (attention, (2, 131, 257, 4, 2, d), dict(dropout_p=0.2))
    CALLS[f"fwd+bwd d{d} deterministic causal"] = (attention, (2, 131, 257, 4, 2, d),
                                                   dict(deterministic=True, causal=True))
    CALLS[f"fwd d{d} return_attn_probs dropout"] = (
        attention, (1, 67, 99, 2, 2, d), dict(dropout_p=0.3, return_attn_probs=True,
                                              backward=False))
# Sizes that take tensor maps, the persistent and three-warpgroup kernels, and the
# longest-first causal walk (its tile counter).
for d, s in ((64, 2048), (128, 1024), (128, 1100), (256, 1024)):
    CALLS[f"fwd+bwd d{d} S{s}"] = (attention, (2, s, s, 4, 4, d), {})
    CALLS[f"fwd+bwd d{d} S{s} causal"] = (attention, (2, s, s, 4, 2, d), dict(causal=True))
    CALLS[f"fwd+bwd d{d} S{s} dropout"] = (attention, (1, s, s, 4, 4, d), dict(dropout_p=0.1))
    CALLS[f"fwd d{d} S{s} alibi"] = (attention, (1, s, s, 4, 4, d),
                                     dict(alibi_slopes=lambda: slopes(4), backward=False))
# d64 causal beyond 2560 keys with maps: the three-warpgroup config, whose warpgroups skip
# the blocks their own rows cannot see (3100 = 16 * 192 + 28: a tail tile where two of the
# three have no rows).
CALLS["fwd d64 S3100 causal"] = (attention, (1, 3100, 3100, 4, 2, 64),
                                 dict(causal=True, backward=False))
# d64 non-causal up to 512 keys with maps: the persistent two-consumer config.
CALLS["fwd+bwd d64 S512 persistent"] = (attention, (8, 512, 512, 16, 16, 64), {})
CALLS["fwd+bwd d64 S512 persistent dropout"] = (attention, (8, 512, 512, 16, 16, 64),
                                                dict(dropout_p=0.1))
for d in (64, 128, 256):
    CALLS[f"varlen d{d}"] = (varlen, ([37, 128, 1, 200], [64, 1, 300, 200], 4, 2, d), {})
    CALLS[f"varlen d{d} causal"] = (varlen, ([37, 128, 1, 200], [64, 130, 300, 200], 4, 4, d),
                                    dict(causal=True))
    CALLS[f"varlen d{d} dropout window"] = (varlen, ([37, 128, 200], [64, 130, 300], 2, 2, d),
                                            dict(dropout_p=0.1, window_size=(20, 20)))
    CALLS[f"varlen d{d} paged"] = (paged_varlen, ([37, 128], [64, 130], 2, 2, d), {})
    CALLS[f"kvcache d{d} decode"] = (kvcache, (3, 1, 512, 8, 2, d, [5, 511, 300]), {})
    CALLS[f"kvcache d{d} append rotary causal"] = (
        kvcache, (3, 4, 512, 4, 2, d, [5, 100, 508]), dict(new=4, rotary=True, causal=True))
    CALLS[f"kvcache d{d} paged16 append"] = (
        kvcache, (2, 3, 256, 4, 4, d, [17, 250]), dict(new=3, page=16))
    CALLS[f"kvcache d{d} paged256 rotary"] = (
        kvcache, (2, 2, 512, 4, 2, d, [300, 40]), dict(new=2, page=256, rotary=True))
    CALLS[f"kvcache d{d} leftpad append"] = (
        kvcache, (2, 2, 512, 4, 2, d, [300, 40]), dict(new=2, leftpad=True))
    CALLS[f"kvcache d{d} batch_idx splits alibi"] = (
        kvcache, (2, 1, 2048, 8, 1, d, [2000, 7]), dict(batch_idx=True, num_splits=4,
                                                        alibi_slopes=lambda: slopes(8)))
    CALLS[f"kvcache d{d} softcap window"] = (
        kvcache, (2, 5, 512, 4, 4, d, [100, 400]), dict(softcap=30.0, window_size=(64, 0),
                                                        causal=True))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="run the calls whose name contains this")
    p.add_argument("--list", action="store_true", help="print the calls' names and stop")
    args = p.parse_args()
    names = [n for n in CALLS if args.only in n]
    if args.list:
        print("\n".join(names))
        return
    torch.manual_seed(0)
    refused = []
    for i, name in enumerate(names):
        fn, a, kw = CALLS[name]
        try:
            # (tensor arguments are made at run time: listing the calls needs no GPU)
            fn(*a, **{k: v() if callable(v) else v for k, v in kw.items()})
            torch.cuda.synchronize()
        except (ValueError, TypeError, NotImplementedError) as e:  # the sweep's own mistake
            refused.append(name)
            print(f"[{i + 1}/{len(names)}] {name}: REFUSED {type(e).__name__}: {e}", flush=True)
            continue
        print(f"[{i + 1}/{len(names)}] {name}", flush=True)
    print(f"sanitizer sweep: {len(names) - len(refused)} of {len(names)} calls ran"
          + (f"; refused: {', '.join(refused)}" if refused else ""))


if __name__ == "__main__":
    main()
