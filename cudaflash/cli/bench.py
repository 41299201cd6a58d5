"""``python -m cudaflash bench``: cudaflash next to PyTorch SDPA's flash, cuDNN and efficient
backends, in one process, on the same random tensors.

cudaflash gets BSHD tensors; SDPA gets ``transpose(1, 2)`` views of the same tensors (BHSD, no
copy). The default sweep is the FlashAttention benchmark convention: batch = 16384 / S,
nheads = 2048 / d, TFLOP/s = 4 * B * H * Sq * Sk * d / time, halved when causal. ``--decode``
times decoding instead: one query row against a K/V cache of S keys, in microseconds and
GB/s of K/V read, with and without GQA (``--suite decode`` says the same). ``--suite train``,
``backward``, ``varlen``, ``window``, ``softcap`` and ``kvcache`` time the suites of
``suites.py`` (forward, backward, training step; their calls in ``suite_calls.py``). How a
call is timed, for every suite: ``timing.method_text`` and ``timing.time_in_turns``.
``measure_case``, ``host_time.measure_host`` and ``suites.measure_rows`` return numbers and print
nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .. import __version__, _driver, dispatch
from ..config import D_HEADS, DTYPES, KernelConfig
from . import suites
from ._common import Progress, comma_list, format_table
from .suites import (CAUSAL_CHOICES, FA_HIDDEN, FA_TOKENS, SUITES, attention_flops,
                     measure_rows)
from .host_time import HOST_CALLS, HOST_ROUNDS, HOST_WARMUP, measure_host, print_host
from .timing import (BACKENDS, DEFAULT_ITERS, DEFAULT_WARMUP, L2_FLUSH_BYTES, MIN_ITERS,  # noqa: F401
                     Timing, backend_call, flush_buffer, make_qkv, method_text,
                     time_in_turns)  # Timing: bench.Timing in the tests

# FlashAttention's benchmark convention (FA_TOKENS per batch, FA_HIDDEN model width: every
# size does comparable total work) and its FLOP count live in suites.py, shared by all suites.
DEFAULT_SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
# Decoding: one new token per sequence against K/V caches of these lengths, for a lone
# sequence and a small batch, with every query head its own K/V head (MHA) and with four
# query heads per K/V head (GQA, as in Llama-style models).
DEFAULT_DECODE_SEQLENS = (1024, 4096, 16384, 65536)
DECODE_BATCHES = (1, 8)
DECODE_GQA_GROUPS = (1, 4)
DEFAULT_HEAD_DIMS = (64, 128)



# ---- problem sizes and FLOPs -----------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One benchmarked problem: seqlen keys; seqlen queries, or one when decoding; nheads
    query heads reading nheads_k K/V heads."""

    dtype: str  # "bf16" or "fp16"
    d_head: int
    causal: bool
    seqlen: int
    batch: int
    nheads: int
    decode: bool = False
    nheads_k: Optional[int] = None  # None: nheads

    @property
    def seqlen_q(self) -> int:
        return 1 if self.decode else self.seqlen

    @property
    def kv_heads(self) -> int:
        return self.nheads if self.nheads_k is None else self.nheads_k

    @property
    def flops(self) -> float:
        return attention_flops(self.batch, self.nheads, self.seqlen_q, self.seqlen,
                               self.d_head, self.causal)

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V, which a decoding step reads once at best."""
        return 2 * self.batch * self.seqlen * self.kv_heads * self.d_head * 2


def fa_case(dtype: str, d_head: int, causal: bool, seqlen: int) -> Case:
    """The problem the FlashAttention convention times at this seqlen and head dim."""
    return Case(dtype=dtype, d_head=d_head, causal=causal, seqlen=seqlen,
                batch=max(1, FA_TOKENS // seqlen), nheads=FA_HIDDEN // d_head)


def build_cases(dtypes, head_dims, causals, seqlens) -> list[Case]:
    return [fa_case(dtype, d_head, causal, seqlen)
            for dtype in dtypes for d_head in head_dims for causal in causals
            for seqlen in seqlens]


def decode_case(dtype: str, d_head: int, batch: int, group: int, seqlen: int) -> Case:
    """One decoding step: nheads = 2048 / d query heads, ``group`` of them per K/V head,
    ``seqlen`` keys. Not causal: one query row sees its whole cache either way."""
    nheads = FA_HIDDEN // d_head
    return Case(dtype=dtype, d_head=d_head, causal=False, seqlen=seqlen, batch=batch,
                nheads=nheads, decode=True, nheads_k=nheads // group)


def build_decode_cases(dtypes, head_dims, seqlens) -> list[Case]:
    """Decoding steps for DECODE_GQA_GROUPS query heads per K/V head and DECODE_BATCHES."""
    return [decode_case(dtype, d_head, batch, group, seqlen)
            for dtype in dtypes for d_head in head_dims for group in DECODE_GQA_GROUPS
            for batch in DECODE_BATCHES for seqlen in seqlens]


def selected_config(device_index: int, dtype: str, d_head: int, causal: bool, seqlen_q: int,
                    seqlen_k: int, n_heads: int = 1, n_heads_k: int = 1,
                    batch: Optional[int] = None) -> Optional[str]:
    """The config ``flash_attn_func`` runs for such a call (of ``batch`` sequences: small
    calls load without tensor maps, and so may run another config), or None if there is
    none."""
    try:
        return dispatch.selected_config(device_index, dtype, d_head, causal, seqlen_q, seqlen_k,
                                        n_heads, n_heads_k, batch=batch)[0]
    except LookupError:
        return None


@dataclass
class CaseResult:
    case: Case
    timings: dict  # backend -> Timing
    errors: dict  # backend -> why it is n/a
    config: Optional[str]  # the config cudaflash ran (None: no cudaflash measurement)

    def tflops(self, backend: str) -> Optional[float]:
        t = self.timings.get(backend)
        return None if t is None else self.case.flops / t.median_ms / 1e9

    def us(self, backend: str) -> Optional[float]:
        t = self.timings.get(backend)
        return None if t is None else t.median_ms * 1e3

    def kv_gbps(self, backend: str) -> Optional[float]:
        """GB/s of K/V read, counting each byte once (decoding's lower bound on traffic)."""
        t = self.timings.get(backend)
        return None if t is None else self.case.kv_bytes / t.median_ms / 1e6

    def ratio(self, backend: str, other: str) -> Optional[float]:
        """How many times faster ``backend`` ran than ``other`` (TFLOP/s ratio)."""
        a, b = self.tflops(backend), self.tflops(other)
        return None if a is None or b is None else a / b


def measure_case(case: Case, backends, *, device, config: Optional[KernelConfig], iters: int,
                 warmup: int, flush: torch.Tensor, progress: "Progress") -> CaseResult:
    """Time every backend on one set of random tensors."""
    q, k, v = make_qkv(case.batch, case.seqlen, case.nheads, case.d_head, case.dtype, device,
                       seqlen_q=case.seqlen_q, nheads_k=case.kv_heads)
    # The backends take turns in CASE_ROUNDS rounds (timing.time_in_turns says why).
    calls = {backend: backend_call(backend, q, k, v, case.causal, config)
             for backend in backends}
    what = (f"decode B={case.batch} H={case.nheads} Hk={case.kv_heads}" if case.decode
            else f"causal={case.causal}")
    got = time_in_turns(
        calls, iters=iters, warmup=warmup, flush=flush,
        announce=lambda backend: progress.step(
            f"{case.dtype} d={case.d_head} {what} S={case.seqlen} {backend}"))
    timings = {b: t for b, t in got.items() if not isinstance(t, str)}
    errors = {b: t for b, t in got.items() if isinstance(t, str)}
    used = None
    if "cudaflash" in timings:  # a failed cudaflash call may mean there is no manifest at all
        used = config.name if config is not None else selected_config(
            device.index, case.dtype, case.d_head, case.causal, case.seqlen_q, case.seqlen,
            case.nheads, case.kv_heads, batch=case.batch)
    return CaseResult(case, timings, errors, used)


# ---- output ----------------------------------------------------------------------------------


def _num(x: Optional[float], fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def environment(device_index: int) -> dict:
    """What the numbers depend on: GPU, driver, library versions."""
    props = torch.cuda.get_device_properties(device_index)
    bindings_version = _driver.bindings_version()
    try:
        driver = _driver.driver_version()
    except (ImportError, RuntimeError):  # no cuda-bindings, or the driver call failed
        driver = None
    return {
        "gpu": props.name,
        "sm_count": props.multi_processor_count,
        "compute_capability": f"{props.major}.{props.minor}",
        "driver": driver,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "cuda_bindings": bindings_version,
        "cudaflash": __version__,
        "python": platform.python_version(),
    }


def print_results(results: list[CaseResult], backends) -> None:
    others = [b for b in backends if b != "cudaflash"] if "cudaflash" in backends else []
    ratios = [f"cf/{b}" for b in others]
    if results and results[0].case.decode:
        header = ("dtype", "d", "S_k", "B", "H", "H_k", *(f"{b} us" for b in backends),
                  "cudaflash GB/s", *ratios)
        rows = [(r.case.dtype, r.case.d_head, r.case.seqlen, r.case.batch, r.case.nheads,
                 r.case.kv_heads, *(_num(r.us(b), ".1f") for b in backends),
                 _num(r.kv_gbps("cudaflash"), ".0f"),
                 *(_num(r.ratio("cudaflash", b), ".2f") for b in others)) for r in results]
        print("decoding (one query row per sequence): microseconds per call; GB/s of K/V "
              "read; cf/X = X's time / cudaflash's time")
    else:
        header = ("dtype", "d", "causal", "S", "B", "H", *backends, *ratios)
        rows = [(r.case.dtype, r.case.d_head, r.case.causal, r.case.seqlen, r.case.batch,
                 r.case.nheads, *(_num(r.tflops(b), ".1f") for b in backends),
                 *(_num(r.ratio("cudaflash", b), ".2f") for b in others)) for r in results]
        print("TFLOP/s per backend; cf/X = cudaflash TFLOP/s / X TFLOP/s")
    print(format_table(header, rows))

    failures: dict = {}  # backend -> [number of sizes, the first size's reason]
    for r in results:
        for backend, why in r.errors.items():
            failures.setdefault(backend, [0, why])[0] += 1
    for backend, (n, why) in failures.items():
        # SDPA's reasons name the tensor sizes, so every size has its own: show the first.
        print(f"n/a: {backend} on {n} size(s); the first: {why}")
    configs: dict = {}  # config -> number of sizes it ran
    for r in results:
        if r.config is not None:
            configs[r.config] = configs.get(r.config, 0) + 1
    for name, n in configs.items():
        print(f"cudaflash config {name}: {n} size(s)")

    if "cudaflash" in backends and "flash" in backends:
        print("\ncudaflash / SDPA flash over S:")
        groups: dict = {}
        for r in results:
            groups.setdefault(_group_key(r.case), []).append(r)
        for key, group in groups.items():
            ratios = [x for x in (r.ratio("cudaflash", "flash") for r in group) if x is not None]
            stats = (f"min {min(ratios):.2f}, median {statistics.median(ratios):.2f} "
                     f"({len(ratios)} of {len(group)} sizes)" if ratios else "n/a")
            print(f"  {_group_title(key)}: {stats}")


def _group_key(case: Case) -> tuple:
    """Cases that one plot panel and one summary line cover: they differ only in S."""
    if case.decode:
        return case.dtype, case.d_head, "decode", case.batch, case.nheads, case.kv_heads
    return case.dtype, case.d_head, case.causal


def _group_title(key: tuple) -> str:
    if key[2] == "decode":
        dtype, d_head, _, batch, nheads, kv_heads = key
        return f"{dtype} d={d_head} decode B={batch} H={nheads} H_k={kv_heads}"
    dtype, d_head, causal = key
    return f"{dtype} d={d_head} causal={causal}"


def _import_pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib, which is not installed; install the "
                           "extra: pip install 'cudaflash[plot]'") from None
    matplotlib.use("Agg")  # write a file; no display needed
    import matplotlib.pyplot as plt

    return plt


def plot(path: Path, results: list[CaseResult], backends) -> None:
    """TFLOP/s (decoding: GB/s of K/V read) over S, one panel per group of cases that differ
    only in S, one line per backend."""
    plt = _import_pyplot()
    groups: dict = {}
    for r in results:
        groups.setdefault(_group_key(r.case), []).append(r)
    fig, axes = plt.subplots(len(groups), 1, figsize=(7, 3.2 * len(groups)), squeeze=False)
    for ax, (key, group) in zip(axes[:, 0], groups.items()):
        decode = group[0].case.decode
        seqlens = [r.case.seqlen for r in group]
        for backend in backends:
            values = [(r.kv_gbps(backend) if decode else r.tflops(backend)) or float("nan")
                      for r in group]
            ax.plot(seqlens, values, marker="o", label=backend)
        ax.set_xscale("log", base=2)
        ax.set_xticks(seqlens, [str(s) for s in seqlens])
        ax.set_title(_group_title(key))
        ax.set_xlabel("keys (K/V cache length)" if decode else "seqlen")
        ax.set_ylabel("GB/s of K/V" if decode else "TFLOP/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_json(path: Path, env: dict, method: dict, results: list[CaseResult],
               host: Optional[dict]) -> None:
    def backend_entry(r: CaseResult, backend: str) -> dict:
        if backend in r.errors:
            return {"error": r.errors[backend]}
        return {"tflops": r.tflops(backend), **dataclasses.asdict(r.timings[backend])}

    data = {
        "suite": "decode" if results and results[0].case.decode else "forward",
        "env": env,
        "method": method,
        "results": [{**dataclasses.asdict(r.case), "seqlen_q": r.case.seqlen_q,
                     "nheads_k": r.case.kv_heads, "flops": r.case.flops,
                     "kv_bytes": r.case.kv_bytes,
                     "cudaflash_config": r.config,
                     "backends": {b: backend_entry(r, b) for b in [*r.timings, *r.errors]}}
                    for r in results],
        "host_us_per_call": None if host is None else {
            b: ({"error": us} if isinstance(us, str) else us) for b, us in host.items()},
    }
    path.write_text(json.dumps(data, indent=1) + "\n")


# ---- command line ----------------------------------------------------------------------------


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"{value} < 1")
    return value


def _iters(text: str) -> int:
    value = int(text)
    if value < MIN_ITERS:
        raise argparse.ArgumentTypeError(f"{value}: at least {MIN_ITERS} timed calls, so that "
                                         "the median is stable")
    return value


def _warmup(text: str) -> int:
    value = int(text)
    if value < 1:  # the first call loads modules and builds plans: never time it
        raise argparse.ArgumentTypeError(f"{value}: at least 1 warm-up call")
    return value


def _config(text: str) -> KernelConfig:
    try:
        return KernelConfig.from_name(text)
    except ValueError as e:  # ConfigError; argparse would drop its message
        raise argparse.ArgumentTypeError(str(e)) from None


SUITE_NAMES = ("forward", "decode", *SUITES)
# Every name --backends accepts: the forward suite's backends and every suite's variants
# (which of them a suite takes: resolve_suite).
ALL_VARIANTS = tuple(dict.fromkeys([*BACKENDS, *(v for s in SUITES.values()
                                                 for v in s.variants)]))


def _suite_lines() -> str:
    return "; ".join([f"forward (default): the forward, {'/'.join(BACKENDS)}",
                      "decode: decoding steps (as --decode)",
                      *(f"{s.name}: {s.help}" for s in SUITES.values())])


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench", help="cudaflash vs PyTorch SDPA (flash, cuDNN, efficient) on this GPU",
        description="Time cudaflash and PyTorch SDPA's flash, cuDNN and efficient backends on "
                    "the same random tensors (FlashAttention convention: batch = "
                    f"{FA_TOKENS} / S, nheads = {FA_HIDDEN} / d), print TFLOP/s and ratios, "
                    "and the host time per call at a tiny size. --suite picks what to time: "
                    + _suite_lines() + ".")
    p.add_argument("--suite", choices=SUITE_NAMES, default=None,
                   help="what to time (default forward): " + ", ".join(SUITE_NAMES))
    p.add_argument("--phases", type=comma_list(str, suites.ALL_PHASES), default=None,
                   help="train, backward, varlen, window, softcap: comma-separated phases of "
                        f"{','.join(suites.PHASES)} (default: the suite's; train: all three); "
                        f"hf: of {','.join(suites.HF_PHASES)}")
    p.add_argument("--seqlens", type=comma_list(_positive), default=None,
                   help="comma-separated sequence lengths (default "
                        f"{','.join(map(str, DEFAULT_SEQLENS))}); batch = {FA_TOKENS} // S. "
                        "With --decode: K/V cache lengths (default "
                        f"{','.join(map(str, DEFAULT_DECODE_SEQLENS))}); varlen: the longest "
                        "sequence; window: batch 1")
    p.add_argument("--decode", action="store_true",
                   help="time decoding steps instead (= --suite decode): one query row per "
                        f"sequence, batch {' and '.join(map(str, DECODE_BATCHES))}, nheads = "
                        f"{FA_HIDDEN} // d, as many K/V heads (MHA) and a quarter of them (GQA)")
    p.add_argument("--head-dims", type=comma_list(int, range(1, D_HEADS[-1] + 1)),
                   default=None,
                   help=f"comma-separated head dims in 1..{D_HEADS[-1]} (default "
                        f"{','.join(map(str, DEFAULT_HEAD_DIMS))}, train and backward "
                        "64,128,256, or --config's); nheads = "
                        f"{FA_HIDDEN} // d. Kernels exist for {list(D_HEADS)}; flash_attn_func "
                        "runs other head dims padded to the next one, and so does the bench")
    p.add_argument("--dtype", type=comma_list(str, DTYPES), default=None,
                   help="bf16, fp16 or bf16,fp16 (default bf16, or --config's)")
    p.add_argument("--causal", choices=list(CAUSAL_CHOICES), default="both",
                   help="causal masking: both (default), yes or no")
    p.add_argument("--backends", type=comma_list(str, ALL_VARIANTS), default=None,
                   help=f"comma-separated subset of {','.join(BACKENDS)} (default: all); for "
                        "the other suites their variants: "
                        + "; ".join(f"{s.name} {','.join(s.variants)} (default "
                                    f"{','.join(s.default_variants)})"
                                    for s in SUITES.values()))
    p.add_argument("--iters", type=_iters, default=DEFAULT_ITERS,
                   help=f"timed calls per backend and size, >= {MIN_ITERS} (default "
                        "%(default)s)")
    p.add_argument("--warmup", type=_warmup, default=DEFAULT_WARMUP,
                   help="untimed calls before timing (default %(default)s)")
    p.add_argument("--config", type=_config, default=None, metavar="NAME",
                   help="forward and decode: time this kernel config through "
                        "cudaflash.forward instead of flash_attn_func's selection "
                        "(`python -m cudaflash list` names them)")
    p.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="write every number, the environment and the method to PATH")
    p.add_argument("--plot", type=Path, default=None, metavar="PATH",
                   help="save a TFLOP/s plot to PATH (needs the extra cudaflash[plot])")
    p.add_argument("--no-host", action="store_true",
                   help="skip the host-overhead measurement (only the forward and decode "
                        "suites take one; the others accept the flag and measure the same)")
    p.set_defaults(run=run)
    return p


def suite_name(args) -> str:
    """The suite to run: --suite, or decode for --decode. Raises ValueError when both are
    given and disagree."""
    if args.decode:
        if args.suite not in (None, "decode"):
            raise ValueError(f"--decode is --suite decode; it does not go with --suite "
                             f"{args.suite}")
        return "decode"
    return args.suite or "forward"


def resolve_suite(args) -> suites.Options:
    """The sweep of a suite other than forward and decode (``suites.resolve``)."""
    return suites.resolve(args, suite_name(args))


def check_forward_args(args) -> list:
    """The backends of the forward and decode suites; raises ValueError for an option of
    the other suites."""
    if args.phases is not None:
        raise ValueError(f"--phases applies to the {', '.join(n for n, s in SUITES.items() if len(s.phases) > 1)} suites; the "
                         f"{suite_name(args)} suite times the forward")
    backends = list(args.backends or BACKENDS)
    bad = [b for b in backends if b not in BACKENDS]
    if bad:
        raise ValueError(f"--backends {','.join(bad)}: the {suite_name(args)} suite has "
                         f"{','.join(BACKENDS)}")
    return backends


def run_suite(args, opts: suites.Options) -> int:
    """The train, backward, varlen, window, softcap, kvcache and hf suites."""
    rows = opts.rows()
    device = torch.device("cuda", torch.cuda.current_device())
    env = environment(device.index)
    whole_model = opts.suite.unit == "tokens"
    if whole_model:
        env["transformers"] = _transformers_version()
    method = {"text": method_text(args.iters, args.warmup, grad=not whole_model,
                                  model=whole_model),
              "iters": args.iters, "warmup": args.warmup, "l2_flush_bytes": L2_FLUSH_BYTES}
    print_env(env)
    print(f"timing: {method['text']}")
    print(f"suite {opts.suite.name}: {opts.suite.help}; phases {', '.join(opts.phases)}: "
          + "; ".join(f"{p} = {opts.suite.describe(p)}" for p in opts.phases))
    progress = Progress(len(rows) * len(opts.phases) * len(opts.variants), opts.suite.name)
    flush = flush_buffer(device)
    from .suite_calls import build_calls  # torch on the GPU: imported when a suite runs
    results = measure_rows(opts, rows, device=device, iters=args.iters, warmup=args.warmup,
                           flush=flush, progress=progress, build=build_calls)
    progress.close()
    print()
    print(suites.format_results(opts, results))
    if args.json is not None:
        suites.write_json(args.json, opts, env, method, results)
        print(f"\nwrote {args.json}")
    if args.plot is not None:
        suites.plot(args.plot, opts, results, _import_pyplot())
        print(f"wrote {args.plot}")
    return 0


def _transformers_version() -> Optional[str]:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__


def print_env(env: dict) -> None:
    print(f"{env['gpu']} ({env['sm_count']} SMs, compute capability "
          f"{env['compute_capability']}), driver "
          f"{env['driver']}, torch {env['torch']} (CUDA {env['torch_cuda']}, cuDNN "
          f"{env['cudnn']}), cuda-bindings {env['cuda_bindings']}, cudaflash {env['cudaflash']}"
          + (f", transformers {env['transformers']}" if "transformers" in env else ""))


def sweep_dims(args) -> tuple[list, list]:
    """(dtypes, head dims) of the sweep; with --config they default to the config's and must
    not contradict it. Raises ValueError on a contradiction."""
    dtypes = args.dtype or ([args.config.dtype] if args.config else ["bf16"])
    head_dims = args.head_dims or ([args.config.d_head] if args.config
                                   else list(DEFAULT_HEAD_DIMS))
    if args.config and (dtypes != [args.config.dtype] or head_dims != [args.config.d_head]):
        raise ValueError(f"--config {args.config.name} is a {args.config.dtype} kernel with "
                         f"d_head={args.config.d_head}; --dtype and --head-dims must be those "
                         "(or left out)")
    return dtypes, head_dims


def run(args) -> int:
    opts = None
    try:
        name = suite_name(args)
        if name in SUITES:
            opts = resolve_suite(args)
        else:
            backends = check_forward_args(args)
            dtypes, head_dims = sweep_dims(args)
            if name == "decode" and args.causal != "both":
                raise ValueError(f"--causal {args.causal} does not apply to --decode: one "
                                 "query row sees its whole cache under either mask")
    except ValueError as e:
        print(f"cudaflash bench: {e}", file=sys.stderr)
        return 2
    if args.plot is not None:
        _import_pyplot()  # fail now, not after a sweep of several minutes
    if not torch.cuda.is_available():
        print(f"cudaflash bench: no CUDA GPU (torch {torch.__version__}: "
              "torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    if opts is not None:
        return run_suite(args, opts)
    decode = name == "decode"

    device = torch.device("cuda", torch.cuda.current_device())
    env = environment(device.index)
    method = {"text": method_text(args.iters, args.warmup), "iters": args.iters,
              "warmup": args.warmup, "l2_flush_bytes": L2_FLUSH_BYTES,
              "host_calls": HOST_CALLS, "host_rounds": HOST_ROUNDS,
              "host_warmup": HOST_WARMUP}
    print_env(env)
    print(f"timing: {method['text']}")
    if args.config is not None:
        print(f"cudaflash config: {args.config.name} (cudaflash.forward)")

    if decode:
        cases = build_decode_cases(dtypes, head_dims, args.seqlens or DEFAULT_DECODE_SEQLENS)
    else:
        cases = build_cases(dtypes, head_dims, CAUSAL_CHOICES[args.causal],
                            args.seqlens or DEFAULT_SEQLENS)
    progress = Progress(len(cases) * len(backends)
                        + (0 if args.no_host else HOST_ROUNDS * len(backends)), "bench")
    flush = flush_buffer(device)
    with torch.inference_mode():
        results = [measure_case(case, backends, device=device, config=args.config,
                                iters=args.iters, warmup=args.warmup, flush=flush,
                                progress=progress) for case in cases]
        host = None if args.no_host else measure_host(backends, device=device,
                                                      progress=progress)
    progress.close()

    print()
    print_results(results, backends)
    if host is not None:
        print_host(host)
    if args.json is not None:
        write_json(args.json, env, method, results, host)
        print(f"\nwrote {args.json}")
    if args.plot is not None:
        plot(args.plot, results, backends)
        print(f"wrote {args.plot}")
    return 0
