#!/usr/bin/env bash
# Install the GPU wheel on a GPU host and run the kernel GPU tests against the
# ops it ships. For a host with torch 2.11 (CUDA) and no network: nothing is
# downloaded, vLLM's dependencies are not installed (--no-deps), only the
# wheel goes into a fresh --target folder, which alone is put on PYTHONPATH.
#
# usage: scripts/check-gpu-wheel.sh WHEEL            the wheel itself
#        scripts/check-gpu-wheel.sh --carried DIR    what `--pack DIR` wrote
#        scripts/check-gpu-wheel.sh --pack DIR [WHEEL]
#   --pack DIR     (on the build machine) write DIR/<wheel> without the
#                  compiled members it shares byte for byte with the pinned
#                  upstream wheel, plus DIR/carry.json (the full wheel's
#                  RECORD and sha256): ~20 MB instead of ~300 MB, so a GPU call
#                  can carry it. The kernel extension and all Python stay.
#   --carried DIR  verify DIR against carry.json first (every member equal to
#                  the full wheel's), then check it like a wheel.
#   --python PY    the host's interpreter (default: python3)
#   --results DIR  write the pytest log, junit XML and a summary here
#   --no-gpu-tests stop after install + import + locating the kernel library
#                  (what a CPU machine can check; the GPU stage needs CUDA)
#   --upstream-binaries DIR  (with --carried) a vllm/ folder holding the
#                  compiled upstream members the slim wheel leaves out (on
#                  the GPU host: the bundle's /root/stage/base/vllm-bin/vllm);
#                  they are copied into the target after the install, so that
#                  `import vllm` finds _C_stable_libtorch. The wheel's own
#                  members, _hisparse_C included, are never replaced.
# The ops must come from the installed wheel's vllm/_hisparse_C*.so:
# HISPARSE_OPS_LIBRARY is unset, and an importable hisparse_ops package
# (which the loader would prefer) is an error. A run where any GPU test
# skipped fails: the tests skip without the ops, which must not pass.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
log() { printf '[check-gpu-wheel.sh] %s\n' "$*" >&2; }
die() { printf '[check-gpu-wheel.sh] error: %s\n' "$*" >&2; exit 1; }
# lib.sh's hs_need and hs_usage, inlined: lib.sh is sourced for --pack only
need() { [[ -n ${3-} && $3 != -* ]] || die "$2 needs $1"; }
usage() { awk 'NR == 1 || /^# SPDX-/ { next } !/^#/ { exit } { sub(/^# ?/, ""); if (NF || n) { print; n++ } }' "$0"; }
py=python3 wheel="" carried="" pack="" results="" gpu_tests=1 upstream=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --carried) need 'a directory' "$@"; carried=$2; shift ;;
    --pack) need 'a directory' "$@"; pack=$2; shift ;;
    --python) need 'an interpreter' "$@"; py=$2; shift ;;
    --results) need 'a directory' "$@"; results=$2; shift ;;
    --no-gpu-tests) gpu_tests=0 ;;
    --upstream-binaries) need 'a directory' "$@"; upstream=$2; shift ;;
    -h|--help) usage; exit 0 ;;
    -*) echo "[check-gpu-wheel.sh] error: unknown argument: $1" >&2; exit 2 ;;
    *) wheel=$1 ;;
  esac
  shift
done
run() { printf '+ %s\n' "$*" >&2; "$@"; }
version=$(tr -d '[:space:]' < "$here/VERSION")

if [[ -n "$pack" ]]; then
  # shellcheck source=lib.sh
  source "$here/scripts/lib.sh"
  [[ -n "$wheel" ]] || wheel=$HS_ROOT/dist/gpu/$HS_GPU_WHEEL_NAME
  [[ -f "$wheel" ]] || die "no GPU wheel (run scripts/build-wheel.sh) or name one"
  rm -rf "$pack"
  run "$HS_PY" "$here/scripts/wheeltool.py" slim --wheel "$wheel" --pinned "$HS_CACHE/pin/$VLLM_WHEEL_FILE" --out-dir "$pack" >/dev/null
  log "packed $(du -sh "$pack" | cut -f1) into $pack: carry it and run scripts/check-gpu-wheel.sh --carried $pack"
  exit 0
fi

if [[ -n "$carried" ]]; then
  run "$py" "$here/scripts/wheeltool.py" verify-slim --dir "$carried"
  wheel=$(ls "$carried"/vllm-*.whl)
fi
[[ -n "$wheel" ]] || die "no wheel given (usage: scripts/check-gpu-wheel.sh WHEEL | --carried DIR)"
[[ -f "$wheel" ]] || die "no such wheel: $wheel"
[[ "$(basename "$wheel")" == "vllm-$version-"* ]] || die "$(basename "$wheel") is not vllm $version (VERSION)"

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
target=$scratch/site
run "$py" -m pip install -q --no-deps --no-index --no-compile --disable-pip-version-check --target "$target" "$wheel"
if [[ -n "$upstream" ]]; then
  [[ -n "$carried" ]] || die "--upstream-binaries completes a --carried (slim) wheel only"
  [[ -d "$upstream" ]] || die "--upstream-binaries $upstream is not a directory"
  added=0
  for so in "$upstream"/*.so; do
    name=$(basename "$so")
    if [[ ! -e "$target/vllm/$name" ]]; then cp "$so" "$target/vllm/$name"; added=$((added + 1)); fi
  done
  log "added $added upstream binaries from $upstream (not the wheel's; the wheel's own members kept)"
fi

unset HISPARSE_OPS_LIBRARY
export PYTHONPATH=$target PYTHONNOUSERSITE=1
# Import from the target, locate the kernel library the loader will use.
run "$py" - "$target" "$version" "$gpu_tests" <<'EOF'
import importlib.util, os, sys
target, version, gpu = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
import vllm
from vllm.v1.hisparse import kernels
where = os.path.dirname(vllm.__file__)
assert where == os.path.join(target, "vllm"), f"vllm imported from {where}, not the target"
assert vllm.__version__ == version, f"vllm {vllm.__version__}, expected {version}"
if importlib.util.find_spec("hisparse_ops") is not None:
    sys.exit("a hisparse_ops package is importable here and would shadow the wheel's kernels")
libs = kernels._in_tree_libraries()
assert libs == [os.path.join(where, "_hisparse_C.abi3.so")], f"kernel libraries found: {libs}"
print(f"vllm {vllm.__version__} from {where}; kernel library {libs[0]}")
if gpu:
    import torch
    assert torch.__version__.startswith("2.11."), f"torch {torch.__version__}: the wheel is built for 2.11"
    assert torch.cuda.is_available(), "no CUDA device"
    kernels.require_ops()
    loaded = [p for p in torch.ops.loaded_libraries if "_hisparse_C" in p]
    assert loaded and all(p.startswith(target) for p in loaded), f"ops loaded from {loaded}"
    name = torch.cuda.get_device_name()
    cap = torch.cuda.get_device_capability()
    print(f"torch {torch.__version__} on {name} (sm_{cap[0]}{cap[1]}); ops loaded from {loaded[0]}")
EOF
if [[ $gpu_tests == 0 ]]; then
  log "install + import ok; GPU tests not run (--no-gpu-tests)"
  exit 0
fi

res=${results:-$scratch/results}
mkdir -p "$res"
# From the repository root (conftest and the case builders live in tests/),
# importing vllm from the target only.
set +e
(cd "$here" && run "$py" -m pytest -p no:cacheprovider -q -rs \
  --junitxml="$res/junit-kernels-gpu.xml" tests/hisparse/kernels/test_kernels_gpu.py) 2>&1 | tee "$res/pytest-kernels-gpu.log"
rc=${PIPESTATUS[0]}
set -e
summary=$("$py" - "$res/junit-kernels-gpu.xml" <<'EOF'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
s = root if root.tag == "testsuite" else root.find("testsuite")
print(" ".join(f"{k}={s.get(k)}" for k in ("tests", "failures", "errors", "skipped")))
EOF
)
echo "$summary" > "$res/summary.txt"
log "kernel GPU tests: $summary (pytest exit $rc)"
[[ $rc == 0 ]] || die "kernel GPU tests failed"
[[ "$summary" == *"skipped=0"* ]] || die "some kernel GPU tests skipped: the ops were not usable"
[[ "$summary" != *"tests=0"* ]] || die "no kernel GPU test ran"
log "GPU wheel check passed: $(basename "$wheel")"
