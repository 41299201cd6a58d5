"""The kernel manifest: what build_cubins.py built, written and read by this module only.

``manifest.json`` (schema in docs/contracts.md) is the only contract between the build and the
runtime: the runtime never parses file names and never recomputes shared-memory sizes. The
build composes it with ``module_record`` and ``manifest_dict`` and writes it with ``write``;
the runtime reads and checks it (``load_manifest``) and answers "which kernels can run on a GPU
of compute capability X with Y bytes of opt-in shared memory per block". It needs no GPU and
imports no torch (build_cubins.py loads it by path where torch is not installed).
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, NamedTuple

from . import _env
from ._params import BWD_PARAMS_BYTES, PARAMS_BYTES
from .backward_config import BackwardConfig
from .config import KernelConfig
from .driver_compat import describe_driver
from .selection import Rule, parse_rules

# 5: a padded batch's cu_seqlens_k holds key counts (flash_attn_with_kvcache); kernels of
# schema 4 would ignore them and attend to the whole cache, so they are refused.
# 6: BwdParams carries the sliding window (360 bytes) and each backward module has a
# dkdv_dq_window_entry.
# 7: Params and BwdParams carry softcap_pre (248 and 368 bytes); each forward module has
# softcap_entry and softcap_split_entry, each backward module softcap_entries.
# 8: cubins assembled by a CUDA 12 ptxas (R525+) from PTX lowered to the ISA it needs; every
# entry records ptxas_version, ptx_isa and min_driver (the oldest CUDA driver version that
# loads the file), checked against cuDriverGetVersion before the first load.
# 9: each module lists its kernel entries as one table, "entries": {role: {"symbol",
# "smem_bytes"}} (config.EntryRole), instead of the *_entry, varlen_entries, softcap_entries
# and *_smem_bytes fields and the top-level entries/backward_entries lists. Same kernels.
# 10: each backward module records fused_threads, the block size of its fused dK/dV + dQ
# entries (384 where warp-specialized: BackwardConfig.warp_specialized), and the atomic
# scheme's dQ accumulator holds seqlen_q rounded up to 64 rows per head.
# 11: Params and BwdParams carry ALiBi (alibi_scale, alibi_slopes, alibi_batch_stride: 304
# and 384 bytes); each forward module adds the *_alibi roles (forward_alibi, split_alibi and
# their _kvcache forms), its *_softcap entries also apply ALiBi, and the backward's
# *_softcap roles are *_scoremod (softcapping and ALiBi: dkdv_scoremod, ...).
# 12: Params and BwdParams carry dropout (dropout_threshold, dropout_seed, dropout_scale: 320
# and 400 bytes); each forward module adds the forward_dropout role (cudaflash_fwd_dropout),
# and the backward's *_scoremod entries also apply dropout.
# 13: each forward module adds the forward_dropout_alibi role (cudaflash_fwd_dropout_alibi:
# dropout with ALiBi).
# 14: Params carries the tensor maps of q, k and v and tma_loads (in place of reserved):
# 704 bytes; the warp-specialized forward loads through them when tma_loads is 1.
# 15: the wgmma (v6) forward also loads through the tensor maps (KernelConfig.tma_loads),
# with 128 bytes of mbarriers after its tiles: a build from schema 14 would ignore the maps.
# 16: BwdParams carries the warp-specialized backward's padded row statistics and the tensor
# maps of q, k, v and dout (960 bytes, 64-byte aligned: launched through kernelParams); that
# kernel loads through them only.
# 17: Params carries tile_counter after the split-KV workspace pointers (768 bytes): the
# persistent forward's causal calls take their tiles from it.
# 18: backward modules carry dkdv_dq_varlen and dq_convert_varlen (the atomic scheme on a
# packed batch).
# 19: backward modules carry dkdv_dq_dropout (the atomic scheme with dropout; a trap unless
# BackwardConfig.fused_dropout).
# 20: Params carries alibi_score_bound after alibi_batch_stride (768 bytes: maps_pad 56 -> 40);
# the forward's *_alibi entries skip the keys outside ALiBi's band when it is set.
SCHEMA = 20
KINDS = ("cubin", "ptx")
MANIFEST_NAME = "manifest.json"


class EntryPoint(NamedTuple):
    """One kernel entry of a module, as the manifest lists it under its role."""

    symbol: str  # the extern "C" name
    smem_bytes: int  # the dynamic shared memory it is launched with (0: none)


@dataclass(frozen=True)
class KernelEntry:
    """One compiled kernel: a config built for one arch, as the manifest lists it."""

    name: str  # canonical config name (KernelConfig.name)
    config: KernelConfig
    arch: int  # compute capability as major*10+minor; for PTX the virtual arch
    kind: str  # "cubin" (SASS for one major) or "ptx" (JIT-compiled by the driver)
    path: Path  # absolute
    # role (KernelConfig.ROLES: forward, split, combine, ...) -> its symbol and smem
    entries: Mapping[str, EntryPoint] = field(hash=False)
    threads: int  # per block
    registers: int | None  # per thread; None for PTX (decided by the JIT)
    spill_bytes: int | None
    sha256: str
    # The oldest CUDA driver that loads the file (cuDriverGetVersion units, 12000 = CUDA 12.0),
    # read off the file by the build (cudaflash/driver_compat.py), and what made it.
    min_driver: int
    ptxas_version: str  # the ptxas that assembled the cubin (or checked the PTX)
    ptx_isa: str  # the PTX ISA the code was declared as, e.g. "8.3"

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory per block of the module's largest entry (the forward's)."""
        return max(e.smem_bytes for e in self.entries.values())


@dataclass(frozen=True)
class BackwardEntry:
    """One compiled backward module (BackwardConfig) for one arch, as the manifest lists it."""

    name: str  # BackwardConfig.name
    config: BackwardConfig
    arch: int
    kind: str  # "cubin" or "ptx"
    path: Path  # absolute
    # role (BackwardConfig.ROLES: preprocess, dkdv, dq, dkdv_dq, ...) -> its symbol and smem
    entries: Mapping[str, EntryPoint] = field(hash=False)
    threads: int  # per block of the dK/dV and dQ kernels
    fused_threads: int  # per block of the fused dK/dV + dQ entries (dkdv_dq, dkdv_dq_window)
    preprocess_threads: int
    preprocess_rows: int  # query rows per preprocess block
    cta_rows: int  # keys per dK/dV block, query rows per dQ block
    schemes: tuple[str, ...]  # the backward schemes this module is selected for
    registers: int | None
    spill_bytes: int | None
    sha256: str
    min_driver: int  # as in KernelEntry
    ptxas_version: str
    ptx_isa: str

    @property
    def smem_bytes(self) -> int:
        return max(e.smem_bytes for e in self.entries.values())


@dataclass(frozen=True)
class Manifest:
    path: Path
    nvcc_version: str
    ptxas_version: str
    source_hash: str
    # The oldest CUDA driver version that loads all cubins, and all PTX: {"cubin": 12000, ...}
    min_driver: dict
    ptx_arch: int | None
    selection: tuple[Rule, ...]
    kernels: tuple[KernelEntry, ...]
    backward: tuple[BackwardEntry, ...] = ()

    def describe_toolchain(self) -> str:
        """'nvcc 13.0.88 + ptxas 12.9.86; needs a driver for: cubins CUDA 12.0 (R525+), ...'"""
        floors = ", ".join(f"{kind}s {describe_driver(v)}"
                           for kind, v in self.min_driver.items() if v is not None)
        return (f"nvcc {self.nvcc_version} + ptxas {self.ptxas_version}; needs a driver for: "
                f"{floors}")

    def usable_backward(self, arch: int, smem_limit: int) -> dict[str, BackwardEntry]:
        """``usable`` for the backward modules."""
        return _usable(self.backward, arch, smem_limit)

    def usable(self, arch: int, smem_limit: int) -> dict[str, KernelEntry]:
        """The kernels that run on a device of compute capability ``arch``, by config name.

        Per config: the cubin of the highest compatible arch, else the PTX (contracts.md,
        "Arch compatibility"); configs needing more shared memory than ``smem_limit`` (the
        device's opt-in maximum per block) are left out. Manifest order is kept: selection
        falls back to the first usable config of a (dtype, d_head).
        """
        return _usable(self.kernels, arch, smem_limit)


def _usable(entries, arch: int, smem_limit: int) -> dict:
    best: dict = {}
    for e in entries:
        if e.smem_bytes > smem_limit or not runs_on(e, arch):
            continue
        held = best.get(e.name)
        if held is None or _preference(e) > _preference(held):
            best[e.name] = e
    return best


def runs_on(entry: KernelEntry | BackwardEntry, arch: int) -> bool:
    """Whether ``entry`` runs on a GPU of compute capability ``arch`` (KernelConfig.runs_on)."""
    return entry.config.runs_on(entry.kind, entry.arch, arch)


def _preference(entry: KernelEntry) -> tuple[bool, int]:
    return entry.kind == "cubin", entry.arch


def load_manifest() -> Manifest:
    """The manifest of ``CUDAFLASH_KERNEL_DIR`` (default: the package's kernels/), cached."""
    return _read(_env.kernel_dir())


def clear_cache() -> None:
    _read.cache_clear()


@functools.lru_cache(maxsize=None)
def _read(kernel_dir: Path) -> Manifest:
    path = kernel_dir / MANIFEST_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise RuntimeError(
            f"cudaflash was installed without its kernels: {path} does not exist. Build them "
            "from a source checkout with `python build_cubins.py` (needs nvcc) and reinstall, "
            "or set CUDAFLASH_KERNEL_DIR to a directory holding manifest.json and the "
            "cubins.") from None
    try:
        data = json.loads(text)
        return _parse(data, path)
    except (ValueError, KeyError, TypeError) as e:
        # ConfigError is a ValueError: a bad config or rule is a malformed manifest too.
        raise RuntimeError(f"{path} is malformed ({type(e).__name__}: {e}); rebuild it with "
                           "`python build_cubins.py`") from None


def _check_struct_size(data: dict, key: str, expected: int) -> None:
    if data[key] != expected:
        raise ValueError(f"{key}={data[key]} but cudaflash/_params.py packs {expected} bytes: "
                         "kernels and runtime come from different sources")


def _entry_config(cls, k: dict, where: str):
    """The validated config of manifest entry ``k`` (a ``cls``), after checking the entry's
    name and kind against it."""
    config = cls.from_dict(k["config"], where=f"{where}.config")
    if k["name"] != config.name:
        raise ValueError(f"{where}: name {k['name']!r} is not the canonical name "
                         f"{config.name!r} of its config")
    if k["kind"] not in KINDS:
        raise ValueError(f"{where}: kind {k['kind']!r}, expected one of {KINDS}")
    return config


def _entry_points(cls, k: dict, where: str) -> dict[str, EntryPoint]:
    """A module's role -> EntryPoint table: exactly the roles this runtime launches."""
    table = k["entries"]
    roles = [role.name for role in cls.ROLES]
    if sorted(table) != sorted(roles):
        raise ValueError(f"{where}: entry roles {sorted(table)}, this cudaflash launches "
                         f"{roles}")
    return {role: EntryPoint(str(table[role]["symbol"]), int(table[role]["smem_bytes"]))
            for role in roles}


def _module(cls, k: dict, path: Path, where: str) -> dict:
    """The fields every manifest entry (forward or backward) has, read and checked."""
    if not isinstance(k["min_driver"], int) or k["min_driver"] < 11000:
        raise ValueError(f"{k['file']}: min_driver={k['min_driver']!r} is not a CUDA driver "
                         "version such as 12000")
    return {"name": k["name"], "config": _entry_config(cls, k, where), "arch": int(k["arch"]),
            "kind": k["kind"], "path": path.parent / k["file"],
            "entries": _entry_points(cls, k, where), "threads": int(k["threads"]),
            "registers": k["registers"], "spill_bytes": k["spill_bytes"],
            "sha256": k["sha256"], "min_driver": k["min_driver"],
            "ptxas_version": str(k["ptxas_version"]), "ptx_isa": str(k["ptx_isa"])}


def _parse(data: dict, path: Path) -> Manifest:
    if data["schema"] != SCHEMA:
        raise ValueError(f"schema {data['schema']!r}, this cudaflash reads schema {SCHEMA}")
    _check_struct_size(data, "params_bytes", PARAMS_BYTES)
    _check_struct_size(data, "bwd_params_bytes", BWD_PARAMS_BYTES)
    kernels = tuple(KernelEntry(**_module(KernelConfig, k, path, f"kernels[{i}]"))
                    for i, k in enumerate(data["kernels"]))
    backward = tuple(
        BackwardEntry(**_module(BackwardConfig, k, path, f"backward_kernels[{i}]"),
                      fused_threads=int(k["fused_threads"]),
                      preprocess_threads=int(k["preprocess_threads"]),
                      preprocess_rows=int(k["preprocess_rows"]), cta_rows=int(k["cta_rows"]),
                      schemes=tuple(k["schemes"]))
        for i, k in enumerate(data["backward_kernels"]))
    selection = parse_rules(data["selection"], where=path.name)
    return Manifest(path=path, nvcc_version=data["nvcc_version"],
                    ptxas_version=data["ptxas_version"], min_driver=dict(data["min_driver"]),
                    source_hash=data["source_hash"], ptx_arch=data.get("ptx_arch"),
                    selection=selection, kernels=kernels, backward=backward)


# ---- writing (build_cubins.py; the tests' fake kernel directories) ---------------------------


def module_record(cfg: KernelConfig | BackwardConfig, *, arch: int, kind: str, file: str,
                  sha256: str, registers: int | None, spill_bytes: int | None,
                  nvcc_version: str, ptxas_version: str, ptx_isa: str, min_driver: int,
                  source_hash: str, schemes=None) -> dict:
    """The manifest entry of ``cfg`` built for ``arch`` as ``kind`` into ``file`` (relative
    to the kernel directory); ``schemes``: a backward module's (configs.yaml ``scheme``)."""
    record = {
        "name": cfg.name,
        "config": cfg.to_dict(),
        "arch": arch,
        "kind": kind,
        "file": file,
        "entries": {role.name: {"symbol": role.symbol, "smem_bytes": role.smem_bytes(cfg)}
                    for role in cfg.ROLES},
        "threads": cfg.threads,
    }
    if isinstance(cfg, BackwardConfig):
        # The dK/dV and dQ kernels' block (d256's warp-specialized ones: 384 threads, 64 rows).
        record.update(threads=cfg.dkdv_threads, fused_threads=cfg.fused_threads,
                      preprocess_threads=cfg.PREPROCESS_THREADS,
                      preprocess_rows=cfg.preprocess_rows, cta_rows=cfg.dkdv_cta_rows,
                      schemes=list(schemes))
    record.update(registers=registers, spill_bytes=spill_bytes, sha256=sha256,
                  nvcc_version=nvcc_version, ptxas_version=ptxas_version, ptx_isa=ptx_isa,
                  min_driver=min_driver, source_hash=source_hash)
    return record


def manifest_dict(*, kernels: list, backward_kernels: list, nvcc_version: str,
                  ptxas_version: str, source_hash: str, params_bytes: int,
                  bwd_params_bytes: int, ptx_arch: int, selection: list) -> dict:
    """The whole manifest: ``kernels`` and ``backward_kernels`` are module_record()s,
    ``selection`` the rules as dicts (selection.Rule.to_dict), the struct sizes as the CUDA
    headers declare them (kParamsBytes, kBwdParamsBytes)."""
    every = kernels + backward_kernels
    return {
        "schema": SCHEMA,
        "nvcc_version": nvcc_version,
        "ptxas_version": ptxas_version,
        # The oldest driver that loads every cubin (every PTX) of this build, for messages
        # and the README; the runtime checks each file's own floor before loading it.
        "min_driver": {kind: max((k["min_driver"] for k in every if k["kind"] == kind),
                                 default=None) for kind in KINDS},
        "source_hash": source_hash,
        "params_bytes": params_bytes,
        "bwd_params_bytes": bwd_params_bytes,
        "archs": sorted({k["arch"] for k in every if k["kind"] == "cubin"}),
        "ptx_arch": ptx_arch,
        "selection": selection,
        "kernels": kernels,
        "backward_kernels": backward_kernels,
    }


def write(kernel_dir: Path, manifest: dict) -> Path:
    """Write ``manifest`` as ``kernel_dir``/manifest.json, atomically; returns the path."""
    path = Path(kernel_dir) / MANIFEST_NAME
    write_atomic(path, json.dumps(manifest, indent=2) + "\n")
    return path


def write_atomic(path: Path, data) -> None:
    """Write ``data`` (str or bytes) through a temp file in the same directory + os.replace:
    readers never see half."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
