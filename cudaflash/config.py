"""The kernel config model: one frozen dataclass shared by the build and the runtime.

A ``KernelConfig`` holds every field that changes the compiled forward kernel. The same
validation rules live here (for the build and the runtime) and as ``static_assert``s in
``cuda_src/kernel_config.cuh`` (for anyone compiling by hand). The canonical name built by
``KernelConfig.name`` is the cubin file name, the manifest key, the pytest id and the debug tag.

Field semantics follow the seed kernel (see docs/design.md):

- ``dtype``: element type of Q/K/V/O (``fp16`` or ``bf16``); accumulation is always fp32.
- ``d_head``: head dimension, a multiple of 64 (shared memory is tiled in 64-column slabs).
- ``B_r`` / ``B_c``: query rows per CTA / key rows per inner iteration.
- ``n_warps``: warps per CTA; each warp owns ``B_r / n_warps`` query rows.
- ``async_copy``: global->shared copies with ``cp.async`` (true) or through registers (false).
- ``eager_load_blocks``: prefetch the next K block and the current V block while computing
  (true) or load each block right before its use (false). Needs ``async_copy``.
- ``swizzled``: XOR-swizzled shared-memory layout (no bank conflicts for ldmatrix).
- ``{Q,K,V}_mma_load_K_fragments``: how many 8-column fragments of the operand are moved from
  shared memory to registers per load step. 0 loads the whole operand at once (for Q: once per
  CTA, before the KV loop); n > 0 loads n/2 16-column k-slices per step, interleaved with the mma.
- ``mma_double_buffer_loads``: prefetch the next k-slice group before the mma of the current one.
- ``optimized_softmax``: a specialised first KV iteration that initialises the row max and sum
  from the first score tile and skips the rescale; with eager loads, the first block's V is
  then also loaded before the loop, with Q and the first K.
- ``min_ctas_per_sm``: the occupancy the kernel is compiled for (``__launch_bounds__``): ptxas
  keeps registers within 65536 / (min_ctas_per_sm * threads), at most 255. More resident warps
  hide more latency; fewer registers may mean spills (the build reports them).
- ``wgmma``: the GEMMs run on Hopper's warpgroup MMA (``wgmma.mma_async``, sm_90a cubins only)
  instead of warp-level ``mma.sync``: each warpgroup of 4 warps owns 64 query rows and the
  tensor cores read Q, K and V straight from the swizzled shared tiles, so the fragment-loading
  fields (``*_mma_load_K_fragments``, ``mma_double_buffer_loads``) do not apply and must be 0.

Four more of the seed's optimizations are knobs with a default (what the knob ablations
measured best, or no worse: docs/perf-log.md), so they are optional in configs.yaml and
appear in the name only when they differ from it:

- ``exp2_softmax`` (seed step 6): scores in base-2 units, softmax_scale * log2(e) folded into
  one FFMA before MUFU.EX2 (true); or natural units, exp(x) as ex2(x * log2(e)): one more
  FMUL per score (false, name suffix ``_natexp``).
- ``kv_reverse`` (seed step 13): KV blocks last to first (true), so the masked blocks (the
  seqlen_k tail, the causal diagonal) come first; or first to last (false, ``_kvfwd``).
- ``d_head_tiled`` (seed step 15): shared tiles stored as d_head / 64 slabs of (rows, 64)
  (true); or as whole rows of d_head elements (false, ``_untiled``; d_head >= 128 only, at 64
  both are the same layout; wgmma needs the slabs).
- ``o_store_cache`` (seed step 14): the cache hint of O's global stores: ``default`` (plain
  st.global), ``streaming`` (st.global.cs: evict first, name suffix ``_ocs``) or
  ``no_allocate`` (st.global.L1::no_allocate, the seed's choice, ``_ona``).

One Hopper knob beyond the seed, also optional (default false):

- ``warp_specialized``: a producer warpgroup (128 threads more than ``n_warps`` count) loads
  Q and a three-stage ring of K/V blocks with cp.async and mbarriers, while two consumer
  warpgroups (``n_warps`` = 8, B_r = 128; or three, ``n_warps`` = 12, B_r = 192) take turns
  on the tensor cores (named barriers: one's GEMMs run under the others' softmax) and issue
  P V of the previous block with
  Q K^T of the current one; ``setmaxnreg`` moves registers from the producer to them
  (cuda_src/fwd_warp_specialized.cuh; name suffix ``_ws``). Needs wgmma, eager loads and
  min_ctas_per_sm = 1.
- ``persistent``: with warp_specialized, where the host gives tensor maps (a padded batch,
  big enough: _tma.worth_maps) one CTA per SM walks the call's tiles, the producer loading
  the next tile's Q (a second Q buffer) and K/V while the consumers finish the current one;
  two K/V stages instead of three (name suffix ``_pers``).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any, Mapping

DTYPES = ("fp16", "bf16")
D_HEADS = (64, 128, 256)
N_WARPS = (4, 8, 12)  # 12: warp_specialized only (three consumer warpgroups)
MIN_CTAS_PER_SM = (1, 2, 3, 4)
ROWS_PER_WARP = (16, 32)
B_C_VALUES = (32, 64, 128)
O_STORE_CACHE = ("default", "streaming", "no_allocate")
_O_STORE_TOKEN = {"streaming": "_ocs", "no_allocate": "_ona"}

# Largest dynamic shared memory one block may opt into, per arch (CUDA C Programming Guide,
# compute capability table). The build uses it to decide which arch a config is compiled
# for; the runtime reads the real limit off the device instead.
ARCH_SMEM_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}

ELEMENT_BYTES = 2  # fp16 and bf16
# The warp-specialized kernel (cuda_src/fwd_warp_specialized.cuh): its producer warpgroup, on
# top of the n_warps consumers, and its mbarriers after the tiles (kWsBarrierBytes).
WS_PRODUCER_THREADS = 128
WS_BARRIER_BYTES = 128
# ... and per key of a block, the ALiBi entries' table of key columns after the mbarriers
# (fwd_warp_specialized.cuh: 16 bytes a row).
WS_ALIBI_COLUMN_BYTES = 16
WGMMA_ARCH = 90  # wgmma exists on sm_90a only (Hopper); Blackwell has tcgen05 instead


def runs_on(kind: str, built_arch: int, device_arch: int, arch_specific: bool) -> bool:
    """Whether a module compiled as ``kind`` ("cubin" or "ptx") for ``built_arch`` runs on a
    GPU of compute capability ``device_arch``: SASS for sm_XY runs on sm_XZ with Z >= Y
    (arch-specific SASS, sm_90a, on sm_XY only); PTX for compute_N JITs for any arch >= N.
    The one compatibility rule of the build and the runtime, for every kernel family."""
    if kind == "ptx":
        return device_arch >= built_arch
    if arch_specific:
        return device_arch == built_arch
    return built_arch // 10 == device_arch // 10 and built_arch <= device_arch


@dataclass(frozen=True)
class EntryRole:
    """One extern "C" entry of a kernel family (the ROLES of KernelConfig and BackwardConfig:
    the only list of them): ``name`` is the attribute of the functions _driver loads, by which
    launch.py and backward.py launch it; ``smem`` the config property with its dynamic shared
    memory. The manifest carries role -> (symbol, smem bytes) per module (module_record)."""

    name: str
    symbol: str
    smem: str | None = None

    def smem_bytes(self, cfg) -> int:
        return getattr(cfg, self.smem) if self.smem else 0


class ConfigError(ValueError):
    """A kernel config that cannot be built; the message names the config and the field."""


@dataclass(frozen=True, order=True)
class KernelConfig:
    dtype: str
    d_head: int
    B_r: int
    B_c: int
    n_warps: int
    async_copy: bool
    eager_load_blocks: bool
    swizzled: bool
    Q_mma_load_K_fragments: int
    K_mma_load_K_fragments: int
    V_mma_load_K_fragments: int
    mma_double_buffer_loads: bool
    optimized_softmax: bool
    min_ctas_per_sm: int
    wgmma: bool
    exp2_softmax: bool = True
    kv_reverse: bool = True
    d_head_tiled: bool = True
    o_store_cache: str = "default"
    warp_specialized: bool = False
    persistent: bool = False

    # The translation unit under cuda_src/ and, by role, the extern "C" entries every module
    # of this family exports (EntryRole: the one table of them).
    SOURCE = "flash_fwd.cu"
    ROLES = (EntryRole("forward", "cudaflash_fwd", "smem_bytes"),
             # the forward over one run of KV blocks per CTA (float32 partials) ...
             EntryRole("split", "cudaflash_fwd_split", "smem_bytes"),
             EntryRole("combine", "cudaflash_combine"),  # ... and the kernel merging them
             # with softcapping (Params.softcap_pre), and ALiBi when alibi_slopes is set ...
             EntryRole("forward_softcap", "cudaflash_fwd_softcap", "smem_bytes"),
             EntryRole("split_softcap", "cudaflash_fwd_split_softcap", "smem_bytes"),
             # ... and with ALiBi alone (Params.alibi_slopes)
             EntryRole("forward_alibi", "cudaflash_fwd_alibi", "alibi_smem_bytes"),
             EntryRole("split_alibi", "cudaflash_fwd_split_alibi", "alibi_smem_bytes"),
             # the six above reading flash_attn_with_kvcache's cache addressing (paged K/V,
             # cache_batch_idx, cache_leftpad: Params.block_table and after)
             EntryRole("forward_kvcache", "cudaflash_fwd_kvcache", "smem_bytes"),
             EntryRole("split_kvcache", "cudaflash_fwd_split_kvcache", "smem_bytes"),
             EntryRole("forward_softcap_kvcache", "cudaflash_fwd_softcap_kvcache", "smem_bytes"),
             EntryRole("split_softcap_kvcache", "cudaflash_fwd_split_softcap_kvcache",
                       "smem_bytes"),
             EntryRole("forward_alibi_kvcache", "cudaflash_fwd_alibi_kvcache",
                       "alibi_smem_bytes"),
             EntryRole("split_alibi_kvcache", "cudaflash_fwd_split_alibi_kvcache",
                       "alibi_smem_bytes"),
             # flash_attn_with_kvcache's append of new keys and values (AppendParams)
             EntryRole("append_kv", "cudaflash_append_kv"),
             # with dropout (Params.dropout_*): whole, plain scores or ALiBi
             EntryRole("forward_dropout", "cudaflash_fwd_dropout", "smem_bytes"),
             EntryRole("forward_dropout_alibi", "cudaflash_fwd_dropout_alibi",
                       "alibi_smem_bytes"))
    ENTRIES = tuple(role.symbol for role in ROLES)

    # ---- derived quantities ---------------------------------------------------------------

    @property
    def name(self) -> str:
        """Canonical name, built from every field (parsed back by ``from_name``); the fields
        with a default appear only when they differ from it."""
        return (
            f"fwd_{self.dtype}_d{self.d_head}_br{self.B_r}_bc{self.B_c}_w{self.n_warps}"
            f"_async{int(self.async_copy)}_eager{int(self.eager_load_blocks)}"
            f"_swz{int(self.swizzled)}"
            f"_q{self.Q_mma_load_K_fragments}k{self.K_mma_load_K_fragments}"
            f"v{self.V_mma_load_K_fragments}"
            f"_dbuf{int(self.mma_double_buffer_loads)}_osm{int(self.optimized_softmax)}"
            f"_ctas{self.min_ctas_per_sm}_wgmma{int(self.wgmma)}"
            + ("" if self.exp2_softmax else "_natexp")
            + ("" if self.kv_reverse else "_kvfwd")
            + ("" if self.d_head_tiled else "_untiled")
            + _O_STORE_TOKEN.get(self.o_store_cache, "")
            + ("_ws" if self.warp_specialized else "")
            + ("_pers" if self.persistent else "")
        )

    @property
    def threads(self) -> int:
        """Per CTA: the n_warps computing warps, and a producer warpgroup when warp
        specialized."""
        return 32 * self.n_warps + (WS_PRODUCER_THREADS if self.warp_specialized else 0)

    @property
    def kv_stages(self) -> int:
        """K/V blocks resident in shared memory at once (the producer's ring): three, or two
        at d_head 256, where three would not fit (kKvStages, kernel_config.cuh)."""
        if not self.warp_specialized:
            return 1
        return 2 if self.d_head == 256 or self.persistent else 3

    @property
    def copy_threads(self) -> int:
        """The threads that copy tiles: all of them, or the producer warpgroup."""
        return WS_PRODUCER_THREADS if self.warp_specialized else self.threads

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: one Q block (reused for O) plus kv_stages K and V blocks,
        and the mbarriers of the kernels that can load through TMA (the warp-specialized
        kernel's ring, kWsBarrierBytes; the wgmma kernel's three tiles, in the same room)."""
        q_buffers = 2 if self.persistent else 1  # (kQBuffers)
        rows = q_buffers * self.B_r + 2 * self.kv_stages * self.B_c
        tiles = rows * self.d_head * ELEMENT_BYTES
        return tiles + (WS_BARRIER_BYTES if self.tma_loads else 0)

    @property
    def alibi_smem_bytes(self) -> int:
        """smem_bytes of the entries with ALiBi alone (and dropout's with ALiBi): the
        warp-specialized kernel's add ALiBi's column part inside Q K^T and read a table of a
        block's key columns after the mbarriers (WS_ALIBI_COLUMN_BYTES per key). Only
        they launch with it (each entry launches with its own bytes: dispatch.Kernel)."""
        return self.smem_bytes + (self.B_c * WS_ALIBI_COLUMN_BYTES if self.warp_specialized
                                  else 0)

    @property
    def tma_loads(self) -> bool:
        """The kernel can load its tiles through TMA tensor maps (Params.tma_loads): the
        warp-specialized kernel, and the wgmma kernel with eager loads (flash_fwd.cu)."""
        return self.warp_specialized or (self.wgmma and self.eager_load_blocks)

    @property
    def needs_tensor_maps(self) -> bool:
        """Dispatch gives this config only calls that launch.run expects to load through
        tensor maps (a padded batch big enough for them); the others (packed batches, cache
        addressing, key counts, small calls) take the next rule that matches. Three consumer
        warpgroups (n_warps = 12) leave the producer 32 registers: its cp.async copies of
        paged or indexed caches spilled there, so its *_kvcache entries are not compiled (they
        trap: flash_fwd.cu). A padded call it gets may still launch without maps (split-KV, a
        sliding window's short span: launch_function decides): its cp.async path for padded
        batches is compiled and tested (test_gpu_tma), not tuned."""
        return self.warp_specialized and self.n_warps == 12

    @property
    def module_smem_bytes(self) -> int:
        """The most any of its entries launches with: what must fit an arch (the runtime's
        test of a module, manifest.KernelEntry.smem_bytes, takes the same maximum)."""
        return max(role.smem_bytes(self) for role in self.ROLES)

    def fits_arch(self, arch: int) -> bool:
        return self.module_smem_bytes <= ARCH_SMEM_LIMIT[arch]

    @property
    def arch_specific(self) -> bool:
        """Compiled for one exact GPU arch (sm_90a for wgmma): no PTX is built, and the SASS
        runs on that compute capability only."""
        return self.wgmma

    def builds_for(self, arch: int) -> bool:
        """Whether a cubin of this config exists for ``arch``: its shared memory fits, and an
        arch-specific config is built for its one arch only."""
        return self.fits_arch(arch) and (not self.arch_specific or arch == WGMMA_ARCH)

    def runs_on(self, kind: str, built_arch: int, device_arch: int) -> bool:
        """Whether this config compiled as ``kind`` ("cubin" or "ptx") for ``built_arch``
        runs on a GPU of compute capability ``device_arch`` (``runs_on``)."""
        return runs_on(kind, built_arch, device_arch, self.arch_specific)

    def nvcc_defines(self) -> dict[str, int]:
        """The -D macros that instantiate this config in cuda_src/flash_fwd.cu."""
        return {
            "CF_DTYPE_BF16": int(self.dtype == "bf16"),
            "CF_D_HEAD": self.d_head,
            "CF_B_R": self.B_r,
            "CF_B_C": self.B_c,
            "CF_N_WARPS": self.n_warps,
            "CF_ASYNC_COPY": int(self.async_copy),
            "CF_EAGER_LOAD_BLOCKS": int(self.eager_load_blocks),
            "CF_SWIZZLED": int(self.swizzled),
            "CF_Q_FRAGS": self.Q_mma_load_K_fragments,
            "CF_K_FRAGS": self.K_mma_load_K_fragments,
            "CF_V_FRAGS": self.V_mma_load_K_fragments,
            "CF_DOUBLE_BUFFER": int(self.mma_double_buffer_loads),
            "CF_OPTIMIZED_SOFTMAX": int(self.optimized_softmax),
            "CF_MIN_CTAS_PER_SM": self.min_ctas_per_sm,
            "CF_WGMMA": int(self.wgmma),
            "CF_EXP2_SOFTMAX": int(self.exp2_softmax),
            "CF_KV_REVERSE": int(self.kv_reverse),
            "CF_D_HEAD_TILED": int(self.d_head_tiled),
            "CF_O_STORE_CACHE": O_STORE_CACHE.index(self.o_store_cache),  # validated
            "CF_WARP_SPECIALIZED": int(self.warp_specialized),
            "CF_PERSISTENT": int(self.persistent),
        }

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---- validation -----------------------------------------------------------------------

    def errors(self) -> list[str]:
        """Every rule this config breaks, as '<field>: <what is wrong>' strings.

        Mirrors the static_asserts in cuda_src/kernel_config.cuh.
        """
        errs: list[str] = []

        def bad(field: str, msg: str) -> None:
            errs.append(f"{field}={getattr(self, field)!r}: {msg}")

        if self.dtype not in DTYPES:
            bad("dtype", f"must be one of {list(DTYPES)}")
        if self.d_head not in D_HEADS:
            bad("d_head", f"must be one of {list(D_HEADS)}")
        if self.n_warps not in N_WARPS:
            bad("n_warps", f"must be one of {list(N_WARPS)}")
        elif self.n_warps == 12 and not self.warp_specialized:
            bad("n_warps", "12 needs warp_specialized=True (three consumer warpgroups)")
        if self.B_c not in B_C_VALUES:
            bad("B_c", f"must be one of {list(B_C_VALUES)}")
        if self.n_warps in N_WARPS:
            if self.B_r % self.n_warps or self.B_r // self.n_warps not in ROWS_PER_WARP:
                bad("B_r", f"B_r / n_warps must be one of {list(ROWS_PER_WARP)} "
                           f"(each warp owns whole 16-row mma tiles); n_warps={self.n_warps}")
            # One cooperative global->shared pass covers threads/8 rows (8 threads x 16 bytes
            # per 64-column row slab), so block heights must be multiples of it.
            rows_per_pass = self.copy_threads // 8
            if self.B_c in B_C_VALUES and self.B_c % rows_per_pass:
                bad("B_c", f"must be a multiple of {rows_per_pass} rows (one copy pass of "
                           f"{self.copy_threads // 32} warps)")
        for field, k_dim in (("Q_mma_load_K_fragments", self.d_head),
                             ("K_mma_load_K_fragments", self.d_head),
                             ("V_mma_load_K_fragments", self.B_c)):
            n = getattr(self, field)
            whole = k_dim // 8  # fragments (8 columns each) along the reduction dimension
            limit = whole // 2 if self.mma_double_buffer_loads else whole - 1
            if not isinstance(n, int) or n < 0 or (n and (n & (n - 1) or n == 1)):
                bad(field, "must be 0 (whole operand) or an even power of two")
            elif n > limit:
                why = ("at most half the operand so that two slice groups alternate"
                       if self.mma_double_buffer_loads else
                       "less than the whole operand (0 already means whole)")
                bad(field, f"must be <= {limit} for a reduction dimension of {k_dim}: {why}")
        if self.Q_mma_load_K_fragments not in (0, self.K_mma_load_K_fragments):
            bad("Q_mma_load_K_fragments",
                f"must be 0 or equal K_mma_load_K_fragments={self.K_mma_load_K_fragments} "
                "(Q and K slices are loaded together)")
        if self.mma_double_buffer_loads and not (
                self.Q_mma_load_K_fragments or self.K_mma_load_K_fragments
                or self.V_mma_load_K_fragments):
            bad("mma_double_buffer_loads",
                "needs at least one operand loaded in slices (a *_mma_load_K_fragments > 0)")
        if self.min_ctas_per_sm not in MIN_CTAS_PER_SM:
            bad("min_ctas_per_sm", f"must be one of {list(MIN_CTAS_PER_SM)} (4 CTAs of 256 "
                                   "threads leave 64 registers per thread)")
        if self.eager_load_blocks and not self.async_copy:
            bad("eager_load_blocks", "needs async_copy=True (synchronous copies cannot overlap)")
        if self.wgmma:
            if self.B_r != 16 * self.n_warps:
                bad("B_r", f"must be 16 * n_warps = {16 * self.n_warps} with wgmma (each "
                           "warpgroup of 4 warps owns 64 query rows)")
            if self.B_c < 64:
                bad("B_c", "must be >= 64 with wgmma")
            if not (self.async_copy and self.swizzled):
                bad("swizzled", "wgmma reads 128-byte-swizzled tiles written by cp.async: "
                                "needs swizzled=True and async_copy=True")
            for field in ("Q_mma_load_K_fragments", "K_mma_load_K_fragments",
                          "V_mma_load_K_fragments", "mma_double_buffer_loads"):
                if getattr(self, field):
                    bad(field, "must be 0 with wgmma (the tensor cores read shared memory; "
                               "there are no fragments to load)")
        if self.warp_specialized:
            wrong = [f for f, ok in (("wgmma", self.wgmma),
                                     ("n_warps", self.n_warps in (8, 12)),
                                     ("min_ctas_per_sm", self.min_ctas_per_sm == 1),
                                     ("eager_load_blocks", self.eager_load_blocks)) if not ok]
            for field in wrong:
                bad(field, "warp_specialized needs wgmma=True, n_warps=8 or 12 (two or three "
                           "consumer warpgroups), min_ctas_per_sm=1 and "
                           "eager_load_blocks=True")
        if self.persistent and not self.warp_specialized:
            bad("persistent", "needs warp_specialized=True")
        if self.o_store_cache not in O_STORE_CACHE:
            bad("o_store_cache", f"must be one of {list(O_STORE_CACHE)}")
        if not self.d_head_tiled:
            if self.d_head == 64:
                bad("d_head_tiled", "must be True at d_head=64 (one 64-column slab: both "
                                    "layouts are the same)")
            if self.wgmma:
                bad("d_head_tiled", "must be True with wgmma (its descriptors address "
                                    "(rows, 64) slabs of 128-byte rows)")
        if not any(self.fits_arch(a) for a in ARCH_SMEM_LIMIT):
            bad("B_r", f"shared memory {self.module_smem_bytes} bytes exceeds every arch's "
                       "limit")
        return errs

    def validate(self) -> "KernelConfig":
        errs = self.errors()
        if errs:
            raise ConfigError(f"invalid kernel config {self._label()}: " + "; ".join(errs))
        return self

    def _label(self) -> str:
        try:
            return self.name
        except Exception:  # a field of the wrong type can break the name itself
            return repr(self)

    # ---- construction ---------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "config") -> "KernelConfig":
        """Build and validate a config from a mapping with exactly the dataclass fields."""
        return config_from_dict(cls, data, where)

    @classmethod
    def from_name(cls, name: str) -> "KernelConfig":
        m = _NAME_RE.fullmatch(name)
        if not m:
            raise ConfigError(f"{name!r} is not a canonical kernel config name "
                              "(expected e.g. fwd_bf16_d128_br128_bc64_w4_async1_eager1_swz1"
                              "_q2k2v0_dbuf1_osm1_ctas1_wgmma0)")
        g = m.groupdict()
        data = {k: (v if k == "dtype" else int(v)) for k, v in g.items()
                if k not in _NAME_SUFFIXES}
        for k in ("async_copy", "eager_load_blocks", "swizzled", "mma_double_buffer_loads",
                  "optimized_softmax", "wgmma"):
            data[k] = bool(data[k])
        data["exp2_softmax"] = g["natexp"] is None
        data["kv_reverse"] = g["kvfwd"] is None
        data["d_head_tiled"] = g["untiled"] is None
        data["o_store_cache"] = {None: "default", "cs": "streaming", "na": "no_allocate"}[
            g["ostore"]]
        data["warp_specialized"] = g["ws"] is not None
        data["persistent"] = g["pers"] is not None
        return cls.from_dict(data, where=f"config name {name!r}")


_NAME_RE = re.compile(
    r"fwd_(?P<dtype>[a-z0-9]+)_d(?P<d_head>\d+)_br(?P<B_r>\d+)_bc(?P<B_c>\d+)_w(?P<n_warps>\d+)"
    r"_async(?P<async_copy>[01])_eager(?P<eager_load_blocks>[01])_swz(?P<swizzled>[01])"
    r"_q(?P<Q_mma_load_K_fragments>\d+)k(?P<K_mma_load_K_fragments>\d+)"
    r"v(?P<V_mma_load_K_fragments>\d+)"
    r"_dbuf(?P<mma_double_buffer_loads>[01])_osm(?P<optimized_softmax>[01])"
    r"_ctas(?P<min_ctas_per_sm>\d+)_wgmma(?P<wgmma>[01])"
    r"(?P<natexp>_natexp)?(?P<kvfwd>_kvfwd)?(?P<untiled>_untiled)?(?:_o(?P<ostore>cs|na))?"
    r"(?P<ws>_ws)?(?P<pers>_pers)?")
_NAME_SUFFIXES = ("natexp", "kvfwd", "untiled", "ostore", "ws", "pers")  # optional tokens


def config_from_dict(cls, data: Mapping[str, Any], where: str):
    """Build and validate a ``cls`` config from a mapping with exactly its fields."""
    fields = {f.name: f.type for f in dataclasses.fields(cls)}
    defaults = {f.name: f.default for f in dataclasses.fields(cls)
                if f.default is not dataclasses.MISSING}
    unknown = sorted(set(data) - set(fields))
    missing = sorted(set(fields) - set(data) - set(defaults))
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(fields)}")
    if missing:
        raise ConfigError(f"{where}: missing field(s) {missing}")
    data = {**defaults, **data}
    for key, typ in fields.items():
        value = data[key]
        want = {"str": str, "int": int, "bool": bool}[typ]
        if want is int and isinstance(value, bool) or not isinstance(value, want):
            raise ConfigError(f"{where}: field {key}={value!r} must be a {typ}")
    cfg = cls(**{key: data[key] for key in fields})
    errs = cfg.errors()
    if errs:
        raise ConfigError(f"{where} ({cfg.name}): " + "; ".join(errs))
    return cfg
