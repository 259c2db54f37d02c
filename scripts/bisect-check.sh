#!/usr/bin/env bash
# Bisectability (target S2): every prefix of the series applies and the
# Python it touches compiles and imports.
#
# usage: scripts/bisect-check.sh [--python PY]
#   PY (default .venv/bin/python) must have vLLM's dependencies installed;
#   each prefix tree goes first on its PYTHONPATH.
source "$(dirname "$0")/lib.sh"

py=$HS_ROOT/.venv/bin/python
while [[ $# -gt 0 ]]; do
  case $1 in
    --python) hs_need 'an interpreter' "$@"; py=$2; shift ;;
    -h|--help) hs_usage; exit 0 ;;
    *) hs_die "unknown argument: $1" ;;
  esac
  shift
done
[[ -x "$py" ]] || hs_die "no interpreter at $py (run scripts/build.sh, or pass --python)"

mapfile -t names < <(hs_series_names)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The whole series once: git am applies patch k onto exactly the tree that
# the first k-1 patches give, so the stack's k-th commit is prefix k, applied.
if ! HISPARSE_PATCHES=$HS_PATCHES "$HS_ROOT/scripts/apply.sh" --to "$tmp/tree" --force >"$tmp/apply.log" 2>&1; then
  name=$(sed -n "s/.*error: patch '\(.*\)' does not apply.*/\1/p" "$tmp/apply.log" | head -n1)
  tail -5 "$tmp/apply.log" >&2
  hs_die "prefix ending at '${name:-?}' does not apply"
fi
mapfile -t commits < <(hs_git -C "$tmp/tree" rev-list --reverse refs/patches/base..refs/patches/top)
[[ ${#commits[@]} == "${#names[@]}" ]] || hs_die "applying ${#names[@]} patches made ${#commits[@]} commits"
# check_prefix K TREE: prefix K's tree in the worktree TREE, and nothing
# else (no bytecode or other file of the prefix checked there before).
check_prefix() {
  local k=$1 tree=$2 name=${names[$(($1 - 1))]} f files modules=()
  hs_git -C "$tree" checkout -q -f --detach "${commits[$((k - 1))]}"
  hs_git -C "$tree" clean -q -f -f -d -x
  mapfile -t files < <(grep -E '^diff --git a/\S+\.py ' "$HS_PATCHES/$name.patch" | sed -E 's#^diff --git a/(\S+) .*#\1#' | sort -u)
  for f in "${files[@]}"; do
    [[ -f "$tree/$f" ]] || continue
    "$py" -m py_compile "$tree/$f" || hs_die "$name: $f does not compile"
    [[ "$f" == vllm/* ]] && modules+=("$(sed -e 's#/__init__\.py$##' -e 's#\.py$##' -e 's#/#.#g' <<<"$f")")
  done
  if [[ ${#modules[@]} -gt 0 ]]; then
    (cd "$tmp" && PYTHONPATH=$tree "$py" -c "
import importlib, sys
for m in sys.argv[1:]:
    importlib.import_module(m)
" "${modules[@]}" >/dev/null 2>"$tree.import.log") || { tail -5 "$tree.import.log" >&2; hs_die "$name: importing ${modules[*]} failed"; }
  fi
  hs_log "ok: $k/${#names[@]} $name (${#files[@]} python files)"
}
# Each prefix imports in a fresh interpreter (seconds each): one worktree
# per CPU (at most 4) takes every jobs-th prefix; the logs come out in order
# and the first failing prefix ends the check, as one at a time would.
n=${#names[@]}
jobs=$(nproc 2>/dev/null || echo 1)
((jobs > 4)) && jobs=4
((jobs > n)) && jobs=$n
trees=("$tmp/tree")
for ((j = 1; j < jobs; j++)); do
  trees+=("$tmp/tree$j")
  hs_git -C "$tmp/tree" worktree add -q --detach "$tmp/tree$j" HEAD
done
for ((j = 0; j < jobs; j++)); do
  (
    set +e
    for ((k = j + 1; k <= n; k += jobs)); do
      (set -e; check_prefix "$k" "${trees[$j]}") >"$tmp/log.$k" 2>&1
      echo $? >"$tmp/rc.$k"
    done
  ) &
done
wait
for ((k = 1; k <= n; k++)); do
  cat "$tmp/log.$k" >&2
  [[ "$(cat "$tmp/rc.$k")" == 0 ]] || exit 1
done
