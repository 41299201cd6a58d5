#!/usr/bin/env bash
# One call on the GPU machine: build every cubin (-j16), run the whole pytest suite (GPU tests
# included) and the benchmarks; full logs under $OUT (default /tmp/cudaflash-out).
#
#   tools/device_check.sh [test] [bench] [decode] [train] [backward] [varlen] [window] [softcap]
#                         [alibi] [dropout] [kvcache] [suites] [tune] [ablation] [tma]
#                         [sanitize]                               (default: test, bench, train)
#
# bench: `python -m cudaflash bench` (the forward suite, bf16 and fp16); decode, train,
# backward, varlen, window, softcap, alibi, dropout, kvcache: `python -m cudaflash bench --suite <step>`
# (train and backward at bf16 and fp16), each with --json, --plot and a log under $OUT;
# suites: all of those but train.
#
# tma: tools/tma_ab.py, the forward's TMA loads against cp.async, flash_attn_func's choice
# and cuDNN in one run (TMA_ARGS, e.g. "--head-dims 64 --config fwd_{dtype}_d{d}_...").
#
# sanitize: compute-sanitizer's memcheck over tools/sanitizer_sweep.py (every kernel family
# at small sizes with tails), racecheck and synccheck over its tensor-map sizes (" S").
#
# ablation: builds tools/ablation.py's knob variants into .dev/ablation (sm_90), runs the
# per-config correctness tests on them and times each variant against its base.
#
# Extra pytest arguments go in PYTEST_ARGS, extra arguments of the forward bench in BENCH_ARGS,
# of the other suites in SUITE_ARGS (e.g. SUITE_ARGS="--seqlens 1024,4096"), extra
# tools/ablation.py bench arguments in ABLATION_ARGS.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cudaflash-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=${*:-test bench train}
steps=${steps/suites/decode backward varlen window softcap kvcache}

# The shipped cubins' assembler: CUDA 12.9's ptxas (the nvidia-cuda-nvcc-cu12 wheel; the
# device cannot reach the registry, so carry the binary as .dev/ptxas12/ptxas). Without it
# the build uses the ptxas beside nvcc (CUDA 13 cubins, R580+ only).
if [[ -z ${CUDAFLASH_PTXAS:-} && -x .dev/ptxas12/ptxas ]]; then
    export CUDAFLASH_PTXAS=$PWD/.dev/ptxas12/ptxas
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv \
    | tee "$OUT/gpu.txt"
python3 build_cubins.py -j16 > "$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
grep -E "^WARNING|^wrote" "$OUT/build.log" | tail -20

rc=0
for step in $steps; do
    case $step in
    test)
        python3 -m pytest -q -rs tests ${PYTEST_ARGS:-} > "$OUT/pytest.log" 2>&1 || rc=1
        grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/pytest.log" | tail -40 ;;
    bench)
        python3 -m cudaflash bench --dtype bf16,fp16 --json "$OUT/bench.json" \
            --plot "$OUT/bench.png" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1 || rc=1
        cat "$OUT/bench.log" ;;
    decode)
        python3 -m cudaflash bench --suite decode --dtype bf16 --json "$OUT/decode.json" \
            --plot "$OUT/decode.png" --no-host ${SUITE_ARGS:-} > "$OUT/decode.log" 2>&1 || rc=1
        cat "$OUT/decode.log" ;;
    train|backward)
        python3 -m cudaflash bench --suite "$step" --dtype bf16,fp16 --json "$OUT/$step.json" \
            --plot "$OUT/$step.png" ${SUITE_ARGS:-} > "$OUT/$step.log" 2>&1 || rc=1
        cat "$OUT/$step.log" ;;
    varlen|window|softcap|alibi|dropout|kvcache)
        python3 -m cudaflash bench --suite "$step" --json "$OUT/$step.json" \
            --plot "$OUT/$step.png" ${SUITE_ARGS:-} > "$OUT/$step.log" 2>&1 || rc=1
        cat "$OUT/$step.log" ;;
    tma)
        PYTHONPATH=. python3 tools/tma_ab.py ${TMA_ARGS:-} > "$OUT/tma-ab.log" 2>&1 || rc=1
        cat "$OUT/tma-ab.log" ;;
    tune)
        python3 -m cudaflash tune --out "$OUT/tuned-sm90.yaml" > "$OUT/tune.log" 2>&1 || rc=1
        cat "$OUT/tune.log" ;;
    ablation)
        python3 tools/ablation.py yaml "$OUT/ablation.yaml"
        if python3 build_cubins.py -j16 --configs "$OUT/ablation.yaml" --out .dev/ablation \
                --archs 90 > "$OUT/ablation-build.log" 2>&1; then
            grep -E "^WARNING|^wrote" "$OUT/ablation-build.log" | tail -40
            CUDAFLASH_KERNEL_DIR=.dev/ablation python3 -m pytest -q \
                tests/test_gpu_correctness.py -k test_config > "$OUT/ablation-pytest.log" 2>&1 || rc=1
            grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/ablation-pytest.log" | tail -20
            CUDAFLASH_KERNEL_DIR=.dev/ablation PYTHONPATH=. python3 tools/ablation.py bench \
                --json "$OUT/ablation.json" ${ABLATION_ARGS:-} > "$OUT/ablation.log" 2>&1 || rc=1
            cat "$OUT/ablation.log"
        else
            tail -40 "$OUT/ablation-build.log"; rc=1
        fi ;;
    sanitize)
        # memcheck over every kernel family (tools/sanitizer_sweep.py), each tensor its own
        # allocation; then racecheck and synccheck over the warp-specialized sizes. API errors
        # are not reported: cuda-bindings' driver loader probes cuGetProcAddress for symbols
        # the driver may lack, and memcheck counted each failed probe as an error.
        for tool in memcheck racecheck synccheck; do
            only=$([[ $tool == memcheck ]] && echo "" || echo " S")
            PYTORCH_NO_CUDA_MEMORY_CACHING=1 PYTHONPATH=. compute-sanitizer --tool $tool \
                --report-api-errors no \
                --print-limit 20 python3 tools/sanitizer_sweep.py --only "$only" \
                > "$OUT/sanitize-$tool.log" 2>&1 || rc=1
            grep -E "REFUSED|calls ran|ERROR SUMMARY|RACECHECK SUMMARY" "$OUT/sanitize-$tool.log"
        done ;;
    *) echo "unknown step $step"; exit 2 ;;
    esac
done
exit $rc
