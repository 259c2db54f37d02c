#!/usr/bin/env bash
# Run the GPU test tiers ON the lent GPU machine, from the root of the carried
# working tree, against the bundle of scripts/bundle.sh (docs/workflow.md
# "GPU bundle").
#
# usage: scripts/test-gpu.sh [--bundle DIR] [--stage DIR] [--only TIER[,TIER...]]
#                            [--print-env] [--allow-stale] [--rebuild-kernels]
#   --bundle DIR       the parts + bundle.json (default .gpu/bundle)
#   --stage DIR        where they are unpacked (default /root/stage); the base
#                      is unpacked once per machine (skipped while its sha
#                      matches), the patch part on every call
#   --only T,...       tiers among kernels,gpu,e2e,serve (default: all four)
#   --print-env        set the stage up (unpack, kernels), then print only
#                      `export ...` lines for: eval "$(scripts/test-gpu.sh --print-env)"
#   --allow-stale      run although overlay/ or patches/ differ from the bundle's
#   --rebuild-kernels  ignore the prebuilt kernels and the build cache
# Tiers:
#   kernels  python3 -m pytest tests/hisparse/kernels -q
#   gpu      python3 -m pytest -m gpu tests/hisparse when a `gpu` marker is
#            registered; otherwise every tests/hisparse/**/test_*_gpu.py (the
#            project's GPU tests are those files plus the `gpu_kernels` skip
#            fixture of tests/hisparse/kernels/conftest.py), less those the
#            kernels tier already ran in this call
#   e2e      python3 tests/e2e/run_e2e.py --out "$OUT/e2e" $E2E_ARGS   (if present)
#   serve    python3 tests/e2e/serve_check.py --out "$OUT/serve" $SERVE_ARGS (if present)
# A GPU test that skips for "no CUDA device" or a missing extension fails its
# tier here. Without a CUDA GPU it prints why, does nothing else and exits 0.
# Logs: $OUT/test-gpu.log and $OUT/test-gpu.json (else under the stage).
# Exit status: non-zero if any requested tier (or the setup) failed, after
# running all requested tiers.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# lib.sh's hs_need and hs_usage (this script runs without lib.sh)
need() { [[ -n ${3-} && $3 != -* ]] || { echo "test-gpu.sh: error: $2 needs $1" >&2; exit 2; }; }
usage() { awk 'NR == 1 || /^# SPDX-/ { next } !/^#/ { exit } { sub(/^# ?/, ""); if (NF || n) { print; n++ } }' "$0"; }
bundle=$root/.gpu/bundle stage=/root/stage only=kernels,gpu,e2e,serve
print_env=0 allow_stale=0 rebuild=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --bundle) need 'a directory' "$@"; bundle=$2; shift ;;
    --stage) need 'a directory' "$@"; stage=$2; shift ;;
    --only) need 'tiers' "$@"; only=$2; shift ;;
    --print-env) print_env=1 ;;
    --allow-stale) allow_stale=1 ;;
    --rebuild-kernels) rebuild=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "test-gpu.sh: error: unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
IFS=, read -r -a tiers <<<"$only"
for t in "${tiers[@]}"; do
  case $t in kernels|gpu|e2e|serve) ;; *) echo "test-gpu.sh: error: unknown tier '$t'" >&2; exit 2 ;; esac
done
wants() { [[ ",$only," == *",$1,"* ]]; }

# Progress goes to stdout, except with --print-env: then stdout (fd 3) gets
# only shell and everything else goes to stderr.
if [[ $print_env == 1 ]]; then exec 3>&1 1>&2; else exec 3>&1; fi
t0=$(date +%s)
say() {
  local line
  line=$(printf '[test-gpu +%ss %s] %s' "$(( $(date +%s) - t0 ))" "$(date -u +%H:%M:%S)" "$*")
  echo "$line"
  [[ -n "${log:-}" ]] && echo "$line" >> "$log"
  return 0
}

# 0. A CUDA GPU, or nothing at all.
py=${HISPARSE_GPU_PYTHON:-$(command -v python3 || true)}
why=""
if ! command -v nvidia-smi >/dev/null 2>&1; then
  why="no nvidia-smi"
elif ! nvidia-smi -L >/dev/null 2>&1; then
  why="nvidia-smi sees no GPU"
elif [[ -z "$py" ]]; then
  why="no python3"
elif ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  why="torch.cuda is not available to $py"
fi
if [[ -n "$why" ]]; then
  [[ $print_env == 1 ]] && echo "# test-gpu.sh: skipped ($why): nothing to export" >&3
  echo "test-gpu.sh: skipped: $why"
  exit 0
fi

logdir=${OUT:-$stage/logs}
mkdir -p "$logdir" "$stage"
log=$logdir/test-gpu.log
: > "$log"
setup_failed=()
results=()   # "tier status seconds"

# 1. Unpack: base once per machine, patch every call.
manifest=$bundle/bundle.json
[[ -f "$manifest" ]] || { say "no $manifest: run scripts/bundle.sh here and carry .gpu/bundle"; exit 1; }
# the manifest's fields as m_* shell variables (one interpreter start)
eval "$("$py" - "$manifest" <<'EOF'
import json, shlex, sys
m = json.load(open(sys.argv[1]))
pre = m["patch"].get("prebuilt_kernels") or {}
for k, v in {"version": m["version"], "commit": m["git_commit"][:12],
             "base_sha": m["base"]["sha256"], "series_sha": m["series_sha"],
             "overlay_sha": m["overlay_sha"], "ksha": m["patch"]["kernel_sources_sha"],
             "prebuilt_ksha": pre.get("sources_sha", ""),
             "base_files": " ".join(p["file"] for p in m["base"]["parts"]),
             "patch_files": " ".join(p["file"] for p in m["patch"]["parts"])}.items():
    print(f"m_{k}={shlex.quote(str(v))}")
EOF
)" || { say "cannot read $manifest"; exit 1; }
say "GPU: $(nvidia-smi -L | head -1); python $py; bundle $m_version (commit $m_commit)"
unpack() {  # unpack KIND DEST: verify each part, extract all into DEST
  local kind=$1 dest=$2 files f
  files=$m_base_files
  [[ $kind == patch ]] && files=$m_patch_files
  if ! "$py" "$root/scripts/gpu_bundle.py" verify "$bundle" --kind "$kind" >>"$log" 2>&1; then
    say "$kind parts missing or damaged (see $log):"; tail -5 "$log"
    [[ $kind == base ]] && say "this machine has no unpacked base yet: carry .gpu/bundle (all parts) in this call"
    return 1
  fi
  rm -rf "$dest.tmp" && mkdir -p "$dest.tmp"
  for f in $files; do
    tar -xJf "$bundle/$f" -C "$dest.tmp" || { say "cannot unpack $f"; return 1; }
  done
  rm -rf "$dest" && mv "$dest.tmp" "$dest"
}
if [[ "$(cat "$stage/base/.bundle-sha" 2>/dev/null)" == "$m_base_sha" ]]; then
  say "base: already unpacked in $stage/base"
else
  say "base: unpacking into $stage/base"
  unpack base "$stage/base" || exit 1
  echo "$m_base_sha" > "$stage/base/.bundle-sha"
  say "base: $(du -sh "$stage/base" | cut -f1) unpacked"
fi
say "patch: unpacking into $stage/patch"
unpack patch "$stage/patch" || exit 1
# the base's precompiled members (.so files, vendored kernels) go inside the
# patched vllm/ package: hard links, the two file sets are disjoint
if ! cp -al "$stage/base/vllm-bin/vllm/." "$stage/patch/site/vllm/" 2>>"$log"; then
  cp -a "$stage/base/vllm-bin/vllm/." "$stage/patch/site/vllm/" || { say "cannot merge the base into vllm/"; exit 1; }
fi
site=$stage/patch/site

# 2. The bundle must be what this working tree holds (lib.sh's
#    hs_series_sha / hs_overlay_sha, inlined: this script runs without lib.sh).
if [[ -d "$root/patches" && -d "$root/overlay" ]]; then
  series_sha=$( (LC_ALL=C; cat "$root/patches/series" "$root/patches"/*.patch 2>/dev/null) | sha256sum | cut -c1-16)  # C: the glob order
  overlay_sha=$("$py" "$root/scripts/patchtool.py" manifest --root "$root" | sha256sum | cut -c1-16)
  if [[ "$series_sha" != "$m_series_sha" || "$overlay_sha" != "$m_overlay_sha" ]]; then
    if [[ $allow_stale == 1 ]]; then
      say "WARNING: the bundle is stale (patches/ or overlay/ changed since scripts/bundle.sh); --allow-stale"
    else
      say "the bundle is stale: patches/ or overlay/ changed since scripts/bundle.sh ran; rebuild it (or --allow-stale)"
      exit 1
    fi
  fi
fi

# 3. Environment (also what --print-env prints).
cuda_home=${CUDA_HOME:-}
if [[ -z "$cuda_home" ]] && command -v nvcc >/dev/null; then cuda_home=$(dirname "$(dirname "$(command -v nvcc)")"); fi
[[ -z "$cuda_home" && -x /usr/local/cuda/bin/nvcc ]] && cuda_home=/usr/local/cuda
mkdir -p "$stage/bin" "$stage/cache"
# The guard: a multiprocessing spawn child re-runs this file as __mp_main__,
# which must not start the CLI again.
printf '#!%s\n# vllm CLI of the GPU bundle (scripts/test-gpu.sh)\nimport sys\nfrom vllm.entrypoints.cli.main import main\n\nif __name__ == "__main__":\n    sys.exit(main())\n' "$py" > "$stage/bin/vllm"
chmod +x "$stage/bin/vllm"
env_lines=()
setenv() { export "$1=$2"; env_lines+=("export $1=$(printf '%q' "$2")"); }
kdir=""  # set below
set_env() {
  setenv PYTHONPATH "${kdir:+$kdir:}$site:$stage/base/site${base_pythonpath:+:$base_pythonpath}"
  setenv PATH "$stage/bin:$base_path"
}
base_pythonpath=${PYTHONPATH:-} base_path=$PATH
set_env
setenv HISPARSE_STAGE "$stage"
setenv HISPARSE_GPU_PYTHON "$py"
setenv VLLM_CACHE_ROOT "$stage/cache/vllm"
setenv DG_JIT_CACHE_DIR "$stage/cache/deep_gemm"
setenv TRITON_CACHE_DIR "$stage/cache/triton"
setenv TORCHINDUCTOR_CACHE_DIR "$stage/cache/inductor"
[[ -n "$cuda_home" ]] && setenv CUDA_HOME "$cuda_home"
setenv VLLM_USE_FLASHINFER_SAMPLER 0   # flashinfer is not in the bundle
setenv HF_HUB_OFFLINE 1
setenv TRANSFORMERS_OFFLINE 1
setenv VLLM_NO_USAGE_STATS 1
setenv DO_NOT_TRACK 1
setenv PYTHONUNBUFFERED 1
# never NVLink multicast on these hosts (KINDS.md)
setenv NCCL_NVLS_ENABLE 0
setenv TORCH_SYMM_MEM_DISABLE_MULTICAST 1
setenv NVSHMEM_DISABLE_NVLS 1

# 4. Kernels: the prebuilt package if it works here, else built on the machine.
ksha=$m_ksha
tver=$("$py" -c 'import torch; print(torch.__version__)' 2>/dev/null)
smoke() { PYTHONPATH="$1${base_pythonpath:+:$base_pythonpath}" "$py" "$root/scripts/gpu_prebuild.py" smoke >>"$log" 2>&1; }
if [[ $rebuild == 0 && -d "$stage/patch/prebuilt/hisparse_ops" && \
      "$m_prebuilt_ksha" == "$ksha" ]]; then
  if smoke "$stage/patch/prebuilt"; then
    kdir=$stage/patch/prebuilt
    say "kernels: prebuilt hisparse_ops loads and runs here ($(tail -1 "$log"))"
  else
    say "kernels: the prebuilt hisparse_ops failed its smoke test here (see $log); building"
  fi
fi
if [[ -z "$kdir" ]]; then
  kb=$stage/hisparse_ops_build
  want="$ksha torch=$tver $("$cuda_home/bin/nvcc" --version 2>/dev/null | tail -1)"
  if [[ $rebuild == 0 && -f "$kb/hisparse_ops/__init__.py" && "$(cat "$kb/.sources" 2>/dev/null)" == "$want" ]]; then
    say "kernels: unchanged since the last build on this machine ($kb)"
    kdir=$kb
  else
    say "kernels: building with scripts/build-kernels.sh --python $py --out $kb"
    rm -rf "$kb"
    kout=$stage/kernels-build.log
    if bash "$stage/patch/kernels/scripts/build-kernels.sh" --python "$py" --out "$kb" >"$kout" 2>&1; then
      cat "$kout" >> "$log"
      echo "$want" > "$kb/.sources"
      kdir=$kb
      say "kernels: built"
    else
      cat "$kout" >> "$log"
      say "kernels: BUILD FAILED (tail of its output; all of it in $log):"; tail -20 "$kout"
      setup_failed+=(kernels-build)
    fi
  fi
  if [[ -n "$kdir" ]] && ! smoke "$kdir"; then
    say "kernels: the built hisparse_ops failed its smoke test (see $log)"
    setup_failed+=(kernels-smoke)
  fi
fi
set_env

# 5. What vLLM requires that this machine lacks (information; excluded
#    packages are not shipped on purpose, see scripts/gpu-bundle/excluded.txt).
rm -f "$stage/requirements.json"
if envcheck=$("$py" "$root/scripts/gpu_bundle.py" env-check --manifest "$manifest" \
                --json-out "$stage/requirements.json" 2>>"$log"); then
  say "requirements: $envcheck"
else
  say "requirements: vllm's metadata is not importable (see $log)"
  setup_failed+=(env)
fi

if [[ $print_env == 1 ]]; then
  {
    echo "# scripts/test-gpu.sh --print-env: $m_version, stage $stage"
    printf '%s\n' "${env_lines[@]}"
    [[ ${#setup_failed[@]} -eq 0 ]] || echo "# setup problems: ${setup_failed[*]}"
  } >&3
  [[ ${#setup_failed[@]} -eq 0 ]] || exit 1
  exit 0
fi

# 6. Tiers.
cd "$root" || exit 1
tier_out=$(mktemp)
trap 'rm -f "$tier_out"' EXIT
run_tier() {  # run_tier NAME CMD...: output to stdout, the log and $tier_out
  local name=$1 s; shift
  s=$(date +%s)
  say "tier $name: $*"
  "$@" 2>&1 | tee -a "$log" > "$tier_out"
  tier_rc=${PIPESTATUS[0]}
  cat "$tier_out"
  tier_secs=$(( $(date +%s) - s ))
}
# A GPU test that skips for want of the GPU or of the extension is a failure here.
gpu_skips() { grep -E '^SKIPPED .*(no CUDA device|extension not available)' "$tier_out" | head -5; }
record() { results+=("$1 $2 $3"); say "tier $1: $2 (${3}s)"; }
pytest_tier() {  # pytest_tier NAME ARGS...
  local name=$1; shift
  run_tier "$name" "$py" -m pytest -q -rs -p no:cacheprovider "$@"
  if [[ $tier_rc == 5 ]]; then
    record "$name" "failed(no-tests-collected)" "$tier_secs"
  elif [[ $tier_rc != 0 ]]; then
    record "$name" "failed(rc=$tier_rc)" "$tier_secs"
  elif [[ -n "$(gpu_skips)" ]]; then
    say "tier $name: GPU tests skipped on a GPU machine:"; gpu_skips
    record "$name" "failed(gpu-tests-skipped)" "$tier_secs"
  else
    record "$name" passed "$tier_secs"
  fi
}

ran_kernels=0
if wants kernels; then
  pytest_tier kernels tests/hisparse/kernels
  ran_kernels=1
fi
if wants gpu; then
  if "$py" -m pytest --markers -p no:cacheprovider tests/hisparse 2>/dev/null | grep -qE '^@pytest\.mark\.gpu[:(]'; then
    pytest_tier gpu -m gpu tests/hisparse
  else
    mapfile -t files < <(find tests/hisparse -name 'test_*_gpu.py' | LC_ALL=C sort)
    sel=()
    for f in "${files[@]}"; do
      if [[ $ran_kernels == 1 && $f == tests/hisparse/kernels/* ]]; then
        say "tier gpu: $f already ran in the kernels tier"
      else
        sel+=("$f")
      fi
    done
    if [[ ${#sel[@]} -gt 0 ]]; then
      pytest_tier gpu "${sel[@]}"
    elif [[ ${#files[@]} -gt 0 ]]; then
      record gpu "covered(by-kernels-tier)" 0
    else
      record gpu "skipped(no-test_*_gpu.py)" 0
    fi
  fi
fi
for t in e2e serve; do
  wants "$t" || continue
  script=tests/e2e/run_e2e.py args=${E2E_ARGS:-}
  [[ $t == serve ]] && script=tests/e2e/serve_check.py args=${SERVE_ARGS:-}
  if [[ ! -f "$script" ]]; then
    record "$t" "skipped(no-$script)" 0
    continue
  fi
  mkdir -p "$logdir/$t"
  # shellcheck disable=SC2086  # E2E_ARGS / SERVE_ARGS are word lists
  run_tier "$t" "$py" "$script" --out "$logdir/$t" $args
  if [[ $tier_rc == 0 ]]; then record "$t" passed "$tier_secs"; else record "$t" "failed(rc=$tier_rc)" "$tier_secs"; fi
done

# 7. Summary (last lines of the output: the device tool shows the tail).
status=0
[[ ${#setup_failed[@]} -eq 0 ]] || status=1
for r in "${results[@]}"; do [[ "$r" == *" failed"* ]] && status=1; done
"$py" - "$logdir/test-gpu.json" "$manifest" "$kdir" "$status" "${setup_failed[*]:-}" "${results[@]}" <<'EOF'
import json, os, sys
out, manifest, kdir, status, setup = sys.argv[1:6]
m = json.load(open(manifest))
req = os.path.join(os.environ["HISPARSE_STAGE"], "requirements.json")
req = json.load(open(req)) if os.path.exists(req) else None
tiers = {}
for r in sys.argv[6:]:
    name, st, secs = r.split(" ")
    tiers[name] = {"status": st, "seconds": int(secs)}
json.dump({"status": "passed" if status == "0" else "failed", "setup_failed": setup.split(),
           "tiers": tiers, "kernels": kdir, "requirements": req, "bundle": {k: m[k] for k in
           ("version", "git_commit", "git_dirty", "series_sha", "overlay_sha")}},
          open(out, "w"), indent=1)
EOF
say "summary ($logdir/test-gpu.json):"
for r in "${results[@]}"; do say "  $r"; done
[[ ${#setup_failed[@]} -eq 0 ]] || say "  setup failed: ${setup_failed[*]}"
say "$([[ $status == 0 ]] && echo PASSED || echo FAILED)"
exit $status
