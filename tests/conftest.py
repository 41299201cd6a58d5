"""Shared test setup.

- ``@pytest.mark.requires_gpu``: the test needs a CUDA GPU that cudaflash supports (sm_80+);
  without one it is skipped with the reason ("no CUDA GPU: ...").
- ``fake_kernel_dir``: a kernel directory with a made-up manifest and kernel files (random
  bytes with the right sha256), selected through CUDAFLASH_KERNEL_DIR, for tests of the
  manifest, selection and launch plumbing that run without nvcc or a GPU.
"""

from __future__ import annotations

import functools
import hashlib

import pytest

from cudaflash import manifest
from cudaflash._params import BWD_PARAMS_BYTES, PARAMS_BYTES
from cudaflash.backward_config import BackwardConfig
from cudaflash.config import KernelConfig


@functools.lru_cache(maxsize=None)
def gpu_skip_reason() -> str | None:
    """Why GPU tests cannot run here, or None when they can."""
    import torch

    if not torch.cuda.is_available():
        return (f"no CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__}, "
                f"built for CUDA {torch.version.cuda})")
    try:
        import cuda.bindings.driver  # noqa: F401
    except ImportError as e:
        return f"no CUDA GPU: cuda.bindings.driver is not importable ({e})"
    major, minor = torch.cuda.get_device_capability(0)
    if major < 8:
        return f"no CUDA GPU: cuda:0 is sm_{major}{minor}; cudaflash needs sm_80 or newer"
    return None


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "requires_gpu: needs a CUDA GPU of sm_80 or newer; skipped with the reason "
                   "otherwise")


@pytest.fixture(autouse=True)
def same_random_inputs_every_run(request):
    """GPU tests draw some inputs from torch's global RNG (torch.randn_like without a
    generator): seeded per test, those are the same whatever ran before, so a failure
    reproduces when the test runs alone."""
    if "requires_gpu" in request.keywords:
        import torch

        torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    reason = gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "requires_gpu" in item.keywords:
            item.add_marker(skip, append=False)  # before "got empty parameter set"


# ---- a fake kernel directory -----------------------------------------------------------------

_BASE = dict(dtype="fp16", d_head=64, B_r=128, B_c=64, n_warps=4, async_copy=True,
             eager_load_blocks=True, swizzled=True, Q_mma_load_K_fragments=0,
             K_mma_load_K_fragments=0, V_mma_load_K_fragments=0,
             mma_double_buffer_loads=False, optimized_softmax=True,
             min_ctas_per_sm=1, wgmma=False)


def fake_config(**fields) -> KernelConfig:
    return KernelConfig.from_dict({**_BASE, **fields})


D64 = {dt: fake_config(dtype=dt) for dt in ("fp16", "bf16")}
D64_WIDE = fake_config(B_c=128, n_warps=8)  # fp16 only
D128 = fake_config(d_head=128, n_warps=8)  # fp16, sm_90 cubin only
D256_BIG = fake_config(d_head=256, B_c=64, n_warps=8)  # 128 KiB of smem: not for sm_86

# (config, kind, arch) in manifest order
FAKE_KERNELS = [
    (D64["fp16"], "cubin", 80), (D64["fp16"], "cubin", 86), (D64["fp16"], "cubin", 90),
    (D64["fp16"], "ptx", 90),
    (D64["bf16"], "cubin", 80), (D64["bf16"], "ptx", 90),
    (D64_WIDE, "cubin", 80),
    (D128, "cubin", 90),
    (D256_BIG, "cubin", 80), (D256_BIG, "cubin", 90),
]
BWD_D64 = BackwardConfig(dtype="fp16", d_head=64, B_r=64, B_c=64, n_warps=4)
FAKE_BACKWARD = [(BWD_D64, "cubin", 80), (BWD_D64, "ptx", 90)]
FAKE_SELECTION = [
    {"d_head": 64, "dtype": "fp16", "max_seqlen_q": 256, "config": D64_WIDE.name},
    {"d_head": 64, "config": D64["fp16"].name.replace("fp16", "{dtype}")},
    {"d_head": 128, "config": D128.name},
]


def write_fake_kernel_dir(root, kernels=FAKE_KERNELS, selection=FAKE_SELECTION,
                          params_bytes=PARAMS_BYTES, backward_kernels=FAKE_BACKWARD):
    """A kernel directory whose manifest cudaflash/manifest.py writes, as the build's is."""
    def fake_module(cfg, kind, arch, text, **fields):
        """Write a stand-in kernel file; its manifest entry (module_record)."""
        rel = f"sm_{arch}/{cfg.name}.cubin" if kind == "cubin" else \
            f"ptx/compute_{arch}/{cfg.name}.ptx"
        data = text.encode()
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        return manifest.module_record(
            cfg, arch=arch, kind=kind, file=rel, sha256=hashlib.sha256(data).hexdigest(),
            nvcc_version="13.0.88", ptxas_version="12.9.86", ptx_isa="8.3",
            min_driver=12000 if kind == "cubin" else 12030, source_hash="f" * 64, **fields)

    entries = [fake_module(cfg, kind, arch, f"fake {kind} {i} {cfg.name}",
                           registers=128 if kind == "cubin" else None,
                           spill_bytes=0 if kind == "cubin" else None)
               for i, (cfg, kind, arch) in enumerate(kernels)]
    backward = [fake_module(cfg, kind, arch, f"fake backward {kind} {i} {cfg.name}",
                            registers=200 if kind == "cubin" else None,
                            spill_bytes=0 if kind == "cubin" else None,
                            schemes=["atomic", "deterministic"])
                for i, (cfg, kind, arch) in enumerate(backward_kernels)]
    data = manifest.manifest_dict(
        kernels=entries, backward_kernels=backward, nvcc_version="13.0.88",
        ptxas_version="12.9.86", source_hash="f" * 64, params_bytes=params_bytes,
        bwd_params_bytes=BWD_PARAMS_BYTES, ptx_arch=90, selection=selection)
    manifest.write(root, data)
    return root


@pytest.fixture
def fake_kernel_dir(tmp_path, monkeypatch):
    """CUDAFLASH_KERNEL_DIR -> a fake kernel dir; cudaflash's caches are cleared around the test."""
    from cudaflash import api

    root = write_fake_kernel_dir(tmp_path / "kernels")
    monkeypatch.setenv("CUDAFLASH_KERNEL_DIR", str(root))
    monkeypatch.delenv("CUDAFLASH_CONFIG", raising=False)
    monkeypatch.delenv("CUDAFLASH_DEBUG", raising=False)
    api.clear_caches()
    yield root
    api.clear_caches()
