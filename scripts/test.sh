#!/usr/bin/env bash
# Run every CPU test tier against the installed patched vLLM (scripts/build.sh).
#
# usage: scripts/test.sh [--only tooling|hisparse|upstream|kernels]... [--venv DIR]
#   tooling   tests/unit: apply/stack/export/validate/fetch on real patches
#   hisparse  tests/hisparse: the project's own tests (GPU tests skip cleanly)
#   upstream  vLLM's own suites listed in ci/upstream-suites.txt (target T3)
#   kernels   compile-only build of the CUDA kernels when nvcc is present
# Any extra arguments after -- go to every pytest call.
# On two cores or more the tooling tier runs beside the others (below);
# HISPARSE_TEST_LANES=1 runs every tier one after the other.
source "$(dirname "$0")/lib.sh"

venv=$HS_ROOT/.venv only=() extra=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --only) hs_need 'a tier' "$@"; only+=("$2"); shift ;;
    --venv) hs_need 'a directory' "$@"; venv=$2; shift ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) hs_usage; exit 0 ;;
    *) hs_die "unknown argument: $1" ;;
  esac
  shift
done
tiers=(tooling hisparse upstream kernels)
for t in "${only[@]}"; do
  [[ " ${tiers[*]} " == *" $t "* ]] || hs_die "--only: unknown tier '$t' (${tiers[*]})"
done
[[ ${#only[@]} -gt 0 ]] || only=("${tiers[@]}")
wants() { [[ " ${only[*]} " == *" $1 "* ]]; }
py=$venv/bin/python
[[ -x "$py" ]] || hs_die "no venv at $venv: run scripts/build.sh first"
# The tooling tier drives git and stgit: the same check build.sh made (it
# links what it installed into .cache/tools/bin, first on PATH via lib.sh).
"$HS_ROOT/scripts/prereqs.sh" --check >/dev/null

# The installed build must be the series and overlay in this checkout.
build_json=$venv/hisparse-build.json
[[ -f "$build_json" ]] || hs_die "$venv has no HiSparse build: run scripts/build.sh first"
series_sha=$(hs_series_sha)
overlay_sha=$(hs_overlay_sha)
grep -q "\"series_sha\": \"$series_sha\"" "$build_json" && grep -q "\"overlay_sha\": \"$overlay_sha\"" "$build_json" \
  || hs_die "the installed build is stale (patches/ or overlay/ changed since): re-run scripts/build.sh"
tree=$("$HS_PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["tree"])' "$build_json")

# Offline model configs for the suites that build a ModelConfig.
export HF_HOME=$HS_CACHE/hf HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
[[ -f "$HF_HOME/.hisparse-fake" ]] || { bash "$HS_ROOT/ci/cpu_test_harness/make_fake_hf_cache.sh" >/dev/null; touch "$HF_HOME/.hisparse-fake"; }
export PYTHONPATH=$HS_ROOT/ci/cpu_test_harness${PYTHONPATH:+:$PYTHONPATH}
# A passing test's tmp_path is removed as it ends: the tooling tier's fresh
# clone and GPU wheel take several GB each, and CI machines vary in disk.
pytest_() { hs_run "$py" -m pytest -p no:cacheprovider -o tmp_path_retention_policy=failed \
  -q "$@" "${extra[@]}"; }
# Inside tests/unit/test_fresh_clone.py's nested run the hisparse and
# upstream tiers run the first test of each module (ci/cpu_test_harness/
# fresh_clone_sample.py): the outer run, which runs them all, is the caller.
sample=()
[[ ${HISPARSE_FRESH_CLONE:-} == 1 ]] && sample=(-p fresh_clone_sample)
# Each tier's failures go to one file, so that a tier run in the second
# lane (below) reports them too.
fails=$(mktemp) lanes_pids=()
# The lanes (below) must not outlive this script: a CI timeout or ^C stops
# their pytest too. Both run in the background and the script waits on them,
# so that a signal reaches this trap at once (bash runs traps only between
# foreground commands).
kill_tree() { local c; for c in $(pgrep -P "$1" 2>/dev/null); do kill_tree "$c"; done; kill "$1" 2>/dev/null || true; }
stop_lanes() { local p; for p in "${lanes_pids[@]}"; do kill -0 "$p" 2>/dev/null && kill_tree "$p"; done; true; }
trap 'stop_lanes; rm -f "$fails"' EXIT
trap 'exit 130' INT TERM
fail() { echo "$1" >> "$fails"; }

# The GPU wheel's build (tests/unit/test_gpu_wheel.py, ~5 min of nvcc and
# pip) is the tooling tier's one part that can run apart from the rest.
wheel_tests=$HS_ROOT/tests/unit/test_gpu_wheel.py
run_tooling() { pytest_ "$HS_ROOT/tests/unit" "$@" || fail tooling; }
run_wheel() { pytest_ "$wheel_tests" || fail tooling; }
run_hisparse() { (cd "$HS_ROOT" && pytest_ -p cpu_noclean "${sample[@]}" tests/hisparse) || fail hisparse; }
run_upstream() {
  # Run the suites from a copy of the patched tree's tests/ so that `vllm`
  # is imported from the installed wheel, not from the source tree.
  local suites=$HS_WORK/upstream-tests line plain=() args
  rm -rf "$suites"; mkdir -p "$suites"
  cp -r "$tree/tests" "$tree/pyproject.toml" "$suites/"
  while read -r line; do
    [[ -z "$line" || "$line" == \#* ]] && continue
    if [[ "$line" == *" "* ]]; then
      eval "args=($line)"
      (cd "$suites" && pytest_ -p cpu_noclean "${sample[@]}" "${args[@]}") || fail "upstream:${args[0]}"
    else
      plain+=("$line")
    fi
  done < "$HS_ROOT/ci/upstream-suites.txt"
  (cd "$suites" && pytest_ -p cpu_noclean "${sample[@]}" "${plain[@]}") || fail upstream
}
run_kernels() {
  if command -v nvcc >/dev/null && [[ -x "$HS_ROOT/scripts/build-kernels.sh" ]]; then
    hs_run "$HS_ROOT/scripts/build-kernels.sh" --compile-only --python "$py" || fail kernels
  else
    hs_log "kernels: skipped (no nvcc or no scripts/build-kernels.sh)"
  fi
}
run_rest() {
  if wants hisparse; then run_hisparse; fi
  if wants upstream; then run_upstream; fi
  if wants kernels; then run_kernels; fi
}

# Two lanes where the machine has two cores or more (CI's has two; pytest
# uses one): the tooling tier, which the fresh-clone test makes the longest
# (29 min in CI), beside the GPU wheel's tests and the other tiers, whose log
# is shown when both lanes are done. The lanes write to different places: the
# tooling tests to their own tmp folders, the wheel to work/wheel, the
# upstream tier to work/upstream-tests, the kernels to build/. They share
# only pip's download cache (the fresh clone's build and the wheel's build
# venv), which pip writes atomically. Inside the
# fresh-clone test's nested run the tiers run one after the other (the
# outer run's lanes already use both cores).
lanes=1
if wants tooling && [[ ${HISPARSE_FRESH_CLONE:-} != 1 && ${HISPARSE_TEST_LANES:-2} != 1 ]] \
   && (( $(nproc) >= 2 )); then
  lanes=2
fi
if (( lanes == 2 )); then
  lane_log=$HS_WORK/test-lane2.log
  mkdir -p "$HS_WORK"
  hs_log "two lanes: tooling here; the GPU wheel's tests and the other requested tiers beside it (log: $lane_log)"
  ( run_wheel; run_rest ) > "$lane_log" 2>&1 &
  lanes_pids+=($!)
  run_tooling --ignore="$wheel_tests" &
  lanes_pids+=($!)
  wait "${lanes_pids[1]}" || fail "tooling lane (exit status $?)"
  wait "${lanes_pids[0]}" || fail "lane 2 (exit status $?)"
  echo "=== lane 2 (ran beside the tooling tier): the GPU wheel's tests and the other tiers"
  cat "$lane_log"
else
  if wants tooling; then run_tooling; fi
  run_rest
fi
mapfile -t failed < <(sort -u "$fails")

if [[ ${#failed[@]} -gt 0 ]]; then
  hs_die "failed tiers: ${failed[*]}"
fi
hs_log "all requested tiers passed: ${only[*]}"
