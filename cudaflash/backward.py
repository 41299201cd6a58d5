"""The backward's launches: dq, dk, dv from dout and what the forward saved (flash_attn_func
and flash_attn_varlen_func).

Three launches on torch's current stream (cuda_src/flash_bwd.cu), in one of two schemes:

- atomic (flash-attn's default, deterministic=False): delta = rowsum(dout * out) (which also
  zeroes a float32 dQ accumulator), then dK/dV (one CTA per key tile and K/V head, summing
  over the query heads of its GQA group) adding each step's dS K to the accumulator with
  atomics or bulk reductions (the warp-specialized modules on Hopper: one per step, by a
  warp of their own), then dq = scale * accumulator. 5 GEMMs; the additions' order varies,
  and so do the last bits of dq.
- deterministic: delta, dK/dV, then dQ in a kernel of its own (one CTA per query tile and
  head), which recomputes S and dP: 7 GEMMs, every gradient written once, bitwise
  reproducible.

Calls with few query rows per dK/dV CTA run the deterministic kernels even when atomic was
asked for (heuristics.effective_scheme: they are faster there). The module for a call is the
first backward config the manifest has for the GPU, dtype, head dim and scheme
(dispatch.find_backward_entry; configs.yaml, ``backward``: an entry's ``scheme`` says which
it serves).

Packed (varlen) batches (run_varlen) run each CTA on its own sequence (flash_bwd.cu,
sequence_view): in the atomic scheme on the warp-specialized fused kernel where the GPU has
it (Hopper, d64 and d128: _varlen_module, a packed dQ accumulator), else on the
deterministic kernels. Softcapped calls (``softcap`` > 0) and ALiBi take the deterministic
kernels, through the modules' *_scoremod entries: the atomic scheme's fused kernel has no
such form (with the tanh it spilled at d128 on wgmma). Dropout in the atomic scheme takes
the warp-specialized fused kernel's dropout entry (dkdv_dq_dropout: padded batches without
a window, on modules with BackwardConfig.fused_dropout), else the *_scoremod entries too.

A padded batch's call keeps a _Plan per signature (the module, maps layout, launches and
fixed BwdParams), as the forward's plans do: a training step repeats every layer's shapes.

Only the autograd functions and the custom ops (_autograd.py) call this;
they have already checked q, k, v (the forward's checks) and made q's device current.
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import torch

from . import _driver, _tma, dispatch, heuristics
from ._params import (BWD_PARAMS_FORMAT, alibi_params, dropout_params,
                      score_scales)
from ._torch import current_stream

_PACK = struct.Struct(BWD_PARAMS_FORMAT)  # all of BwdParams (_params.BwdParams), in one pack
DQ_ACCUM_ROW_ALIGN = 128  # flash_bwd.cu kDqAccumRowAlign: dq_accum's rows per head, rounded up
# A packed batch's padded statistics may hold at most this many rows per packed query row
# (2 float32 per head each: a quarter of the d256 q tensor's bytes), else run_varlen takes
# the kernels without them.
STATS_ROWS_PER_PACKED_ROW = 16


def scheme(deterministic: bool, softcap: float = 0.0, alibi: bool = False) -> str:
    """The scheme of a call: deterministic when asked for, when torch's global switch
    (torch.use_deterministic_algorithms) asks every op for reproducible results, or with
    softcapping or ALiBi (the only scheme with their kernels). Dropout runs in either (run:
    the fused kernel's dropout entry where a module has it)."""
    if deterministic or softcap or alibi or torch.are_deterministic_algorithms_enabled():
        return "deterministic"
    return "atomic"


def _kernel_ready(t: torch.Tensor) -> bool:
    """What the kernels need of a gradient input: unit last stride, 16-byte aligned data and
    strides of whole 16-byte vectors."""
    s = t.stride()
    return s[-1] == 1 and t.data_ptr() % 16 == 0 and not any(x % 8 for x in s[:-1])


def _kernel_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the kernels read it: itself, or a contiguous copy where its layout is not
    kernel-ready (the forward's output: the library's own always is, but the public op
    torch.ops.cudaflash.bwd may be handed any view, and the preprocess reads it with
    16-byte loads)."""
    if _kernel_ready(t):
        return t
    return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t)


def _kernel_dout(dout: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The gradient of out as the kernels take it: q's dtype and shape (else ValueError), and
    a copy where its layout is not kernel-ready (e.g. the expanded gradient of out.sum():
    strides 0)."""
    if dout.dtype != q.dtype or dout.shape != q.shape:
        raise ValueError(f"the gradient of out has dtype {dout.dtype} and shape "
                         f"{tuple(dout.shape)}; expected {q.dtype} and {tuple(q.shape)}")
    return _kernel_layout(dout)


@dataclass(frozen=True)
class _Steps:
    """The launches of one backward call as (role, grid, threads) steps, all with one packed
    BwdParams: the grid of each kernel follows from what it iterates over (query rows, key
    tiles, query tiles)."""

    kernel: dispatch.BackwardKernel
    seqlen_q: int
    seqlen_k: int
    n_heads: int
    n_heads_k: int
    batch: int

    def per_row(self, role: str, rows: int | None = None) -> tuple:
        """preprocess, dq_convert: a few query rows per CTA, over ``rows`` rows (default
        seqlen_q)."""
        e = self.kernel.entry
        rows = self.seqlen_q if rows is None else rows
        grid = ((rows + e.preprocess_rows - 1) // e.preprocess_rows, self.n_heads, self.batch)
        return role, grid, e.preprocess_threads

    def per_key_tile(self, role: str) -> tuple:
        """dkdv, dkdv_dq: one CTA per tile of keys and K/V head (the fused dkdv_dq entries
        with the module's fused_threads: warp-specialized modules add a producer warpgroup;
        the dkdv entries with its dkdv_threads and dkdv_cta_rows: d256's warp-specialized
        kernel has 64 keys per CTA)."""
        e = self.kernel.entry
        if role.startswith("dkdv_dq"):
            rows, threads = e.config.cta_rows, e.fused_threads
        else:
            rows, threads = e.config.dkdv_cta_rows, e.config.dkdv_threads
        tiles = (self.seqlen_k + rows - 1) // rows
        return role, (tiles, self.n_heads_k, self.batch), threads

    def per_query_tile(self, role: str) -> tuple:
        """dq: one CTA per tile of query rows and query head (the module's dq_cta_rows and
        dq_threads: d256's warp-specialized kernel has 64 rows and a producer warpgroup)."""
        config = self.kernel.entry.config
        tiles = (self.seqlen_q + config.dq_cta_rows - 1) // config.dq_cta_rows
        return role, (tiles, self.n_heads, self.batch), config.dq_threads

    def dkdv_then_dq(self, suffix: str) -> tuple:
        """The deterministic scheme's GEMM kernels: dkdv per key tile, then dq per query tile
        (their padded, varlen or score-modifier roles: ``suffix`` names which)."""
        return self.per_key_tile("dkdv" + suffix), self.per_query_tile("dq" + suffix)


def _launch_step(kernel: dispatch.BackwardKernel, role: str, grid: tuple, threads: int,
                 stream: int, args: "_driver.PackedArgs") -> None:
    """Launch the module's ``role`` entry (backward_config.BackwardConfig.ROLES) with the
    dynamic shared memory the manifest gives it."""
    _driver.launch_packed(getattr(kernel.fns, role),
                          f"cuLaunchKernel({kernel.entry.name} {role})", grid, threads,
                          kernel.entry.entries[role].smem_bytes, stream, args,
                          kernel.synchronize)


def _launch(kernel: dispatch.BackwardKernel, steps, stream: int,
            args: "_driver.PackedArgs") -> None:
    for role, grid, threads in steps:
        _launch_step(kernel, role, grid, threads, stream, args)


def _encoded_maps(config, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  dout: torch.Tensor):
    """The warp-specialized kernels' four tensor maps (BwdParams.tma_*), encoded into a
    scratch buffer, or None where TMA cannot describe a tensor or the driver refuses the
    pointers (the caller then takes a module without maps). q, k, v, dout: (batch, seqlen,
    heads, d_head); a packed batch passes its (total, heads, d_head) tensors as one entry."""
    layout = _tma.backward_maps(q, k, v, dout, config.ws_query_rows, config.dkdv_cta_rows)
    if layout is None:
        return None
    maps = ctypes.create_string_buffer(4 * _tma.MAP_BYTES)
    try:
        layout.write(ctypes.addressof(maps), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                     dout.data_ptr())
    except _driver.CudaError:
        return None
    return maps


@dataclass(frozen=True)
class _Plan:
    """What ``run`` concluded for one call signature (_plan_key): a repeat call (every layer
    of every training step) only allocates, packs this call's pointers and launches.

    The workspace is one float32 allocation: the atomic scheme's dQ accumulator, then the
    warp-specialized kernels' padded row statistics (lse in log2 units, delta), then delta;
    the first two start at multiples of 128 floats (their bulk copies and reductions need 16
    bytes)."""

    kernel: dispatch.BackwardKernel
    maps: object  # the layout's _tma.TensorMaps (written per call's pointers), or None
    steps: tuple  # (role, grid, threads), in launch order
    fixed: tuple  # BwdParams from the strides to the cap's scales (after dq_accum)
    accum_floats: int  # 0 in the deterministic scheme
    stats_floats: int  # per statistic; 0 without maps
    delta_floats: int


MAX_PLANS = 1024
_plans: dict[tuple, _Plan] = {}


def clear_plans() -> None:
    """Forget every backward plan (dispatch.clear_backward_cache and api.clear_caches call
    this: a plan holds a module's functions and the heuristics' verdict)."""
    _plans.clear()


def _plan_key(q, k, v, out, dout, scale, causal, scheme, window, softcap, alibi_slopes,
              dropout) -> tuple:
    """Everything a _Plan depends on besides the context (run keys by it: it fixes the
    device): shapes, strides (dq, dk, dv are empty_like's of q, k, v), dtype, the scheme
    asked for (torch's deterministic switch included), window, scale and cap, and which score
    modifiers the call has (their pointers are per call)."""
    return (q.shape, q.stride(), k.shape, k.stride(), v.stride(), out.stride(), dout.stride(),
            q.dtype, scale, causal, scheme, window, softcap,
            None if alibi_slopes is None else alibi_slopes.shape, dropout is None)


def _new_plan(ctx: int, q, k, v, out, dout, dq, dk, dv, scale, causal, scheme, window,
              softcap, scoremod: bool, dropout: bool, maps_refused: bool = False) -> _Plan:
    """The module (loaded in context ``ctx``), maps, launches and fixed BwdParams fields of a
    padded-batch call (``scoremod``: softcap, ALiBi or dropout; ``dropout``: dropout).
    ``maps_refused``: the driver refused this call's pointers (TensorMaps.write), so the
    module without maps serves it."""
    batch, seqlen_q, n_heads, d_head = q.shape
    seqlen_k, n_heads_k = k.shape[1], k.shape[2]
    index = q.get_device()
    plain_window = window == (-1, 0 if causal else -1)
    if scheme == "atomic":
        # Dropout: a fused kernel with dropout (no window form), else the deterministic ones.
        atomic = (dispatch.find_backward_entry(index, q.dtype, d_head, "atomic",
                                               dropout=dropout)
                  if plain_window or not dropout else None)
        if atomic is None:  # no fused kernel at this head dim (d256): the deterministic ones
            scheme = "deterministic"
        else:
            scheme = heuristics.effective_scheme(scheme, seqlen_q, n_heads // n_heads_k,
                                                 causal, atomic.config.wgmma, window)
    # A padded batch without score modifiers may take a module that serves only such calls
    # (d256's warp-specialized dK/dV kernel, deterministic scheme).
    kernel = dispatch.backward_kernel(ctx, index, q.dtype, d_head, scheme, plain=not scoremod,
                                      dropout=dropout and scheme == "atomic")
    maps = None
    config = kernel.entry.config
    if config.warp_specialized and (scheme == "atomic" or config.dkdv_warp_specialized):
        # Its loader reads q, k, v and dout through tensor maps only. The kernel-ready
        # tensors (whole 16-byte strides and alignment) always have them; should the driver
        # still refuse a layout or a call's pointers, a module without maps serves the call:
        # the deterministic scheme's (d64, d128), the mma.sync one (d256).
        if not maps_refused:
            maps = _tma.backward_maps(q, k, v, dout, config.ws_query_rows,
                                      config.dkdv_cta_rows)
        if maps is None:
            scheme = "deterministic"
            kernel = dispatch.backward_kernel(ctx, index, q.dtype, d_head, scheme)
    deterministic = scheme == "deterministic"
    # The atomic scheme's dQ accumulator, whole query tiles per head (flash_bwd.cu,
    # dq_accum_rows: a tile is one bulk reduction); the preprocess kernel zeroes it.
    accum_rows = -(-seqlen_q // DQ_ACCUM_ROW_ALIGN) * DQ_ACCUM_ROW_ALIGN
    steps = _Steps(kernel, seqlen_q, seqlen_k, n_heads, n_heads_k, batch)
    if deterministic:
        launches = (steps.per_row("preprocess", accum_rows),
                    *steps.dkdv_then_dq("_scoremod" if scoremod else ""))
    else:
        # The fused kernel without window code where the mask is only causal (or none): the
        # window's masking cost it 2-5% (flash_bwd.cu, bwd_dkdv). dq_convert covers whole
        # tiles (fragment order: a tile's rows spread over all of it).
        fused = ("dkdv_dq_dropout" if dropout else
                 "dkdv_dq" if plain_window else "dkdv_dq_window")
        launches = (steps.per_row("preprocess", accum_rows), steps.per_key_tile(fused),
                    steps.per_row("dq_convert", accum_rows))
    strides = [x for t in (q, k, v, out, dout, dq, dk, dv) for x in t.stride()[:3]]
    scales = score_scales(scale, softcap)  # as the forward's Params had them
    fixed = (*strides, n_heads * seqlen_q, seqlen_q, batch, n_heads, n_heads_k, seqlen_q,
             seqlen_k, int(causal), *scales[:2], 0, 0, 0, 0,  # 0s: not a packed batch
             *window, *scales[2:])
    rows = batch * n_heads * accum_rows
    return _Plan(kernel=kernel, maps=maps, steps=launches, fixed=fixed,
                 accum_floats=0 if deterministic else rows * d_head,
                 stats_floats=0 if maps is None else rows,
                 delta_floats=batch * n_heads * seqlen_q)


def _run_plan(plan: _Plan, stream: int, q, k, v, out, dout, lse, dq, dk, dv, alibi_slopes,
              dropout) -> bool:
    """Launch ``plan`` on this call's tensors; False, with nothing launched, where the
    driver refuses the maps of these pointers."""
    work = torch.empty(plan.accum_floats + 2 * plan.stats_floats + plan.delta_floats,
                       dtype=torch.float32, device=q.device)
    base = work.data_ptr()
    stats = base + 4 * plan.accum_floats
    q_ptr, k_ptr, v_ptr, dout_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr(), dout.data_ptr()
    lse = lse.contiguous()  # the forward's own: already (batch, nheads, seqlen_q), contiguous
    args = _driver.PackedArgs(_PACK.pack(
        q_ptr, k_ptr, v_ptr, out.data_ptr(), dout_ptr, lse.data_ptr(),
        stats + 8 * plan.stats_floats,  # delta
        dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), base if plan.accum_floats else 0,
        *plan.fixed, *alibi_params(alibi_slopes), *dropout_params(dropout),
        0,  # reserved
        *((stats, stats + 4 * plan.stats_floats) if plan.stats_floats else (0, 0))))
    if plan.maps is not None:
        try:
            plan.maps.write(args.address + _tma.BWD_MAPS_OFFSET, q_ptr, k_ptr, v_ptr, dout_ptr)
        except _driver.CudaError:
            return False
    _launch(plan.kernel, plan.steps, stream, args)
    return True


def run(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        out: torch.Tensor, lse: torch.Tensor, scale: float, causal: bool, scheme: str,
        window: tuple[int, int], softcap: float = 0.0, alibi_slopes=None, dropout=None
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) laid out like q, k, v. ``lse`` is the forward's (batch, nheads, seqlen_q)
    float32 log-sum-exp; q's device must be current. ``scheme``: "atomic" or
    "deterministic" (see the module docstring). ``window``: (left, right) exactly as the
    forward's kernel took them (heuristics.kernel_window: -1 unbounded, causal as right = 0); the
    kernels mask by it, so a causal call must pass right = 0 (``causal`` only orders CTAs
    and picks the scheme). ``softcap``: the forward's cap (0.0: none); ``alibi_slopes``: the
    forward's checked slopes (None: none); either needs the deterministic scheme (scheme()).
    ``dropout``: the forward's _dropout.Dropout (None: none), in either scheme.
    A signature seen before takes its _Plan."""
    scoremod = bool(softcap) or alibi_slopes is not None or dropout is not None
    if (softcap or alibi_slopes is not None) and scheme != "deterministic":
        raise ValueError(f"softcap={softcap} and ALiBi ({alibi_slopes is not None}) run in the "
                         f"deterministic scheme, not {scheme!r}")
    dout, out = _kernel_dout(dout, q), _kernel_layout(out)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.shape[0] == 0 or q.shape[1] == 0 or k.shape[1] == 0:
        # No query row or no key: every gradient is zero (out was zero-filled).
        return dq.zero_(), dk.zero_(), dv.zero_()
    # The context made current on this thread as every call did before plans (a thread whose
    # first CUDA work is this call has none), and part of the key: a plan's functions are
    # that context's.
    index = q.get_device()
    ctx = _driver.current_context(index)
    key = (ctx, _plan_key(q, k, v, out, dout, scale, causal, scheme, window, softcap,
                          alibi_slopes, dropout))
    plan = _plans.get(key)
    if plan is None:
        plan = _new_plan(ctx, q, k, v, out, dout, dq, dk, dv, scale, causal, scheme, window,
                         softcap, scoremod, dropout is not None)
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    stream = current_stream(index)
    if not _run_plan(plan, stream, q, k, v, out, dout, lse, dq, dk, dv, alibi_slopes, dropout):
        _run_plan(_new_plan(ctx, q, k, v, out, dout, dq, dk, dv, scale, causal, scheme,
                            window, softcap, scoremod, dropout is not None, maps_refused=True),
                  stream, q, k, v, out, dout, lse, dq, dk, dv, alibi_slopes, dropout)
    return dq, dk, dv


def run_varlen(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
               cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float,
               causal: bool, window: tuple[int, int], softcap: float = 0.0, alibi_slopes=None,
               dropout=None, scheme: str = "deterministic"
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of flash_attn_varlen_func, laid out like q, k, v ((total, nheads,
    headdim)); ``lse`` is its forward's (nheads, total_q). Rows of no sequence get zero
    gradients. The maxima must be at least the real lengths (flash-attn's contract): a
    sequence longer than them has undefined gradients (the forward did not compute all of
    its rows). ``scheme`` as in run: "atomic" takes the warp-specialized fused kernel where
    the GPU has one (Hopper, d64 and d128; _varlen_module), else the deterministic kernels
    run, bitwise reproducible. ``window``, ``softcap`` and ``alibi_slopes`` as in
    run."""
    total_q, n_heads, d_head = q.shape
    total_k, n_heads_k = k.shape[0], k.shape[1]
    batch = cu_seqlens_q.numel() - 1
    dout, out = _kernel_dout(dout, q), _kernel_layout(out)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    seqlen_q, seqlen_k = min(max_seqlen_q, total_q), min(max_seqlen_k, total_k)
    if batch == 0 or seqlen_q == 0 or seqlen_k == 0:
        return dq, dk, dv

    index = q.get_device()
    ctx = _driver.current_context(index)
    scoremod = bool(softcap) or alibi_slopes is not None or dropout is not None
    accum_rows = -(-seqlen_q // DQ_ACCUM_ROW_ALIGN) * DQ_ACCUM_ROW_ALIGN
    # Padded statistics (the warp-specialized kernels': the longest sequence's rows rounded
    # up, per sequence, as in run) only where they are not many times the packed rows (many
    # short sequences beside a long one).
    stats_fit = batch * accum_rows <= STATS_ROWS_PER_PACKED_ROW * total_q
    kernel, maps, atomic = _varlen_module(ctx, index, q, k, v, dout, batch, causal, window,
                                          scheme, scoremod, stats_fit)
    delta = torch.empty((n_heads, total_q), dtype=torch.float32, device=q.device)
    lse = lse.contiguous()  # the forward's own: (nheads, total_q)
    # The atomic scheme's accumulator is packed, (nheads, total_q + 128 * batch, headdim):
    # sequence b from row cu_seqlens_q[b] + 128 b, so its whole tiles (whose rows the kernel
    # writes in fragment order) never reach the next sequence's (flash_bwd.cu,
    # packed_dq_accum_row); the preprocess zeroes each sequence's tiles.
    dq_accum = None if not atomic else torch.empty(
        (n_heads, total_q + DQ_ACCUM_ROW_ALIGN * batch, d_head), dtype=torch.float32,
        device=q.device)
    stats = None if maps is None else torch.empty(
        (2, batch, n_heads, accum_rows), dtype=torch.float32, device=q.device)
    # (total, nheads, headdim): batch stride 0
    strides = [x for t in (q, k, v, out, dout, dq, dk, dv) for x in (0, *t.stride()[:2])]
    scales = score_scales(scale, softcap)
    args = _driver.PackedArgs(_PACK.pack(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), dout.data_ptr(),
        lse.data_ptr(), delta.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
        0 if dq_accum is None else dq_accum.data_ptr(),
        *strides, 0, total_q, batch, n_heads, n_heads_k, seqlen_q, seqlen_k, int(causal),
        *scales[:2], cu_seqlens_q.data_ptr(), cu_seqlens_k.data_ptr(), total_q, total_k,
        *window, *scales[2:], *alibi_params(alibi_slopes), *dropout_params(dropout),
        0,  # reserved
        *((0, 0) if stats is None else (stats[0].data_ptr(), stats[1].data_ptr()))))
    if maps is not None:
        ctypes.memmove(args.address + _tma.BWD_MAPS_OFFSET, maps, len(maps))

    steps = _Steps(kernel, seqlen_q, seqlen_k, n_heads, n_heads_k, batch)
    if atomic:
        launches = (steps.per_row("preprocess_varlen", accum_rows),
                    steps.per_key_tile("dkdv_dq_varlen"),
                    steps.per_row("dq_convert_varlen", accum_rows))
    else:
        # (with statistics, every padded row of each sequence: +inf and 0 past its length)
        launches = (steps.per_row("preprocess_varlen", None if stats is None else accum_rows),
                    *steps.dkdv_then_dq("_varlen_scoremod" if scoremod else "_varlen"))
    _launch(kernel, launches, current_stream(index), args)
    return dq, dk, dv


def _varlen_module(ctx: int, index: int, q, k, v, dout, batch: int, causal: bool,
                   window: tuple[int, int], scheme: str, scoremod: bool, stats_fit: bool):
    """(module, encoded maps or None, atomic) of a packed batch's backward. The atomic scheme
    takes the warp-specialized fused kernel (one CTA per key tile, K/V head and sequence; dQ
    added to a float32 accumulator by bulk reductions) where it is built (Hopper, d64 and
    d128), the mean sequence has enough query rows per CTA (effective_scheme, as run's
    longest sequence), the statistics fit and the maps are given. Otherwise the deterministic
    kernels: d256's warp-specialized ones read the packed tensors through maps of one batch
    entry, each sequence from its first row (packed_origin); without maps or room for the
    statistics, the mma.sync module."""
    total_q, n_heads, d_head = q.shape
    if scheme == "atomic" and not scoremod and stats_fit:
        entry = dispatch.find_backward_entry(index, q.dtype, d_head, "atomic")
        if (entry is not None and entry.config.warp_specialized
                and heuristics.effective_scheme("atomic", max(1, total_q // batch),
                                                n_heads // k.shape[1], causal,
                                                entry.config.wgmma, window) == "atomic"):
            kernel = dispatch.backward_kernel(ctx, index, q.dtype, d_head, "atomic")
            maps = _encoded_maps(kernel.entry.config, q[None], k[None], v[None], dout[None])
            if maps is not None:
                return kernel, maps, True
    kernel = dispatch.backward_kernel(ctx, index, q.dtype, d_head, "deterministic",
                                      plain=not scoremod)
    maps = None
    if kernel.entry.config.dkdv_warp_specialized:
        if stats_fit:
            maps = _encoded_maps(kernel.entry.config, q[None], k[None], v[None], dout[None])
        if maps is None:
            kernel = dispatch.backward_kernel(ctx, index, q.dtype, d_head, "deterministic")
    return kernel, maps, False
