"""Reading the manifest and choosing the kernels a GPU can run (no GPU, no nvcc needed)."""

import dataclasses
import json

import pytest

from conftest import BWD_D64, D64, D64_WIDE, D128, D256_BIG, write_fake_kernel_dir
from cudaflash import __main__ as cli
from cudaflash import list_kernels, manifest


def test_fields_and_order(fake_kernel_dir):
    m = manifest.load_manifest()
    assert m.path == fake_kernel_dir / "manifest.json"
    first = m.kernels[0]
    assert (first.name, first.config, first.kind, first.arch) == (
        D64["fp16"].name, D64["fp16"], "cubin", 80)
    assert first.path == fake_kernel_dir / f"sm_80/{first.name}.cubin"
    assert (first.threads, first.smem_bytes) == (128, 32768)
    assert first.entries["forward"] == ("cudaflash_fwd", 32768)
    assert first.entries["combine"] == ("cudaflash_combine", 0)
    assert list(first.entries) == [role.name for role in D64["fp16"].ROLES]
    bwd = m.backward[0]
    assert bwd.entries["dkdv_dq_window"] == ("cudaflash_bwd_dkdv_dq_window",
                                             BWD_D64.dkdv_dq_smem_bytes)
    assert bwd.entries["dq_varlen"] == ("cudaflash_bwd_dq_varlen", BWD_D64.dq_smem_bytes)
    assert bwd.smem_bytes == BWD_D64.smem_bytes
    ptx = m.kernels[3]
    assert (ptx.kind, ptx.registers, ptx.spill_bytes) == ("ptx", None, None)
    assert [r.config for r in m.selection][0] == D64_WIDE.name
    assert list_kernels() == list(m.kernels)
    assert manifest.load_manifest() is m  # cached


def _entry_points(config):
    return {role.name: manifest.EntryPoint(role.symbol, role.smem_bytes(config))
            for role in config.ROLES}


@pytest.mark.parametrize("kind, kernel_arch, device_arch, runs", [
    ("cubin", 80, 80, True), ("cubin", 80, 86, True), ("cubin", 80, 89, True),
    ("cubin", 86, 80, False), ("cubin", 80, 90, False), ("cubin", 90, 100, False),
    ("ptx", 90, 90, True), ("ptx", 90, 100, True), ("ptx", 90, 120, True), ("ptx", 90, 89, False),
])
def test_runs_on(kind, kernel_arch, device_arch, runs):
    entry = manifest.KernelEntry(
        name=D64["fp16"].name, config=D64["fp16"], arch=kernel_arch, kind=kind, path=None,
        entries=_entry_points(D64["fp16"]), threads=128, registers=None, spill_bytes=None,
        sha256="", min_driver=12000, ptxas_version="12.9.86", ptx_isa="8.3")
    assert manifest.runs_on(entry, device_arch) is runs


@pytest.mark.parametrize("device_arch, runs", [(90, True), (80, False), (89, False),
                                               (100, False), (120, False)])
def test_wgmma_cubins_run_on_sm90_only(device_arch, runs):
    """sm_90a SASS is arch-specific: not even a later 9.x minor may load it."""
    config = dataclasses.replace(D64["fp16"], B_r=64, n_warps=4, wgmma=True).validate()
    entry = manifest.KernelEntry(
        name=config.name, config=config, arch=90, kind="cubin", path=None,
        entries=_entry_points(config), threads=128, registers=None, spill_bytes=None,
        sha256="", min_driver=12000, ptxas_version="12.9.86", ptx_isa="8.3")
    assert manifest.runs_on(entry, device_arch) is runs
    assert not manifest.runs_on(entry, 91)  # a hypothetical later Hopper minor


def _usable(arch, smem):
    return {name: (e.kind, e.arch)
            for name, e in manifest.load_manifest().usable(arch, smem).items()}


def test_usable_picks_best_binary_per_config(fake_kernel_dir):
    fp16, bf16 = D64["fp16"].name, D64["bf16"].name
    # sm_89: highest cubin of its major (86); the d128 config has only an sm_90 cubin.
    assert _usable(89, 101376) == {fp16: ("cubin", 86), bf16: ("cubin", 80),
                                   D64_WIDE.name: ("cubin", 80)}
    # sm_90: its own cubins; bf16 d64 only has sm_80 SASS (other major) so it runs as PTX.
    assert _usable(90, 232448) == {fp16: ("cubin", 90), bf16: ("ptx", 90),
                                   D128.name: ("cubin", 90), D256_BIG.name: ("cubin", 90)}
    # A newer major than any cubin: PTX only.
    assert _usable(120, 101376) == {fp16: ("ptx", 90), bf16: ("ptx", 90)}
    # Manifest order is kept (selection falls back to the first usable config).
    assert list(_usable(80, 166912)) == [fp16, bf16, D64_WIDE.name, D256_BIG.name]


def test_usable_respects_smem_limit(fake_kernel_dir):
    assert D256_BIG.name in _usable(80, 166912)
    assert D256_BIG.name not in _usable(80, D256_BIG.smem_bytes - 1)


def test_missing_manifest_says_how_to_build(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDAFLASH_KERNEL_DIR", str(tmp_path))
    with pytest.raises(RuntimeError, match=r"installed without its kernels.*manifest\.json.*"
                                           r"python build_cubins\.py"):
        manifest.load_manifest()


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(schema=1), "schema 1"),
    (lambda m: m["kernels"][0]["entries"].pop("split"), r"entry roles \[.*\], this "
                                                          r"cudaflash launches \['forward'"),
    (lambda m: m["backward_kernels"][1]["entries"]["dq"].pop("smem_bytes"), "KeyError"),
    (lambda m: m.update(params_bytes=160), "params_bytes=160"),
    (lambda m: m["kernels"][0].update(name="fwd_fp16_d64_x"), "not the canonical name"),
    (lambda m: m["kernels"][0].update(kind="fatbin"), "kind 'fatbin'"),
    (lambda m: m["kernels"][0].pop("sha256"), "KeyError"),
    (lambda m: m["kernels"][0]["config"].update(B_r=96), "B_r"),
    (lambda m: m["selection"].append({"d_head": 64}), "missing key 'config'"),
])
def test_malformed_manifest(tmp_path, monkeypatch, edit, message):
    root = write_fake_kernel_dir(tmp_path)
    data = json.loads((root / "manifest.json").read_text())
    edit(data)
    (root / "manifest.json").write_text(json.dumps(data))
    monkeypatch.setenv("CUDAFLASH_KERNEL_DIR", str(root))
    with pytest.raises(RuntimeError, match=f"malformed.*{message}"):
        manifest.load_manifest()


def test_cli_list(fake_kernel_dir, capsys):
    assert cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["name", "arch", "kind", "threads", "smem", "regs",
                                           "spills"]
    rows = {tuple(line.split()) for line in out.splitlines()}
    assert (D256_BIG.name, "sm_90", "cubin", "256", "131072", "128", "0") in rows
    assert (D64["bf16"].name, "compute_90", "ptx", "128", "32768", "-", "-") in rows
    smem = str(BWD_D64.smem_bytes)
    assert (BWD_D64.name, "sm_80", "cubin", "128", smem, "200", "0",
            "atomic,deterministic") in rows
    assert (BWD_D64.name, "compute_90", "ptx", "128", smem, "-", "-",
            "atomic,deterministic") in rows
    assert "10 forward kernels and 2 backward modules in" in out


def test_cli_without_manifest_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUDAFLASH_KERNEL_DIR", str(tmp_path))
    assert cli.main(["list"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cudaflash: cudaflash was installed without its kernels")
    assert len(err.strip().splitlines()) == 1


def test_cli_info_without_a_gpu(fake_kernel_dir, monkeypatch, capsys):
    """`info` on a machine without a GPU: versions and the manifest, then says so."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cudaflash ")
    assert "kernels: 10 in" in out
    assert out.rstrip().endswith("GPU: none (torch.cuda.is_available() is False)")
