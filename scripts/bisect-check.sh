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
mkdir -p "$tmp/patches"
cp "$HS_PATCHES"/*.patch "$tmp/patches/" 2>/dev/null || true
for ((k = 1; k <= ${#names[@]}; k++)); do
  name=${names[$((k - 1))]}
  printf '# prefix %d\n' "$k" > "$tmp/patches/series"
  printf '%s\n' "${names[@]:0:$k}" >> "$tmp/patches/series"
  HISPARSE_PATCHES=$tmp/patches "$HS_ROOT/scripts/apply.sh" --to "$tmp/tree" --force >/dev/null 2>&1 \
    || hs_die "prefix ending at '$name' does not apply"
  mapfile -t files < <(grep -E '^diff --git a/\S+\.py ' "$HS_PATCHES/$name.patch" | sed -E 's#^diff --git a/(\S+) .*#\1#' | sort -u)
  modules=()
  for f in "${files[@]}"; do
    [[ -f "$tmp/tree/$f" ]] || continue
    "$py" -m py_compile "$tmp/tree/$f" || hs_die "$name: $f does not compile"
    [[ "$f" == vllm/* ]] && modules+=("$(sed -e 's#/__init__\.py$##' -e 's#\.py$##' -e 's#/#.#g' <<<"$f")")
  done
  if [[ ${#modules[@]} -gt 0 ]]; then
    (cd "$tmp" && PYTHONPATH=$tmp/tree "$py" -c "
import importlib, sys
for m in sys.argv[1:]:
    importlib.import_module(m)
" "${modules[@]}" >/dev/null 2>"$tmp/import.log") || { tail -5 "$tmp/import.log" >&2; hs_die "$name: importing ${modules[*]} failed"; }
  fi
  hs_log "ok: $k/${#names[@]} $name (${#files[@]} python files)"
done
