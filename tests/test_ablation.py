"""tools/ablation.py: the knob ablation configs are valid and each differs from its base in
exactly the fields of its knob. CPU only."""

import dataclasses
import sys
from pathlib import Path

import pytest

import build_cubins

ROOT = Path(build_cubins.__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))
import ablation  # noqa: E402

KernelConfig = build_cubins.config.KernelConfig


@pytest.mark.parametrize("name", ablation.BASES)
def test_each_variant_switches_exactly_its_knob(name):
    base = KernelConfig.from_name(name)
    knobs = {label: change for label, _, change in ablation.KNOBS}
    found = ablation.variants(base)
    assert found, f"no knob applies to {name}"
    for label, _, cfg in found:
        if isinstance(cfg, str):  # not applicable: the message names the knob's field
            assert any(f"{field}=" in cfg for field in knobs[label]), cfg
            continue
        changed = {f.name for f in dataclasses.fields(KernelConfig)
                   if getattr(cfg, f.name) != getattr(base, f.name)}
        assert changed and changed <= set(knobs[label]), (label, changed)
        assert not cfg.errors()


def test_every_knob_of_the_issue_is_ablated_somewhere():
    # swizzle, eager loads, slice interleave, double buffer, exp2, first iteration, KV order,
    # O store cache hints, d_head tiling: each runs against at least one base.
    ran = {label for name in ablation.BASES
           for label, _, cfg in ablation.variants(KernelConfig.from_name(name))
           if not isinstance(cfg, str)}
    assert ran == {label for label, _, _ in ablation.KNOBS}


def test_yaml_builds_into_a_spec(tmp_path):
    path = tmp_path / "ablation.yaml"
    assert ablation.write_yaml(path) == 0
    spec = build_cubins.load_spec(path)
    names = {cfg.name for cfg in spec.configs}
    assert set(ablation.BASES) <= names
    assert len(names) == len(spec.configs) > len(ablation.BASES)
    assert spec.archs == (90,)
