#!/usr/bin/env bash
# One call on the GPU machine for the Hugging Face and SDPA integrations (issue 22): their
# tests (GPU and CPU) and `python -m cudaflash bench --suite hf`; logs under $OUT (default
# /tmp/out). Expects the cubins built (cudaflash/kernels/) and transformers installed.
# About 3 minutes on an H100: tests ~2 min (torch.compile ones the longest), bench ~1 min.
#
#   OUT=/tmp/out tools/hf_check.sh
#
# Extra pytest arguments in PYTEST_ARGS, extra bench arguments in BENCH_ARGS.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

python3 - <<'EOF' 2>&1 | tee "$OUT/hf-env.txt"
import torch, torch.nn.attention as attention
print("torch", torch.__version__, "cuda", torch.version.cuda,
      "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
print("torch.nn.attention registry:", hasattr(attention, "register_flash_attention_impl"),
      "impls:", getattr(attention, "list_flash_attention_impls", lambda: "n/a")())
print("torch.library.get_kernel:", hasattr(torch.library, "get_kernel"))
try:
    import transformers
    print("transformers", transformers.__version__)
except ImportError as e:
    print("transformers: not installed", e)
try:
    import flash_attn
    print("flash_attn", flash_attn.__version__)
except ImportError:
    print("flash_attn: not installed (the hf bench's flash_attention_2 column is n/a)")
EOF

rc=0
timeout 300 python3 -m pytest -q -rs tests/test_gpu_hf.py tests/test_gpu_sdpa.py \
    tests/test_hf_integration.py tests/test_hf_token_layout.py tests/test_sdpa_integration.py \
    tests/test_bench_cli.py::test_hf_calls_on_the_cpu ${PYTEST_ARGS:-} \
    > "$OUT/hf-pytest.log" 2>&1 || rc=1
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$OUT/hf-pytest.log" | tail -40

timeout 240 python3 -m cudaflash bench --suite hf --iters 20 --warmup 3 \
    --json "$OUT/hf-bench.json" ${BENCH_ARGS:-} > "$OUT/hf-bench.log" 2>&1 || rc=1
cat "$OUT/hf-bench.log"
exit $rc
