#!/usr/bin/env bash
# Issue 23 on a machine with 2 GPUs (nvidia-h100-x2 / nvidia-h200-x2), one call, about 3
# minutes (each step has its own time limit: 150 + 60 + 100 s at most):
#   1. the GPUs' link (nvidia-smi topo -m),
#   2. pytest: several GPUs in one process (tests/test_gpu_multi_device.py), the NCCL ring on
#      two processes against cudaflash on one GPU (tests/test_gpu_ring.py), the ring's CPU
#      tests (tests/test_distributed_ring.py, gloo),
#   3. the README's torchrun example (tools/ring_example.py),
#   4. the ring's efficiency against one GPU doing the same work, 64k tokens (32k per GPU),
#      16 heads, d128, bf16, causal and not (python -m cudaflash.distributed.bench).
# Logs under $OUT (default /tmp/out); a summary on stdout. The kernels must be built
# (cudaflash/kernels/, e.g. by tools/device_check.sh's build step or python build_cubins.py).
#
#   tools/multi_gpu_check.sh            # extra pytest arguments: PYTEST_ARGS, bench: BENCH_ARGS
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# torchrun runs tools/ring_example.py with tools/ as its path: use the repository's cudaflash.
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# NVLink multicast stays off (a program using it can take the host's GPUs down).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
torchrun="python3 -m torch.distributed.run --standalone --nproc-per-node 2"

if [[ ! -f cudaflash/kernels/manifest.json ]]; then
    echo "cudaflash/kernels/manifest.json is missing: build the kernels first"; exit 1
fi
{ nvidia-smi --query-gpu=index,name,driver_version --format=csv; nvidia-smi topo -m; } \
    > "$OUT/gpus.txt" 2>&1
head -4 "$OUT/gpus.txt"

rc=0
timeout 150 python3 -m pytest -q -rs tests/test_gpu_multi_device.py tests/test_gpu_ring.py \
    tests/test_distributed_ring.py ${PYTEST_ARGS:-} > "$OUT/pytest_multi_gpu.log" 2>&1 || rc=1
echo "== pytest (log: pytest_multi_gpu.log)"
grep -E "^(FAILED|ERROR)|^SKIPPED|passed|failed|skipped|Timeout" "$OUT/pytest_multi_gpu.log" \
    | tail -25

timeout 60 $torchrun tools/ring_example.py > "$OUT/ring_example.log" 2>&1 || rc=1
echo "== torchrun tools/ring_example.py (log: ring_example.log)"
grep -E "^rank|Error" "$OUT/ring_example.log" | tail -6

timeout 100 $torchrun -m cudaflash.distributed.bench --json "$OUT/ring_bench.json" \
    ${BENCH_ARGS:-} > "$OUT/ring_bench.log" 2>&1 || rc=1
echo "== ring efficiency (log: ring_bench.log, ring_bench.json)"
grep -vE "^(W|\[W|\[rank|NCCL|  warnings)" "$OUT/ring_bench.log" | tail -12
exit $rc
