#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# Run 6 (fewer shared-memory atomics in the resolver, K1), on the GPU
# machine, in one device call. The device call that produced
# results/kernels (run 6) was exactly
#
#   set -o pipefail; PYTHONUNBUFFERED=1 timeout 400 \
#     results/kernels/p1-run6-device.sh $OUT 2>&1 | tee $OUT/log
#
# (no carry: every candidate is the working tree's resolve_residency.cu with
# other -D switches; "base", no switches, is the committed run-5 kernel, whose
# SASS the switch-free source reproduces bit for bit.)
#  1. builds, for sm_90a and in parallel, the candidates below
#     (scripts/build-kernels.sh --define ...);
#  2. per candidate: the 33 resolver GPU tests (bit-exact against the CPU
#     reference, corrupted state included), then scripts/bench-kernels at
#     batch 64 (all_resident, all_hit, miss_10, --skip-gather); then two more
#     timing passes over the candidates whose tests passed (reverse order,
#     then forward), so drift does not favour one candidate;
#  3. picks, among candidates whose tests passed, the best worst-case ratio
#     to the P1 limits (all-resident / 10 us, all-hit / 25 us, 10% misses /
#     30 us; median of the passes); scores within 0.01 of the best tie, and
#     a tie goes to the candidate with fewer switches;
#  4. with the chosen build: the whole kernel test folder, the full
#     benchmark, the per-phase clock of the same switches plus
#     HISPARSE_PHASE_CLOCK=1 (built while the tests run), and, if time is
#     left, compute-sanitizer memcheck/racecheck on two small resolver cases.
# Everything the run keeps is in OUTDIR (8 files: log, variants.log,
# variants.json, pytest-gpu.log, bench.log, bench-kernels.json,
# phase-clock.txt, sanitizer.log).
#
# usage (repo root, GPU machine): results/kernels/p1-run6-device.sh OUTDIR
set -uo pipefail
out=${1:?usage: p1-run6-device.sh OUTDIR}
py=${PYTHON:-python3}
shim=/tmp/hisparse-shim
rm -rf "$shim" && mkdir -p "$shim/vllm/v1"
touch "$shim/vllm/__init__.py" "$shim/vllm/v1/__init__.py"
cp -r overlay/vllm/v1/hisparse "$shim/vllm/v1/"
export PYTHONPATH="$shim" PYTHONUNBUFFERED=1
echo "=== env"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
nvcc --version | tail -1
echo "=== $(date -u +%FT%TZ) build"

names=(base nofilter scan scan_first scan_first_nofilter scan_first_bytefilter)
declare -A defs=(
  [base]=""
  [nofilter]="HISPARSE_MISS_FILTER=0"
  [scan]="HISPARSE_SCAN_PLAIN=1"
  [scan_first]="HISPARSE_SCAN_PLAIN=1 HISPARSE_FIRST_PLAIN=1"
  [scan_first_nofilter]="HISPARSE_SCAN_PLAIN=1 HISPARSE_FIRST_PLAIN=1 HISPARSE_MISS_FILTER=0"
  [scan_first_bytefilter]="HISPARSE_SCAN_PLAIN=1 HISPARSE_FIRST_PLAIN=1 HISPARSE_MISS_FILTER=2"
)
gc=(--gencode arch=compute_90a,code=sm_90a --jobs 2)
build() {  # build NAME "DEFINES"
  local d args=()
  for d in $2; do args+=(--define "$d"); done
  timeout 150 scripts/build-kernels.sh --python "$py" --out "/tmp/hs-$1" \
    "${gc[@]}" "${args[@]}" > "/tmp/hs-$1.build.log" 2>&1
}
for name in "${names[@]}"; do build "$name" "${defs[$name]}" & done
wait
for name in "${names[@]}"; do
  echo "build $name: $(tail -1 /tmp/hs-$name.build.log | cut -c1-90)"
done
echo "=== $(date -u +%FT%TZ) variants (${SECONDS}s)"

log=$out/variants.log
: > "$log"
t=tests/hisparse/kernels/test_kernels_gpu.py
bench() {  # bench NAME PASS
  HISPARSE_OPS_LIBRARY=/tmp/hs-$1/hisparse_ops/_hisparse_ops.so timeout 45 \
    "$py" scripts/bench-kernels --batches 64 \
    --scenarios all_resident,all_hit,miss_10 --skip-gather --replays 11 \
    --out "/tmp/variant-$1.pass$2.json" 2>&1 | grep "^resolver" \
    | sed "s/^/pass $2 $1: /" >> "$log"
}
ok=()
for name in "${names[@]}"; do
  lib=/tmp/hs-$name/hisparse_ops/_hisparse_ops.so
  echo "=== $name: ${defs[$name]:-no switches (the committed run-5 kernel)}" >> "$log"
  [[ -f $lib ]] || { tail -20 "/tmp/hs-$name.build.log" >> "$log"; continue; }
  (( SECONDS < 200 )) || { echo "skipped: out of time" >> "$log"; continue; }
  if HISPARSE_OPS_LIBRARY=$lib timeout 60 "$py" -m pytest -q -p no:cacheprovider \
      "$t::test_resolve_fuzz_matches_reference" "$t::test_resolve_corrupted_state" \
      "$t::test_resolve_is_deterministic" "$t::test_k14_multistep_fuzz" \
      >> "$log" 2>&1; then
    ok+=("$name")
    bench "$name" 1
  fi
  tail -5 "$log" | cut -c1-110
done
for pass in 2 3; do
  (( SECONDS < 230 )) || { echo "pass $pass skipped: out of time" | tee -a "$log"; break; }
  if (( pass == 2 )); then
    order=(); for (( i=${#ok[@]}-1; i>=0; i-- )); do order+=("${ok[$i]}"); done
  else
    order=("${ok[@]}")
  fi
  for name in "${order[@]}"; do bench "$name" "$pass"; done
  echo "=== pass $pass done (${SECONDS}s)"
done
best=$("$py" - "$out/variants.json" "${ok[@]}" <<'PY'
import glob, json, statistics, sys
out, names = sys.argv[1], sys.argv[2:]
limits = {"all_resident": 10.0, "all_hit": 25.0, "miss_10": 30.0}
switches = {"base": 0, "nofilter": 1, "scan": 1, "scan_first": 2,
            "scan_first_nofilter": 3, "scan_first_bytefilter": 3}
rows = {}
for name in names:
    passes = []
    for path in sorted(glob.glob(f"/tmp/variant-{name}.pass*.json")):
        res = json.load(open(path))["resolver"]
        passes.append({r["scenario"]: r["us_per_launch_graph_median"]
                       for r in res if r["batch"] == 64})
    if not passes or any(all(s not in p for p in passes) for s in limits):
        continue
    med = {s: statistics.median(p[s] for p in passes if s in p)
           for s in limits}
    score = max(med[s] / limits[s] for s in limits)
    rows[name] = {"passes": passes, "median": med, "score": score,
                  "switches": switches.get(name, 9)}
best_score = min(r["score"] for r in rows.values())
tied = [n for n, r in rows.items() if r["score"] <= best_score + 0.01]
best = min(tied, key=lambda n: (rows[n]["switches"], rows[n]["score"]))
json.dump({"chosen": best, "rule": "min over candidates whose 33 resolver "
           "tests passed of max(all_resident/10, all_hit/25, miss_10/30) "
           "(batch 64, us per launch, median over passes); scores within "
           "0.01 of the best tie; ties -> fewest switches",
           "tied": tied, "variants": rows}, open(out, "w"), indent=1)
for n, r in rows.items():
    m = r["median"]
    print(f"# {n:24s} score {r['score']:.3f}  res {m['all_resident']:.2f}  "
          f"hit {m['all_hit']:.2f}  miss10 {m['miss_10']:.2f}  "
          f"({len(r['passes'])} passes)", file=sys.stderr)
print(best)
PY
)
echo "=== chosen: ${best:-none}" | tee -a "$log"
[[ -n $best ]] || { echo "no candidate passed"; exit 1; }
lib=/tmp/hs-$best/hisparse_ops/_hisparse_ops.so
echo "--- build log of $best"; cat "/tmp/hs-$best.build.log"
build phase "${defs[$best]} HISPARSE_PHASE_CLOCK=1" &
phase_pid=$!
echo "=== $(date -u +%FT%TZ) full suite (${SECONDS}s)"
HISPARSE_OPS_LIBRARY=$lib timeout 120 "$py" -m pytest tests/hisparse/kernels -q \
  -p no:cacheprovider -rs --durations=10 > "$out/pytest-gpu.log" 2>&1
echo "=== full suite exit $?" | tee -a "$log"
tail -3 "$out/pytest-gpu.log"
wait "$phase_pid"
echo "=== $(date -u +%FT%TZ) full bench (${SECONDS}s)"
HISPARSE_OPS_LIBRARY=$lib timeout 120 "$py" scripts/bench-kernels \
  --out "$out/bench-kernels.json" > "$out/bench.log" 2>&1
echo "=== bench exit $?" | tee -a "$log"
grep -E "^resolver|^gather" "$out/bench.log"
echo "=== $(date -u +%FT%TZ) phase clock (${SECONDS}s): ${defs[$best]} HISPARSE_PHASE_CLOCK=1"
tail -1 /tmp/hs-phase.build.log | cut -c1-90
HISPARSE_OPS_LIBRARY=/tmp/hs-phase/hisparse_ops/_hisparse_ops.so timeout 60 \
  "$py" results/kernels/phase-clock.py "$out/phase-clock.txt"
if (( SECONDS < 300 )); then
  echo "=== $(date -u +%FT%TZ) sanitizer (${SECONDS}s)"
  cases=("$t::test_resolve_fuzz_matches_reference[65-2]"
         "$t::test_resolve_corrupted_state[33]")
  for tool in memcheck racecheck; do
    echo "=== compute-sanitizer --tool $tool ($best)" >> "$out/sanitizer.log"
    HISPARSE_OPS_LIBRARY=$lib timeout $(( (380 - SECONDS) / 2 )) \
      compute-sanitizer --tool "$tool" --error-exitcode 9 \
      "$py" -m pytest -q -p no:cacheprovider "${cases[@]}" \
      >> "$out/sanitizer.log" 2>&1
    echo "=== exit $?" >> "$out/sanitizer.log"
  done
  grep -E "^===|ERROR SUMMARY|RACECHECK SUMMARY|passed|failed" "$out/sanitizer.log"
fi
echo "=== $(date -u +%FT%TZ) done (${SECONDS}s)"
grep -E "^===|passed|failed|^pass" "$log"
