"""Every KernelConfig field changes the compiled kernel (issue: no vestigial config keys).

Compiles the real cuda_src/flash_fwd.cu for sm_90 once per field: a base config and, for each
field, the base with only that field changed (each variant is itself a valid config). The
machine code with the variant must differ from the base's. CPU only; needs nvcc (skipped with
the reason when it is missing). 25 compiles of about 1 s each.
"""

import dataclasses
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import build_cubins
from cudaflash.config import KernelConfig

ROOT = Path(build_cubins.__file__).resolve().parent
NVCC = shutil.which("nvcc")

BASE = KernelConfig(dtype="bf16", d_head=128, B_r=128, B_c=64, n_warps=4, async_copy=True,
                    eager_load_blocks=False, swizzled=True, Q_mma_load_K_fragments=0,
                    K_mma_load_K_fragments=2, V_mma_load_K_fragments=2,
                    mma_double_buffer_loads=True, optimized_softmax=True,
                    min_ctas_per_sm=1, wgmma=False)
CHANGED = {  # field -> another value that keeps the config valid
    "dtype": "fp16", "d_head": 64, "B_r": 64, "B_c": 32, "n_warps": 8, "async_copy": False,
    "eager_load_blocks": True, "swizzled": False, "Q_mma_load_K_fragments": 2,
    "K_mma_load_K_fragments": 4, "V_mma_load_K_fragments": 0, "mma_double_buffer_loads": False,
    "optimized_softmax": False,
    "min_ctas_per_sm": 3,  # 170 registers instead of 255
    "wgmma": True,  # against WGMMA_BASE below: BASE's fragment fields do not apply to wgmma
    "exp2_softmax": False, "kv_reverse": False, "d_head_tiled": False,
    "o_store_cache": "no_allocate",
    "warp_specialized": True,  # against WS_BASE below: it needs wgmma and eager loads
    "persistent": True,  # against PERSISTENT_BASE below: it needs warp_specialized
}
# wgmma needs 16 rows per warp and no fragment loading, so its variant changes from this base.
WGMMA_BASE = dataclasses.replace(BASE, n_warps=8, K_mma_load_K_fragments=0,
                                 V_mma_load_K_fragments=0, mma_double_buffer_loads=False)
WS_BASE = dataclasses.replace(WGMMA_BASE, wgmma=True, eager_load_blocks=True)
PERSISTENT_BASE = dataclasses.replace(WS_BASE, warp_specialized=True)
BASE_OF = {"wgmma": "wgmma_base", "warp_specialized": "ws_base",
           "persistent": "persistent_base"}  # the rest vary BASE
BASES = {"base": BASE, "wgmma_base": WGMMA_BASE, "ws_base": WS_BASE,
         "persistent_base": PERSISTENT_BASE}


def test_every_field_has_a_variant():
    assert set(CHANGED) == {f.name for f in dataclasses.fields(KernelConfig)}


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH: cannot compile the kernel")
def test_each_field_changes_the_machine_code(tmp_path):
    # "again" compiles the base a second time: nvcc is deterministic, so equal code gives equal
    # bytes, and a field whose change leaves the bytes equal changed nothing.
    variants = {"again": BASE, **BASES}
    for field, value in CHANGED.items():
        cfg = dataclasses.replace(BASES[BASE_OF.get(field, "base")], **{field: value})
        assert not cfg.errors(), (field, cfg.errors())
        variants[field] = cfg

    def compile_one(item):
        label, cfg = item
        out = tmp_path / f"{label}.cubin"
        argv = build_cubins.nvcc_argv(cfg, 90, "cubin", nvcc=NVCC, src_dir=ROOT / "cuda_src",
                                      out=out)
        subprocess.run(argv, check=True, capture_output=True)
        return label, out.read_bytes()

    with ThreadPoolExecutor(max_workers=4) as pool:
        code = dict(pool.map(compile_one, variants.items()))
    assert code["again"] == code["base"], "nvcc output is not deterministic: compare differently"
    same = [field for field in CHANGED
            if code[field] == code[BASE_OF.get(field, "base")]]
    assert not same, f"changing these fields does not change the kernel: {same}"
