"""Per device: which kernels run there and which one serves a call.

The forward: the manifest's entries usable on the GPU (arch, shared memory), the selection
rules (the user's, this arch's tuned table, the shipped ones: first match wins), and the
kernel chosen per (context, dtype, head dim, causal, seqlen bucket) or per explicit config,
with its functions loaded. The backward: the first module the manifest has for the GPU,
dtype, head dim and scheme. Everything is cached; ``clear_cache`` forgets it.
"""

from __future__ import annotations

import bisect
import functools
import dataclasses
from dataclasses import dataclass

import torch

from . import _driver, _env, _tma, heuristics, manifest as _manifest, selection
from ._checks import DTYPES
from ._env import log
from .backward_config import BWD_D_HEADS
from .config import KernelConfig
from .manifest import BackwardEntry, KernelEntry


@dataclass(frozen=True)
class Kernel:
    """What a forward launch needs, resolved once per (context, problem class or config)."""

    fns: tuple  # the module's CUfunctions by role (config.KernelConfig.ROLES): fns.forward
    label: str  # names the kernel in a launch error
    block_rows: int  # B_r: query rows per CTA
    block_cols: int  # B_c: keys per KV block
    threads: int
    # Each entry's dynamic shared memory, as (role, bytes) pairs (the manifest's: the
    # warp-specialized ALiBi entries hold a table the others do not, config.KernelConfig).
    smem: tuple
    synchronize: bool  # CUDAFLASH_DEBUG
    # How many CTAs of each split entry fit on one SM (the driver's count), as (role, count)
    # pairs: the score-modifier and kvcache entries of some configs are built for fewer CTAs
    # per SM than the plain one, and the split count must plan waves of the entry that runs.
    split_ctas: tuple
    # The kernel can load through tensor maps (Params.tma_loads: KernelConfig.tma_loads,
    # sm_90a only).
    tma_loads: bool = False
    # Persistent CTAs where tensor maps are given (KernelConfig.persistent): the launch's
    # grid is then one CTA per SM at most, the kernel walking the call's tiles.
    persistent: bool = False

    def split_ctas_per_sm(self, role: str) -> int:
        return next(count for name, count in self.split_ctas if name == role)

    def smem_of(self, role: str) -> int:
        return next(size for name, size in self.smem if name == role)


@dataclass(frozen=True)
class DeviceKernels:
    device: "_driver.Device"
    usable: dict  # config name -> KernelEntry, manifest order
    debug: bool

    def head_dims(self, dtype: str) -> list[int]:
        return sorted({e.config.d_head for e in self.usable.values() if e.config.dtype == dtype})

    def describe(self) -> str:
        d = self.device
        return f"cuda:{d.index} ({d.name}, sm_{d.arch}, {d.smem_optin} bytes of shared memory)"


@dataclass(frozen=True)
class Rules:
    rules: tuple
    # Every max_seqlen bound of the rules, sorted: two lengths with the same bisect position
    # satisfy the same conditions, so that position is the cache key's seqlen bucket.
    q_bounds: tuple[int, ...]
    k_bounds: tuple[int, ...]


@dataclass(frozen=True)
class BackwardKernel:
    entry: BackwardEntry
    fns: tuple  # CUfunctions by role (backward_config.BackwardConfig.ROLES): fns.preprocess, ...
    synchronize: bool  # CUDAFLASH_DEBUG


_devices: dict[int, DeviceKernels] = {}
_auto_kernels: dict[tuple, Kernel] = {}
_config_kernels: dict[tuple, Kernel] = {}
_backward_kernels: dict[tuple, BackwardKernel] = {}
# find_backward_entry's answers: every forward that records gradients asks
# (check_backward_supported).
_backward_entries: dict[tuple, BackwardEntry | None] = {}


def clear_cache() -> None:
    rules.cache_clear()
    _devices.clear()
    _auto_kernels.clear()
    _config_kernels.clear()
    clear_backward_cache()


def clear_backward_cache() -> None:
    _backward_kernels.clear()
    _backward_entries.clear()
    from . import backward  # (backward imports this module: import at call time)
    backward.clear_plans()  # its plans hold these modules' functions


# ---- forward ---------------------------------------------------------------------------------


@functools.cache
def rules(arch: int) -> Rules:
    """Selection rules for GPUs of compute capability ``arch``, first match wins: the user's
    (CUDAFLASH_CONFIG), then this arch's tuned table (``python -m cudaflash tune``), then the
    shipped ones from the manifest."""
    found = _manifest.load_manifest().selection
    tuned = _env.tuned_table_path(arch)
    if tuned.is_file():
        found = selection.load_user_rules(tuned) + found
    path = _env.config_path()
    if path is not None:
        found = selection.load_user_rules(path) + found
    return Rules(found,
                 tuple(sorted({r.max_seqlen_q for r in found if r.max_seqlen_q is not None})),
                 tuple(sorted({r.max_seqlen_k for r in found if r.max_seqlen_k is not None})))


def selected_config(device_index: int, dtype: str, d_head: int, causal: bool, seqlen_q: int,
                    seqlen_k: int, n_heads: int = 1, n_heads_k: int = 1,
                    window: tuple[int, int] = (-1, -1), alibi: bool = False,
                    maps: bool = True, batch: int | None = None,
                    dropout: bool = False) -> tuple[str, str]:
    """The config ``flash_attn_func`` runs on cuda:``device_index`` for such a call (with
    ``n_heads`` query heads reading ``n_heads_k`` K/V heads, the sliding ``window``, ALiBi
    slopes or not, ``dropout`` or not: a bool, or the dropout_p, > 0 meaning dropout), and
    the rule that chose it. ``maps``: whether the call loads through tensor maps (a padded
    batch big enough for them; packed batches, cache addressing and small calls do not, and
    run a persistent config's twin, without_persistence, or with no twin built the next
    rule's config, maps_only). ``batch``: the padded batch's size; given, a padded call's
    ``maps`` is decided as flash_attn_func decides it (_tma.selects_with_maps: small calls
    load without maps), not taken from ``maps``. Raises LookupError when no built config
    fits."""
    dk = device_kernels(device_index)
    dropout = bool(dropout)
    rows, heads, causal, kernel_window = heuristics.kernel_problem(
        seqlen_q, n_heads, n_heads_k, seqlen_k, causal, window, alibi or dropout)
    if batch is not None:
        maps = rows == seqlen_q and _tma.selects_with_maps(rows, seqlen_k, heads, batch,
                                                           kernel_window)
    return _select(dk, rules(dk.device.arch), dtype, d_head, causal, rows, seqlen_k, maps,
                   dropout=dropout)


def _select(dk: DeviceKernels, r: Rules, dtype: str, d_head: int, causal: bool,
            seqlen_q: int, seqlen_k: int, maps: bool,
            dropout: bool = False) -> tuple[str, str]:
    """The built config the rules choose for the problem, and why. A call without tensor
    maps passes over the configs that are for calls with them (maps_only: the next matching
    rule serves it), and takes a persistent config's twin (without_persistence); where no
    other config serves it, a persistent config without a twin runs it one tile per CTA
    (correct, not tuned), and only the configs that cannot run without maps at all
    (KernelConfig.needs_tensor_maps) are left out."""
    def select(usable):
        return selection.select(r.rules, usable, arch=dk.device.arch, dtype=dtype,
                                d_head=d_head, causal=causal, seqlen_q=seqlen_q,
                                seqlen_k=seqlen_k, dropout=dropout)

    if maps:
        return select(dk.usable)
    try:
        name, reason = select({n: e for n, e in dk.usable.items()
                               if not maps_only(e.config, dk.usable)})
    except LookupError:
        runnable = {n: e for n, e in dk.usable.items() if not e.config.needs_tensor_maps}
        try:
            name, reason = select(runnable)
        except LookupError as e:
            left_out = [n for n, entry in dk.usable.items() if n not in runnable
                        and (entry.config.dtype, entry.config.d_head) == (dtype, d_head)]
            if not left_out:
                raise
            raise LookupError(f"{e}; built but left out because this call loads without "
                              f"tensor maps (packed batch, cache addressing, key counts or a "
                              f"small call) and they need them "
                              f"(KernelConfig.needs_tensor_maps): {left_out}") from None
    twin = without_persistence(dk.usable, dk.usable[name]).name
    if twin != name:
        name, reason = twin, f"{reason}; no tensor maps: its non-persistent twin"
    return name, reason


def device_kernels(index: int) -> DeviceKernels:
    dk = _devices.get(index)
    if dk is None:
        device = _driver.device(index)
        if device.arch < selection.MIN_ARCH:
            raise RuntimeError(f"cuda:{index} ({device.name}) is sm_{device.arch}; cudaflash "
                               f"needs sm_{selection.MIN_ARCH} (Ampere) or newer")
        usable = _manifest.load_manifest().usable(device.arch, device.smem_optin)
        dk = _devices[index] = DeviceKernels(device, usable, _env.debug())
    return dk


def auto_kernel(ctx: int, index: int, dtype: torch.dtype, d_head: int, causal: bool,
                seqlen_q: int, seqlen_k: int, maps: bool = False,
                dropout: bool = False) -> Kernel:
    """The kernel the selection rules choose for the problem (kernel_problem's rows and
    causal), loaded in context ``ctx``. ``maps``: whether the call will load through tensor
    maps (launch.run: _tma.worth_maps); without them a persistent config gives way to its
    twin (without_persistence), or with no twin built to the next rule's config (maps_only).
    ``dropout``: whether the call drops scores (rules may give those another config)."""
    dk = device_kernels(index)
    r = rules(dk.device.arch)
    key = (ctx, dtype, d_head, causal, bisect.bisect_left(r.q_bounds, seqlen_q),
           bisect.bisect_left(r.k_bounds, seqlen_k), maps, dropout)
    kernel = _auto_kernels.get(key)
    if kernel is None:
        name = DTYPES[dtype]
        if d_head not in dk.head_dims(name):
            raise ValueError(f"no {name} kernel with head dim {d_head} runs on {dk.describe()}; "
                             f"{name} head dims built for it: {dk.head_dims(name)}")
        config_name, reason = _select(dk, r, name, d_head, causal, seqlen_q, seqlen_k, maps,
                                      dropout=dropout)
        if dk.debug:
            log.debug("cuda:%d %s d_head=%d causal=%s seqlen_q=%d seqlen_k=%d%s -> %s (%s)",
                      index, name, d_head, causal, seqlen_q, seqlen_k,
                      " dropout" if dropout else "", config_name, reason)
        kernel = _auto_kernels[key] = _make_kernel(dk, dk.usable[config_name], ctx)
    return kernel


def non_persistent_twin(config: KernelConfig) -> str:
    """The name of a persistent config's non-persistent twin (the same config walking one
    tile per CTA on a three-stage ring), built or not."""
    return dataclasses.replace(config, persistent=False).name


def maps_only(config: KernelConfig, built) -> bool:
    """Whether dispatch gives ``config`` only calls that load through tensor maps, with
    ``built`` (config name -> anything) the build's configs: the configs that need them
    (KernelConfig.needs_tensor_maps), and a persistent config whose non-persistent twin is
    not built (without maps it would run one tile per CTA on a two-stage ring, a form nobody
    tuned: d64's, 0.69x cuDNN where the next rule's 64-row config gives 0.82; perf log "The
    d64 persistent forward for S <= 512"). The next matching rule serves the others (_select:
    where none does, such a persistent config still runs them)."""
    if config.needs_tensor_maps:
        return True
    return config.persistent and non_persistent_twin(config) not in built


def without_persistence(usable: dict, entry: KernelEntry) -> KernelEntry:
    """The config a call without tensor maps runs in place of ``entry``: a persistent
    config's non-persistent twin where it is built (the persistent kernel walks tiles only
    with maps; without them it runs one tile per CTA on two K/V stages where its twin has
    three), else ``entry`` itself."""
    if not entry.config.persistent:
        return entry
    return usable.get(non_persistent_twin(entry.config), entry)


def config_kernel(ctx: int, index: int, config: KernelConfig) -> Kernel:
    """The kernel of an explicit ``config`` (cudaflash.forward), loaded in context ``ctx``."""
    kernel = _config_kernels.get((ctx, config))
    if kernel is not None:
        return kernel
    dk = device_kernels(index)
    entry = dk.usable.get(config.name)
    if entry is None:
        raise ValueError(f"config {config.name} is not built for {dk.describe()}; configs "
                         f"built for it: {list(dk.usable) or 'none'}")
    if dk.debug:
        log.debug("cuda:%d explicit config %s", index, config.name)
    kernel = _config_kernels[(ctx, config)] = _make_kernel(dk, entry, ctx)
    return kernel


def _make_kernel(dk: DeviceKernels, entry: KernelEntry, ctx: int) -> Kernel:
    fns = _driver.get_functions(entry, dk.device.index, ctx)
    split_ctas = tuple(
        (role, max(1, _driver.max_active_ctas(getattr(fns, role), entry.threads,
                                              entry.entries[role].smem_bytes, entry.name)))
        for role in fns._fields if role.startswith("split"))
    return Kernel(fns=fns, label=f"cuLaunchKernel({entry.name})", block_rows=entry.config.B_r,
                  block_cols=entry.config.B_c, threads=entry.threads,
                  smem=tuple((role, e.smem_bytes) for role, e in entry.entries.items()),
                  synchronize=dk.debug, split_ctas=split_ctas,
                  tma_loads=entry.config.tma_loads, persistent=entry.config.persistent)


# ---- backward --------------------------------------------------------------------------------


def find_backward_entry(index: int, dtype: torch.dtype, d_head: int, scheme: str,
                        plain: bool = False, dropout: bool = False) -> BackwardEntry | None:
    """The backward module for (dtype, d_head, scheme) that runs on cuda:``index``, or None.
    ``plain``: the call has no score modifiers (softcap, ALiBi, dropout), so modules that
    serve only such calls may take it (BackwardConfig.plain_calls_only: d256's
    warp-specialized one). ``dropout`` (atomic scheme): only a module whose fused kernel
    applies dropout (BackwardConfig.fused_dropout)."""
    key = (index, dtype, d_head, scheme, plain, dropout)
    if key not in _backward_entries:
        device = _driver.device(index)
        usable = _manifest.load_manifest().usable_backward(device.arch, device.smem_optin)
        _backward_entries[key] = next(  # manifest order: configs.yaml's
            (e for e in usable.values()
             if e.config.dtype == DTYPES[dtype] and e.config.d_head == d_head
             and scheme in e.schemes and (scheme != "atomic" or e.config.fuses_dq)
             and (plain or not e.config.plain_calls_only)
             and (not dropout or e.config.fused_dropout)), None)
    return _backward_entries[key]


def check_backward_supported(index: int, dtype: torch.dtype, d_head: int, scheme: str) -> None:
    """Raise NotImplementedError unless a backward module serves this call: checked when the
    forward runs, so an unsupported training call fails before any work is done. The atomic
    scheme is served by the deterministic kernels where no module has the fused kernel (d256),
    as backward.run does."""
    if find_backward_entry(index, dtype, d_head, scheme) is None and (
            scheme != "atomic" or find_backward_entry(index, dtype, d_head, "deterministic")
            is None):
        device = _driver.device(index)
        raise NotImplementedError(
            f"no backward kernel for {DTYPES[dtype]} with head dim {d_head} runs on cuda:"
            f"{index} ({device.name}, sm_{device.arch}) in the {scheme} scheme; the backward "
            f"supports head dims "
            f"{list(BWD_D_HEADS)}. Call flash_attn_func under torch.no_grad() for inference")


def backward_kernel(ctx: int, index: int, dtype: torch.dtype, d_head: int,
                    scheme: str, plain: bool = False, dropout: bool = False) -> BackwardKernel:
    """The backward module for the call, loaded in context ``ctx`` (``plain``, ``dropout``:
    as in find_backward_entry)."""
    key = (ctx, index, dtype, d_head, scheme, plain, dropout)
    kernel = _backward_kernels.get(key)
    if kernel is None:
        entry = find_backward_entry(index, dtype, d_head, scheme, plain, dropout)
        if entry is None:  # the forward checked; only a changed manifest or switch gets here
            check_backward_supported(index, dtype, d_head, scheme)
            raise AssertionError("check_backward_supported did not raise")
        debug = _env.debug()
        if debug:
            log.debug("cuda:%d backward %s d_head=%d %s -> %s", index, DTYPES[dtype], d_head,
                      scheme, entry.name)
        kernel = _backward_kernels[key] = BackwardKernel(
            entry, _driver.get_functions(entry, index, ctx), debug)
    return kernel
