#!/usr/bin/env python3
"""Compile every kernel config of configs.yaml and write cudaflash/kernels/.

    python build_cubins.py [-j N] [--configs PATH] [--out DIR] [--src DIR] [--nvcc PATH]
                           [--ptxas PATH] [--only SUBSTRING] [--archs 80,90]
    python build_cubins.py --check WHEEL_OR_KERNEL_DIR [--max-cubin-driver 12.0]
                           [--max-ptx-driver 12.3]

One job per (config, arch): ``sm_XX/<name>.cubin`` for every arch of configs.yaml whose
shared-memory limit the config fits, plus ``ptx/compute_XX/<name>.ptx`` for ``ptx_arch`` so
newer GPUs can JIT it. Each job runs two tools: nvcc's front end writes PTX, then ptxas
assembles it. The PTX's ``.version`` is lowered to the lowest ISA its code needs (ptxas says
which), and the ptxas is a CUDA 12 one when one is found (the ``nvidia-cuda-nvcc-cu12``
package, a build requirement), so the cubins are in the CUDA 12 format every driver from R525
on loads, whatever nvcc wrote the PTX (see cudaflash/driver_compat.py). Then
``manifest.json`` (schema: docs/contracts.md) is written atomically, recording per file the
toolkit that wrote it and the oldest driver that loads it. A job is skipped when its output
exists and its ``.stamp`` file holds the same sha256 of (source files, commands, tool
versions). The build stops at the first error and prints that command with the tool's log.

``--check`` reads a built kernel directory or a wheel and fails unless every file's format
matches what the manifest says, and no cubin (PTX) needs a newer driver than the maximum
given: CI's guard against a CUDA 13 cubin slipping into the wheel.

``--only`` and ``--archs`` build a subset (the manifest then lists only that subset); files
of other configs are kept so that the next full build does not redo them. Files of configs
no longer in configs.yaml are removed.

This script runs inside pip's isolated build environment (setup.py calls ``build``), where
torch is not installed: it loads cudaflash/config.py and cudaflash/selection.py by path
instead of importing cudaflash. Environment (for setup.py, which takes no arguments):
CUDAFLASH_NVCC (nvcc path), CUDAFLASH_PTXAS (ptxas path), CUDAFLASH_SRC_DIR (kernel
sources, default cuda_src), CUDAFLASH_BUILD_JOBS (parallel jobs, default: usable CPU cores).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

ROOT = Path(__file__).resolve().parent

# Flags of every nvcc (front end, to PTX) and ptxas run; they are part of each job's stamp.
# -std=c++17: the kernel headers use if constexpr. nvcc's -O3 is its host-side level (the
# device front end optimises fully by default); it is listed so hand builds match. ptxas -v
# prints registers, spills and stack per entry, which go into the manifest.
NVCC_FLAGS = ("-O3", "-std=c++17")
PTXAS_FLAGS = ("-O3", "-v")

# Each kernel family is one translation unit under the source dir (config.SOURCE) exporting a
# fixed set of extern "C" entries (config.ROLES: the one table of them, which the manifest
# carries per module): the forward (flash_fwd.cu) and the backward (flash_bwd.cu).
PARAMS_HEADER = "params.cuh"  # holds `constexpr int kParamsBytes = N;`
BWD_PARAMS_HEADER = "bwd_params.cuh"  # holds `constexpr int kBwdParamsBytes = N;`
YAML_KEYS = ("archs", "ptx_arch", "defaults", "configs", "selection", "backward")


def _load_cudaflash_modules():
    """Import cudaflash/config.py, config_file.py, selection.py, driver_compat.py and
    manifest.py (which writes the manifest) without cudaflash/__init__.py.

    The package __init__ imports torch, which pip's build environment does not have. A
    stand-in package whose __path__ is the cudaflash directory lets selection.py keep its
    relative ``from .config import ...``.
    """
    pkg_name = "_cudaflash_build"
    if pkg_name not in sys.modules:
        spec = importlib.machinery.ModuleSpec(pkg_name, None, is_package=True)
        pkg = importlib.util.module_from_spec(spec)
        pkg.__path__ = [str(ROOT / "cudaflash")]
        sys.modules[pkg_name] = pkg
    return (importlib.import_module(f"{pkg_name}.config"),
            importlib.import_module(f"{pkg_name}.backward_config"),
            importlib.import_module(f"{pkg_name}.config_file"),
            importlib.import_module(f"{pkg_name}.selection"),
            importlib.import_module(f"{pkg_name}.driver_compat"),
            importlib.import_module(f"{pkg_name}.manifest"))


config, backward_config, config_file, selection, driver_compat, manifest = _load_cudaflash_modules()
ConfigError = config.ConfigError
MANIFEST_NAME, KINDS = manifest.MANIFEST_NAME, manifest.KINDS
write_atomic = manifest.write_atomic


def _symbol(cls, role: str) -> str:
    return next(r.symbol for r in cls.ROLES if r.name == role)


# The entry a PTX job's check compiles, per module family: the one that assembles fastest.
SMALLEST_ENTRY = {"KernelConfig": _symbol(config.KernelConfig, "combine"),
                  "BackwardConfig": _symbol(backward_config.BackwardConfig, "dq_convert")}


class BuildError(RuntimeError):
    """nvcc failed or produced something that breaks the manifest contract."""


# ---- the build plan ----------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """configs.yaml, validated."""

    archs: tuple
    ptx_arch: int
    configs: tuple  # KernelConfig, in file order
    rules: tuple  # selection.Rule
    backward_configs: tuple = ()  # BackwardConfig, in file order
    # The backward schemes each backward config serves (its entry's `scheme`, default both):
    # per call, the first config listed for the call's dtype, head dim and scheme runs it.
    backward_schemes: dict = field(default_factory=dict)
    # Configs whose entry names its own `archs` (a subset of the file's), e.g. to keep a config
    # off an arch where ptxas spills its registers; every other config gets all archs.
    config_archs: dict = field(default_factory=dict)

    def cubin_archs(self, cfg) -> tuple:
        """The archs ``cfg`` is compiled for: its entry's (or all) archs it builds for."""
        return tuple(a for a in self.config_archs.get(cfg, self.archs) if cfg.builds_for(a))


@dataclass(frozen=True)
class Job:
    cfg: "config.KernelConfig"
    kind: str  # "cubin" or "ptx"
    arch: int

    @property
    def target(self) -> str:
        """sm_XY for a cubin, compute_XY for PTX."""
        return f"sm_{self.arch}" if self.kind == "cubin" else f"compute_{self.arch}"

    @property
    def label(self) -> str:
        return f"{self.cfg.name} {self.target}" + (" (ptx)" if self.kind == "ptx" else "")

    @property
    def file(self) -> str:
        """Relative to the output dir, as recorded in the manifest."""
        if self.kind == "cubin":
            return f"{self.target}/{self.cfg.name}.cubin"
        return f"ptx/{self.target}/{self.cfg.name}.ptx"


def nvcc_argv(cfg, arch: int, kind: str, *, nvcc: str, src_dir: Path, out: Path) -> list:
    """The nvcc command that compiles one config to PTX for one arch (pure: no I/O); ptxas
    then assembles it (``ptxas_argv``)."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; allowed: {list(KINDS)}")
    defines = [f"-D{macro}={value}" for macro, value in cfg.nvcc_defines().items()]
    return [nvcc, "-ptx", f"-arch=compute_{ptxas_target(cfg, arch, kind)[3:]}", *NVCC_FLAGS,
            "-I", str(src_dir), *defines, str(src_dir / cfg.SOURCE), "-o", str(out)]


def ptxas_target(cfg, arch: int, kind: str) -> str:
    """The SASS target of a job: sm_XY, or sm_XYa for wgmma configs (their SASS runs on sm_90
    GPUs only). A PTX job assembles for its own arch to prove the shipped PTX compiles."""
    return f"sm_{arch}a" if cfg.arch_specific and kind == "cubin" else f"sm_{arch}"


def ptxas_argv(cfg, arch: int, kind: str, *, ptxas: str, ptx: Path, out: Path) -> list:
    """The ptxas command that assembles a job's PTX (pure). A PTX job compiles only its
    smallest entry: ptxas parses (and checks the ISA of) the whole file either way."""
    only = [] if kind == "cubin" else ["-e", SMALLEST_ENTRY[type(cfg).__name__]]
    return [ptxas, f"-arch={ptxas_target(cfg, arch, kind)}", *PTXAS_FLAGS, *only, str(ptx),
            "-o", str(out)]


def load_spec(path: Path) -> Spec:
    where = path.name
    data = config_file.read_yaml(path, "config file")
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping with keys {list(YAML_KEYS)}")
    unknown = sorted(set(data) - set(YAML_KEYS), key=str)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {list(YAML_KEYS)}")
    for key in ("archs", "ptx_arch", "configs"):
        if key not in data:
            raise ConfigError(f"{where}: missing key {key!r}")

    known = sorted(config.ARCH_SMEM_LIMIT)
    archs = data["archs"]
    if (not isinstance(archs, list) or not archs
            or any(a not in config.ARCH_SMEM_LIMIT or isinstance(a, bool) for a in archs)
            or len(set(archs)) != len(archs)):
        raise ConfigError(f"{where}: archs={archs!r} must be a non-empty list of distinct archs "
                          f"from {known} (the ones with a known smem limit in config.py)")
    ptx_arch = data["ptx_arch"]
    if not isinstance(ptx_arch, int) or isinstance(ptx_arch, bool) or ptx_arch < min(known):
        raise ConfigError(f"{where}: ptx_arch={ptx_arch!r} must be an integer compute "
                          f"capability >= {min(known)}")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ConfigError(f"{where}: defaults={defaults!r} must be a mapping of config fields")
    if not isinstance(data["configs"], list) or not data["configs"]:
        raise ConfigError(f"{where}: configs must be a non-empty list of config entries")
    configs, config_archs = [], {}
    for i, entry in enumerate(data["configs"]):
        label = f"{where} configs[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{label} must be a mapping of config fields, got {entry!r}")
        fields = {k: v for k, v in entry.items() if k != "archs"}
        expanded = config_file.expand_config_entries([fields], defaults, where=label)
        if "archs" in entry:
            only = entry["archs"]
            if not isinstance(only, list) or not only or any(a not in archs for a in only):
                raise ConfigError(f"{label}: archs={only!r} must be a non-empty list of archs "
                                  f"from the file's archs {sorted(archs)}")
            config_archs.update((cfg, tuple(sorted(only))) for cfg in expanded)
        configs += expanded
    duplicates = sorted({c.name for c in configs if configs.count(c) > 1})
    if duplicates:
        raise ConfigError(f"{where}: configs listed more than once: {duplicates}")
    backward = data.get("backward") or []
    if not isinstance(backward, list):
        raise ConfigError(f"{where}: backward must be a list of backward config entries")
    backward_configs, backward_schemes = [], {}
    for i, entry in enumerate(backward):
        label = f"{where} backward[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{label} must be a mapping of config fields, got {entry!r}")
        fields = {k: v for k, v in entry.items() if k != "scheme"}
        expanded = config_file.expand_config_entries([fields], where=label,
                                                cls=backward_config.BackwardConfig)
        schemes = entry.get("scheme", list(backward_config.BACKWARD_SCHEMES))
        schemes = schemes if isinstance(schemes, list) else [schemes]
        if not schemes or any(s not in backward_config.BACKWARD_SCHEMES for s in schemes):
            raise ConfigError(f"{label}: scheme={entry['scheme']!r} must be one of (or a list "
                              f"of) {list(backward_config.BACKWARD_SCHEMES)}")
        for cfg in expanded:
            if cfg in backward_schemes:
                raise ConfigError(f"{label}: {cfg.name} is already listed")
            if "atomic" in schemes and not cfg.fuses_dq:
                raise ConfigError(f"{label}: {cfg.name} has no fused dK/dV + dQ kernel (d_head "
                                  f"{cfg.d_head}): give it scheme: deterministic")
            backward_schemes[cfg] = tuple(s for s in backward_config.BACKWARD_SCHEMES if s in schemes)
        backward_configs += expanded
    spec = Spec(archs=tuple(sorted(archs)), ptx_arch=ptx_arch, configs=tuple(configs),
                rules=selection.parse_rules(data.get("selection") or [], where=where),
                backward_configs=tuple(backward_configs), config_archs=config_archs,
                backward_schemes=backward_schemes)
    _check_rules_built(spec, where)
    return spec


def _check_rules_built(spec: Spec, where: str) -> None:
    """Every name a rule can produce must be a listed config built for the rule's archs."""
    by_name = {cfg.name: cfg for cfg in spec.configs}
    jobs = {cfg: [] for cfg in spec.configs}
    for job in plan_jobs(spec):
        if job.cfg in jobs:  # forward configs: the rules' targets
            jobs[job.cfg].append(job)
    for rule in spec.rules:
        for dtype in rule.dtypes():
            name = rule.config_name(dtype)
            cfg = by_name.get(name)
            if cfg is None:
                raise ConfigError(f"{where}: rule {rule.index}: config {name!r} is not in the "
                                  "configs list, so it is never built (add it to configs, or "
                                  "give the rule a dtype condition if it serves one dtype)")
            for arch in rule.arch or ():
                if arch in config.ARCH_SMEM_LIMIT and not cfg.fits_arch(arch):
                    raise ConfigError(
                        f"{where}: rule {rule.index}: config {name!r} needs "
                        f"{cfg.module_smem_bytes} bytes of shared memory, more than sm_{arch}'s "
                        f"{config.ARCH_SMEM_LIMIT[arch]}, so it can never run there")
                # What the runtime will find for this arch: the same rule it uses.
                if not any(job.cfg.runs_on(job.kind, job.arch, arch) for job in jobs[cfg]):
                    built = ", ".join(job.label for job in jobs[cfg]) or "nothing"
                    raise ConfigError(
                        f"{where}: rule {rule.index}: config {name!r} is not built for "
                        f"sm_{arch}: nothing of what is built runs there ({built})")


def plan_jobs(spec: Spec, only: Optional[str] = None,
              archs: Optional[Sequence[int]] = None) -> list:
    """Jobs in manifest order: per config, its cubins by arch, then its PTX.

    ``archs`` filters the cubin archs; the PTX is built when ``ptx_arch`` is among them.
    """
    wanted = set(spec.archs) | {spec.ptx_arch} if archs is None else set(archs)
    jobs = []
    for cfg in spec.configs + spec.backward_configs:
        if only and only not in cfg.name:
            continue
        for arch in spec.cubin_archs(cfg):
            if arch in wanted:
                jobs.append(Job(cfg, "cubin", arch))
        if spec.ptx_arch in wanted and not cfg.arch_specific:  # sm_90a PTX JITs nowhere else
            jobs.append(Job(cfg, "ptx", spec.ptx_arch))
    return jobs


def expected_files(spec: Spec) -> set:
    """Every output file of a full build of spec (what the stale-file sweep keeps)."""
    return {job.file for job in plan_jobs(spec)}


# ---- toolchain and hashing ---------------------------------------------------------------


def _named_tool(tool: str, explicit: Optional[str]) -> Optional[str]:
    """The ``tool`` that --<tool> or $CUDAFLASH_<TOOL> names (in that order), or None."""
    variable = f"CUDAFLASH_{tool.upper()}"
    for origin, candidate in ((f"--{tool}", explicit), (variable, os.environ.get(variable))):
        if candidate:
            path = shutil.which(candidate)
            if path is None:
                raise BuildError(f"{origin}={candidate!r} is not an executable {tool}")
            return path
    return None


def find_nvcc(explicit: Optional[str] = None) -> str:
    """--nvcc, else $CUDAFLASH_NVCC, else $CUDA_HOME/bin/nvcc, else nvcc on PATH."""
    named = _named_tool("nvcc", explicit)
    if named:
        return named
    cuda_home = os.environ.get("CUDA_HOME")
    if cuda_home:
        path = Path(cuda_home) / "bin" / "nvcc"
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    path = shutil.which("nvcc")
    if path is None:
        raise BuildError("nvcc not found: pass --nvcc PATH, set CUDAFLASH_NVCC or CUDA_HOME, "
                         "or put the CUDA toolkit's bin directory on PATH")
    return path


def tool_version(tool: str) -> str:
    """'13.0.88' from ``nvcc --version`` or ``ptxas --version``."""
    out = subprocess.run([tool, "--version"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    m = re.search(r"\bV(\d+\.\d+\.\d+)", out.stdout)
    if out.returncode or not m:
        raise BuildError(f"'{tool} --version' failed or printed no version:\n{out.stdout}")
    return m.group(1)


# Where the nvidia-cuda-nvcc-cu12 wheel (a build requirement in pyproject.toml) puts ptxas,
# under a site-packages directory.
PIP_PTXAS = Path("nvidia") / "cuda_nvcc" / "bin"


def find_ptxas(nvcc: str, explicit: Optional[str] = None) -> str:
    """--ptxas, else $CUDAFLASH_PTXAS, else the CUDA 12 ptxas of the nvidia-cuda-nvcc-cu12
    package on sys.path, else the ptxas beside nvcc (with a CUDA 13 nvcc, its cubins need a
    CUDA 13 driver, R580+: the manifest records it)."""
    named = _named_tool("ptxas", explicit)
    if named:
        return named
    for site in sys.path:
        for name in ("ptxas", "ptxas.exe"):
            path = Path(site or ".") / PIP_PTXAS / name
            if path.is_file() and os.access(path, os.X_OK):
                return str(path)
    beside = Path(nvcc).resolve().parent / "ptxas"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    path = shutil.which("ptxas")
    if path is None:
        raise BuildError(f"no ptxas beside {nvcc} or on PATH: pass --ptxas PATH, set "
                         "CUDAFLASH_PTXAS, or `pip install nvidia-cuda-nvcc-cu12`")
    return path


def source_digest(src_dir: Path) -> str:
    """sha256 over every file under src_dir, in path order, names included."""
    h = hashlib.sha256()
    files = sorted(p for p in src_dir.rglob("*") if p.is_file())
    if not files:
        raise BuildError(f"no kernel sources under {src_dir}")
    for path in files:
        h.update(path.relative_to(src_dir).as_posix().encode() + b"\0")
        h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


def job_stamp(digest: str, argv: Sequence[str], version: str) -> str:
    """``argv``: the job's commands, tool paths and output paths left out (the same tool
    versions found elsewhere build the same file); ``version``: every tool's version."""
    return hashlib.sha256("\0".join([digest, version, *argv]).encode()).hexdigest()


def params_bytes(src_dir: Path, header_name: str = PARAMS_HEADER,
                 constant: str = "kParamsBytes") -> int:
    """The size of a kernel argument struct as its header declares it (``constexpr int
    <constant> = N;``, static_asserted against sizeof there), for the manifest."""
    header = src_dir / header_name
    try:
        m = re.search(rf"{constant}\s*=\s*(\d+)", header.read_text())
    except OSError as e:
        raise BuildError(f"{header}: cannot read it ({e}); the manifest records the struct "
                         f"size from its {constant}") from None
    if not m:
        raise BuildError(f"{header}: no 'constexpr int {constant} = N;' found; the manifest "
                         "records the struct size from it")
    return int(m.group(1))


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ---- ptxas report ------------------------------------------------------------------------


def parse_ptxas(log: str, cfg=None) -> dict:
    """From ptxas's report of one module of ``cfg``'s family (default: the forward's):
    registers (the forward entry's; for the backward, the most any entry uses) and
    static_smem of the main entry, split_registers of the split-KV forward (None for the
    backward), spill_bytes (stores + loads, summed over all entries: none may spill),
    stack_bytes (the largest frame), and wgmma_serialized: ptxas's note that it had to
    serialize the wgmma instructions (it could not prove the accumulator registers untouched
    while they run), which costs their overlap.

    Raises BuildError unless ptxas compiled exactly the family's entries.
    """
    expected = cfg.ENTRIES if cfg is not None else config.KernelConfig.ENTRIES
    entries = re.findall(r"Compiling entry function '([^']+)'", log)
    if sorted(entries) != sorted(expected):
        raise BuildError(f"ptxas compiled entries {entries}; this module must export exactly "
                         f"{list(expected)} (docs/contracts.md)")
    stats = {}
    for name in expected:
        section = log.split(f"Compiling entry function '{name}'", 1)[1]
        section = section.split("Compiling entry function", 1)[0]
        props = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                          r"(\d+) bytes spill loads", section)
        used = re.search(r"Used (\d+) registers", section)
        if not props or not used:
            raise BuildError(f"could not read registers/spills of {name!r} from the ptxas "
                             "report")
        smem = re.search(r"Used \d+ registers[^\n]*?(\d+) bytes smem", section)
        stats[name] = (int(used.group(1)), int(props.group(2)) + int(props.group(3)),
                       int(props.group(1)), int(smem.group(1)) if smem else 0)
    if isinstance(cfg, backward_config.BackwardConfig) and cfg.warp_specialized:
        _check_register_pool(cfg, stats)
    forward = expected == config.KernelConfig.ENTRIES
    entry, split = (_symbol(config.KernelConfig, role) for role in ("forward", "split"))
    return {"registers": stats[entry][0] if forward else max(s[0] for s in stats.values()),
            "split_registers": stats[split][0] if forward else None,
            "spill_bytes": sum(s[1] for s in stats.values()),
            "stack_bytes": max(s[2] for s in stats.values()),
            "static_smem": max(s[3] for s in stats.values()),
            "wgmma_serialized": "wgmma.mma_async instructions are serialized" in log}


def _check_register_pool(cfg, stats: dict) -> None:
    """A warp-specialized backward module's fused entries (at d256 its dK/dV and dQ ones) move
    registers between warpgroups with setmaxnreg, whose .inc waits until the CTA's pool (the
    launch's registers per thread x fused_threads) can give them: asking for more than the
    pool holds deadlocks at run time (perf log "Backward v4"), so a ptxas that gives the entry
    fewer registers fails the build instead."""
    need = (backward_config.BWD_WS_PRODUCER_REGS * (cfg.fused_threads - cfg.threads)
            + backward_config.BWD_WS_CONSUMER_REGS * cfg.threads)
    # (d256: the dK/dV and dQ entries, padded and packed; its fused entries are traps)
    roles = (("dkdv", "dq", "dkdv_varlen", "dq_varlen") if cfg.dkdv_warp_specialized
             else ("dkdv_dq", "dkdv_dq_window", "dkdv_dq_varlen", "dkdv_dq_dropout"))
    for role in roles:
        symbol = _symbol(backward_config.BackwardConfig, role)
        registers = stats[symbol][0]
        if registers * cfg.fused_threads < need:
            raise BuildError(f"{cfg.name}: {symbol} got {registers} registers per thread, a pool "
                             f"of {registers * cfg.fused_threads} for {cfg.fused_threads} "
                             f"threads; its setmaxnreg split needs {need} (producer "
                             f"{backward_config.BWD_WS_PRODUCER_REGS}, consumers "
                             f"{backward_config.BWD_WS_CONSUMER_REGS}) and would deadlock")


def ptx_entries(text: str) -> list:
    return re.findall(r"\.entry\s+(\w+)", text)


# ---- running nvcc ------------------------------------------------------------------------


class Builder:
    def __init__(self, *, out_dir: Path, src_dir: Path, nvcc: str, ptxas: str,
                 versions: str, digest: str):
        self.out_dir = out_dir
        self.src_dir = src_dir
        self.nvcc = nvcc
        self.ptxas = ptxas
        self.versions = versions  # every tool's version, for the stamps
        self.digest = digest
        self._print_lock = threading.Lock()
        self._failed = threading.Event()  # set by the first failing job; later ones skip

    def say(self, msg: str) -> None:
        with self._print_lock:
            print(msg, flush=True)

    def commands(self, job: Job, ptx: Path, out: Path) -> tuple:
        """(nvcc to ``ptx``, ptxas from ``ptx`` to ``out``)."""
        return (nvcc_argv(job.cfg, job.arch, job.kind, nvcc=self.nvcc, src_dir=self.src_dir,
                          out=ptx),
                ptxas_argv(job.cfg, job.arch, job.kind, ptxas=self.ptxas, ptx=ptx, out=out))

    def stamp(self, job: Job) -> str:
        front, back = self.commands(job, Path("job.ptx"), Path("job.out"))
        return job_stamp(self.digest, [*front[1:], "|", *back[1:]], self.versions)

    def stamp_path(self, job: Job) -> Path:
        return self.out_dir / (job.file + ".stamp")

    def up_to_date(self, job: Job, stamp: str) -> Optional[dict]:
        """The recorded ptxas stats when the output exists and was built with this stamp."""
        try:
            recorded = json.loads(self.stamp_path(job).read_text())
        except (OSError, ValueError):
            return None
        if recorded.get("stamp") != stamp or not (self.out_dir / job.file).is_file():
            return None
        return recorded["stats"]

    def compile(self, job: Job, stamp: str) -> Optional[dict]:
        if self._failed.is_set():
            return None
        try:
            return self._compile(job, stamp)
        except JobFailed:
            self._failed.set()
            raise

    def _compile(self, job: Job, stamp: str) -> dict:
        out = self.out_dir / job.file
        out.parent.mkdir(parents=True, exist_ok=True)
        # Drop the old stamp first: an interrupted job may leave a partial output behind,
        # which must not look up to date next time.
        self.stamp_path(job).unlink(missing_ok=True)
        start = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="cudaflash-build-") as tmp:
            ptx, assembled = Path(tmp) / "job.ptx", Path(tmp) / "job.cubin"
            front, back = self.commands(job, ptx, assembled)
            self.say(shlex.join(front))
            proc = subprocess.run(front, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
            if proc.returncode:
                raise JobFailed(job, front, f"nvcc exited with status {proc.returncode}",
                                proc.stdout)
            text, isa, log = self._assemble(job, ptx, back)
            try:
                if job.kind == "cubin":
                    stats = parse_ptxas(log, job.cfg)
                    write_atomic(out, assembled.read_bytes())
                else:
                    entries = ptx_entries(text)
                    if sorted(entries) != sorted(job.cfg.ENTRIES):
                        raise BuildError(f"the PTX defines entries {entries}; it must define "
                                         f"exactly {list(job.cfg.ENTRIES)} "
                                         "(docs/contracts.md)")
                    stats = {"registers": None, "split_registers": None, "spill_bytes": None,
                             "stack_bytes": None, "static_smem": 0, "wgmma_serialized": False}
                    write_atomic(out, text)
            except BuildError as e:
                raise JobFailed(job, back, str(e), log) from None
        stats["ptx_isa"] = f"{isa[0]}.{isa[1]}"
        seconds = time.monotonic() - start
        write_atomic(self.stamp_path(job), json.dumps({"stamp": stamp, "stats": stats}) + "\n")
        regs = "" if stats["registers"] is None else \
            f", {stats['registers']} registers, {stats['spill_bytes']} bytes spilled"
        self.say(f"built {job.label} in {seconds:.1f}s (PTX ISA {stats['ptx_isa']}{regs})")
        return stats

    def _assemble(self, job: Job, ptx: Path, back: list) -> tuple:
        """Run ptxas on the PTX nvcc wrote, declared as the lowest ISA it needs: start at the
        lowest ISA that knows the target and raise it to what ptxas says the code requires.
        Returns (the PTX text as assembled, its ISA, ptxas's log)."""
        original = ptx.read_text()
        written = driver_compat.ptx_isa(original)
        target = ptxas_target(job.cfg, job.arch, job.kind)
        isa = min(written, driver_compat.TARGET_MIN_PTX_ISA.get(target, written))
        while True:
            text = driver_compat.with_ptx_isa(original, isa)
            ptx.write_text(text)
            self.say(shlex.join(back) + f"  # PTX declared as ISA {isa[0]}.{isa[1]}")
            proc = subprocess.run(back, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
            if not proc.returncode:
                return text, isa, proc.stdout
            needed = driver_compat.isa_required_by(proc.stdout)
            if needed is None or needed <= isa:
                raise JobFailed(job, back, f"ptxas exited with status {proc.returncode} (PTX "
                                f"declared as ISA {isa[0]}.{isa[1]}; nvcc wrote "
                                f"{written[0]}.{written[1]})", proc.stdout)
            isa = needed

    def run(self, jobs: Sequence[Job], n_jobs: int) -> dict:
        """Compile what is out of date; returns {job: stats}. Raises JobFailed on the first
        nvcc failure after cancelling the jobs not yet started."""
        stats = {}
        todo = []
        for job in jobs:
            stamp = self.stamp(job)
            recorded = self.up_to_date(job, stamp)
            if recorded is not None:
                self.say(f"up to date: {job.label}")
                stats[job] = recorded
            else:
                todo.append((job, stamp))
        if not todo:
            return stats
        self.say(f"compiling {len(todo)} of {len(jobs)} kernels with {n_jobs} parallel jobs")
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=n_jobs)
        futures = {pool.submit(self.compile, job, stamp): job for job, stamp in todo}
        try:
            for future in concurrent.futures.as_completed(futures):
                stats[futures[future]] = future.result()
        except JobFailed as failure:
            # cancel() drops a job not yet started and returns False for a running one.
            running = sum(1 for f in futures if not f.done() and not f.cancel())
            self.say(f"FAILED: {failure.job.label}; cancelled pending jobs"
                     + (f", waiting for {running} running" if running else ""))
            raise
        finally:
            pool.shutdown(wait=True)
        return stats


class JobFailed(BuildError):
    def __init__(self, job: Job, argv: Sequence[str], why: str, log: str):
        super().__init__(f"{job.label}: {why}")
        self.job = job
        self.argv = list(argv)
        self.log = log

    def report(self) -> str:
        tool = Path(self.argv[0]).name
        return (f"error: {self}\ncommand:\n  {shlex.join(self.argv)}\n"
                f"{tool} output:\n{self.log.rstrip() or '(none)'}")


# ---- outputs -----------------------------------------------------------------------------


def remove_stale(out_dir: Path, keep: set) -> list:
    """Delete cubins/PTX (and their stamps) of configs or archs no longer in configs.yaml.

    Only files matching the build's own layout are touched, whatever --out points at.
    """
    removed = []
    for pattern in ("sm_*/*.cubin", "sm_*/*.cubin.stamp", "ptx/compute_*/*.ptx",
                    "ptx/compute_*/*.ptx.stamp"):
        for path in sorted(out_dir.glob(pattern)):
            rel = path.relative_to(out_dir).as_posix()
            if rel.endswith(".stamp"):
                rel = rel[: -len(".stamp")]
            if rel not in keep:
                path.unlink()
                removed.append(path.relative_to(out_dir).as_posix())
    for pattern in ("sm_*", "ptx/compute_*", "ptx"):
        for path in sorted(out_dir.glob(pattern)):
            if path.is_dir() and not any(path.iterdir()):
                path.rmdir()
    return removed


def file_floor(job: Job, out_dir: Path, stats: dict, ptxas_version: str) -> dict:
    """What the manifest records of the toolchain behind one file and the driver it needs,
    the floor read off the file itself (cudaflash/driver_compat.py)."""
    data = (out_dir / job.file).read_bytes()
    try:
        floor = driver_compat.min_driver(job.kind, data)
    except driver_compat.KernelFormatError as e:
        raise BuildError(f"{job.file}: {e}") from None
    return {"ptxas_version": ptxas_version, "ptx_isa": stats["ptx_isa"], "min_driver": floor}


def manifest_dict(spec: Spec, jobs: Sequence[Job], stats: dict, *, out_dir: Path,
                  version: str, ptxas_version: str, src_hash: str, params_size: int,
                  bwd_params_size: int) -> dict:
    """The manifest of ``jobs`` (built; ``stats`` their ptxas reports), composed by
    cudaflash/manifest.py, the one module that writes and reads it."""
    kernels, backward = [], []
    for job in jobs:
        s = stats[job]
        backward_job = isinstance(job.cfg, backward_config.BackwardConfig)
        (backward if backward_job else kernels).append(manifest.module_record(
            job.cfg, arch=job.arch, kind=job.kind, file=job.file,
            sha256=sha256_file(out_dir / job.file), registers=s["registers"],
            spill_bytes=s["spill_bytes"], nvcc_version=version, source_hash=src_hash,
            schemes=spec.backward_schemes[job.cfg] if backward_job else None,
            **file_floor(job, out_dir, s, ptxas_version)))
    return manifest.manifest_dict(
        kernels=kernels, backward_kernels=backward, nvcc_version=version,
        ptxas_version=ptxas_version, source_hash=src_hash, params_bytes=params_size,
        bwd_params_bytes=bwd_params_size, ptx_arch=spec.ptx_arch,
        selection=[rule.to_dict() for rule in spec.rules])


def _cell(value) -> str:
    return "-" if value is None else str(value)  # PTX has no ptxas stats


def summary(jobs: Sequence[Job], stats: dict) -> str:
    rows = [("name", "arch", "regs", "split regs", "spill", "stack", "smem")]
    for job in jobs:
        s = stats[job]
        rows.append((job.cfg.name, job.target, _cell(s["registers"]),
                     _cell(s.get("split_registers")), _cell(s["spill_bytes"]),
                     _cell(s["stack_bytes"]), str(job.cfg.smem_bytes)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))) for r in rows)


# ---- entry points ------------------------------------------------------------------------


def default_jobs() -> int:
    if os.environ.get("CUDAFLASH_BUILD_JOBS"):
        value = os.environ["CUDAFLASH_BUILD_JOBS"]
        if not value.isdigit() or int(value) < 1:
            raise BuildError(f"CUDAFLASH_BUILD_JOBS={value!r} must be a positive integer")
        return int(value)
    # Usable cores, not the host's: a container limited to 2 cores still reports them all
    # through os.cpu_count(), and each nvcc job needs ~1 GB of memory.
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def build(*, configs_path: Path = ROOT / "configs.yaml",
          out_dir: Path = ROOT / "cudaflash" / "kernels",
          src_dir: Optional[Path] = None, nvcc: Optional[str] = None,
          ptxas: Optional[str] = None, jobs: Optional[int] = None, only: Optional[str] = None,
          archs: Optional[Sequence[int]] = None) -> dict:
    """Build what is out of date and write the manifest; returns the manifest dict.

    Raises ConfigError for a bad configs.yaml or filter, BuildError (JobFailed for nvcc or
    ptxas) for a failed build.
    """
    start = time.monotonic()
    if src_dir is None:
        src_dir = Path(os.environ.get("CUDAFLASH_SRC_DIR") or ROOT / "cuda_src")
    configs_path, out_dir, src_dir = (Path(p).resolve() for p in (configs_path, out_dir,
                                                                  src_dir))
    spec = load_spec(configs_path)
    if archs is not None:
        allowed = sorted(set(spec.archs) | {spec.ptx_arch})
        bad = [a for a in archs if a not in allowed]
        if bad:
            raise ConfigError(f"--archs {bad} not in {configs_path.name}; allowed: {allowed}")
    plan = plan_jobs(spec, only, archs)
    if not plan:
        raise ConfigError(f"no kernel to build: no config name contains only={only!r} "
                          f"(for archs {list(archs) if archs else list(spec.archs)})")
    for source in sorted({job.cfg.SOURCE for job in plan}):
        if not (src_dir / source).is_file():
            raise BuildError(f"kernel source {src_dir / source} not found")

    nvcc = find_nvcc(nvcc)
    version = tool_version(nvcc)
    ptxas = find_ptxas(nvcc, ptxas)
    ptxas_version = tool_version(ptxas)
    digest = source_digest(src_dir)
    src_hash = hashlib.sha256("\0".join([digest, *NVCC_FLAGS, *PTXAS_FLAGS]).encode()
                              ).hexdigest()
    params_size = params_bytes(src_dir)
    bwd_params_size = params_bytes(src_dir, BWD_PARAMS_HEADER, "kBwdParamsBytes")
    print(f"nvcc {version} ({nvcc}); ptxas {ptxas_version} ({ptxas}); sources {src_dir}; "
          f"output {out_dir}", flush=True)
    if int(ptxas_version.split(".")[0]) >= 13:
        print(f"NOTE: ptxas {ptxas_version} writes cubins in the CUDA 13 format, which needs "
              "an NVIDIA driver for CUDA 13 (R580+); a CUDA 12 ptxas (`pip install "
              "nvidia-cuda-nvcc-cu12`, or --ptxas) makes cubins every driver from R525 on "
              "loads", flush=True)

    out_dir.mkdir(parents=True, exist_ok=True)
    for rel in remove_stale(out_dir, expected_files(spec)):
        print(f"removed stale: {rel}", flush=True)
    builder = Builder(out_dir=out_dir, src_dir=src_dir, nvcc=nvcc, ptxas=ptxas,
                      versions=f"nvcc {version}, ptxas {ptxas_version}", digest=digest)
    stats = builder.run(plan, jobs or default_jobs())

    built = manifest_dict(spec, plan, stats, out_dir=out_dir, version=version,
                          ptxas_version=ptxas_version, src_hash=src_hash,
                          params_size=params_size, bwd_params_size=bwd_params_size)
    manifest.write(out_dir, built)

    print(summary(plan, stats))
    for job in plan:
        s = stats[job]
        if s["spill_bytes"]:
            print(f"WARNING: {job.label} spills {s['spill_bytes']} bytes to local memory "
                  f"({s['registers']} registers, stack frame {s['stack_bytes']} bytes)")
        elif s["stack_bytes"]:
            print(f"WARNING: {job.label} keeps a {s['stack_bytes']}-byte stack frame in local "
                  "memory without spilling (an array indexed at run time, e.g. a loop the "
                  "compiler did not unroll)")
        if s.get("wgmma_serialized"):  # .get: stamps written before this check lack the key
            print(f"WARNING: {job.label}: ptxas serialized its wgmma instructions (see the "
                  "ptxas log: ptxas -v)")
        if s["static_smem"]:
            print(f"WARNING: {job.label} uses {s['static_smem']} bytes of static shared "
                  f"memory on top of the {job.cfg.smem_bytes} dynamic bytes in the manifest")
    floors = ", ".join(f"{kind} {driver_compat.describe_driver(v)}"
                       for kind, v in built["min_driver"].items() if v is not None)
    print(f"wrote {out_dir / MANIFEST_NAME}: {len(plan)} kernels in "
          f"{time.monotonic() - start:.1f}s; driver floors: {floors}", flush=True)
    return built


# ---- checking built kernels (CI, on the wheel) -------------------------------------------


def _kernel_files(path: Path) -> tuple:
    """(manifest dict, {relative path: bytes} of every cubin/PTX) of a kernel directory or a
    wheel (whose kernels live under cudaflash/kernels/)."""
    if path.is_dir():
        files = {p.relative_to(path).as_posix(): p.read_bytes()
                 for p in sorted(path.rglob("*")) if p.suffix in (".cubin", ".ptx")}
        return json.loads((path / MANIFEST_NAME).read_text()), files
    prefix = "cudaflash/kernels/"
    with zipfile.ZipFile(path) as wheel:
        names = [n for n in wheel.namelist() if n.startswith(prefix)]
        files = {n[len(prefix):]: wheel.read(n) for n in names if n.endswith((".cubin", ".ptx"))}
        return json.loads(wheel.read(prefix + MANIFEST_NAME)), files


def check_kernels(path: Path, *, max_cubin_driver: Optional[int] = None,
                  max_ptx_driver: Optional[int] = None) -> list:
    """Problems with the kernels of a directory or wheel (empty: all good). Every cubin's
    ELF header and every PTX ``.version`` must give the driver floor the manifest states for
    that file, the manifest's toolchain must match the file's format, every kernel file must
    be listed, and no floor may exceed the maximum given for its kind."""
    listing, files = _kernel_files(path)
    problems = []
    if listing["schema"] != manifest.SCHEMA:
        problems.append(f"manifest schema {listing['schema']!r}; this build writes and the "
                        f"runtime reads schema {manifest.SCHEMA}")
    entries = listing["kernels"] + listing["backward_kernels"]
    listed = {k["file"] for k in entries}
    problems += [f"{f}: a kernel file the manifest does not list" for f in sorted(set(files)
                                                                                  - listed)]
    limit = {"cubin": max_cubin_driver, "ptx": max_ptx_driver}
    for k in entries:
        where = k["file"]
        data = files.get(where)
        if data is None:
            problems.append(f"{where}: listed in the manifest but missing")
            continue
        if hashlib.sha256(data).hexdigest() != k["sha256"]:
            problems.append(f"{where}: sha256 differs from the manifest's")
        try:
            floor = driver_compat.min_driver(k["kind"], data)
            if k["kind"] == "cubin":
                family = driver_compat.cubin_toolkit(data)
                ptxas = k["ptxas_version"].split(".")
                if family != ".".join(ptxas[:len(family.split("."))]):
                    problems.append(f"{where}: a CUDA {family} cubin, but the manifest says "
                                    f"ptxas {k['ptxas_version']} built it")
            else:
                isa = "%d.%d" % driver_compat.ptx_isa(data.decode("ascii", errors="replace"))
                if isa != k["ptx_isa"]:
                    problems.append(f"{where}: declares PTX ISA {isa}, the manifest says "
                                    f"{k['ptx_isa']}")
        except driver_compat.KernelFormatError as e:
            problems.append(f"{where}: {e}")
            continue
        if floor != k["min_driver"]:
            problems.append(f"{where}: needs a driver for CUDA "
                            f"{driver_compat.cuda_version_text(floor)}, the manifest says "
                            f"{k['min_driver']}")
        most = limit[k["kind"]]
        if most is not None and floor > most:
            problems.append(f"{where}: needs {driver_compat.describe_driver(floor)}, above the "
                            f"allowed {driver_compat.describe_driver(most)} for a {k['kind']}")
    for kind in KINDS:
        floors = [k["min_driver"] for k in entries if k["kind"] == kind]
        if listing["min_driver"].get(kind) != max(floors, default=None):
            problems.append(f"manifest min_driver[{kind!r}] = {listing['min_driver'].get(kind)}"
                            f" is not the highest floor of its {kind} files")
    return problems


def _check_main(path: Path, max_cubin: Optional[str], max_ptx: Optional[str]) -> int:
    limits = [None if v is None else driver_compat.parse_cuda_version(v)
              for v in (max_cubin, max_ptx)]
    listing, files = _kernel_files(path)
    problems = check_kernels(path, max_cubin_driver=limits[0], max_ptx_driver=limits[1])
    counts: dict = {}
    for k in listing["kernels"] + listing["backward_kernels"]:
        fmt = (f"CUDA {driver_compat.cubin_toolkit(files[k['file']])} cubin"
               if k["kind"] == "cubin" and k["file"] in files else f"PTX ISA {k['ptx_isa']}")
        key = (k["kind"], fmt, k["min_driver"])
        counts[key] = counts.get(key, 0) + 1
    print(f"{path}: {len(files)} kernel files; nvcc {listing['nvcc_version']}, ptxas "
          f"{listing['ptxas_version']}")
    for (kind, fmt, floor), n in sorted(counts.items()):
        print(f"  {n:4d} x {fmt}: needs {driver_compat.describe_driver(floor)}")
    for problem in problems:
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if problems else 0


def _arch_list(text: str) -> list:
    try:
        return [int(a) for a in text.split(",") if a.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of archs "
                                         "such as 80,90") from None


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-j", "--jobs", type=_positive, default=None,
                        help="parallel jobs (default: usable CPU cores, or "
                             "$CUDAFLASH_BUILD_JOBS)")
    parser.add_argument("--configs", type=Path, default=ROOT / "configs.yaml",
                        help="config list (default: configs.yaml next to this script)")
    parser.add_argument("--out", type=Path, default=ROOT / "cudaflash" / "kernels",
                        help="output directory (default: cudaflash/kernels)")
    parser.add_argument("--src", type=Path, default=None,
                        help="kernel source directory (default: $CUDAFLASH_SRC_DIR or cuda_src)")
    parser.add_argument("--nvcc", default=None,
                        help="nvcc to use (default: $CUDAFLASH_NVCC, $CUDA_HOME/bin/nvcc, PATH)")
    parser.add_argument("--ptxas", default=None,
                        help="ptxas to use (default: $CUDAFLASH_PTXAS, the nvidia-cuda-nvcc-cu12 "
                             "package's, the one beside nvcc)")
    parser.add_argument("--only", default=None, metavar="SUBSTRING",
                        help="build only configs whose name contains SUBSTRING")
    parser.add_argument("--archs", type=_arch_list, default=None, metavar="90,...",
                        help="build only these archs (the PTX is built when ptx_arch is listed)")
    parser.add_argument("--check", type=Path, default=None, metavar="WHEEL_OR_DIR",
                        help="build nothing: check the kernel files of a wheel or kernel "
                             "directory against its manifest")
    parser.add_argument("--max-cubin-driver", default=None, metavar="12.0",
                        help="with --check: fail if a cubin needs a driver newer than this "
                             "CUDA version")
    parser.add_argument("--max-ptx-driver", default=None, metavar="12.3",
                        help="with --check: fail if a PTX file needs a driver newer than this")
    args = parser.parse_args(argv)
    if args.check is not None:
        try:
            return _check_main(args.check, args.max_cubin_driver, args.max_ptx_driver)
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
            print(f"error: cannot check {args.check}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
    try:
        build(configs_path=args.configs, out_dir=args.out, src_dir=args.src, nvcc=args.nvcc,
              ptxas=args.ptxas, jobs=args.jobs, only=args.only, archs=args.archs)
    except JobFailed as e:
        print(e.report(), file=sys.stderr, flush=True)
        return 1
    except (BuildError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
