"""``python -m cudaflash bench`` and ``tune`` (cudaflash/bench.py, cudaflash/tune.py): argument
parsing, the FLOP formula, the tuned-table writer and its path on the CPU; the measurements
themselves on a GPU."""

import argparse
import json
import sys
from pathlib import Path

import pytest
import yaml

from cudaflash import _env, selection
from cudaflash.cli import bench, timing, tune

D64 = "fwd_{dtype}_d64_br128_bc64_w4_async1_eager1_swz1_q0k0v0_dbuf0_osm1_ctas1_wgmma0"
D64_W8 = "fwd_{dtype}_d64_br128_bc128_w8_async1_eager1_swz1_q0k0v0_dbuf0_osm1_ctas1_wgmma0"
D128_W8 = "fwd_{dtype}_d128_br128_bc64_w8_async1_eager1_swz1_q0k0v0_dbuf0_osm1_ctas1_wgmma0"


def parse(*argv):
    parser = argparse.ArgumentParser(prog="python -m cudaflash")
    sub = parser.add_subparsers(dest="command", required=True)
    bench.add_parser(sub)
    tune.add_parser(sub)
    return parser.parse_args(argv)


# ---- bench: arguments and sizes ------------------------------------------------------------


def test_bench_defaults():
    args = parse("bench")
    assert args.run is bench.run
    assert args.seqlens is None and not args.decode  # run() picks the sweep's default lengths
    assert args.causal == "both"
    assert args.backends == ["cudaflash", "flash", "cudnn", "efficient"]
    assert args.iters == 30 and args.warmup >= 1
    assert (args.config, args.json, args.plot, args.no_host) == (None, None, None, False)
    assert bench.sweep_dims(args) == (["bf16"], [64, 128])


def test_bench_options():
    args = parse("bench", "--seqlens", "1024, 4096", "--head-dims", "128", "--dtype",
                 "bf16,fp16", "--causal", "yes", "--backends", "cudaflash,flash", "--iters",
                 "20", "--warmup", "3", "--json", "out.json", "--plot", "out.png", "--no-host")
    assert args.seqlens == [1024, 4096]
    assert bench.sweep_dims(args) == (["bf16", "fp16"], [128])
    assert bench.CAUSAL_CHOICES[args.causal] == (True,)
    assert args.backends == ["cudaflash", "flash"]
    assert (args.iters, args.warmup) == (20, 3)
    assert (args.json, args.plot, args.no_host) == (Path("out.json"), Path("out.png"), True)


@pytest.mark.parametrize("argv", [
    ["--iters", "19"],  # fewer than 20 timed calls
    ["--warmup", "0"],
    ["--seqlens", "0"],
    ["--seqlens", "1k"],
    ["--head-dims", "264"],  # above flash-attn's 256 (96 is fine: padded to 128)
    ["--head-dims", "0"],
    ["--dtype", "fp32"],
    ["--backends", "cudaflash,math"],
    ["--causal", "maybe"],
    ["--config", "fwd_bf16_d64"],
])
def test_bench_rejects(argv, capsys):
    with pytest.raises(SystemExit):
        parse("bench", *argv)
    assert "error" in capsys.readouterr().err


def test_bench_config_sets_the_sweep():
    name = D128_W8.format(dtype="fp16")
    args = parse("bench", "--config", name)
    assert args.config.name == name
    assert bench.sweep_dims(args) == (["fp16"], [128])
    with pytest.raises(ValueError, match="--config"):
        bench.sweep_dims(parse("bench", "--config", name, "--dtype", "bf16"))
    with pytest.raises(ValueError, match="--config"):
        bench.sweep_dims(parse("bench", "--config", name, "--head-dims", "64,128"))


def test_flops_formula():
    # 4 * B * H * Sq * Sk * d, halved when causal
    assert bench.attention_flops(4, 16, 4096, 4096, 128, False) == 4 * 4 * 16 * 4096**2 * 128
    assert bench.attention_flops(4, 16, 4096, 4096, 128, True) == 2 * 4 * 16 * 4096**2 * 128
    assert bench.attention_flops(1, 2, 128, 256, 64, False) == 4 * 2 * 128 * 256 * 64


def test_fa_convention_cases():
    cases = bench.build_cases(["bf16"], [64, 128], [False, True], bench.DEFAULT_SEQLENS)
    assert len(cases) == 2 * 2 * 6
    for c in cases:
        assert c.batch * c.seqlen == 16384 and c.nheads * c.d_head == 2048
    c = bench.fa_case("bf16", 128, True, 4096)
    assert (c.batch, c.nheads) == (4, 16)
    assert c.flops == bench.attention_flops(4, 16, 4096, 4096, 128, True)
    assert bench.fa_case("bf16", 64, False, 32768).batch == 1  # never an empty batch


def test_decode_cases():
    cases = bench.build_decode_cases(["bf16"], [64, 128], bench.DEFAULT_DECODE_SEQLENS)
    assert len(cases) == 2 * 2 * 2 * 4  # d x GQA groups x batches x cache lengths
    for c in cases:
        assert c.decode and c.seqlen_q == 1 and not c.causal
        assert c.nheads * c.d_head == 2048 and c.nheads % c.kv_heads == 0
    c = next(c for c in cases if (c.d_head, c.batch, c.seqlen, c.kv_heads) == (128, 8, 4096, 4))
    assert c.nheads == 16
    assert c.flops == bench.attention_flops(8, 16, 1, 4096, 128, False)
    assert c.kv_bytes == 2 * 8 * 4096 * 4 * 128 * 2
    r = bench.CaseResult(c, {"cudaflash": bench.Timing(0.05, 0.04, 0.06, 30),
                             "flash": bench.Timing(0.1, 0.1, 0.1, 30)}, {}, "cfg")
    assert r.us("cudaflash") == pytest.approx(50.0)
    assert r.kv_gbps("cudaflash") == pytest.approx(c.kv_bytes / 50e-6 / 1e9)
    assert r.ratio("cudaflash", "flash") == pytest.approx(2.0)


def test_decode_takes_no_causal_option(capsys):
    assert bench.run(parse("bench", "--decode", "--causal", "yes")) == 2
    assert "--causal yes does not apply to --decode" in capsys.readouterr().err


def test_tflops_and_ratio():
    case = bench.fa_case("bf16", 128, False, 4096)
    r = bench.CaseResult(case, {"cudaflash": bench.Timing(1.0, 0.9, 1.2, 30),
                                "flash": bench.Timing(2.0, 1.9, 2.2, 30)},
                         {"cudnn": "RuntimeError: No available kernel"}, "cfg")
    assert r.tflops("cudaflash") == pytest.approx(case.flops / 1e-3 / 1e12)
    assert r.ratio("cudaflash", "flash") == pytest.approx(2.0)
    assert r.tflops("cudnn") is None and r.ratio("cudaflash", "cudnn") is None


def test_plot_without_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with pytest.raises(RuntimeError, match=r"cudaflash\[plot\]"):
        bench._import_pyplot()


# ---- tune: arguments, table, path ----------------------------------------------------------


def test_tune_arguments():
    args = parse("tune")
    assert args.run is tune.run
    assert (args.dtypes, args.head_dims, args.quick, args.out) == (["fp16", "bf16"], None,
                                                                   False, None)
    args = parse("tune", "--dtypes", "bf16", "--head-dims", "64,128", "--quick", "--out",
                 "t.yaml")
    assert (args.dtypes, args.head_dims, args.quick, args.out) == (["bf16"], [64, 128], True,
                                                                   Path("t.yaml"))
    for bad in (["--dtypes", "fp8"], ["--head-dims", "32"]):
        with pytest.raises(SystemExit):
            parse("tune", *bad)


def test_buckets_are_ordered_with_the_unbounded_one_last():
    bounds = [b.max_seqlen_k for b in tune.BUCKETS]
    assert bounds == [1024, 4096, None]
    for b in tune.BUCKETS:
        assert all(b.max_seqlen_k is None or s <= b.max_seqlen_k for s in b.seqlens)


def test_tuned_table_round_trips_in_first_match_order(tmp_path):
    # Given in a scrambled order: the writer must put the bounded buckets first.
    winners = [
        tune.Winner("bf16", 64, False, None, D64.format(dtype="bf16")),
        tune.Winner("bf16", 64, False, 1024, D64_W8.format(dtype="bf16")),
        tune.Winner("bf16", 64, True, 4096, D64.format(dtype="bf16")),
        tune.Winner("bf16", 64, False, 4096, D64.format(dtype="bf16")),
        tune.Winner("fp16", 128, True, None, D128_W8.format(dtype="fp16")),
        tune.Winner("bf16", 64, None, None, D64_W8.format(dtype="bf16"), max_seqlen_q=16),
    ]
    rules = tune.selection_rules(90, winners)
    text = tune.render_table(rules, ["GPU X (sm_90), 2026-01-01, cudaflash 0.1.0"])
    assert text.startswith("# GPU X (sm_90)")
    path = tmp_path / "tuned.yaml"
    tune.write_table(path, text)
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind

    assert yaml.safe_load(text) == {"selection": rules}
    parsed = selection.load_user_rules(path)  # what CUDAFLASH_CONFIG reads
    assert parsed == selection.parse_rules(rules, where=str(path))
    assert [(r.dtype, r.d_head, r.causal, r.max_seqlen_q, r.max_seqlen_k) for r in parsed] == [
        ("bf16", 64, None, 16, None),  # decoding first: it would never match after the rest
        ("bf16", 64, False, None, 1024), ("bf16", 64, False, None, 4096),
        ("bf16", 64, False, None, None), ("bf16", 64, True, None, 4096),
        ("fp16", 128, True, None, None)]
    assert all(r.arch == (90,) for r in parsed)

    available = [D64.format(dtype="bf16"), D64_W8.format(dtype="bf16"),
                 D128_W8.format(dtype="fp16")]
    for seqlen, want in ((512, D64_W8), (1024, D64_W8), (1025, D64), (100000, D64)):
        name, reason = selection.select(parsed, available, arch=90, dtype="bf16", d_head=64,
                                        causal=False, seqlen_q=seqlen, seqlen_k=seqlen)
        assert name == want.format(dtype="bf16") and reason.startswith("rule ")
    for causal in (False, True):  # one query row against a long cache: the decoding rule
        name, reason = selection.select(parsed, available, arch=90, dtype="bf16", d_head=64,
                                        causal=causal, seqlen_q=1, seqlen_k=100000)
        assert (name, reason) == (D64_W8.format(dtype="bf16"), "rule 0 of " + str(path))
    # The arch condition keeps the table to the GPU it was tuned on.
    _, reason = selection.select(parsed, available, arch=80, dtype="bf16", d_head=64,
                                 causal=False, seqlen_q=512, seqlen_k=512)
    assert reason.startswith("fallback")


def test_empty_tuned_table_is_valid():
    assert selection.parse_rules(yaml.safe_load(tune.render_table([], ["x"]))["selection"],
                                 where="t") == ()


def test_tuned_table_path_honours_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert _env.tuned_table_path(90) == tmp_path / "cudaflash" / "tuned-sm90.yaml"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for unset in ("", "relative/cache"):  # empty or relative: the XDG spec says use ~/.cache
        monkeypatch.setenv("XDG_CACHE_HOME", unset)
        assert _env.tuned_table_path(86) == tmp_path / "home/.cache/cudaflash/tuned-sm86.yaml"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert _env.tuned_table_path(80) == tmp_path / "home/.cache/cudaflash/tuned-sm80.yaml"


# ---- GPU -----------------------------------------------------------------------------------


@pytest.mark.requires_gpu
def test_bench_run_small_sweep(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = parse("bench", "--seqlens", "512", "--head-dims", "64", "--iters", "20",
                 "--warmup", "2", "--json", str(out))
    assert bench.run(args) == 0
    text = capsys.readouterr().out
    assert "L2 flushed" in text and "host time per call" in text
    data = json.loads(out.read_text())
    assert data["env"]["gpu"] and data["env"]["sm_count"] > 0
    assert len(data["results"]) == 2  # causal and non-causal
    for r in data["results"]:
        cf = r["backends"]["cudaflash"]
        assert cf["tflops"] > 0 and cf["min_ms"] <= cf["median_ms"] <= cf["max_ms"]
        assert cf["iters"] == 20
        assert r["cudaflash_config"].startswith("fwd_bf16_d64_")
        assert set(r["backends"]) == set(bench.BACKENDS)
    assert data["host_us_per_call"]["cudaflash"] > 0


@pytest.mark.requires_gpu
def test_bench_decode_sweep(tmp_path, capsys):
    out = tmp_path / "decode.json"
    args = parse("bench", "--decode", "--seqlens", "2048", "--head-dims", "128", "--iters",
                 "20", "--warmup", "2", "--backends", "cudaflash,flash", "--no-host",
                 "--json", str(out))
    assert bench.run(args) == 0
    assert "decoding (one query row per sequence)" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert len(data["results"]) == 2 * 2  # GQA groups x batches
    for r in data["results"]:
        assert r["seqlen_q"] == 1 and r["decode"] and r["kv_bytes"] > 0
        assert r["backends"]["cudaflash"]["median_ms"] > 0


@pytest.mark.requires_gpu
def test_bench_reports_a_refusing_backend_as_na():
    import torch

    # SDPA's flash backend has no fp32 kernel: it must come back as a reason, not raise.
    q = torch.randn(1, 128, 2, 64, device="cuda")
    result = timing.time_backend("flash", q, q, q, False, config=None, iters=20, warmup=1,
                                 flush=timing.flush_buffer(q.device))
    assert isinstance(result, str) and result


@pytest.mark.requires_gpu
def test_tune_quick_writes_a_valid_table(tmp_path):
    out = tmp_path / "tuned.yaml"
    assert tune.run(parse("tune", "--quick", "--dtypes", "bf16", "--head-dims", "64",
                          "--out", str(out))) == 0
    rules = selection.load_user_rules(out)
    assert [(r.causal, r.max_seqlen_q, r.max_seqlen_k) for r in rules] == [
        (None, 16, None), (False, None, 1024), (False, None, 4096), (False, None, None),
        (True, None, 1024), (True, None, 4096), (True, None, None)]
    assert all(r.dtype == "bf16" and r.d_head == 64 for r in rules)
