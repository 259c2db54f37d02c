#!/usr/bin/env bash
# Check the series.
#
# usage: scripts/validate.sh [--lint-only]
#   lint tier (seconds, no vLLM): series <-> files, names, one commit per
#     file with Upstream-Status / Drop-When / Fork-Test / Signed-off-by,
#     full index lines, status order, no patch touching an overlay path,
#     MANIFEST, UPSTREAM and VERSION; `bash -n` on every script.
#   full (default) adds the apply tier: the series applies on the pin with
#     git am (no fuzz, no 3-way) as an stgit stack, the export round-trips
#     byte for byte, no patch is already upstream (applies in reverse), and
#     every prefix of the series imports (scripts/bisect-check.sh, needs .venv).
source "$(dirname "$0")/lib.sh"

lint_only=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --lint-only) lint_only=1 ;;
    -h|--help) hs_usage; exit 0 ;;
    *) hs_die "unknown argument: $1" ;;
  esac
  shift
done

rc=0
"$HS_PY" "$HS_ROOT/scripts/patchtool.py" lint --root "$HS_ROOT" || rc=1
for s in "$HS_ROOT"/scripts/*.sh "$HS_ROOT/.ci/run"; do
  [[ -f "$s" ]] && { bash -n "$s" || { hs_log "syntax error in $s"; rc=1; }; }
done
[[ $lint_only == 1 ]] && exit $rc
[[ $rc == 0 ]] || hs_die "lint failed; not running the apply tier"

dir=$HS_WORK/validate/vllm
"$HS_ROOT/scripts/stack.sh" --to "$dir" --force
"$HS_ROOT/scripts/export.sh" --from "$dir" --check
# A4: a patch that applies in reverse on the base is already upstream.
base=$(hs_git -C "$dir" rev-parse refs/patches/base)
hs_git -C "$dir" worktree add -q --detach "$dir.base" "$base"
trap 'hs_git -C "$dir" worktree remove --force "$dir.base"' EXIT
while read -r name; do
  if hs_git -C "$dir.base" apply -R --check "$HS_PATCHES/$name.patch" 2>/dev/null; then
    hs_log "A4 $name applies in reverse on the pin: already upstream? drop it or mark it Accepted"; rc=1
  fi
done < <(hs_series_names)
# A5 / target S2: every prefix applies and its Python imports.
if [[ -x "$HS_ROOT/.venv/bin/python" ]]; then
  "$HS_ROOT/scripts/bisect-check.sh" || rc=1
else
  hs_log "A5 bisect check skipped: no .venv (run scripts/build.sh)"
fi
[[ $rc == 0 ]] && hs_log "validate: lint + apply tier passed"
exit $rc
