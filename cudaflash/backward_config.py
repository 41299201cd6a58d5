"""The backward kernel config model (cuda_src/flash_bwd.cu, cuda_src/bwd_warp_specialized.cuh):
``BackwardConfig``, one frozen dataclass shared by the build and the runtime, and the
backward's constants. The forward's model and what both share (entry roles, arch limits,
the validation of a config read from a mapping) are in config.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from .config import (ARCH_SMEM_LIMIT, DTYPES, ELEMENT_BYTES, N_WARPS, WGMMA_ARCH, EntryRole,
                     config_from_dict, runs_on)

BWD_D_HEADS = (64, 128, 256)
BWD_TILE_ROWS = (16, 32, 64, 128)
BWD_WS_STAGES = 2  # kBwdStages: the warp-specialized backward's Q/dO ring
# kBwdProducerRegs, kBwdConsumerRegs: the registers per thread setmaxnreg gives its producer
# warpgroup and its consumer warps. setmaxnreg.inc waits until the CTA's pool (the launch's
# registers x threads) holds them, so the build checks the pool (build_cubins.parse_ptxas).
BWD_WS_PRODUCER_REGS = 24
BWD_WS_CONSUMER_REGS = 240


BACKWARD_SCHEMES = ("atomic", "deterministic")  # flash_attn_func's deterministic False / True


@dataclass(frozen=True, order=True)
class BackwardConfig:
    """One backward module (cuda_src/flash_bwd.cu): its five kernels share these fields.

    - ``dtype``, ``d_head``: as in KernelConfig; d_head 64, 128 or 256. At 256 the dK and dV
      accumulators of a warp's keys do not fit its registers together, and the module serves
      the deterministic scheme only (``fuses_dq`` is false: its fused entries are traps). Its
      dK/dV kernel either runs a dV pass and a dK pass (mma.sync), or, warp_specialized, has
      two consumer warpgroups on the same 64 keys, one holding dV and one dK
      (cuda_src/bwd_warp_specialized_d256.cuh; ``plain_calls_only``: no score modifiers).
    - ``n_warps``: warps per CTA of the dK/dV and dQ kernels; each warp owns 16 rows of the
      CTA's own tile (keys in dK/dV, query rows in dQ), so a CTA owns 16 * n_warps of them.
    - ``B_r``: query rows per tile the dK/dV kernel streams past its keys.
    - ``B_c``: keys per tile the dQ kernel streams past its query rows.
    - ``wgmma``: the dK/dV kernels' GEMMs on Hopper's warpgroup MMA (sm_90a cubins only; the
      dQ kernel keeps mma.sync). Optional in configs.yaml, default false.
    - ``warp_specialized``: the atomic scheme's fused dK/dV + dQ kernel with a producer
      warpgroup (loads, dQ bulk reductions) beside the n_warps consumer warps
      (cuda_src/bwd_warp_specialized.cuh); at d256 the deterministic scheme's dK/dV kernel
      instead (``dkdv_warp_specialized``). Needs wgmma, n_warps 8 and B_r 64. Optional,
      default false.
    - ``ws_query_rows``: query rows per step of that kernel, 64 or 128 (128: its score GEMMs
      are N = 128 wgmmas and dQ two 64-row halves; its own tile, the module's other kernels
      keep B_r). Optional, default 64; 128 needs warp_specialized.
    """

    dtype: str
    d_head: int
    B_r: int
    B_c: int
    n_warps: int
    wgmma: bool = False
    warp_specialized: bool = False
    ws_query_rows: int = 64

    SOURCE = "flash_bwd.cu"
    ROLES = (EntryRole("preprocess", "cudaflash_bwd_preprocess"),  # delta = rowsum(dO * O)
             EntryRole("dkdv", "cudaflash_bwd_dkdv", "dkdv_smem_bytes"),
             EntryRole("dq", "cudaflash_bwd_dq", "dq_smem_bytes"),
             # the atomic scheme: dK, dV and dQ added to a float32 accumulator, then dQ
             EntryRole("dkdv_dq", "cudaflash_bwd_dkdv_dq", "dkdv_dq_smem_bytes"),
             EntryRole("dq_convert", "cudaflash_bwd_dq_convert"),
             EntryRole("dkdv_dq_window", "cudaflash_bwd_dkdv_dq_window", "dkdv_dq_smem_bytes"),
             # the deterministic scheme on a packed (varlen) batch (preprocess_varlen serves
             # both schemes)
             EntryRole("preprocess_varlen", "cudaflash_bwd_preprocess_varlen"),
             EntryRole("dkdv_varlen", "cudaflash_bwd_dkdv_varlen", "dkdv_smem_bytes"),
             EntryRole("dq_varlen", "cudaflash_bwd_dq_varlen", "dq_smem_bytes"),
             # with the score modifiers (softcapping, ALiBi): the deterministic scheme's dkdv
             # and dq (preprocess sees no score)
             EntryRole("dkdv_scoremod", "cudaflash_bwd_dkdv_scoremod", "dkdv_smem_bytes"),
             EntryRole("dq_scoremod", "cudaflash_bwd_dq_scoremod", "dq_smem_bytes"),
             EntryRole("dkdv_varlen_scoremod", "cudaflash_bwd_dkdv_varlen_scoremod",
                       "dkdv_smem_bytes"),
             EntryRole("dq_varlen_scoremod", "cudaflash_bwd_dq_varlen_scoremod",
                       "dq_smem_bytes"),
             # the atomic scheme on a packed batch (warp-specialized modules; elsewhere traps)
             EntryRole("dkdv_dq_varlen", "cudaflash_bwd_dkdv_dq_varlen", "dkdv_dq_smem_bytes"),
             EntryRole("dq_convert_varlen", "cudaflash_bwd_dq_convert_varlen"),
             # the atomic scheme with dropout (warp-specialized modules; elsewhere traps)
             EntryRole("dkdv_dq_dropout", "cudaflash_bwd_dkdv_dq_dropout", "dkdv_dq_smem_bytes"))
    ENTRIES = tuple(role.symbol for role in ROLES)
    PREPROCESS_THREADS = 128  # kPreprocessThreads: d_head / 8 lanes per query row

    @property
    def preprocess_rows(self) -> int:
        """Query rows per preprocess / dq_convert CTA (kPreprocessRows: each thread takes 8
        elements of a row)."""
        return self.PREPROCESS_THREADS * 8 // self.d_head

    @property
    def name(self) -> str:
        return (f"bwd_{self.dtype}_d{self.d_head}_br{self.B_r}_bc{self.B_c}"
                f"_w{self.n_warps}" + ("_wgmma" if self.wgmma else "")
                + ("_ws" if self.warp_specialized else "")
                + (f"_wsq{self.ws_query_rows}" if self.ws_query_rows != 64 else ""))

    @property
    def threads(self) -> int:
        return 32 * self.n_warps

    @property
    def fused_threads(self) -> int:
        """Threads per block of the fused dK/dV + dQ entries (dkdv_dq, dkdv_dq_window): the
        consumer warps, and the producer warpgroup when warp-specialized (kFusedThreads)."""
        return self.threads + (128 if self.warp_specialized else 0)

    @property
    def cta_rows(self) -> int:
        """Keys per dK/dV CTA and query rows per dQ CTA (dkdv_cta_rows: the dK/dV kernel's)."""
        return 16 * self.n_warps

    @property
    def dkdv_warp_specialized(self) -> bool:
        """The deterministic dK/dV kernel is the d256 warp-specialized one
        (bwd_warp_specialized_d256.cuh): a producer warpgroup and two consumer warpgroups on
        the same 64 keys."""
        return self.warp_specialized and self.d_head == 256

    @property
    def fused_dropout(self) -> bool:
        """Its dkdv_dq_dropout entry is the fused kernel with dropout (the warp-specialized
        dK/dV + dQ kernel, d64 and d128); elsewhere that entry traps (flash_bwd.cu,
        bwd_dkdv_dq_dropout) and dropout takes the deterministic scheme's *_scoremod
        entries."""
        return self.warp_specialized and not self.dkdv_warp_specialized

    @property
    def plain_calls_only(self) -> bool:
        """The module serves calls without score modifiers only (softcap, ALiBi, dropout):
        its score-modifier entries are traps (dispatch.find_backward_entry's ``plain``)."""
        return self.dkdv_warp_specialized

    @property
    def dkdv_threads(self) -> int:
        """Threads per block of the dK/dV entries."""
        return self.fused_threads if self.dkdv_warp_specialized else self.threads

    @property
    def dq_threads(self) -> int:
        """Threads per block of the dQ entries (the d256 warp-specialized kernel's too)."""
        return self.dkdv_threads

    @property
    def dq_cta_rows(self) -> int:
        """Query rows per dQ CTA (64 in the d256 warp-specialized kernel)."""
        return self.dkdv_cta_rows

    @property
    def dkdv_cta_rows(self) -> int:
        """Keys per dK/dV CTA (kD256Keys for the d256 warp-specialized kernel)."""
        return 64 if self.dkdv_warp_specialized else self.cta_rows

    @property
    def dkdv_smem_bytes(self) -> int:
        """K and V of the CTA, Q and dO double-buffered, lse and delta (float32) per buffer.
        The d256 warp-specialized kernel: K and V of 64 keys, a ring of BWD_WS_STAGES stages
        of Q, dO, lse and delta (64 rows), two P^T hand-off buffers (128 threads x 64 bytes),
        the mbarriers (K/V, and full + empty per stage)."""
        if self.dkdv_warp_specialized:
            stages, rows, keys = BWD_WS_STAGES, 64, 64
            return (2 * keys * self.d_head * ELEMENT_BYTES
                    + stages * (2 * rows * self.d_head * ELEMENT_BYTES + 2 * rows * 4)
                    + 2 * 128 * 64 + 8 * (1 + 2 * stages))
        return (2 * self.cta_rows + 4 * self.B_r) * self.d_head * ELEMENT_BYTES + 4 * self.B_r * 4

    @property
    def dkdv_dq_smem_bytes(self) -> int:
        """dkdv_smem_bytes and the step's dS^T, (cta_rows, 64) 16-bit values; with wgmma at
        d128 also two dQ tiles for the bulk reductions, (B_r, d_head) float32
        (bwd_config.cuh kBulkDq). 0 at d256, whose fused entries are traps."""
        if not self.fuses_dq:
            return 0
        if self.warp_specialized:
            return self.warp_specialized_smem_bytes
        dq_tiles = 2 * self.B_r * self.d_head * 4 if self.wgmma and self.d_head == 128 else 0
        return self.dkdv_smem_bytes + self.cta_rows * 64 * ELEMENT_BYTES + dq_tiles

    @property
    def warp_specialized_smem_bytes(self) -> int:
        """The warp-specialized fused kernel (bwd_warp_specialized.cuh): K and V; a ring of
        BWD_WS_STAGES stages of Q, dO, lse and delta (ws_query_rows rows); two dS^T tiles
        (cta_rows, ws_query_rows); two dQ tiles (ws_query_rows, d_head) float32; the mbarriers
        (K/V, and full + empty per stage)."""
        stages, rows = BWD_WS_STAGES, self.ws_query_rows
        return (2 * self.cta_rows * self.d_head * ELEMENT_BYTES
                + stages * (2 * rows * self.d_head * ELEMENT_BYTES + 2 * rows * 4)
                + 2 * self.cta_rows * rows * ELEMENT_BYTES + 2 * rows * self.d_head * 4
                + 8 * (1 + 2 * stages))

    @property
    def dq_smem_bytes(self) -> int:
        """Q and dO of the CTA, K and V double-buffered. The d256 warp-specialized kernel: Q
        and dO of its 64 rows, a ring of BWD_WS_STAGES stages of K and V (B_c keys), two P
        and two dS hand-off buffers (128 threads x 64 bytes each), lse and delta of its rows,
        the mbarriers (Q/dO, and full + empty per stage)."""
        if self.dkdv_warp_specialized:
            stages, rows = BWD_WS_STAGES, 64
            return ((2 * rows + stages * 2 * self.B_c) * self.d_head * ELEMENT_BYTES
                    + 4 * 128 * 64 + 2 * rows * 4 + 8 * (1 + 2 * stages))
        return (2 * self.cta_rows + 4 * self.B_c) * self.d_head * ELEMENT_BYTES

    @property
    def smem_bytes(self) -> int:
        return max(self.dkdv_smem_bytes, self.dkdv_dq_smem_bytes, self.dq_smem_bytes)

    def fits_arch(self, arch: int) -> bool:
        return self.smem_bytes <= ARCH_SMEM_LIMIT[arch]

    @property
    def arch_specific(self) -> bool:
        """As KernelConfig.arch_specific: wgmma modules are sm_90a SASS only, no PTX. Without
        it (mma.sync), SASS for sm_8x runs on later 8.x and the PTX JITs anywhere."""
        return self.wgmma

    def builds_for(self, arch: int) -> bool:
        return self.fits_arch(arch) and (not self.wgmma or arch == WGMMA_ARCH)

    def runs_on(self, kind: str, built_arch: int, device_arch: int) -> bool:
        return runs_on(kind, built_arch, device_arch, self.arch_specific)

    def nvcc_defines(self) -> dict[str, int]:
        """The -D macros of cuda_src/bwd_config.cuh."""
        return {"CF_DTYPE_BF16": int(self.dtype == "bf16"), "CF_D_HEAD": self.d_head,
                "CF_B_R": self.B_r, "CF_B_C": self.B_c, "CF_N_WARPS": self.n_warps,
                "CF_WGMMA": int(self.wgmma), "CF_WARP_SPECIALIZED": int(self.warp_specialized),
                "CF_WS_QUERY_ROWS": self.ws_query_rows}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def fuses_dq(self) -> bool:
        """Whether the module has the atomic scheme's fused dK/dV + dQ kernel (d256's
        compile to traps: flash_bwd.cu, bwd_dkdv_dq), so whether it can serve that scheme."""
        return self.d_head != 256

    def errors(self) -> list[str]:
        """Every rule this config breaks (mirrors the static_asserts in bwd_config.cuh)."""
        errs: list[str] = []

        def bad(field: str, msg: str) -> None:
            errs.append(f"{field}={getattr(self, field)!r}: {msg}")

        if self.dtype not in DTYPES:
            bad("dtype", f"must be one of {list(DTYPES)}")
        if self.d_head not in BWD_D_HEADS:
            bad("d_head", f"must be one of {list(BWD_D_HEADS)} for the backward")
        if self.n_warps not in N_WARPS:
            bad("n_warps", f"must be one of {list(N_WARPS)}")
        rows_per_pass = 4 * self.n_warps  # threads / 8: one cooperative copy pass
        for field in ("B_r", "B_c"):
            value = getattr(self, field)
            if value not in BWD_TILE_ROWS or value % rows_per_pass:
                bad(field, f"must be one of {list(BWD_TILE_ROWS)} and a multiple of "
                           f"{rows_per_pass} rows (one copy pass of {self.n_warps} warps)")
        if self.B_r > self.threads:
            bad("B_r", f"must be at most the {self.threads} threads (one per query row "
                       "loads its lse and delta)")
        # The dK/dV kernel with atomic dQ (kDqCols in bwd_config.cuh).
        if self.B_r % 16 == 0 and 0 < self.B_r and self.n_warps in N_WARPS:
            blocks = self.B_r // 16
            cols = self.d_head // (self.n_warps // blocks) if self.n_warps % blocks == 0 else 0
            if self.B_r > 64 or self.n_warps % blocks:
                bad("B_r", f"must be at most 64 with B_r / 16 dividing n_warps={self.n_warps} "
                           "(the atomic dQ split)")
            elif cols % 16 or (cols > 64 and cols % 64):
                bad("B_r", f"gives d_head / (n_warps / (B_r / 16)) = {cols} dQ columns per "
                           "warp; they must be whole 16-column slices within one 64-column "
                           "slab, or whole slabs")
        if self.d_head == 256 and self.wgmma and not (self.warp_specialized
                                                      and self.ws_query_rows == 64
                                                      and self.B_c == 64):
            bad("d_head", "256 runs the two-pass mma.sync dK/dV kernel (wgmma false) or the "
                          "warp-specialized kernels (wgmma, warp_specialized, ws_query_rows "
                          "64, B_c 64)")
        if self.wgmma and self.B_r != 64:
            bad("B_r", "must be 64 with wgmma (the step's dQ = dS K is one 64-row wgmma)")
        if self.warp_specialized and not (self.wgmma and self.n_warps == 8 and self.B_r == 64):
            bad("warp_specialized", "needs wgmma, n_warps 8 and B_r 64 (two consumer "
                                    "warpgroups of 64 keys)")
        if self.ws_query_rows not in (64, 128) or (self.ws_query_rows == 128
                                                    and not self.warp_specialized):
            bad("ws_query_rows", "must be 64, or 128 with warp_specialized")
        if not errs and not any(self.fits_arch(a) for a in ARCH_SMEM_LIMIT):
            bad("B_c", f"shared memory {self.smem_bytes} bytes exceeds every arch's limit")
        if not errs and self.wgmma and not self.fits_arch(WGMMA_ARCH):
            bad("B_c", f"shared memory {self.smem_bytes} bytes exceeds sm_{WGMMA_ARCH}'s limit "
                       "(wgmma modules build for it only)")
        return errs

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "config") -> "BackwardConfig":
        return config_from_dict(cls, data, where)
