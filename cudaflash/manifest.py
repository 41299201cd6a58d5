"""The kernel manifest: what build_cubins.py built, read by the runtime.

``manifest.json`` (schema in docs/contracts.md) is the only contract between the build and the
runtime: the runtime never parses file names and never recomputes shared-memory sizes. This
module reads and checks it and answers "which kernels can run on a GPU of compute capability
X with Y bytes of opt-in shared memory per block". It needs no GPU.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from . import _env
from ._params import BWD_PARAMS_BYTES, PARAMS_BYTES
from .config import BackwardConfig, KernelConfig
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
SCHEMA = 8
KINDS = ("cubin", "ptx")


@dataclass(frozen=True)
class KernelEntry:
    """One compiled kernel: a config built for one arch, as the manifest lists it."""

    name: str  # canonical config name (KernelConfig.name)
    config: KernelConfig
    arch: int  # compute capability as major*10+minor; for PTX the virtual arch
    kind: str  # "cubin" (SASS for one major) or "ptx" (JIT-compiled by the driver)
    path: Path  # absolute
    entry: str  # the forward's extern "C" symbol
    split_entry: str  # the split-KV forward's
    combine_entry: str  # the kernel that merges split-KV partial results
    softcap_entry: str  # the forward with softcapping (Params.softcap_pre)
    softcap_split_entry: str  # the split-KV forward with softcapping
    threads: int  # per block
    smem_bytes: int  # dynamic shared memory per block
    registers: int | None  # per thread; None for PTX (decided by the JIT)
    spill_bytes: int | None
    sha256: str
    # The oldest CUDA driver that loads the file (cuDriverGetVersion units, 12000 = CUDA 12.0),
    # read off the file by the build (cudaflash/driver_compat.py), and what made it.
    min_driver: int
    ptxas_version: str  # the ptxas that assembled the cubin (or checked the PTX)
    ptx_isa: str  # the PTX ISA the code was declared as, e.g. "8.3"


@dataclass(frozen=True)
class BackwardEntry:
    """One compiled backward module (BackwardConfig) for one arch, as the manifest lists it."""

    name: str  # BackwardConfig.name
    config: BackwardConfig
    arch: int
    kind: str  # "cubin" or "ptx"
    path: Path  # absolute
    preprocess_entry: str  # delta = rowsum(dO * O)
    dkdv_entry: str
    dq_entry: str
    dkdv_dq_entry: str  # dK, dV and the atomic dQ accumulation (non-deterministic scheme)
    dq_convert_entry: str  # dQ = scale * accumulator
    dkdv_dq_window_entry: str  # dkdv_dq with a sliding window
    # preprocess, dkdv and dq of a packed (varlen) batch, each CTA on its own sequence
    varlen_entries: tuple[str, str, str]
    # with softcapping (the deterministic scheme): dkdv, dq, dkdv_varlen, dq_varlen
    softcap_entries: tuple[str, str, str, str]
    threads: int  # per block of the dK/dV and dQ kernels
    preprocess_threads: int
    preprocess_rows: int  # query rows per preprocess block
    cta_rows: int  # keys per dK/dV block, query rows per dQ block
    dkdv_smem_bytes: int
    dq_smem_bytes: int
    dkdv_dq_smem_bytes: int
    schemes: tuple[str, ...]  # the backward schemes this module is selected for
    registers: int | None
    spill_bytes: int | None
    sha256: str
    min_driver: int  # as in KernelEntry
    ptxas_version: str
    ptx_isa: str

    @property
    def smem_bytes(self) -> int:
        return max(self.dkdv_smem_bytes, self.dq_smem_bytes, self.dkdv_dq_smem_bytes)


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
    path = kernel_dir / "manifest.json"
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


def _floor(k: dict) -> dict:
    """An entry's toolchain and driver floor fields."""
    if not isinstance(k["min_driver"], int) or k["min_driver"] < 11000:
        raise ValueError(f"{k['file']}: min_driver={k['min_driver']!r} is not a CUDA driver "
                         "version such as 12000")
    return {"min_driver": k["min_driver"], "ptxas_version": str(k["ptxas_version"]),
            "ptx_isa": str(k["ptx_isa"])}


def _parse(data: dict, path: Path) -> Manifest:
    if data["schema"] != SCHEMA:
        raise ValueError(f"schema {data['schema']!r}, this cudaflash reads schema {SCHEMA}")
    _check_struct_size(data, "params_bytes", PARAMS_BYTES)
    _check_struct_size(data, "bwd_params_bytes", BWD_PARAMS_BYTES)
    kernels = []
    for i, k in enumerate(data["kernels"]):
        config = _entry_config(KernelConfig, k, f"kernels[{i}]")
        kernels.append(KernelEntry(
            name=k["name"], config=config, arch=int(k["arch"]), kind=k["kind"],
            path=path.parent / k["file"], entry=k["entry"], split_entry=k["split_entry"],
            combine_entry=k["combine_entry"], softcap_entry=k["softcap_entry"],
            softcap_split_entry=k["softcap_split_entry"], threads=int(k["threads"]),
            smem_bytes=int(k["smem_bytes"]), registers=k["registers"],
            spill_bytes=k["spill_bytes"], sha256=k["sha256"], **_floor(k)))
    backward = []
    for i, k in enumerate(data["backward_kernels"]):
        config = _entry_config(BackwardConfig, k, f"backward_kernels[{i}]")
        backward.append(BackwardEntry(
            name=k["name"], config=config, arch=int(k["arch"]), kind=k["kind"],
            path=path.parent / k["file"], preprocess_entry=k["preprocess_entry"],
            dkdv_entry=k["dkdv_entry"], dq_entry=k["dq_entry"],
            dkdv_dq_entry=k["dkdv_dq_entry"], dq_convert_entry=k["dq_convert_entry"],
            dkdv_dq_window_entry=k["dkdv_dq_window_entry"],
            varlen_entries=tuple(k["varlen_entries"]),
            softcap_entries=tuple(k["softcap_entries"]), threads=int(k["threads"]),
            preprocess_threads=int(k["preprocess_threads"]),
            preprocess_rows=int(k["preprocess_rows"]), cta_rows=int(k["cta_rows"]),
            dkdv_smem_bytes=int(k["dkdv_smem_bytes"]), dq_smem_bytes=int(k["dq_smem_bytes"]),
            dkdv_dq_smem_bytes=int(k["dkdv_dq_smem_bytes"]), schemes=tuple(k["schemes"]),
            registers=k["registers"], spill_bytes=k["spill_bytes"], sha256=k["sha256"],
            **_floor(k)))
    selection = parse_rules(data["selection"], where=path.name)
    return Manifest(path=path, nvcc_version=data["nvcc_version"],
                    ptxas_version=data["ptxas_version"], min_driver=dict(data["min_driver"]),
                    source_hash=data["source_hash"], ptx_arch=data.get("ptx_arch"),
                    selection=selection, kernels=tuple(kernels), backward=tuple(backward))
