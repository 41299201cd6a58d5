"""setuptools hook: compile the cubins before build_py copies package data.

All metadata lives in pyproject.toml. ``pip install .`` and ``pip wheel .`` both run
build_py, which runs build_cubins.py in the source tree (incremental: an unchanged kernel is
not recompiled) into cudaflash/kernels/. The wheel stays pure (py3-none-any): it has no
extension modules, only cubins and PTX that the CUDA driver loads at run time.
Build-time environment: CUDAFLASH_NVCC, CUDAFLASH_SRC_DIR, CUDAFLASH_BUILD_JOBS (see
build_cubins.py).
"""

import importlib.util
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _load_build_cubins():
    # By path: the build backend does not put the source tree on sys.path.
    spec = importlib.util.spec_from_file_location("build_cubins", ROOT / "build_cubins.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["build_cubins"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


class BuildPyWithCubins(build_py):
    def run(self):
        build_cubins = _load_build_cubins()
        try:
            build_cubins.build()
        except build_cubins.JobFailed as e:
            raise SystemExit(e.report()) from None
        except (build_cubins.BuildError, build_cubins.ConfigError) as e:
            raise SystemExit(f"error: {e}") from None
        # build_py computes its package-data list lazily and caches it; drop a list made
        # before the cubins existed.
        self.__dict__.pop("data_files", None)
        super().run()


setup(cmdclass={"build_py": BuildPyWithCubins})
