#!/usr/bin/env bash
# Run every CPU test tier against the installed patched vLLM (scripts/build.sh).
#
# usage: scripts/test.sh [--only tooling|hisparse|upstream|kernels]... [--venv DIR]
#   tooling   tests/unit: apply/stack/export/validate/fetch on real patches
#   hisparse  tests/hisparse: the project's own tests (GPU tests skip cleanly)
#   upstream  vLLM's own suites listed in ci/upstream-suites.txt (target T3)
#   kernels   compile-only build of the CUDA kernels when nvcc is present
# Any extra arguments after -- go to every pytest call.
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
failed=()

if wants tooling; then
  pytest_ "$HS_ROOT/tests/unit" || failed+=(tooling)
fi
if wants hisparse; then
  (cd "$HS_ROOT" && pytest_ -p cpu_noclean "${sample[@]}" tests/hisparse) || failed+=(hisparse)
fi
if wants upstream; then
  # Run the suites from a copy of the patched tree's tests/ so that `vllm`
  # is imported from the installed wheel, not from the source tree.
  suites=$HS_WORK/upstream-tests
  rm -rf "$suites"; mkdir -p "$suites"
  cp -r "$tree/tests" "$tree/pyproject.toml" "$suites/"
  plain=()
  while read -r line; do
    [[ -z "$line" || "$line" == \#* ]] && continue
    if [[ "$line" == *" "* ]]; then
      eval "args=($line)"
      (cd "$suites" && pytest_ -p cpu_noclean "${sample[@]}" "${args[@]}") || failed+=("upstream:${args[0]}")
    else
      plain+=("$line")
    fi
  done < "$HS_ROOT/ci/upstream-suites.txt"
  (cd "$suites" && pytest_ -p cpu_noclean "${sample[@]}" "${plain[@]}") || failed+=(upstream)
fi
if wants kernels; then
  if command -v nvcc >/dev/null && [[ -x "$HS_ROOT/scripts/build-kernels.sh" ]]; then
    hs_run "$HS_ROOT/scripts/build-kernels.sh" --compile-only --python "$py" || failed+=(kernels)
  else
    hs_log "kernels: skipped (no nvcc or no scripts/build-kernels.sh)"
  fi
fi

if [[ ${#failed[@]} -gt 0 ]]; then
  hs_die "failed tiers: ${failed[*]}"
fi
hs_log "all requested tiers passed: ${only[*]}"
