#!/usr/bin/env bash
# Run several steps in one device call, each under its own time limit, so one
# step that hangs or dies does not cost the others (a device call has one
# limit for all of it, and a machine held idle is given back within ~30 s).
#
# usage: scripts/device-steps.sh NAME:LIMIT=COMMAND [NAME:LIMIT=COMMAND ...]
#   NAME      the step's name: a letter or digit, then letters, digits, '.', '_' or '-'
#   LIMIT     its time limit, as timeout(1) reads it (300, 5m)
#   COMMAND   a bash command line, run from the current directory with OUT
#             set to the step's own folder
# Each step's stdout and stderr go to its folder's log.txt; after it, the
# vLLM engine processes it left are killed, its log's last lines printed and
# its folder packed into $OUT/NAME.tar.xz. $OUT/steps.txt gets one line per
# step: "== NAME rc=STATUS SECONDSs" (status 124: the limit was reached).
# Every argument is checked before the first step runs.
# Environment:
#   OUT                the call's output folder (required)
#   DEVICE_STEPS_WORK  where the step folders are made (default /tmp/device-steps)
#   DEVICE_STEPS_KILL  the pkill -f pattern run after each step (default: vLLM's
#                      engine cores and `vllm serve`; empty: none). The
#                      default is bracketed so that it never matches this
#                      script's own command line.
# Exit status: 0 if every step exited 0, else 1.
source "$(dirname "$0")/lib.sh"

step_re='^([A-Za-z0-9][A-Za-z0-9._-]*):([0-9]+[smhd]?)=(.+)$'
steps=() names=" "
for arg in "$@"; do
  case $arg in
    -h|--help) hs_usage; exit 0 ;;
    -*) hs_die "unknown argument: $arg" ;;
  esac
  [[ $arg =~ $step_re ]] || hs_die "not NAME:LIMIT=COMMAND: $arg"
  # one tar per name: a second step of the name would overwrite the first's
  [[ $names != *" ${BASH_REMATCH[1]} "* ]] || hs_die "step name used twice: ${BASH_REMATCH[1]}"
  names+="${BASH_REMATCH[1]} "
  steps+=("$arg")
done
[[ ${#steps[@]} -gt 0 ]] || hs_die "usage: scripts/device-steps.sh NAME:LIMIT=COMMAND ..."
[[ -n ${OUT-} ]] || hs_die "OUT is not set (the device call's output folder)"
mkdir -p "$OUT"
work=${DEVICE_STEPS_WORK:-/tmp/device-steps}
kill_pattern=${DEVICE_STEPS_KILL-"EngineCor[e]|vllm [s]erve"}

failed=0
for step in "${steps[@]}"; do
  [[ $step =~ $step_re ]]
  name=${BASH_REMATCH[1]} limit=${BASH_REMATCH[2]} cmd=${BASH_REMATCH[3]}
  dir=$work/$name
  rm -rf "$dir" && mkdir -p "$dir"
  t0=$(date +%s)
  rc=0
  ( export OUT=$dir; timeout -k 10 "$limit" bash -c "$cmd" ) > "$dir/log.txt" 2>&1 || rc=$?
  echo "== $name rc=$rc $(( $(date +%s) - t0 ))s" | tee -a "$OUT/steps.txt"
  [[ $rc -eq 0 ]] || failed=1
  if [[ -n $kill_pattern ]] && pkill -9 -f "$kill_pattern"; then
    sleep 2  # the killed engines' GPU memory is freed before the next step
  fi
  tail -15 "$dir/log.txt"
  tar -cJf "$OUT/$name.tar.xz" -C "$work" "$name"
done
exit $failed
