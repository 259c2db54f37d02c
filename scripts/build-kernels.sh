#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# Build the standalone hisparse_ops CUDA extension (spec 2.1 "Build").
#
# usage: scripts/build-kernels.sh [--compile-only] [--python PY] [--out DIR]
#                                 [--gencode arch=compute_XX,code=sm_XX]... [--ptxas-verbose]
#                                 [--define NAME=VALUE]... [--jobs N]
#
#   --compile-only  nvcc -c every overlay/csrc/hisparse/*.cu|*.cpp into
#                   DIR/obj (default build/hisparse_ops/obj) and stop: no GPU,
#                   no CUDA torch, no link. CI uses this so a kernel that does
#                   not compile fails the build.
#   --python PY     interpreter whose torch the extension is built against and
#                   whose site-packages receive the package (default: the
#                   repository's .venv/bin/python, made by scripts/build.sh).
#   --out DIR       put objects in DIR/obj and the package in DIR/hisparse_ops
#                   instead of installing into site-packages.
#   --gencode, --define, --jobs, --ptxas-verbose go to build.py as they are.
#
# How the overlay finds the result (vllm/v1/hisparse/kernels.py), in order:
#   1. $HISPARSE_OPS_LIBRARY = path to _hisparse_ops.so;
#   2. the importable package `hisparse_ops` (installed into site-packages by
#      default, or on PYTHONPATH when built with --out);
#   3. vllm/_hisparse_C*.so from a full vLLM source build (hisparse.cmake).
set -euo pipefail

# Standalone: the GPU bundle ships this file without lib.sh.
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
die() { printf '[build-kernels.sh] error: %s\n' "$*" >&2; exit 2; }  # every error here is about the arguments or the setup
need() { [[ -n ${3-} && $3 != -* ]] || die "$2 needs $1"; }  # lib.sh's hs_need
# lib.sh's hs_usage: the header comment above, without the '#'.
usage() { awk 'NR == 1 || /^# SPDX-/ { next } !/^#/ { exit } { sub(/^# ?/, ""); if (NF || n) { print; n++ } }' "$0"; }

python="" jobs="" args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) need 'an interpreter' "$@"; python=$2; shift 2 ;;
    --python=*) python="${1#*=}"; shift ;;
    --compile-only|--ptxas-verbose) args+=("$1"); shift ;;
    --jobs) need 'a number' "$@"; jobs=$2; shift 2 ;;
    --jobs=*) jobs=${1#*=}; shift ;;
    --out|--gencode|--define) need 'a value' "$@"; args+=("$1" "$2"); shift 2 ;;
    --out=*|--gencode=*|--define=*) args+=("$1"); shift ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument: $1" ;;
  esac
done
if [[ -n "$jobs" ]]; then
  [[ $jobs =~ ^[1-9][0-9]*$ ]] || die "--jobs must be a positive integer, got '$jobs'"
  args+=(--jobs "$jobs")
fi
if [[ -z "$python" ]]; then
  python=$here/.venv/bin/python
  [[ -x "$python" ]] || die "no .venv/bin/python: run scripts/build.sh first (or pass --python PY)"
fi
command -v "$python" >/dev/null || die "--python: no interpreter '$python'"

# Objects land in <repo>/build/hisparse_ops (ignored) unless --out says else.
args=(--build-dir "$here/build/hisparse_ops" "${args[@]}")
echo "+ $python $here/overlay/csrc/hisparse/build.py ${args[*]}"
exec "$python" "$here/overlay/csrc/hisparse/build.py" "${args[@]}"
