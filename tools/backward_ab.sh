#!/usr/bin/env bash
# A/B of backward modules in one GPU call, on one build: the backward suite with the manifest
# as built (A), then with the modules whose name contains MATCH changed (B), alternating
# ROUNDS times. Logs under $OUT (default /tmp/cudaflash-out); the kernels must be built.
#
#   tools/backward_ab.sh MATCH [ROUNDS]     e.g. tools/backward_ab.sh _ws 2
#
# B is, by default, the manifest without those modules (the runtime then takes the next
# module configs.yaml lists for the scheme). With B_SRC=DIR, B keeps every module but rebuilds
# the matching ones (sm_90) from the kernel sources in DIR: an A/B of two source versions of
# one kernel (carry DIR, e.g. `git archive HEAD cuda_src | tar -x -C .dev/ab-src`).
#
# Extra arguments of the suite in SUITE_ARGS (default: bf16, d 64 and 128, S 1024..16384,
# cudaflash and cudnn). AB_SUITE / AB_PHASE pick another suite and the phase compared (default
# backward / backward; a forward A/B: AB_SUITE=train AB_PHASE=forward SUITE_ARGS="... --phases
# forward"). B_SRC rebuilds forward and backward modules alike.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/cudaflash-out}
match=${1:?usage: tools/backward_ab.sh MATCH [ROUNDS]}
rounds=${2:-2}
kernels=cudaflash/kernels
rm -rf .dev/ab-b .dev/ab-b-build
mkdir -p "$OUT" .dev/ab-b
if [[ -n ${B_SRC:-} ]]; then
    # B: a copy of the kernels, the matching modules' files and manifest entries replaced.
    python3 build_cubins.py -j16 --src "$B_SRC" --only "$match" --archs 90 \
        --out .dev/ab-b-build > "$OUT/ab-b-build.log" 2>&1 || { tail -30 "$OUT/ab-b-build.log"; exit 1; }
    cp -r "$kernels"/. .dev/ab-b/
else
    # B: the same files, a manifest without the matching modules (links, not copies).
    for d in "$kernels"/*/; do ln -sfn "$PWD/$d" ".dev/ab-b/$(basename "$d")"; done
fi
python3 - "$kernels/manifest.json" .dev/ab-b "$match" "${B_SRC:+.dev/ab-b-build}" <<'PY'
import json, shutil, sys
from pathlib import Path
m = json.load(open(sys.argv[1]))
b_dir, match, rebuilt = Path(sys.argv[2]), sys.argv[3], sys.argv[4]
if rebuilt:
    new = json.load(open(Path(rebuilt) / "manifest.json"))
    for family in ("kernels", "backward_kernels"):
        by_key = {(k["name"], k["arch"], k["kind"]): k for k in new[family]}
        for i, k in enumerate(m[family]):
            if (k["name"], k["arch"], k["kind"]) in by_key:
                m[family][i] = by_key.pop((k["name"], k["arch"], k["kind"]))
                shutil.copyfile(Path(rebuilt) / k["file"], b_dir / k["file"])
                print(f"B rebuilds {k['name']} sm_{k['arch']}")
else:
    before = len(m["backward_kernels"])
    m["backward_kernels"] = [k for k in m["backward_kernels"] if match not in k["name"]]
    print(f"B hides {before - len(m['backward_kernels'])} backward modules matching {match!r}")
json.dump(m, open(b_dir / "manifest.json", "w"), indent=1)
PY
args=${SUITE_ARGS:---dtype bf16 --head-dims 64,128 --seqlens 1024,2048,4096,8192,16384 --backends cudaflash,cudnn}
suite=${AB_SUITE:-backward}
phase=${AB_PHASE:-backward}
rc=0
for r in $(seq "$rounds"); do
    for side in A B; do
        dir=$kernels; [[ $side == B ]] && dir=.dev/ab-b
        echo "== round $r, $side ($dir)"
        # shellcheck disable=SC2086  # the argument list is meant to split into words
        CUDAFLASH_KERNEL_DIR=$dir timeout 150 python3 -m cudaflash bench --suite "$suite" $args \
            --json "$OUT/ab-$side$r.json" > "$OUT/ab-$side$r.log" 2>&1 || rc=1
        grep -E "^ *(bf16|fp16) " "$OUT/ab-$side$r.log"
    done
done
python3 - "$OUT" "$rounds" "$phase" <<'PY'
import json, statistics, sys
out, rounds, phase = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def rows(side):
    per = {}
    for r in range(1, rounds + 1):
        for row in json.load(open(f"{out}/ab-{side}{r}.json"))["results"]:
            key = (row["dtype"], row["d"], row["causal"], row["S"])
            per.setdefault(key, []).append(row["phases"][phase]["cudaflash"]["tflops"])
    return {k: statistics.median(v) for k, v in per.items()}
a, b = rows("A"), rows("B")
print(f"A/B of cudaflash {phase} TFLOP/s (median over rounds)")
ratios = []
for k in sorted(a):
    ratios.append(a[k] / b[k])
    print(*k, f"A {a[k]:.1f}  B {b[k]:.1f}  A/B {a[k] / b[k]:.3f}")
print(f"A/B: median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}")
PY
exit $rc
