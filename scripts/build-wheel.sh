#!/usr/bin/env bash
# Build the GPU wheel users pip-install: vllm-<VERSION>-cp38-abi3-linux_x86_64.whl
# in precompiled mode (the pinned, hash-checked upstream wheel's compiled
# extensions + the patched Python) with the HiSparse kernels compiled in as
# vllm/_hisparse_C.abi3.so (sm_90a machine code, sm_80 + compute_80 PTX:
# overlay/csrc/hisparse/build.py's targets), which vllm/v1/hisparse/kernels.py
# loads when no standalone hisparse_ops build is installed. Needs nvcc (CUDA
# 13), no GPU.
#
# usage: scripts/build-wheel.sh [--out DIR] [--jobs N] [--gencode G]...
#   --out DIR     where the wheel goes (default: dist/gpu)
#   --jobs N      parallel nvcc jobs (default: nproc)
#   --gencode G   nvcc -gencode values instead of build.py's defaults
# Steps: prerequisites (gpu tier) -> fetch.sh --wheel -> apply.sh into
# work/wheel/vllm -> build venv work/wheel/venv with torch 2.11.0 (CUDA build,
# hash-pinned in ci/torch-gpu.txt) and the tree's requirements/build/cuda.txt
# -> kernels -> `pip wheel` (VLLM_TARGET_DEVICE=cuda, --py-limited-api=cp38)
# -> add the kernels, regenerate RECORD -> wheeltool.py check.
# Outputs: DIR/<wheel>, DIR/<wheel>.sha256, DIR/build-info.json.
source "$(dirname "$0")/lib.sh"

out=$HS_ROOT/dist/gpu jobs=$(nproc) gencode=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --out) hs_need 'a directory' "$@"; out=$2; shift ;;
    --jobs) hs_need 'a number' "$@"; jobs=$2; shift ;;
    --gencode) hs_need 'a value' "$@"; gencode+=(--gencode "$2"); shift ;;
    -h|--help) hs_usage; exit 0 ;;
    *) hs_die "unknown argument: $1" ;;
  esac
  shift
done
hs_positive_int --jobs "$jobs"
out=$(realpath -m "$out")
wdir=$HS_WORK/wheel
tree=$wdir/vllm venv=$wdir/venv
export PIP_CACHE_DIR=${PIP_CACHE_DIR:-$HS_CACHE/pip}

"$HS_ROOT/scripts/prereqs.sh" --tier gpu
"$HS_ROOT/scripts/fetch.sh" --wheel
pinned=$HS_CACHE/pin/$VLLM_WHEEL_FILE
"$HS_ROOT/scripts/apply.sh" --to "$tree" --force

# The build venv: what vLLM's own CUDA build requires (requirements/build/
# cuda.txt, torch == 2.11.0 among them) + cuobjdump for the check. torch comes
# first, hash-checked and without dependencies; then its CUDA runtime
# packages with the rest (setup.py imports torch to read torch.version.cuda).
cuobjdump_req="nvidia-cuda-cuobjdump==13.2.78"
stamp=$(cat "$HS_ROOT/ci/torch-gpu.txt" "$tree/requirements/build/cuda.txt" <(echo "$cuobjdump_req") | sha256sum | cut -c1-16)
if [[ "$(cat "$venv/.hisparse-deps" 2>/dev/null)" != "$stamp" ]]; then
  rm -rf "$venv"
  hs_run "$HS_PY" -m venv "$venv"
  hs_run "$venv/bin/python" -m pip install -q --upgrade pip
  hs_run "$venv/bin/python" -m pip install -q --no-deps --require-hashes -r "$HS_ROOT/ci/torch-gpu.txt"
  hs_run "$venv/bin/python" -m pip install -q -r "$tree/requirements/build/cuda.txt" "$cuobjdump_req"
  echo "$stamp" > "$venv/.hisparse-deps"
else
  hs_log "build venv $venv is up to date"
fi
py=$venv/bin/python
torch_v=$(cd /tmp && "$py" -c 'import torch; print(torch.__version__, torch.version.cuda)')
[[ "${torch_v%% *}" =~ ^${TORCH_GPU_VERSION//./\.}(\+.*)?$ && "$torch_v" != *" None" ]] \
  || hs_die "build venv torch is '$torch_v', expected $TORCH_GPU_VERSION with CUDA"
cuobjdump=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia/cu13/bin/cuobjdump
[[ -x "$cuobjdump" ]] || cuobjdump=$(command -v cuobjdump || true)

# Kernels against that torch, linked like vLLM's own extensions.
rm -rf "$wdir/kernels"; mkdir -p "$wdir/kernels"
hs_run "$py" "$HS_ROOT/scripts/wheeltool.py" kernels --tree "$tree" --out "$wdir/kernels/_hisparse_C.abi3.so" \
  --jobs "$jobs" "${gencode[@]}"

# The Python wheel in precompiled mode: the pinned wheel's compiled members
# are extracted by vLLM's own setup.py (VLLM_PRECOMPILED_WHEEL_LOCATION).
rm -rf "$wdir/py"
(cd "$tree" && VLLM_TARGET_DEVICE=cuda VLLM_VERSION_OVERRIDE=$HS_VERSION VLLM_PRECOMPILED_WHEEL_LOCATION=$pinned \
  hs_run "$py" -m pip wheel -q --no-deps --no-build-isolation \
    --config-settings=--build-option=--py-limited-api=cp38 -w "$wdir/py" .)
pywheel=$(ls "$wdir/py"/vllm-*.whl)

mkdir -p "$out"
rm -f "$out/vllm-$HS_VERSION"-*.whl "$out/vllm-$HS_VERSION"-*.whl.sha256
wheel=$(hs_run "$py" "$HS_ROOT/scripts/wheeltool.py" assemble --wheel "$pywheel" \
  --add "vllm/_hisparse_C.abi3.so=$wdir/kernels/_hisparse_C.abi3.so" --out-dir "$out" \
  --plat "$HS_GPU_WHEEL_PLAT")
[[ "$(basename "$wheel")" == "$HS_GPU_WHEEL_NAME" ]] || hs_die "built $(basename "$wheel"), expected $HS_GPU_WHEEL_NAME"
hs_run "$py" "$HS_ROOT/scripts/wheeltool.py" check --wheel "$wheel" --pinned "$pinned" --version "$HS_VERSION" \
  --overlay "$HS_OVERLAY" ${cuobjdump:+--cuobjdump "$cuobjdump"} --json "$out/check.json"
(cd "$out" && sha256sum "$(basename "$wheel")" > "$(basename "$wheel").sha256")

series_sha=$(hs_series_sha)
overlay_sha=$(hs_overlay_sha)
commit=$(git -C "$HS_ROOT" rev-parse HEAD 2>/dev/null || echo unknown)
"$HS_PY" - "$out/build-info.json" "$wdir/kernels/_hisparse_C.abi3.json" <<EOF
import json, sys
json.dump({"version": "$HS_VERSION", "wheel": "$(basename "$wheel")",
           "sha256": "$(cut -d' ' -f1 "$wheel.sha256")", "pin": "$VLLM_VERSION",
           "pinned_wheel": "$VLLM_WHEEL_FILE", "pinned_wheel_sha256": "$VLLM_WHEEL_SHA256",
           "series_sha": "$series_sha", "overlay_sha": "$overlay_sha", "commit": "$commit",
           "tree_head": "$(hs_git -C "$tree" rev-parse HEAD)",
           "kernels": json.load(open(sys.argv[2]))}, open(sys.argv[1], "w"), indent=1)
EOF
echo "GPU wheel: $wheel"
echo "sha256:    $(cut -d' ' -f1 "$wheel.sha256")"
