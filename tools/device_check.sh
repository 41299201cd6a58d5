#!/usr/bin/env bash
# One call on the GPU machine: build every cubin (-j16), run the whole pytest suite (GPU tests
# included) and the benchmark; full logs under $OUT (default /tmp/cudaflash-out).
#
#   tools/device_check.sh [test] [bench] [decode] [tune]     (no argument: test and bench)
#
# Extra pytest arguments go in PYTEST_ARGS, extra bench arguments in BENCH_ARGS.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cudaflash-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=${*:-test bench}

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
        python3 -m cudaflash bench --decode --dtype bf16 --json "$OUT/decode.json" \
            --plot "$OUT/decode.png" --no-host ${BENCH_ARGS:-} > "$OUT/decode.log" 2>&1 || rc=1
        cat "$OUT/decode.log" ;;
    tune)
        python3 -m cudaflash tune --out "$OUT/tuned-sm90.yaml" > "$OUT/tune.log" 2>&1 || rc=1
        cat "$OUT/tune.log" ;;
    *) echo "unknown step $step"; exit 2 ;;
    esac
done
exit $rc
