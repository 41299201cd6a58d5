"""Kernel config model (cudaflash/config.py) and configs.yaml: validation, names, expansion.

CPU only. The config module is loaded the way build_cubins.py loads it (without importing
cudaflash, hence without torch).
"""

import dataclasses
from pathlib import Path

import pytest

import build_cubins

config = build_cubins.config
config_file = build_cubins.config_file
ConfigError = config.ConfigError
KernelConfig = config.KernelConfig

ROOT = Path(build_cubins.__file__).resolve().parent
SPEC = build_cubins.load_spec(ROOT / "configs.yaml")

BASE = dict(dtype="bf16", d_head=128, B_r=128, B_c=64, n_warps=4, async_copy=True,
            eager_load_blocks=True, swizzled=True, Q_mma_load_K_fragments=2,
            K_mma_load_K_fragments=2, V_mma_load_K_fragments=0, mma_double_buffer_loads=True,
            optimized_softmax=True, min_ctas_per_sm=1, wgmma=False)


def test_base_config_is_valid():
    assert KernelConfig.from_dict(BASE).errors() == []


def test_configs_yaml_is_valid_and_names_are_unique():
    assert SPEC.configs, "configs.yaml lists no configs"
    names = [cfg.name for cfg in SPEC.configs]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("cfg", SPEC.configs, ids=lambda c: c.name)
def test_name_round_trip(cfg):
    assert KernelConfig.from_name(cfg.name) == cfg
    assert cfg.validate() is cfg


@pytest.mark.parametrize("cfg", SPEC.configs, ids=lambda c: c.name)
def test_every_config_fits_a_built_arch(cfg):
    assert any(cfg.fits_arch(a) for a in SPEC.archs), (
        f"{cfg.name} needs {cfg.smem_bytes} bytes of smem, more than any arch in configs.yaml")


# One case per validity rule: the change that breaks it and the field the error must name.
# A valid wgmma config as a change of BASE (fields BASE sets for the mma.sync path reset).
WGMMA = {"wgmma": True, "B_r": 64, "n_warps": 4, "Q_mma_load_K_fragments": 0,
         "K_mma_load_K_fragments": 0, "V_mma_load_K_fragments": 0,
         "mma_double_buffer_loads": False}


def test_wgmma_config_is_valid_and_hopper_only():
    cfg = KernelConfig(**{**BASE, **WGMMA}).validate()
    assert cfg.name.endswith("_wgmma1") and KernelConfig.from_name(cfg.name) == cfg
    assert cfg.nvcc_defines()["CF_WGMMA"] == 1
    assert [a for a in (80, 86, 89, 90) if cfg.builds_for(a)] == [90]


# The knobs with a default appear in the name only when switched away from it, in this
# order.
KNOB_SUFFIXES = [
    ({"exp2_softmax": False}, "_natexp"),
    ({"kv_reverse": False}, "_kvfwd"),
    ({"d_head_tiled": False}, "_untiled"),
    ({"o_store_cache": "streaming"}, "_ocs"),
    ({"o_store_cache": "no_allocate"}, "_ona"),
    ({"exp2_softmax": False, "kv_reverse": False, "d_head_tiled": False,
      "o_store_cache": "no_allocate"}, "_natexp_kvfwd_untiled_ona"),
]


@pytest.mark.parametrize("change,suffix", KNOB_SUFFIXES, ids=[s for _, s in KNOB_SUFFIXES])
def test_knob_with_default_is_named_only_when_changed(change, suffix):
    base = KernelConfig.from_dict(BASE)
    assert base.name.endswith("_wgmma0")  # every default: no suffix
    cfg = KernelConfig.from_dict({**BASE, **change})
    assert cfg.name == base.name + suffix
    assert KernelConfig.from_name(cfg.name) == cfg
    assert cfg.nvcc_defines() != base.nvcc_defines()


def test_knob_defaults_are_optional_in_a_mapping():
    assert KernelConfig.from_dict(BASE) == KernelConfig.from_dict(
        {**BASE, "exp2_softmax": True, "kv_reverse": True, "d_head_tiled": True,
         "o_store_cache": "default"})


BAD = [
    ({"dtype": "fp32"}, "dtype"),
    ({"d_head": 96}, "d_head"),
    ({"n_warps": 2}, "n_warps"),
    ({"B_c": 48}, "B_c"),
    ({"B_r": 96}, "B_r"),  # 24 rows per warp
    ({"B_r": 256, "n_warps": 8, "d_head": 256, "B_c": 128, "Q_mma_load_K_fragments": 0,
      "K_mma_load_K_fragments": 0, "mma_double_buffer_loads": False}, "B_r"),  # smem > 227 KiB
    ({"Q_mma_load_K_fragments": 3, "K_mma_load_K_fragments": 3}, "K_mma_load_K_fragments"),
    ({"Q_mma_load_K_fragments": 1, "K_mma_load_K_fragments": 1}, "K_mma_load_K_fragments"),
    ({"Q_mma_load_K_fragments": 16, "K_mma_load_K_fragments": 16}, "K_mma_load_K_fragments"),
    ({"V_mma_load_K_fragments": 8, "mma_double_buffer_loads": False}, "V_mma_load_K_fragments"),
    ({"Q_mma_load_K_fragments": 4}, "Q_mma_load_K_fragments"),  # Q slices must match K's
    ({"Q_mma_load_K_fragments": 0, "K_mma_load_K_fragments": 0}, "mma_double_buffer_loads"),
    ({"async_copy": False}, "eager_load_blocks"),
    ({"min_ctas_per_sm": 0}, "min_ctas_per_sm"),
    ({"min_ctas_per_sm": 5}, "min_ctas_per_sm"),
    # wgmma: 16 rows per warp, no fragment loading, d_head <= 128, B_c >= 64, swizzled tiles
    ({"wgmma": True}, "K_mma_load_K_fragments"),
    ({"wgmma": True}, "B_r"),
    ({**WGMMA, "B_r": 128, "n_warps": 4}, "B_r"),
    ({**WGMMA, "B_c": 32}, "B_c"),
    ({**WGMMA, "swizzled": False}, "swizzled"),
    ({"o_store_cache": "evict_last"}, "o_store_cache"),
    # one slab at d_head 64: the untiled layout would be the same kernel under another name
    ({"d_head": 64, "Q_mma_load_K_fragments": 0, "K_mma_load_K_fragments": 0,
      "mma_double_buffer_loads": False, "d_head_tiled": False}, "d_head_tiled"),
    ({**WGMMA, "d_head_tiled": False}, "d_head_tiled"),
    # warp_specialized: two consumer warpgroups on wgmma, one CTA per SM, eager loads
    ({"warp_specialized": True}, "wgmma"),
    ({**WGMMA, "warp_specialized": True}, "n_warps"),  # WGMMA has 4 warps
    ({**WGMMA, "B_r": 128, "n_warps": 8, "min_ctas_per_sm": 2, "warp_specialized": True},
     "min_ctas_per_sm"),
    ({**WGMMA, "B_r": 128, "n_warps": 8, "eager_load_blocks": False, "warp_specialized": True},
     "eager_load_blocks"),
]


@pytest.mark.parametrize("change,field", BAD, ids=[f for _, f in BAD])
def test_bad_config_names_config_and_field(change, field):
    cfg = KernelConfig(**{**BASE, **change})
    assert any(e.startswith(f"{field}=") for e in cfg.errors()), cfg.errors()
    with pytest.raises(ConfigError) as exc:
        KernelConfig.from_dict({**BASE, **change}, where="configs.yaml configs[7]")
    msg = str(exc.value)
    assert "configs.yaml configs[7]" in msg and cfg.name in msg and f"{field}=" in msg
    with pytest.raises(ConfigError, match=f"invalid kernel config {cfg.name}: .*{field}="):
        cfg.validate()


@pytest.mark.parametrize("change,text", [
    ({"d_head": "128"}, "d_head='128' must be a int"),
    ({"swizzled": 1}, "swizzled=1 must be a bool"),
    ({"n_warps": True}, "n_warps=True must be a int"),
    ({"B_m": 64}, "unknown field(s) ['B_m']"),
    ({"o_store_cache": 1}, "o_store_cache=1 must be a str"),
    ({"kv_reverse": "yes"}, "kv_reverse='yes' must be a bool"),
])
def test_from_dict_rejects_bad_fields(change, text):
    with pytest.raises(ConfigError) as exc:
        KernelConfig.from_dict({**BASE, **change}, where="here")
    assert str(exc.value).startswith("here") and text in str(exc.value)


def test_from_dict_rejects_missing_field():
    data = dict(BASE)
    del data["swizzled"]
    with pytest.raises(ConfigError, match=r"missing field\(s\) \['swizzled'\]"):
        KernelConfig.from_dict(data)


def test_from_name_rejects_non_canonical_name():
    with pytest.raises(ConfigError, match="not a canonical kernel config name"):
        KernelConfig.from_name("fwd_bf16_d128")


def test_expand_lists_to_cartesian_product():
    cfgs = config_file.expand_config_entries([{**BASE, "dtype": ["fp16", "bf16"]}])
    assert [c.dtype for c in cfgs] == ["fp16", "bf16"]
    assert cfgs[0] == dataclasses.replace(cfgs[1], dtype="fp16")


def test_expand_merges_defaults():
    defaults = {k: v for k, v in BASE.items() if k not in ("dtype", "d_head")}
    (cfg,) = config_file.expand_config_entries([{"dtype": "fp16", "d_head": 128}], defaults)
    assert cfg == KernelConfig(**{**BASE, "dtype": "fp16"})


def test_duplicate_configs_are_rejected():
    entries = [{**BASE, "dtype": ["fp16", "bf16"]}, dict(BASE)]
    with pytest.raises(ConfigError) as exc:
        config_file.expand_config_entries(entries, where="configs")
    name = KernelConfig(**BASE).name
    assert str(exc.value) == f"configs[1]: {name} is already listed by configs[0]"


def test_entry_must_be_a_mapping():
    with pytest.raises(ConfigError, match=r"configs\[0\] must be a mapping"):
        config_file.expand_config_entries(["fwd_bf16"])


def test_smem_and_threads():
    cfg = KernelConfig(**BASE)
    assert cfg.threads == 128
    assert cfg.smem_bytes == (128 + 2 * 64) * 128 * 2
    assert cfg.fits_arch(80) and cfg.fits_arch(86)
    big = KernelConfig(**{**BASE, "d_head": 256})  # 128 KiB: too much for sm_86's 99 KiB
    assert big.fits_arch(80) and not big.fits_arch(86)


def test_warp_specialized_config():
    """A producer warpgroup on top of n_warps, a three-stage K/V ring and 128 bytes of mbarriers
    in the dynamic shared memory, and for the ALiBi entries alone a table of key columns (16
    bytes per key of a block), which still fits sm_90's 227 KiB; named by the _ws suffix;
    sm_90a only."""
    cfg = KernelConfig(**{**BASE, **WGMMA, "B_r": 128, "B_c": 128, "n_warps": 8,
                          "warp_specialized": True}).validate()
    assert cfg.threads == 32 * 8 + 128 and cfg.copy_threads == 128 and cfg.kv_stages == 3
    assert cfg.smem_bytes == (128 + 2 * 3 * 128) * 128 * 2 + 128
    assert cfg.alibi_smem_bytes == cfg.smem_bytes + 128 * 16 <= config.ARCH_SMEM_LIMIT[90]
    smem = {role.name: role.smem_bytes(cfg) for role in KernelConfig.ROLES}
    assert {r for r, b in smem.items() if b == cfg.alibi_smem_bytes} == {
        "forward_alibi", "split_alibi", "forward_alibi_kvcache", "split_alibi_kvcache",
        "forward_dropout_alibi"}
    assert smem["forward"] == smem["forward_softcap"] == smem["forward_dropout"] == cfg.smem_bytes
    assert cfg.module_smem_bytes == cfg.alibi_smem_bytes  # what must fit an arch
    assert cfg.name.endswith("_wgmma1_ws") and KernelConfig.from_name(cfg.name) == cfg
    assert cfg.nvcc_defines()["CF_WARP_SPECIALIZED"] == 1
    assert [a for a in (80, 86, 89, 90) if cfg.builds_for(a)] == [90]


def test_nvcc_defines_cover_every_field():
    defines = KernelConfig(**BASE).nvcc_defines()
    assert len(defines) == len(dataclasses.fields(KernelConfig))
    assert defines["CF_DTYPE_BF16"] == 1 and defines["CF_D_HEAD"] == 128
    assert all(isinstance(v, int) and not isinstance(v, bool) for v in defines.values())
