"""build_cubins.py: nvcc commands, ptxas parsing, incremental/fail-fast builds, the manifest.

CPU only. Tests that run nvcc build a tiny stand-in kernel (not the real one) in a temp dir
and skip when nvcc is missing; the checks of the real build read cudaflash/kernels/
manifest.json (made by `pip install .` or `python build_cubins.py`) and skip without it.
"""

import dataclasses
import ctypes
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import build_cubins

ROOT = Path(build_cubins.__file__).resolve().parent
SPEC = build_cubins.load_spec(ROOT / "configs.yaml")
KernelConfig = build_cubins.config.KernelConfig
BackwardConfig = build_cubins.backward_config.BackwardConfig
MANIFEST = ROOT / "cudaflash" / "kernels" / "manifest.json"

CFG = KernelConfig(dtype="bf16", d_head=128, B_r=128, B_c=64, n_warps=4, async_copy=True,
                   eager_load_blocks=True, swizzled=True, Q_mma_load_K_fragments=2,
                   K_mma_load_K_fragments=2, V_mma_load_K_fragments=0,
                   mma_double_buffer_loads=True, optimized_softmax=True, min_ctas_per_sm=1, wgmma=False)


def load_params_module():
    # By path, so that the test does not import cudaflash (and torch) for a ctypes struct.
    spec = importlib.util.spec_from_file_location("_cf_params", ROOT / "cudaflash" / "_params.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- pure pieces -------------------------------------------------------------------------


def test_nvcc_argv_writes_ptx_for_the_job_arch():
    argv = build_cubins.nvcc_argv(CFG, 86, "cubin", nvcc="/x/nvcc", src_dir=Path("/s"),
                                  out=Path("/t/job.ptx"))
    assert argv[0] == "/x/nvcc"
    assert "-ptx" in argv and "-arch=compute_86" in argv
    assert "-cubin" not in argv and "-gencode" not in argv
    joined = " ".join(argv)
    assert " ".join(build_cubins.NVCC_FLAGS) in joined
    assert "-I /s " in joined and "/s/flash_fwd.cu -o /t/job.ptx" in joined
    for macro, value in CFG.nvcc_defines().items():
        assert f"-D{macro}={value}" in argv
    assert "-DCF_DTYPE_BF16=1" in argv and "-DCF_D_HEAD=128" in argv and "-DCF_Q_FRAGS=2" in argv
    again = build_cubins.nvcc_argv(CFG, 86, "cubin", nvcc="/x/nvcc", src_dir=Path("/s"),
                                   out=Path("/t/job.ptx"))
    assert again == argv
    ptx_job = build_cubins.nvcc_argv(CFG, 90, "ptx", nvcc="nvcc", src_dir=Path("src"),
                                     out=Path("k.ptx"))
    assert "-ptx" in ptx_job and "-arch=compute_90" in ptx_job
    with pytest.raises(ValueError, match="kind='sass'"):
        build_cubins.nvcc_argv(CFG, 90, "sass", nvcc="nvcc", src_dir=Path("s"), out=Path("o"))


def test_ptxas_argv():
    argv = build_cubins.ptxas_argv(CFG, 86, "cubin", ptxas="/p/ptxas", ptx=Path("/t/job.ptx"),
                                   out=Path("/t/job.cubin"))
    assert argv == ["/p/ptxas", "-arch=sm_86", *build_cubins.PTXAS_FLAGS, "/t/job.ptx", "-o",
                    "/t/job.cubin"]
    assert "-v" in build_cubins.PTXAS_FLAGS  # registers and spills for the manifest
    # A PTX job proves the shipped PTX assembles, compiling only its smallest entry.
    argv = build_cubins.ptxas_argv(CFG, 90, "ptx", ptxas="ptxas", ptx=Path("k.ptx"),
                                   out=Path("k.cubin"))
    assert argv[argv.index("-e") + 1] == "cudaflash_combine" and "-arch=sm_90" in argv


def test_wgmma_configs_target_sm90a():
    cfg = dataclasses.replace(CFG, n_warps=8, Q_mma_load_K_fragments=0, K_mma_load_K_fragments=0,
                              V_mma_load_K_fragments=0, mma_double_buffer_loads=False,
                              wgmma=True).validate()
    argv = build_cubins.nvcc_argv(cfg, 90, "cubin", nvcc="nvcc", src_dir=Path("s"),
                                  out=Path("o"))
    assert "-arch=compute_90a" in argv and "-DCF_WGMMA=1" in argv
    argv = build_cubins.ptxas_argv(cfg, 90, "cubin", ptxas="ptxas", ptx=Path("p"), out=Path("o"))
    assert "-arch=sm_90a" in argv
    assert [a for a in (80, 86, 89, 90) if cfg.builds_for(a)] == [90]


def test_plan_covers_every_config_and_fitting_arch():
    jobs = build_cubins.plan_jobs(SPEC)
    got = {(j.cfg, j.kind, j.arch) for j in jobs}
    want = {(c, "cubin", a) for c in SPEC.configs for a in SPEC.archs if c.fits_arch(a)
            and a in SPEC.config_archs.get(c, SPEC.archs) and (not c.wgmma or a == 90)}
    # wgmma kernels are sm_90a SASS only: no PTX, which no other GPU could JIT.
    want |= {(c, "ptx", SPEC.ptx_arch) for c in SPEC.configs if not c.wgmma}
    # Backward modules: mma.sync ones for every arch they fit, plus PTX; wgmma ones sm_90a only.
    assert SPEC.backward_configs and any(c.wgmma for c in SPEC.backward_configs)
    want |= {(c, "cubin", a) for c in SPEC.backward_configs for a in SPEC.archs
             if c.fits_arch(a) and (not c.wgmma or a == 90)}
    want |= {(c, "ptx", SPEC.ptx_arch) for c in SPEC.backward_configs if not c.wgmma}
    assert got == want and len(jobs) == len(want)
    assert {j.file for j in jobs} == build_cubins.expected_files(SPEC)


def test_plan_skips_arch_the_config_does_not_fit():
    big = KernelConfig(**{**CFG.to_dict(), "d_head": 256})  # 128 KiB of smem
    spec = build_cubins.Spec(archs=(80, 86, 90), ptx_arch=90, configs=(big,), rules=())
    assert [(j.kind, j.arch) for j in build_cubins.plan_jobs(spec)] == [
        ("cubin", 80), ("cubin", 90), ("ptx", 90)]


def test_plan_filters():
    jobs = build_cubins.plan_jobs(SPEC, only="bf16_d128", archs=[80])
    assert jobs and all("bf16_d128" in j.cfg.name and (j.kind, j.arch) == ("cubin", 80)
                        for j in jobs)
    ptx_only = build_cubins.plan_jobs(SPEC, archs=[SPEC.ptx_arch])
    assert {j.kind for j in ptx_only} == {"cubin", "ptx"}


PTXAS_LOG = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'cudaflash_combine' for 'sm_90'
ptxas info    : Function properties for cudaflash_combine
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 30 registers, used 0 barriers, 520 bytes cmem[0]
ptxas info    : Compile time = 10.0 ms
ptxas info    : Compiling entry function 'cudaflash_fwd_split' for 'sm_90'
ptxas info    : Function properties for cudaflash_fwd_split
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 254 registers, used 1 barriers, 1024 bytes smem
ptxas info    : Compile time = 160.0 ms
ptxas info    : Compiling entry function 'cudaflash_fwd' for 'sm_90'
ptxas info    : Function properties for cudaflash_fwd
    16 bytes stack frame, 44 bytes spill stores, 36 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 1024 bytes smem
ptxas info    : Compile time = 161.2 ms
ptxas info    : Compiling entry function 'cudaflash_fwd_softcap' for 'sm_90'
ptxas info    : Function properties for cudaflash_fwd_softcap
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 250 registers, used 1 barriers, 1024 bytes smem
ptxas info    : Compile time = 150.0 ms
ptxas info    : Compiling entry function 'cudaflash_fwd_split_softcap' for 'sm_90'
ptxas info    : Function properties for cudaflash_fwd_split_softcap
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 252 registers, used 1 barriers, 1024 bytes smem
ptxas info    : Compile time = 150.0 ms
ptxas info    : Compiling entry function 'cudaflash_fwd_alibi' for 'sm_90'
ptxas info    : Function properties for cudaflash_fwd_alibi
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 251 registers, used 1 barriers, 1024 bytes smem
ptxas info    : Compiling entry function 'cudaflash_fwd_split_alibi' for 'sm_90'
ptxas info    : Function properties for cudaflash_fwd_split_alibi
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 251 registers, used 1 barriers, 1024 bytes smem
ptxas info    : Compiling entry function 'cudaflash_fwd_alibi_kvcache' for 'sm_90'
ptxas info    : Function properties for cudaflash_fwd_alibi_kvcache
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 251 registers, used 1 barriers, 1024 bytes smem
ptxas info    : Compiling entry function 'cudaflash_fwd_split_alibi_kvcache' for 'sm_90'
ptxas info    : Function properties for cudaflash_fwd_split_alibi_kvcache
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 251 registers, used 1 barriers, 1024 bytes smem
ptxas info    : Compiling entry function 'cudaflash_fwd_kvcache' for 'sm_90'
ptxas info    : Function properties for cudaflash_fwd_kvcache
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 250 registers, used 1 barriers, 1024 bytes smem
ptxas info    : Compiling entry function 'cudaflash_fwd_split_kvcache' for 'sm_90'
ptxas info    : Function properties for cudaflash_fwd_split_kvcache
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 251 registers, used 1 barriers, 1024 bytes smem
ptxas info    : Compiling entry function 'cudaflash_fwd_softcap_kvcache' for 'sm_90'
ptxas info    : Function properties for cudaflash_fwd_softcap_kvcache
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 252 registers, used 1 barriers, 1024 bytes smem
ptxas info    : Compiling entry function 'cudaflash_fwd_split_softcap_kvcache' for 'sm_90'
ptxas info    : Function properties for cudaflash_fwd_split_softcap_kvcache
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 253 registers, used 1 barriers, 1024 bytes smem
ptxas info    : Compiling entry function 'cudaflash_fwd_dropout' for 'sm_90'
ptxas info    : Function properties for cudaflash_fwd_dropout
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 250 registers, used 1 barriers, 1024 bytes smem
ptxas info    : Compiling entry function 'cudaflash_fwd_dropout_alibi' for 'sm_90'
ptxas info    : Function properties for cudaflash_fwd_dropout_alibi
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 251 registers, used 1 barriers, 1024 bytes smem
ptxas info    : Compiling entry function 'cudaflash_append_kv' for 'sm_90'
ptxas info    : Function properties for cudaflash_append_kv
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 20 registers, used 1 barriers, 1024 bytes smem
"""


def test_parse_ptxas():
    # Registers and smem of the forward, the split forward's registers, spills summed over
    # all sixteen entries, the largest stack frame.
    assert build_cubins.parse_ptxas(PTXAS_LOG) == {
        "registers": 255, "split_registers": 254, "spill_bytes": 88, "stack_bytes": 16,
        "static_smem": 1024, "wgmma_serialized": False}
    serialized = PTXAS_LOG + ("ptxas info    : (C7515) Potential Performance Loss: "
                              "wgmma.mma_async instructions are serialized due to ...\n")
    assert build_cubins.parse_ptxas(serialized)["wgmma_serialized"] is True
    clean = PTXAS_LOG.replace("16 bytes stack frame, 44 bytes spill stores, 36",
                              "0 bytes stack frame, 0 bytes spill stores, 0")
    clean = clean.replace("8 bytes stack frame, 4 bytes spill stores, 4",
                          "0 bytes stack frame, 0 bytes spill stores, 0")
    clean = clean.replace("used 1 barriers, 1024 bytes smem", "used 1 barriers, 520 bytes cmem[0]")
    assert build_cubins.parse_ptxas(clean) == {
        "registers": 255, "split_registers": 254, "spill_bytes": 0, "stack_bytes": 0,
        "static_smem": 0, "wgmma_serialized": False}


def _backward_ptxas_log(fused_registers: int) -> str:
    """A ptxas report of a backward module's entries: the fused ones with fused_registers."""
    out = []
    for symbol in BackwardConfig.ENTRIES:
        regs = fused_registers if symbol.startswith("cudaflash_bwd_dkdv_dq") else 200
        out += [f"ptxas info    : Compiling entry function '{symbol}' for 'sm_90a'",
                f"ptxas info    : Function properties for {symbol}",
                "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads",
                f"ptxas info    : Used {regs} registers, used 16 barriers, 720 bytes cmem[0]"]
    return "\n".join(out) + "\n"


def test_parse_ptxas_checks_the_warp_specialized_register_pool():
    """setmaxnreg's split (24 x 128 + 240 x 256) must fit the launch's pool (registers x 384):
    168 registers per thread does, 160 would deadlock, so the build refuses it."""
    cfg = BackwardConfig("bf16", 128, 64, 64, 8, wgmma=True, warp_specialized=True)
    assert build_cubins.parse_ptxas(_backward_ptxas_log(168), cfg)["registers"] == 200
    with pytest.raises(build_cubins.BuildError, match=r"cudaflash_bwd_dkdv_dq got 160 "
                                                      r"registers.*needs 64512.*deadlock"):
        build_cubins.parse_ptxas(_backward_ptxas_log(160), cfg)
    # Without warp specialization no setmaxnreg: any count passes.
    plain = BackwardConfig("bf16", 128, 64, 64, 8, wgmma=True)
    assert build_cubins.parse_ptxas(_backward_ptxas_log(160), plain)["registers"] == 200


@pytest.mark.parametrize("log", [
    "",
    PTXAS_LOG.replace("'cudaflash_fwd'", "'_Z3fooPf'"),
    PTXAS_LOG.replace("'cudaflash_combine'", "'other'"),
    PTXAS_LOG + PTXAS_LOG.replace("'cudaflash_fwd'", "'other'"),
])
def test_parse_ptxas_requires_exactly_the_three_entries(log):
    with pytest.raises(build_cubins.BuildError, match="must export exactly"):
        build_cubins.parse_ptxas(log)


def test_stamp_depends_on_sources_commands_and_tool_versions():
    argv = ["-ptx", "-DCF_D_HEAD=64", "|", "-arch=sm_90"]
    versions = "nvcc 13.0.88, ptxas 12.9.86"
    base = build_cubins.job_stamp("src", argv, versions)
    assert build_cubins.job_stamp("src", list(argv), versions) == base
    assert build_cubins.job_stamp("src2", argv, versions) != base
    assert build_cubins.job_stamp("src", argv[:1] + ["-DCF_D_HEAD=128"] + argv[2:],
                                  versions) != base
    assert build_cubins.job_stamp("src", argv, "nvcc 13.0.88, ptxas 13.0.88") != base


def test_source_digest_sees_every_file(tmp_path):
    (tmp_path / "a.cuh").write_text("a")
    first = build_cubins.source_digest(tmp_path)
    (tmp_path / "b.cuh").write_text("")
    assert build_cubins.source_digest(tmp_path) != first


def test_remove_stale_keeps_expected_and_foreign_files(tmp_path):
    files = ["sm_80/keep.cubin", "sm_80/keep.cubin.stamp", "sm_80/old.cubin",
             "sm_80/old.cubin.stamp", "sm_75/gone.cubin", "ptx/compute_90/keep.ptx",
             "ptx/compute_90/old.ptx", "notes.txt", "manifest.json"]
    for f in files:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("x")
    removed = build_cubins.remove_stale(tmp_path, {"sm_80/keep.cubin", "ptx/compute_90/keep.ptx"})
    assert sorted(removed) == ["ptx/compute_90/old.ptx", "sm_75/gone.cubin", "sm_80/old.cubin",
                               "sm_80/old.cubin.stamp"]
    left = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert left == ["manifest.json", "notes.txt", "ptx/compute_90/keep.ptx", "sm_80/keep.cubin",
                    "sm_80/keep.cubin.stamp"]
    assert not (tmp_path / "sm_75").exists()


def test_params_bytes_matches_ctypes():
    params = load_params_module()
    assert build_cubins.params_bytes(ROOT / "cuda_src") == ctypes.sizeof(params.Params)
    assert params.PARAMS_BYTES == ctypes.sizeof(params.Params)


def test_find_nvcc_errors(monkeypatch, tmp_path):
    with pytest.raises(build_cubins.BuildError, match="--nvcc='/no/such/nvcc'"):
        build_cubins.find_nvcc("/no/such/nvcc")
    monkeypatch.setenv("CUDAFLASH_NVCC", "/no/nvcc")
    with pytest.raises(build_cubins.BuildError, match="CUDAFLASH_NVCC='/no/nvcc'"):
        build_cubins.find_nvcc()
    monkeypatch.delenv("CUDAFLASH_NVCC")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(build_cubins.BuildError, match="nvcc not found: pass --nvcc"):
        build_cubins.find_nvcc()


def test_find_ptxas_order(monkeypatch, tmp_path):
    def executable(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
        return str(path)

    nvcc = executable(tmp_path / "cuda" / "bin" / "nvcc")
    beside = executable(tmp_path / "cuda" / "bin" / "ptxas")
    monkeypatch.delenv("CUDAFLASH_PTXAS", raising=False)
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site")])
    assert build_cubins.find_ptxas(nvcc) == beside  # no CUDA 12 package: the one beside nvcc
    pip = executable(tmp_path / "site" / "nvidia" / "cuda_nvcc" / "bin" / "ptxas")
    assert build_cubins.find_ptxas(nvcc) == pip  # the nvidia-cuda-nvcc-cu12 package's
    named = executable(tmp_path / "other" / "ptxas")
    monkeypatch.setenv("CUDAFLASH_PTXAS", named)
    assert build_cubins.find_ptxas(nvcc) == named
    with pytest.raises(build_cubins.BuildError, match="--ptxas='/no/ptxas' is not an executable"):
        build_cubins.find_ptxas(nvcc, "/no/ptxas")


def test_config_and_selection_load_without_torch():
    # build_cubins.py runs in pip's build env, which has no torch (nor numpy, nor cudaflash).
    code = ("import sys, build_cubins; bad = {'torch', 'numpy', 'cudaflash'} & set(sys.modules); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def unlisted_config_template() -> str:
    """A valid config name (with "{dtype}") that configs.yaml does not list."""
    listed = {c.name for c in SPEC.configs}
    for b_r in (64, 128):
        for b_c in (32, 64, 128):
            cfg = KernelConfig(**{**CFG.to_dict(), "dtype": "fp16", "B_r": b_r, "B_c": b_c})
            if not cfg.errors() and cfg.name not in listed:
                return cfg.name.replace("fwd_fp16_", "fwd_{dtype}_")
    raise AssertionError("configs.yaml lists every candidate")


@pytest.mark.parametrize("change,error", [
    ({"extra": 1}, "unknown key(s) ['extra']"),
    ({"archs": [75, 90]}, "archs=[75, 90] must be a non-empty list of distinct archs"),
    ({"archs": [90, 90]}, "archs=[90, 90]"),
    ({"ptx_arch": "sm_90"}, "ptx_arch='sm_90' must be an integer"),
    ({"configs": []}, "configs must be a non-empty list"),
    ({"defaults": [1]}, "defaults=[1] must be a mapping"),
    ({"selection": [{"d_head": 128, "config": unlisted_config_template()}]},
     "rule 0: config '" + unlisted_config_template().format(dtype="fp16")
     + "' is not in the configs list"),
])
def test_bad_configs_yaml(tmp_path, change, error):
    data = yaml.safe_load((ROOT / "configs.yaml").read_text())
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump({**data, **change}))
    with pytest.raises(build_cubins.ConfigError) as exc:
        build_cubins.load_spec(path)
    assert str(exc.value).startswith("broken.yaml") and error in str(exc.value), str(exc.value)


def test_entry_archs_limit_the_cubins_and_the_rules(tmp_path):
    """An entry's own `archs` keeps its configs off the other archs (PTX is still built), and
    a rule naming such a config for an arch it is not built for is a build error."""
    fields = {k: v for k, v in CFG.to_dict().items() if k != "dtype"}
    entry = {**fields, "dtype": ["fp16", "bf16"], "archs": [90]}
    data = {"archs": [80, 86, 90], "ptx_arch": 90, "configs": [entry]}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    spec = build_cubins.load_spec(path)
    jobs = {(j.cfg.dtype, j.kind, j.arch) for j in build_cubins.plan_jobs(spec)}
    assert jobs == {(dt, kind, 90) for dt in ("fp16", "bf16") for kind in ("cubin", "ptx")}

    rule = {"arch": [80], "config": CFG.name.replace(f"fwd_{CFG.dtype}_", "fwd_{dtype}_")}
    path.write_text(yaml.safe_dump({**data, "selection": [rule]}))
    with pytest.raises(build_cubins.ConfigError, match="rule 0: .* is not built for sm_80"):
        build_cubins.load_spec(path)
    path.write_text(yaml.safe_dump({**data, "configs": [{**entry, "archs": [75]}]}))
    with pytest.raises(build_cubins.ConfigError, match=r"configs\[0\]: archs=\[75\]"):
        build_cubins.load_spec(path)


def test_shipped_backward_serves_every_scheme_once_per_dtype_and_head_dim():
    """Every (dtype, head dim, scheme) has a module; at d256, which has no fused kernel, the
    deterministic modules serve the atomic scheme too (backward.run, dispatch)."""
    cfg = build_cubins.backward_config
    for dtype in build_cubins.config.DTYPES:
        for d in cfg.BWD_D_HEADS:
            for scheme in cfg.BACKWARD_SCHEMES:
                wanted = "deterministic" if d == 256 else scheme
                serving = [c for c in SPEC.backward_configs if (c.dtype, c.d_head) == (dtype, d)
                           and wanted in SPEC.backward_schemes[c]]
                assert serving, (dtype, d, scheme)


def test_a_d256_backward_entry_must_not_serve_the_atomic_scheme(tmp_path):
    data = yaml.safe_load((ROOT / "configs.yaml").read_text())
    entry = {"dtype": "fp16", "d_head": 256, "B_r": 32, "B_c": 32, "n_warps": 4}
    path = tmp_path / "b.yaml"
    path.write_text(yaml.safe_dump({**data, "backward": [entry]}))  # default: both schemes
    with pytest.raises(build_cubins.ConfigError, match=r"no fused dK/dV \+ dQ kernel .* "
                                                       "scheme: deterministic"):
        build_cubins.load_spec(path)
    path.write_text(yaml.safe_dump({**data, "backward": [{**entry, "scheme": "deterministic"}]}))
    assert build_cubins.load_spec(path).backward_configs
    assert any("warp-specialized kernels (wgmma, warp_specialized, ws_query_rows 64, B_c 64)" in e
               for e in BackwardConfig(**{**entry, "B_r": 64, "wgmma": True}).errors())
    ws = BackwardConfig(**{**entry, "B_r": 64, "B_c": 64, "n_warps": 8, "wgmma": True,
                           "warp_specialized": True})
    assert ws.errors() == [] and not ws.fuses_dq and ws.plain_calls_only
    assert (ws.dkdv_threads, ws.dkdv_cta_rows) == (ws.dq_threads, ws.dq_cta_rows) == (384, 64)
    assert max(ws.dkdv_smem_bytes, ws.dq_smem_bytes) <= 232448  # sm_90's opt-in limit
    assert ws.dkdv_dq_smem_bytes == 0  # its fused entries are traps


def test_modules_for_plain_calls_only_have_a_general_module_behind_them():
    """A module that serves only padded batches without score modifiers (d256's
    warp-specialized one) must have, for its dtype, head dim and arch, a module listed after
    it that serves every call (varlen, softcap, ALiBi, dropout, refused tensor maps)."""
    plain_only = [c for c in SPEC.backward_configs if c.plain_calls_only]
    assert plain_only, "configs.yaml lists no plain-calls-only module: update this test"
    for cfg in plain_only:
        later = SPEC.backward_configs[SPEC.backward_configs.index(cfg) + 1:]
        for arch in SPEC.cubin_archs(cfg):
            assert any((c.dtype, c.d_head) == (cfg.dtype, cfg.d_head) and not c.plain_calls_only
                       and arch in SPEC.cubin_archs(c)
                       and set(SPEC.backward_schemes[cfg]) <= set(SPEC.backward_schemes[c])
                       for c in later), (cfg.name, arch)


def test_every_atomic_module_of_hopper_has_a_fused_dropout_module():
    """Dropout's atomic backward runs a module whose fused kernel applies it
    (BackwardConfig.fused_dropout: warp-specialized, not d256; its dkdv_dq_dropout entry
    traps elsewhere): configs.yaml builds one for every (dtype, d_head) whose first sm_90
    atomic module is warp-specialized, and only those are marked."""
    for cfg in SPEC.backward_configs:
        assert cfg.fused_dropout == (cfg.warp_specialized and cfg.d_head != 256), cfg.name
    atomic = [c for c in SPEC.backward_configs if "atomic" in SPEC.backward_schemes[c]
              and 90 in SPEC.cubin_archs(c)]
    firsts = {}
    for c in atomic:
        firsts.setdefault((c.dtype, c.d_head), c)
    for (dtype, d_head), first in firsts.items():
        if first.warp_specialized:
            assert any(c.fused_dropout and (c.dtype, c.d_head) == (dtype, d_head)
                       for c in atomic), (dtype, d_head)


def test_backward_entry_scheme(tmp_path):
    data = yaml.safe_load((ROOT / "configs.yaml").read_text())
    entry = {"dtype": "fp16", "d_head": 64, "B_r": 64, "B_c": 64, "n_warps": 4}
    path = tmp_path / "b.yaml"
    for scheme, want in (("atomic", ("atomic",)), (["deterministic"], ("deterministic",)),
                         (None, ("atomic", "deterministic"))):
        given = entry if scheme is None else {**entry, "scheme": scheme}
        path.write_text(yaml.safe_dump({**data, "backward": [given]}))
        spec = build_cubins.load_spec(path)
        assert spec.backward_schemes == {BackwardConfig(**entry): want}
    for bad in ("fast", [], ["atomic", "x"]):
        path.write_text(yaml.safe_dump({**data, "backward": [{**entry, "scheme": bad}]}))
        with pytest.raises(build_cubins.ConfigError, match=r"backward\[0\]: scheme="):
            build_cubins.load_spec(path)
    path.write_text(yaml.safe_dump({**data, "backward": [entry, {**entry, "scheme": "atomic"}]}))
    with pytest.raises(build_cubins.ConfigError, match=r"backward\[1\]: .* already listed"):
        build_cubins.load_spec(path)


def test_rule_whose_config_cannot_fit_its_arch(tmp_path):
    # (128 + 2 * 64) * 256 * 2 bytes = 128 KiB of smem: built for sm_80/sm_90, never sm_86.
    name = "fwd_{dtype}_d256_br128_bc64_w4_async1_eager1_swz1_q0k0v0_dbuf0_osm1_ctas1_wgmma0"
    path = tmp_path / "c.yaml"
    path.write_text(FAKE_YAML.split("selection:")[0].replace("d_head: 64", "d_head: 256")
                    .replace("B_r: 64", "B_r: 128")
                    + f'selection:\n  - {{arch: [86], config: "{name}"}}\n')
    with pytest.raises(build_cubins.ConfigError, match="rule 0: .* more than sm_86's 101376"):
        build_cubins.load_spec(path)


# ---- manifest schema (docs/contracts.md) ------------------------------------------------

TOP_KEYS = {"schema", "nvcc_version", "ptxas_version", "min_driver", "source_hash",
            "params_bytes", "bwd_params_bytes", "archs", "ptx_arch", "selection", "kernels",
            "backward_kernels"}
BACKWARD_KEYS = {"name", "config", "arch", "kind", "file", "entries", "threads",
                 "fused_threads", "preprocess_threads", "preprocess_rows", "cta_rows", "schemes", "registers",
                 "spill_bytes", "sha256", "nvcc_version", "ptxas_version", "ptx_isa",
                 "min_driver", "source_hash"}
# Written out here, not taken from config.py: what the kernels export (docs/contracts.md).
BACKWARD_ENTRIES = ["cudaflash_bwd_preprocess", "cudaflash_bwd_dkdv", "cudaflash_bwd_dq",
                    "cudaflash_bwd_dkdv_dq", "cudaflash_bwd_dq_convert",
                    "cudaflash_bwd_dkdv_dq_window", "cudaflash_bwd_preprocess_varlen",
                    "cudaflash_bwd_dkdv_varlen", "cudaflash_bwd_dq_varlen",
                    "cudaflash_bwd_dkdv_scoremod", "cudaflash_bwd_dq_scoremod",
                    "cudaflash_bwd_dkdv_varlen_scoremod", "cudaflash_bwd_dq_varlen_scoremod",
                    "cudaflash_bwd_dkdv_dq_varlen", "cudaflash_bwd_dq_convert_varlen",
                    "cudaflash_bwd_dkdv_dq_dropout"]
KERNEL_KEYS = {"name", "config", "arch", "kind", "file", "entries", "threads", "registers",
               "spill_bytes", "sha256", "nvcc_version", "ptxas_version", "ptx_isa",
               "min_driver", "source_hash"}
ENTRIES = ["cudaflash_fwd", "cudaflash_fwd_split", "cudaflash_combine", "cudaflash_fwd_softcap",
           "cudaflash_fwd_split_softcap", "cudaflash_fwd_alibi", "cudaflash_fwd_split_alibi",
           "cudaflash_fwd_kvcache", "cudaflash_fwd_split_kvcache",
           "cudaflash_fwd_softcap_kvcache", "cudaflash_fwd_split_softcap_kvcache",
           "cudaflash_fwd_alibi_kvcache", "cudaflash_fwd_split_alibi_kvcache",
           "cudaflash_append_kv", "cudaflash_fwd_dropout", "cudaflash_fwd_dropout_alibi"]


def check_entries(k: dict, cfg, symbols: list) -> None:
    """A module's role table: every role of its family once, in the family's order, with
    the exported ``symbols`` and the smem its config property gives (0 without one)."""
    assert list(k["entries"]) == [role.name for role in cfg.ROLES]
    assert [e["symbol"] for e in k["entries"].values()] == symbols
    for role in cfg.ROLES:
        want = getattr(cfg, role.smem) if role.smem else 0
        assert k["entries"][role.name]["smem_bytes"] == want, (k["name"], role.name)


def check_manifest(m: dict, out_dir: Path) -> None:
    assert set(m) == TOP_KEYS
    assert m["schema"] == build_cubins.manifest.SCHEMA == 20
    assert re.fullmatch(r"\d+\.\d+\.\d+", m["nvcc_version"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", m["ptxas_version"])
    # Every file's driver floor is what its own header / .version line says.
    assert build_cubins.check_kernels(out_dir) == []
    assert re.fullmatch(r"[0-9a-f]{64}", m["source_hash"])
    assert m["archs"] == sorted(m["archs"]) and all(isinstance(a, int) for a in m["archs"])
    assert isinstance(m["ptx_arch"], int)
    build_cubins.selection.parse_rules(m["selection"], where="manifest.json")
    seen = set()
    for k in m["kernels"]:
        assert set(k) == KERNEL_KEYS, k.get("name")
        cfg = KernelConfig.from_dict(k["config"], where=k["name"])
        assert k["name"] == cfg.name
        check_entries(k, cfg, ENTRIES)
        assert k["entries"]["forward"]["smem_bytes"] == cfg.smem_bytes
        assert k["threads"] == cfg.threads
        if k["kind"] == "cubin":
            assert k["arch"] in m["archs"] and cfg.builds_for(k["arch"])
            assert k["file"] == f"sm_{k['arch']}/{cfg.name}.cubin"
            assert isinstance(k["registers"], int) and 0 < k["registers"] <= 255
            assert isinstance(k["spill_bytes"], int) and k["spill_bytes"] >= 0
        else:
            assert k["kind"] == "ptx" and k["arch"] == m["ptx_arch"]
            assert k["file"] == f"ptx/compute_{k['arch']}/{cfg.name}.ptx"
            assert k["registers"] is None and k["spill_bytes"] is None
        assert k["sha256"] == hashlib.sha256((out_dir / k["file"]).read_bytes()).hexdigest()
        assert (k["nvcc_version"], k["ptxas_version"], k["source_hash"]) == (
            m["nvcc_version"], m["ptxas_version"], m["source_hash"])
        key = (k["name"], k["kind"], k["arch"])
        assert key not in seen, key
        seen.add(key)
    for k in m["backward_kernels"]:
        assert set(k) == BACKWARD_KEYS, k.get("name")
        cfg = BackwardConfig.from_dict(k["config"], where=k["name"])
        assert k["name"] == cfg.name
        assert k["schemes"] and set(k["schemes"]) <= {"atomic", "deterministic"}
        check_entries(k, cfg, BACKWARD_ENTRIES)
        assert (k["threads"], k["cta_rows"]) == (cfg.dkdv_threads, cfg.dkdv_cta_rows)
        # The fused dK/dV + dQ entries: a producer warpgroup more where warp-specialized.
        assert k["fused_threads"] == cfg.threads + 128 * cfg.warp_specialized
        if k["kind"] == "cubin":
            assert k["file"] == f"sm_{k['arch']}/{cfg.name}.cubin" and cfg.builds_for(k["arch"])
            assert isinstance(k["registers"], int) and 0 < k["registers"] <= 255
        else:
            assert k["file"] == f"ptx/compute_{k['arch']}/{cfg.name}.ptx"
        assert k["sha256"] == hashlib.sha256((out_dir / k["file"]).read_bytes()).hexdigest()
        key = (k["name"], k["kind"], k["arch"])
        assert key not in seen, key
        seen.add(key)


@pytest.fixture(scope="module")
def built_manifest():
    if not MANIFEST.is_file():
        pytest.skip(f"{MANIFEST.relative_to(ROOT)} not built (run `python build_cubins.py` or "
                    "`pip install .`)")
    return json.loads(MANIFEST.read_text())


def test_built_manifest_schema(built_manifest):
    check_manifest(built_manifest, MANIFEST.parent)


def test_built_manifest_has_every_config_for_every_arch_it_fits(built_manifest):
    want = {(j.cfg.name, j.kind, j.arch) for j in build_cubins.plan_jobs(SPEC)}
    got = {(k["name"], k["kind"], k["arch"])
           for k in built_manifest["kernels"] + built_manifest["backward_kernels"]}
    missing, extra = sorted(want - got), sorted(got - want)
    assert not missing and not extra, (
        f"manifest.json is out of date with configs.yaml (rebuild with `python build_cubins.py`):"
        f" {len(missing)} missing, e.g. {missing[:2]}; {len(extra)} extra, e.g. {extra[:2]}")
    assert built_manifest["selection"] == [r.to_dict() for r in SPEC.rules]


# The one known exception: the warp-specialized backward's producer warpgroup runs at 24
# registers (setmaxnreg: 24 x 128 + 240 x 256 is the launch's whole pool), where the loader and
# reducer warps spill their per-step bookkeeping (step counters, row pointers: up to 380 bytes
# of stores + loads per fused entry at d64 with 128 query rows, 240 at d128). The copy loops
# themselves do not spill (SASS read in the sixteenth session), and the consumers reload at most
# three values per step that the compiler spilled before the roles split. At 32/232 the
# consumers spilled in the hot loop instead. The fast loader that raised these numbers (from 96
# per entry) made the backward 11% faster: perf log "Backward v4.2". A TMA producer would need
# no registers for addresses.
# The one consumer exception: the bf16 d64 128-query-row module's dropout entry
# (cudaflash_bwd_dkdv_dq_dropout) spills 16 bytes (8 stored, 8 loaded: two loop-invariant
# values stored before the loop and reloaded once a step each, beside the unpacking of P^T's
# and the kept P^T's bf16 fragments for dS^T and the unrolled Philox; its fp16 twin does not
# spill; perf log, "The fused dropout backward's dS^T from dV's operand" and "Philox
# unrolled in the fused dropout backward"). Drawn as keep bits (until the thirtieth session)
# it spilled 108.
WS_PRODUCER_SPILL_BYTES = 640


def test_no_shipped_cubin_spills(built_manifest):
    spilling = [(k["name"], k["arch"], k["spill_bytes"])
                for k in built_manifest["kernels"] + built_manifest["backward_kernels"]
                if k["kind"] == "cubin" and k["spill_bytes"]
                and not (k["config"].get("warp_specialized") is True
                         and k["spill_bytes"] <= WS_PRODUCER_SPILL_BYTES)]
    assert not spilling, f"cubins that spill registers (bytes): {spilling}"


def test_built_manifest_params_bytes(built_manifest):
    params = load_params_module()
    assert built_manifest["params_bytes"] == ctypes.sizeof(params.Params)
    assert built_manifest["bwd_params_bytes"] == ctypes.sizeof(params.BwdParams)


# ---- real nvcc runs on a stand-in kernel -------------------------------------------------

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"),
                                reason="nvcc not found (PATH, CUDA_HOME)")

FAKE_KERNEL = """\
// Stand-in for the real kernel: exercises the build, computes nothing useful.
#include "params.cuh"
extern "C" __global__ void cudaflash_fwd(const __grid_constant__ cudaflash::Params p) {
    extern __shared__ float smem[];
    smem[threadIdx.x] = p.softmax_scale * (CF_D_HEAD + CF_B_R + CF_DTYPE_BF16);
    __syncthreads();
    static_cast<float*>(p.o)[threadIdx.x] = smem[(threadIdx.x + 1) % (32 * CF_N_WARPS)];
}
extern "C" __global__ void cudaflash_fwd_split(const __grid_constant__ cudaflash::Params p) {
    p.o_accum[threadIdx.x] = p.scale_log2;
}
extern "C" __global__ void cudaflash_combine(const __grid_constant__ cudaflash::Params p) {
    p.lse_accum[threadIdx.x] = p.softmax_scale;
}
extern "C" __global__ void cudaflash_fwd_softcap(const __grid_constant__ cudaflash::Params p) {
    p.o_accum[threadIdx.x] = p.softcap_pre;
}
extern "C" __global__ void cudaflash_fwd_split_softcap(
        const __grid_constant__ cudaflash::Params p) {
    p.lse_accum[threadIdx.x] = p.softcap_pre;
}
#define KVCACHE_STAND_IN(name, field)                                           \
    extern "C" __global__ void name(const __grid_constant__ cudaflash::Params p) { \
        p.o_accum[threadIdx.x] = float(p.field);                              \
    }
KVCACHE_STAND_IN(cudaflash_fwd_kvcache, page_shift)
KVCACHE_STAND_IN(cudaflash_fwd_split_kvcache, n_cache_entries)
KVCACHE_STAND_IN(cudaflash_fwd_softcap_kvcache, block_table_stride)
KVCACHE_STAND_IN(cudaflash_fwd_split_softcap_kvcache, paged_keys)
KVCACHE_STAND_IN(cudaflash_fwd_alibi, alibi_batch_stride)
KVCACHE_STAND_IN(cudaflash_fwd_split_alibi, alibi_scale)
KVCACHE_STAND_IN(cudaflash_fwd_alibi_kvcache, alibi_batch_stride)
KVCACHE_STAND_IN(cudaflash_fwd_split_alibi_kvcache, alibi_scale)
KVCACHE_STAND_IN(cudaflash_fwd_dropout, dropout_scale)
KVCACHE_STAND_IN(cudaflash_fwd_dropout_alibi, dropout_threshold)
extern "C" __global__ void cudaflash_append_kv(const __grid_constant__ cudaflash::AppendParams p) {
    static_cast<int*>(p.k_cache)[threadIdx.x] = p.seqlen_new;
}
"""
FAKE_YAML = """\
archs: [80, 90]
ptx_arch: 90
defaults: {async_copy: true, eager_load_blocks: true, swizzled: true,
           Q_mma_load_K_fragments: 0, K_mma_load_K_fragments: 0, V_mma_load_K_fragments: 0,
           mma_double_buffer_loads: false, optimized_softmax: true, min_ctas_per_sm: 1, wgmma: false}
configs:
  - {dtype: [fp16, bf16], d_head: 64, B_r: 64, B_c: 64, n_warps: 4}
selection:
  - {d_head: 64, config: "fwd_{dtype}_d64_br64_bc64_w4_async1_eager1_swz1_q0k0v0_dbuf0_osm1_ctas1_wgmma0"}
"""
FAKE_NAMES = [f"fwd_{dt}_d64_br64_bc64_w4_async1_eager1_swz1_q0k0v0_dbuf0_osm1_ctas1_wgmma0"
              for dt in ("fp16", "bf16")]


@pytest.fixture
def fake_tree(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(ROOT / "cuda_src" / "params.cuh", src / "params.cuh")
    shutil.copy(ROOT / "cuda_src" / "bwd_params.cuh", src / "bwd_params.cuh")
    (src / "flash_fwd.cu").write_text(FAKE_KERNEL)
    (tmp_path / "configs.yaml").write_text(FAKE_YAML)
    return tmp_path


def fake_build(tree: Path, **kw) -> dict:
    return build_cubins.build(configs_path=tree / "configs.yaml", out_dir=tree / "out",
                              src_dir=tree / "src", jobs=kw.pop("jobs", 2), **kw)


@needs_nvcc
def test_build_incremental_and_stale(fake_tree, capsys):
    m = fake_build(fake_tree)
    check_manifest(m, fake_tree / "out")
    assert m == json.loads((fake_tree / "out" / "manifest.json").read_text())
    assert [(k["name"], k["kind"], k["arch"]) for k in m["kernels"]] == [
        (n, kind, arch) for n in FAKE_NAMES
        for kind, arch in (("cubin", 80), ("cubin", 90), ("ptx", 90))]
    out = capsys.readouterr().out
    assert "-ptx -arch=compute_80" in out and "-ptx -arch=compute_90" in out
    assert re.search(r"ptxas -arch=sm_80 .* # PTX declared as ISA 7\.0", out)
    assert re.search(rf"{FAKE_NAMES[0]} +sm_90 +\d+ +\d+ +0 +0 +24576", out)  # summary row

    assert fake_build(fake_tree) == m  # nothing changed: nothing compiled
    out = capsys.readouterr().out
    assert "nvcc -" not in out and f"up to date: {FAKE_NAMES[1]} sm_80" in out
    assert out.count("up to date: ") == 6

    with open(fake_tree / "src" / "params.cuh", "a") as f:
        f.write("// touched\n")
    fake_build(fake_tree)
    assert "compiling 6 of 6 kernels" in capsys.readouterr().out

    (fake_tree / "configs.yaml").write_text(
        FAKE_YAML.replace("[fp16, bf16]", "fp16").replace("{d_head: 64,", "{dtype: fp16, d_head: 64,"))
    m = fake_build(fake_tree)
    assert {k["name"] for k in m["kernels"]} == {FAKE_NAMES[0]}
    out = capsys.readouterr().out
    assert f"removed stale: sm_80/{FAKE_NAMES[1]}.cubin\n" in out
    assert not list((fake_tree / "out").rglob(f"{FAKE_NAMES[1]}*"))


@needs_nvcc
def test_build_declares_the_lowest_ptx_isa_and_records_driver_floors(fake_tree):
    m = fake_build(fake_tree)
    out = fake_tree / "out"
    for k in m["kernels"]:
        data = (out / k["file"]).read_bytes()
        if k["kind"] == "ptx":
            # The stand-in uses nothing newer than what compute_90 itself needs (ISA 7.8):
            # the PTX is declared as that, whatever nvcc wrote, so CUDA 11.8+ drivers JIT it.
            assert build_cubins.driver_compat.ptx_isa(data.decode()) == (7, 8)
            assert (k["ptx_isa"], k["min_driver"]) == ("7.8", 11080)
        else:
            assert k["min_driver"] == build_cubins.driver_compat.cubin_min_driver(data)
            assert k["ptx_isa"] == {80: "7.0", 90: "7.8"}[k["arch"]]
    assert m["min_driver"]["ptx"] == 11080
    assert m["min_driver"]["cubin"] == max(k["min_driver"] for k in m["kernels"]
                                           if k["kind"] == "cubin")


@needs_nvcc
def test_check_kernels_catches_a_foreign_format(fake_tree, capsys):
    m = fake_build(fake_tree)
    out = fake_tree / "out"
    assert build_cubins.check_kernels(out) == []
    cubin_floor = m["min_driver"]["cubin"]
    too_low = build_cubins.driver_compat.cuda_version_text(cubin_floor - 10)
    assert build_cubins.main(["--check", str(out), "--max-cubin-driver", too_low]) == 1
    assert "above the allowed" in capsys.readouterr().err
    # A cubin in the other toolkit family's format than its manifest entry says (what a
    # CUDA 13 ptxas slipping into a release build would look like).
    first = next(k for k in m["kernels"] if k["kind"] == "cubin")
    path = out / first["file"]
    data = bytearray(path.read_bytes())
    data[7] = 0x41 if data[7] == 0x33 else 0x33
    path.write_bytes(bytes(data))
    problems = build_cubins.check_kernels(out)
    assert any("sha256 differs" in p for p in problems)
    assert any(first["file"] in p and ("driver for CUDA" in p or "cubin, but" in p)
               for p in problems), problems
    # An unlisted kernel file.
    (out / "sm_80" / "stray.cubin").write_bytes(bytes(data))
    assert any("stray.cubin: a kernel file the manifest does not list" in p
               for p in build_cubins.check_kernels(out))


@needs_nvcc
def test_build_subset_keeps_other_outputs(fake_tree):
    fake_build(fake_tree)
    m = fake_build(fake_tree, only="bf16", archs=[80])
    assert [(k["name"], k["kind"], k["arch"]) for k in m["kernels"]] == [
        (FAKE_NAMES[1], "cubin", 80)]
    assert m["archs"] == [80]
    assert (fake_tree / "out" / "sm_90" / f"{FAKE_NAMES[0]}.cubin").is_file()


@needs_nvcc
def test_build_stops_at_first_nvcc_error(fake_tree, capsys):
    (fake_tree / "src" / "flash_fwd.cu").write_text(FAKE_KERNEL.replace("__syncthreads();",
                                                                        "__syncthreads()"))
    with pytest.raises(build_cubins.JobFailed) as exc:
        fake_build(fake_tree, jobs=1)
    report = exc.value.report()
    assert "command:\n  " in report and "-DCF_D_HEAD=64" in report
    assert "error: expected a \";\"" in report  # nvcc's own message
    out = capsys.readouterr().out
    assert out.count("nvcc -ptx") == 1, "jobs after the failure must be cancelled"
    assert "FAILED: " in out and not (fake_tree / "out" / "manifest.json").exists()

    rc = build_cubins.main(["--configs", str(fake_tree / "configs.yaml"), "--src",
                            str(fake_tree / "src"), "--out", str(fake_tree / "out"), "-j", "2"])
    assert rc == 1
    assert "nvcc output:" in capsys.readouterr().err


@needs_nvcc
def test_cli_reports_config_errors(fake_tree, capsys):
    rc = build_cubins.main(["--configs", str(fake_tree / "configs.yaml"), "--src",
                            str(fake_tree / "src"), "--out", str(fake_tree / "out"),
                            "--archs", "86"])
    assert rc == 1
    assert "error: --archs [86] not in configs.yaml; allowed: [80, 90]" in capsys.readouterr().err
    assert build_cubins.main(["--configs", str(fake_tree / "configs.yaml"), "--src",
                              str(fake_tree / "src"), "--only", "d999"]) == 1
    assert "no config name contains only='d999'" in capsys.readouterr().err


def test_generated_wgmma_header_is_current():
    """cuda_src/wgmma.cuh is what tools/gen_wgmma.py writes: edit the generator, not it."""
    spec = importlib.util.spec_from_file_location("gen_wgmma", ROOT / "tools" / "gen_wgmma.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (ROOT / "cuda_src" / "wgmma.cuh").read_text() == gen.render(), (
        "cuda_src/wgmma.cuh is out of date: run `python tools/gen_wgmma.py`")
