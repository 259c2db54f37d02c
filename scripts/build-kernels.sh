#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# Build the standalone hisparse_ops CUDA extension (spec 2.1 "Build").
#
# usage: scripts/build-kernels.sh [--compile-only] [--python PY] [--out DIR]
#                                 [--gencode arch=compute_XX,code=sm_XX]... [--ptxas-verbose]
#
#   --compile-only  nvcc -c every overlay/csrc/hisparse/*.cu|*.cpp into
#                   DIR/obj (default build/hisparse_ops/obj) and stop: no GPU,
#                   no CUDA torch, no link. CI uses this so a kernel that does
#                   not compile fails the build.
#   --python PY     interpreter whose torch the extension is built against and
#                   whose site-packages receive the package (default: python3).
#   --out DIR       put objects in DIR/obj and the package in DIR/hisparse_ops
#                   instead of installing into site-packages.
#
# How the overlay finds the result (vllm/v1/hisparse/kernels.py), in order:
#   1. $HISPARSE_OPS_LIBRARY = path to _hisparse_ops.so;
#   2. the importable package `hisparse_ops` (installed into site-packages by
#      default, or on PYTHONPATH when built with --out);
#   3. vllm/_hisparse_C*.so from a full vLLM source build (hisparse.cmake).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python=python3
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --python) python="$2"; shift 2 ;;
    --python=*) python="${1#*=}"; shift ;;
    -h|--help) sed -n '5,23p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) args+=("$1"); shift ;;
  esac
done

# Objects land in <repo>/build/hisparse_ops (ignored) unless --out says else.
args=(--build-dir "$here/build/hisparse_ops" "${args[@]}")
echo "+ $python $here/overlay/csrc/hisparse/build.py ${args[*]}"
exec "$python" "$here/overlay/csrc/hisparse/build.py" "${args[@]}"
