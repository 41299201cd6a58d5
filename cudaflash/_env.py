"""Every environment variable cudaflash reads, in one place.

``CUDAFLASH_CONFIG``
    Path to a yaml file with a top-level ``selection:`` list of rules (the format of
    ``configs.yaml``'s ``selection``). Its rules are tried first; the shipped rules stay
    behind them as the fallback.
``CUDAFLASH_DEBUG``
    ``1`` logs each kernel selection (config name and the rule that chose it) and each module
    load to stderr, and synchronizes and checks the stream after every launch so that a kernel
    fault is reported by the call that caused it.
``CUDAFLASH_KERNEL_DIR``
    Directory with ``manifest.json`` and the cubins; default: the package's ``kernels/``.
``XDG_CACHE_HOME``
    Where ``python -m cudaflash tune`` writes its tables (``$XDG_CACHE_HOME/cudaflash/
    tuned-sm<arch>.yaml``, else ``~/.cache/cudaflash/...``) and where the runtime looks for
    them: a tuned table's rules come after CUDAFLASH_CONFIG's and before the shipped ones.

The runtime reads them when it first needs them on a device (first call per device and
context) and caches what it builds from them. After changing one in a running process, call
``cudaflash.api.clear_caches()``.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

_PACKAGE_KERNEL_DIR = Path(__file__).resolve().parent / "kernels"

log = logging.getLogger("cudaflash")


def config_path() -> Path | None:
    value = os.environ.get("CUDAFLASH_CONFIG", "")
    return Path(value) if value else None


def kernel_dir() -> Path:
    value = os.environ.get("CUDAFLASH_KERNEL_DIR", "")
    return Path(value) if value else _PACKAGE_KERNEL_DIR


def tuned_table_path(arch: int) -> Path:
    """The tuned selection table for GPUs of compute capability ``arch`` (it may not exist).
    A relative or empty XDG_CACHE_HOME is ignored, as the XDG spec says."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    cache = Path(base) if os.path.isabs(base) else Path.home() / ".cache"
    return cache / "cudaflash" / f"tuned-sm{arch}.yaml"


def debug() -> bool:
    """CUDAFLASH_DEBUG is set to something other than "", "0", "false" or "no".

    When it is, the "cudaflash" logger gets a stderr handler at DEBUG level (once), so the
    runtime's ``log.debug`` lines show without any logging setup by the user.
    """
    on = os.environ.get("CUDAFLASH_DEBUG", "").strip().lower() not in ("", "0", "false", "no")
    if on and not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[cudaflash] %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.DEBUG)
    return on
