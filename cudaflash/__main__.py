"""Command line: ``python -m cudaflash list`` (the manifest's kernels, no GPU needed),
``info`` (versions, GPUs and the config each would run), ``bench`` (cudaflash against PyTorch
SDPA's backends) and ``tune`` (the fastest config per problem class on this GPU)."""

import argparse
import platform
import sys

from . import __version__, _driver, api, dispatch
from .cli import bench, tune
from .manifest import load_manifest


def _table(header: tuple, rows: list) -> str:
    return bench.format_table(header, rows, left=range(len(header)))


def cmd_list(args) -> int:
    m = load_manifest()
    rows = [(e.name, ("compute_" if e.kind == "ptx" else "sm_") + str(e.arch), e.kind,
             e.threads, e.smem_bytes, "-" if e.registers is None else e.registers,
             "-" if e.spill_bytes is None else e.spill_bytes) for e in m.kernels]
    print(_table(("name", "arch", "kind", "threads", "smem", "regs", "spills"), rows))
    # Backward modules: smem is the most any of their kernels asks for; regs likewise.
    backward = [(e.name, ("compute_" if e.kind == "ptx" else "sm_") + str(e.arch), e.kind,
                 e.threads, e.smem_bytes, "-" if e.registers is None else e.registers,
                 "-" if e.spill_bytes is None else e.spill_bytes, ",".join(e.schemes))
                for e in m.backward]
    if backward:
        print()
        print(_table(("backward module", "arch", "kind", "threads", "smem", "regs", "spills",
                      "schemes"), backward))
    print(f"\n{len(rows)} forward kernels and {len(backward)} backward modules in {m.path} "
          f"({m.describe_toolchain()}; sources {m.source_hash[:12]})")
    return 0


def cmd_info(args) -> int:
    import torch

    print(f"cudaflash {__version__}, python {platform.python_version()}, torch "
          f"{torch.__version__} (CUDA {torch.version.cuda}), cuda-bindings "
          f"{_driver.bindings_version() or 'not importable'}")
    m = load_manifest()
    print(f"kernels: {len(m.kernels)} in {m.path} ({m.describe_toolchain()}; sources "
          f"{m.source_hash[:12]})")
    if not torch.cuda.is_available():
        print("GPU: none (torch.cuda.is_available() is False)")
        return 0
    module = _driver.kernel_module_version()
    print(f"CUDA driver {_driver.driver_version()}" + (f" ({module})" if module else ""))
    for index in range(torch.cuda.device_count()):
        dk = dispatch.device_kernels(index)
        print(f"\n{dk.describe()}: {len(dk.usable)} configs usable; selection for "
              f"seqlen_q = seqlen_k = {args.seqlen} (a batch big enough for tensor maps; "
              f"smaller calls may run another config):")
        rows = []
        for dtype, d_head in sorted({(e.config.dtype, e.config.d_head)
                                     for e in dk.usable.values()}):
            for causal in (False, True):
                name, reason = api.selected_config(index, dtype, d_head, causal, args.seqlen,
                                                   args.seqlen)
                # Rules may give dropout calls another config (configs.yaml: d64).
                dropout_name, _ = api.selected_config(index, dtype, d_head, causal, args.seqlen,
                                                      args.seqlen, dropout=True)
                rows.append((dtype, d_head, causal, name, dk.usable[name].kind, reason,
                             "same" if dropout_name == name else dropout_name))
        print(_table(("dtype", "d_head", "causal", "config", "kind", "chosen by",
                      "with dropout"), rows))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cudaflash", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="list the kernels of the manifest").set_defaults(run=cmd_list)
    info = sub.add_parser("info", help="versions, GPUs and the configs they select")
    info.add_argument("--seqlen", type=int, default=4096,
                      help="sequence length to show the selection for (default 4096)")
    info.set_defaults(run=cmd_info)
    bench.add_parser(sub)
    tune.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except RuntimeError as e:  # no manifest, no driver, old GPU: one line, not a traceback
        print(f"cudaflash: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
