"""Selection rules (cudaflash/selection.py): parsing, errors, what select() picks. CPU only."""

import dataclasses
import itertools
from pathlib import Path

import pytest

import build_cubins
from cudaflash import dispatch

selection = build_cubins.selection
ConfigError = build_cubins.ConfigError

ROOT = Path(build_cubins.__file__).resolve().parent
SPEC = build_cubins.load_spec(ROOT / "configs.yaml")
KernelConfig = build_cubins.config.KernelConfig


def template(**fields) -> str:
    """Canonical name of a config (defaults: the seed's A100 d128 kernel), dtype as "{dtype}"."""
    base = dict(dtype="fp16", d_head=128, B_r=128, B_c=64, n_warps=4, async_copy=True,
                eager_load_blocks=True, swizzled=True, Q_mma_load_K_fragments=2,
                K_mma_load_K_fragments=2, V_mma_load_K_fragments=0,
                mma_double_buffer_loads=True, optimized_softmax=True, min_ctas_per_sm=1, wgmma=False)
    name = KernelConfig(**{**base, **fields}).validate().name
    return name.replace("fwd_fp16_", "fwd_{dtype}_", 1)


# A fixed kernel list for the select() tests, so that they do not change with configs.yaml.
D64 = template(d_head=64, Q_mma_load_K_fragments=0, K_mma_load_K_fragments=0,
               mma_double_buffer_loads=False)
D64_B = template(d_head=64, B_r=64, Q_mma_load_K_fragments=0, K_mma_load_K_fragments=0,
                 mma_double_buffer_loads=False)
D128 = template()
D128_BC32 = template(B_c=32)
ALL = {t.format(dtype=dt): None for t in (D64, D64_B, D128, D128_BC32) for dt in ("fp16", "bf16")}
RULES = [
    {"d_head": 64, "config": D64},
    {"d_head": 128, "arch": [86, 89], "config": D128_BC32},
    {"d_head": 128, "config": D128},
]


def call(rules, available=ALL, *, arch=90, dtype="bf16", d_head=128, causal=False,
         seqlen_q=1024, seqlen_k=1024, dropout=False):
    return selection.select(rules, available, arch=arch, dtype=dtype, d_head=d_head,
                            causal=causal, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                            dropout=dropout)


def rules(*raw):
    return selection.parse_rules(list(raw), where="test.yaml")


# ---- select() ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch,dtype,d_head,expected,rule", [
    (80, "fp16", 64, D64, 0),
    (90, "bf16", 64, D64, 0),
    (86, "bf16", 128, D128_BC32, 1),
    (89, "fp16", 128, D128_BC32, 1),
    (80, "bf16", 128, D128, 2),
    (90, "fp16", 128, D128, 2),
])
def test_first_matching_rule_wins(arch, dtype, d_head, expected, rule):
    assert call(rules(*RULES), arch=arch, dtype=dtype, d_head=d_head) == (
        expected.format(dtype=dtype), f"rule {rule} of test.yaml")


def test_unavailable_config_falls_through_to_next_rule():
    available = {n: None for n in ALL if n != D128_BC32.format(dtype="bf16")}
    assert call(rules(*RULES), available, arch=86) == (D128.format(dtype="bf16"),
                                                       "rule 2 of test.yaml")


def test_fallback_takes_first_available_with_dtype_and_d_head():
    available = [D64.format(dtype="fp16"), D128_BC32.format(dtype="bf16"),
                 D128.format(dtype="bf16")]
    assert call((), available) == (D128_BC32.format(dtype="bf16"),
                                   "fallback: no selection rule matched")
    assert call((), set(available), d_head=64, dtype="fp16")[0] == D64.format(dtype="fp16")


def test_no_kernel_lists_what_is_available():
    available = [D64.format(dtype="fp16"), D128.format(dtype="bf16")]
    with pytest.raises(LookupError) as exc:
        call(rules(*RULES), available, dtype="fp16", d_head=256, arch=86)
    msg = str(exc.value)
    assert "dtype=fp16 d_head=256 on sm_86" in msg
    assert "bf16 d_head=128, fp16 d_head=64" in msg
    with pytest.raises(LookupError, match="available .*: none"):
        call(rules(*RULES), {})


def test_conditions():
    rs = rules({"causal": True, "max_seqlen_k": 512, "config": D64_B},
               {"arch": [80], "max_seqlen_q": 128, "config": D64_B},
               {"dtype": "fp16", "config": D64_B},
               {"config": D64})
    d64 = dict(d_head=64, dtype="bf16")
    assert call(rs, causal=True, seqlen_k=512, **d64)[1] == "rule 0 of test.yaml"
    assert call(rs, causal=True, seqlen_k=513, **d64)[1] == "rule 3 of test.yaml"
    assert call(rs, causal=False, seqlen_k=100, **d64)[1] == "rule 3 of test.yaml"
    assert call(rs, arch=80, seqlen_q=128, **d64)[1] == "rule 1 of test.yaml"
    assert call(rs, arch=86, seqlen_q=128, **d64)[1] == "rule 3 of test.yaml"
    assert call(rs, arch=80, seqlen_q=129, **d64)[1] == "rule 3 of test.yaml"
    assert call(rs, d_head=64, dtype="fp16") == (D64_B.format(dtype="fp16"),
                                                 "rule 2 of test.yaml")


def test_dropout_condition():
    """``dropout: true`` serves only calls that drop scores, ``false`` only those that do not;
    a rule without it serves both."""
    rs = rules({"dropout": True, "config": D64_B},
               {"dropout": False, "causal": True, "config": D64_B},
               {"config": D64})
    d64 = dict(d_head=64, dtype="bf16")
    assert call(rs, dropout=True, **d64)[1] == "rule 0 of test.yaml"
    assert call(rs, dropout=True, causal=True, **d64)[1] == "rule 0 of test.yaml"
    assert call(rs, causal=True, **d64)[1] == "rule 1 of test.yaml"
    assert call(rs, **d64)[1] == "rule 2 of test.yaml"
    assert [r.dropout for r in rs] == [True, False, None]
    assert [r.to_dict().get("dropout") for r in rs] == [True, False, None]


def test_rule_never_serves_another_head_dim():
    # No d_head condition: the rule's config is d64, so a d128 call must skip it.
    rs = rules({"config": D64})
    assert call(rs, d_head=128) == (D128.format(dtype="bf16"),
                                    "fallback: no selection rule matched")


def test_literal_name_serves_only_its_dtype():
    rs = rules({"config": D64.format(dtype="fp16")})
    assert call(rs, d_head=64, dtype="fp16")[1] == "rule 0 of test.yaml"
    assert call(rs, d_head=64, dtype="bf16")[1] == "fallback: no selection rule matched"


def test_to_dict_round_trip():
    parsed = rules(*RULES)
    assert [r.to_dict() for r in parsed] == RULES
    assert selection.parse_rules([r.to_dict() for r in SPEC.rules], "configs.yaml") == SPEC.rules


# ---- configs.yaml's own rules ------------------------------------------------------------


def test_configs_yaml_rules_serve_every_built_kernel_family():
    """On each arch (and a newer one that JITs the PTX), every (dtype, d_head) that
    configs.yaml builds gets a kernel of that dtype and d_head built for the arch, and every
    rule is chosen somewhere: by calls with tensor maps (every built config available) or
    by calls without them (dispatch passes over the configs that need maps), with dropout or
    without."""
    chosen = set()
    for arch, maps, dropout in itertools.product((80, 86, 89, 90, 100), (True, False),
                                                 (False, True)):
        if arch == 100:  # a newer GPU: every config's compute_90 PTX (smem permitting)
            fits = {c.name: c for c in SPEC.configs}
        else:
            built_for = 86 if arch == 89 else arch  # sm_89 runs the sm_86 cubins
            fits = {c.name: c for c in SPEC.configs if built_for in SPEC.cubin_archs(c)}
        if not maps:
            fits = {n: c for n, c in fits.items() if not dispatch.maps_only(c, fits)}
        for dtype, d_head in {(c.dtype, c.d_head) for c in fits.values()}:
            for causal in (False, True):
                # One length per bucket of the rules, and decoding (one query row).
                for seqlen_q, seqlen_k in ((512, 512), (2048, 2048), (4096, 4096), (8192, 8192),
                                           (16384, 16384), (1, 2048), (1, 8192)):
                    name, reason = call(SPEC.rules, fits, arch=arch, dtype=dtype,
                                        d_head=d_head, causal=causal, seqlen_q=seqlen_q,
                                        seqlen_k=seqlen_k, dropout=dropout)
                    assert (fits[name].dtype, fits[name].d_head) == (dtype, d_head)
                    chosen.add(reason)
    unused = {f"rule {r.index} of configs.yaml" for r in SPEC.rules} - chosen
    assert not unused, f"never chosen (shadowed by an earlier rule?): {sorted(unused)}"


# ---- parse errors ------------------------------------------------------------------------


@pytest.mark.parametrize("rule,text", [
    ({"d_head": 64, "config": D64, "head_dim": 64}, "unknown key(s) ['head_dim']"),
    ({"d_head": 64}, "missing key 'config'"),
    ({"arch": 90, "config": D64}, "arch=90 is invalid"),
    ({"arch": [], "config": D64}, "arch=[] is invalid"),
    ({"arch": [75], "config": D64}, "arch=[75] is invalid"),
    ({"arch": [True], "config": D64}, "arch=[True] is invalid"),
    ({"dtype": "fp32", "config": D64}, "dtype='fp32' is invalid; allowed: one of ['fp16', 'bf16']"),
    ({"d_head": "64", "config": D64}, "d_head='64' is invalid"),
    ({"causal": "yes", "config": D64}, "causal='yes' is invalid; allowed: true or false"),
    ({"dropout": 0.1, "config": D64}, "dropout=0.1 is invalid; allowed: true or false"),
    ({"max_seqlen_q": 0, "config": D64}, "max_seqlen_q=0 is invalid"),
    ({"max_seqlen_k": 1.5, "config": D64}, "max_seqlen_k=1.5 is invalid"),
    ({"config": 64}, "config=64 is invalid"),
    ({"config": "fwd_{dtype}_d64"}, "not a canonical kernel config name"),
    ({"config": D64.replace("w4", "w2")}, "n_warps=2"),
    ({"d_head": 128, "config": D64}, "has d_head=64 but the rule has d_head=128"),
    ({"dtype": "bf16", "config": D64.format(dtype="fp16")}, "is a fp16 kernel but the rule"),
])
def test_bad_rule_names_index_key_and_value(rule, text):
    with pytest.raises(ConfigError) as exc:
        selection.parse_rules([{"config": D128}, rule], where="my.yaml")
    msg = str(exc.value)
    assert msg.startswith("my.yaml: rule 1"), msg
    assert text in msg, msg


def test_rules_must_be_a_list_of_mappings():
    with pytest.raises(ConfigError, match="my.yaml: selection must be a list"):
        selection.parse_rules({"config": D64}, where="my.yaml")
    with pytest.raises(ConfigError, match="my.yaml: rule 0 must be a mapping"):
        selection.parse_rules([D64], where="my.yaml")


# ---- user rule files (CUDAFLASH_CONFIG) ---------------------------------------------------


def test_load_user_rules(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text(f"selection:\n  - {{d_head: 64, causal: true, config: \"{D64_B}\"}}\n")
    rs = selection.load_user_rules(path)
    assert len(rs) == 1 and rs[0].causal is True
    assert call(rs, d_head=64, causal=True) == (D64_B.format(dtype="bf16"),
                                                f"rule 0 of {path}")


@pytest.mark.parametrize("text,error", [
    (None, "cannot read the selection file"),
    ("selection: [", "not valid yaml"),
    ("- {config: x}\n", "expected a mapping with a top-level 'selection:'"),
    ("rules: []\n", "expected a mapping with a top-level 'selection:' list of rules, got dict "
                    "with keys ['rules']"),
    ("selection: []\nconfigs: []\n", "unknown top-level key(s) ['configs']"),
    ("selection:\n  - {d_head: 64, config: fwd_x}\n", "rule 0: config='fwd_x'"),
])
def test_user_rules_errors_name_the_file(tmp_path, text, error):
    path = tmp_path / "rules.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        selection.load_user_rules(path)
    assert str(exc.value).startswith(str(path)) and error in str(exc.value), str(exc.value)


def select_on_sm90(configs):
    """dispatch's choice for a call on an sm_90 GPU with ``configs`` built and configs.yaml's
    rules: select(dtype, d_head, causal, seqlen_q, seqlen_k, maps) -> (name, reason)."""
    from types import SimpleNamespace

    import _internals as internals
    usable = {c.name: SimpleNamespace(name=c.name, config=c) for c in configs}
    dk = SimpleNamespace(device=SimpleNamespace(arch=90), usable=usable)
    r = internals.Rules(SPEC.rules, (), ())
    return lambda *call, maps, dropout=False: internals.select_for_call(dk, r, *call, maps=maps,
                                                                      dropout=dropout)


def test_calls_without_tensor_maps_pass_over_configs_that_need_them():
    """d64 prefill with maps runs the three-warpgroup config; the same call without them
    (packed, cache addressing: its *_kvcache entries trap) takes the next rule, a 64-row
    config, and never the pre-Hopper fallback."""
    built = {c.name: c for c in SPEC.configs if 90 in SPEC.cubin_archs(c)}
    select = select_on_sm90(built.values())
    for dtype, causal in itertools.product(("bf16", "fp16"), (False, True)):
        with_maps, _ = select(dtype, 64, causal, 8192, 8192, maps=True)
        assert built[with_maps].needs_tensor_maps, with_maps
        without, reason = select(dtype, 64, causal, 8192, 8192, maps=False)
        config = built[without]
        assert not config.needs_tensor_maps and config.wgmma and config.B_r == 64, without
        assert reason.startswith("rule "), reason
    # Few query rows (decoding, a short chunk) keep the tuned 64-row choices with or without
    # maps: bf16 non-causal up to 4096 keys the one-CTA-per-SM build, beyond it the 3-CTA one.
    for maps in (True, False):
        for seqlen_k, ctas in ((2048, 1), (4096, 1), (8192, 3)):
            name, _ = select("bf16", 64, False, 16, seqlen_k, maps=maps)
            assert name.endswith(f"_ctas{ctas}_wgmma1"), (maps, seqlen_k, name)


def test_d64_dropout_calls_take_the_64_row_config_where_plain_ones_take_three_groups():
    """configs.yaml: a d64 call with dropout that a plain call's rules would give the
    three-warpgroup config takes the 64-row one-CTA config instead (its dropout forward is
    faster), with maps or without; every other dropout call takes the plain call's config
    (d64 below the three-warpgroup sizes, d128)."""
    built = {c.name: c for c in SPEC.configs if 90 in SPEC.cubin_archs(c)}
    select = select_on_sm90(built.values())
    for dtype, causal in itertools.product(("bf16", "fp16"), (False, True)):
        v6 = f"fwd_{dtype}_d64_br64_bc128_w4_async1_eager1_swz1_q0k0v0_dbuf0_osm1_ctas1_wgmma1"
        for seqlen in (4096, 16384):
            assert built[select(dtype, 64, causal, seqlen, seqlen, maps=True)[0]].B_r == 192
            for maps in (True, False):
                name, reason = select(dtype, 64, causal, seqlen, seqlen, maps=maps,
                                      dropout=True)
                assert name == v6 and reason.startswith("rule "), (maps, name, reason)
        for d_head, seqlen in ((64, 512), (64, 1024), (128, 4096)):
            for maps in (True, False):
                assert select(dtype, d_head, causal, seqlen, seqlen, maps=maps,
                              dropout=True) == select(dtype, d_head, causal, seqlen, seqlen,
                                                      maps=maps)


def test_d64_short_calls_with_maps_take_the_persistent_config():
    """d64 non-causal up to 512 keys: with tensor maps the persistent two-consumer config,
    whose non-persistent twin is not built, so a call without maps passes over it to the
    tuned 64-row rule (not to the persistent kernel's one-tile-per-CTA form); from 513 keys,
    and causal, the rules as before."""
    built = {c.name: c for c in SPEC.configs if 90 in SPEC.cubin_archs(c)}
    select = select_on_sm90(built.values())
    for dtype in ("bf16", "fp16"):
        persistent, _ = select(dtype, 64, False, 512, 512, maps=True)
        config = built[persistent]
        assert config.persistent and config.B_r == 128 and not config.needs_tensor_maps
        assert dispatch.maps_only(config, built)
        assert dataclasses.replace(config, persistent=False).name not in built
        without, reason = select(dtype, 64, False, 512, 512, maps=False)
        tuned = f"fwd_{dtype}_d64_br64_bc128_w4_async1_eager1_swz1_q0k0v0_dbuf0_osm1_ctas3_wgmma1"
        assert without == tuned, without
        assert "twin" not in reason, reason
        for maps in (True, False):
            assert select(dtype, 64, False, 513, 513, maps=maps)[0] == without
            assert select(dtype, 64, False, 513, 512, maps=maps)[0] == without  # 513 rows
            assert not built[select(dtype, 64, True, 512, 512, maps=maps)[0]].persistent
    # d128's persistent config keeps its built twin for calls without maps.
    d128 = next(c for c in built.values() if c.persistent and c.d_head == 128)
    assert not dispatch.maps_only(d128, built)


def test_a_persistent_config_without_a_twin_still_serves_when_nothing_else_does():
    """A custom build whose only d64 config is the persistent one (no twin, so dispatch
    keeps it for calls with maps): a call without maps still runs it, one tile per CTA,
    rather than finding no kernel."""
    only = [c for c in SPEC.configs if c.persistent and c.d_head == 64 and c.dtype == "bf16"]
    assert len(only) == 1 and not only[0].needs_tensor_maps
    select = select_on_sm90(only)
    for maps in (True, False):
        assert select("bf16", 64, False, 512, 512, maps=maps)[0] == only[0].name


def test_a_build_of_maps_only_configs_says_why_a_call_without_maps_has_none():
    """A custom build whose only d64 configs need tensor maps: a call without maps gets a
    LookupError that names them and why they were left out."""
    only = [c for c in SPEC.configs if c.needs_tensor_maps and c.dtype == "bf16"]
    assert only
    select = select_on_sm90(only)
    assert select("bf16", 64, False, 4096, 4096, maps=True)[0] == only[0].name
    with pytest.raises(LookupError) as exc:
        select("bf16", 64, False, 4096, 4096, maps=False)
    assert "without tensor maps" in str(exc.value) and only[0].name in str(exc.value)


def test_calls_without_tensor_maps_leave_persistent_configs_for_their_twin():
    """A persistent config walks tiles only through tensor maps: a call without them (packed,
    cache addressing, too small) runs the non-persistent twin where it is built."""
    from types import SimpleNamespace

    from cudaflash.dispatch import without_persistence
    pers = next(c for c in SPEC.configs if c.persistent)
    twin = next(c for c in SPEC.configs if c.name == pers.name.removesuffix("_pers"))
    entry = {c.name: SimpleNamespace(name=c.name, config=c) for c in (pers, twin)}
    assert without_persistence(entry, entry[pers.name]) is entry[twin.name]
    assert without_persistence(entry, entry[twin.name]) is entry[twin.name]
    alone = {pers.name: entry[pers.name]}  # no twin built: the persistent config itself
    assert without_persistence(alone, entry[pers.name]) is entry[pers.name]
