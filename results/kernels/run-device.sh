#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# What produced the files in this folder, on the lent H200 (no vLLM
# installed there): build hisparse_ops against the machine's torch, run the
# kernel tests, then the benchmark.
#
# usage (repo root, GPU machine): results/kernels/run-device.sh OUTDIR [pytest args]
#   env PYTHON (default python3), BENCH_ARGS (extra scripts/bench-kernels args)
#
# vllm.v1.hisparse.{kernels,reference} import only torch, so a shim package
# (empty vllm/__init__.py + the overlay's hisparse folder) stands in for vLLM.
set -uo pipefail
out=${1:?usage: run-device.sh OUTDIR [pytest args]}
shift
py=${PYTHON:-python3}
build=/tmp/hisparse-build
shim=/tmp/hisparse-shim
mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
  nvcc --version | tail -1
} 2>&1 | tee "$out/env.txt"

timeout 300 scripts/build-kernels.sh --python "$py" --out "$build" \
  --ptxas-verbose 2>&1 | tee "$out/build.log" || { echo "build failed"; exit 1; }

rm -rf "$shim" && mkdir -p "$shim/vllm/v1"
touch "$shim/vllm/__init__.py" "$shim/vllm/v1/__init__.py"
cp -r overlay/vllm/v1/hisparse "$shim/vllm/v1/"
export PYTHONPATH="$build:$shim" PYTHONUNBUFFERED=1

status=0
timeout 330 "$py" -m pytest tests/hisparse/kernels -q -p no:cacheprovider -rs \
  --durations=12 "$@" 2>&1 | tee "$out/pytest.log" || status=1
timeout 240 "$py" scripts/bench-kernels --out "$out/bench-kernels.json" \
  ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" || status=1
exit $status
