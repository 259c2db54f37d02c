#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
#
# Where the resolver's time goes, and memory/race checks, on the GPU machine.
# Run after results/kernels/run-device.sh (it uses that build and shim).
#
# usage (repo root, GPU machine): results/kernels/profile-device.sh OUTDIR
#   ncu_details.txt / ncu_source.csv  Nsight Compute, one steady-state launch
#       of resolve_residency at batch 64, top_k 2048, hot 2x, 10% misses
#       (stall reasons per CUDA source line; the build uses -lineinfo)
#   sanitizer.log  compute-sanitizer memcheck and racecheck on small fuzz
#       cases of every kernel
set -uo pipefail
out=${1:?usage: profile-device.sh OUTDIR}
py=${PYTHON:-python3}
export PYTHONPATH="/tmp/hisparse-build:/tmp/hisparse-shim" PYTHONUNBUFFERED=1
rep=/tmp/resolve_b64_miss10
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
timeout 150 "$ncu" --clock-control none --kernel-name regex:resolve_residency \
  --launch-skip 8 --launch-count 1 --set full --import-source yes -f -o "$rep" \
  "$py" scripts/bench-kernels --batches 64 --scenarios miss_10 --steps 4 \
  --replays 1 --out /tmp/ncu-bench.json > "$out/ncu_run.txt" 2>&1
"$ncu" --import "$rep.ncu-rep" --page details > "$out/ncu_details.txt" 2>&1
"$ncu" --import "$rep.ncu-rep" --page source --csv --print-source cuda \
  > "$out/ncu_source.csv" 2>&1
tail -5 "$out/ncu_run.txt" >> "$out/ncu_details.txt"

t=tests/hisparse/kernels/test_kernels_gpu.py
cases=("$t::test_resolve_fuzz_matches_reference[65-2]"
       "$t::test_resolve_fuzz_matches_reference[33-5]"
       "$t::test_resolve_corrupted_state[33]"
       "$t::test_gather_plan_matches_reference[True-True]"
       "$t::test_k10_invalidate_matches_reference[31-2]"
       "$t::test_k11_copy_descriptors_equals_copy_engine")
for tool in memcheck racecheck; do
  echo "=== compute-sanitizer --tool $tool" >> "$out/sanitizer.log"
  timeout 150 compute-sanitizer --tool "$tool" --error-exitcode 9 \
    "$py" -m pytest -q -p no:cacheprovider "${cases[@]}" \
    >> "$out/sanitizer.log" 2>&1
  echo "=== exit $?" >> "$out/sanitizer.log"
done
