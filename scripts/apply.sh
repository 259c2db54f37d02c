#!/usr/bin/env bash
# Generate the patched vLLM tree: pin -> overlay base commit -> git am series.
#
# usage: scripts/apply.sh [--to DIR] [--3way] [--force]
#   --to DIR   where to build the tree (default: work/vllm)
#   --3way     let git am fall back to a 3-way merge (rebasing only; never CI)
#   --force    replace DIR even if it has uncommitted changes
# Every patch applies with `git am` (no fuzz; no 3-way unless asked) or the
# script stops, naming the patch and printing the hunk that did not apply.
# The result: branch 'hisparse' with refs/patches/upstream-head (the pin),
# refs/patches/base (pin + overlay) and one commit per series entry. Commit
# ids are reproducible: same pin + overlay + series => same SHAs.
source "$(dirname "$0")/lib.sh"

dir=$HS_WORK/vllm threeway=() force=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --to) hs_need 'a directory' "$@"; dir=$2; shift ;;
    --3way) threeway=(--3way) ;;
    --force) force=1 ;;
    -h|--help) hs_usage; exit 0 ;;
    *) hs_die "unknown argument: $1" ;;
  esac
  shift
done
dir=$(realpath -m "$dir")

[[ -d "$HS_PIN_REPO" ]] || "$HS_ROOT/scripts/fetch.sh"

if [[ -e "$dir" ]]; then
  if [[ $force == 0 && -d "$dir/.git" ]] && [[ -n "$(hs_git -C "$dir" status --porcelain --untracked-files=no 2>/dev/null)" ]]; then
    hs_die "$dir has uncommitted changes to tracked files; commit/export them or pass --force"
  fi
  rm -rf "$dir"
fi
mkdir -p "$(dirname "$dir")"
hs_run hs_git clone -q --local --no-checkout "$HS_PIN_REPO" "$dir"
hs_git -C "$dir" checkout -q -b hisparse 'pin^{commit}'
hs_git -C "$dir" update-ref refs/patches/upstream-head HEAD

# Overlay: new files only (A3), committed as the base of the stack.
mapfile -t overlay < <(cd "$HS_OVERLAY" && find . -type f ! -name MANIFEST ! -path '*/__pycache__/*' | sed 's#^\./##' | LC_ALL=C sort)
collisions=()
for f in "${overlay[@]}"; do
  if hs_git -C "$dir" cat-file -e "HEAD:$f" 2>/dev/null; then collisions+=("$f"); fi
done
if [[ ${#collisions[@]} -gt 0 ]]; then
  printf '  %s\n' "${collisions[@]}" >&2
  hs_die "overlay path(s) above already exist in vLLM $VLLM_VERSION: overlay is for new files only; change existing files with a patch"
fi
manifest_sha=$("$HS_PY" "$HS_ROOT/scripts/patchtool.py" manifest --root "$HS_ROOT" | sha256sum | cut -c1-12)
if [[ ${#overlay[@]} -gt 0 ]]; then
  (cd "$HS_OVERLAY" && cp --parents "${overlay[@]}" "$dir/")
  hs_git -C "$dir" add -f -- "${overlay[@]}"
fi
hs_git_fixed -C "$dir" commit -q --allow-empty -m "overlay: import $manifest_sha" \
  -m "HiSparse overlay: ${#overlay[@]} new files (overlay/MANIFEST of the series repo)."
hs_git -C "$dir" update-ref refs/patches/base HEAD

n=0
while read -r name; do
  [[ -n "$name" ]] || continue
  patch=$HS_PATCHES/$name.patch
  [[ -f "$patch" ]] || hs_die "series names '$name' but $patch does not exist"
  if ! out=$(hs_git -C "$dir" am -q --keep --keep-cr --committer-date-is-author-date "${threeway[@]}" "$patch" 2>&1); then
    printf '%s\n' "$out" >&2
    echo "---- hunk(s) that did not apply (no fuzz allowed):" >&2
    grep -oE 'patch failed: [^:]+:[0-9]+' <<<"$out" | while read -r _ _ loc; do
      "$HS_PY" "$HS_ROOT/scripts/patchtool.py" hunk "$patch" "${loc%:*}" "${loc##*:}" >&2
    done
    hs_git -C "$dir" am --abort >/dev/null 2>&1 || true
    hs_die "patch '$name' does not apply to $(hs_git -C "$dir" rev-parse --short HEAD) (after $n patches)"
  fi
  n=$((n + 1))
done < <(hs_series_names)
hs_git -C "$dir" update-ref refs/patches/top HEAD
hs_log "applied $n patches onto vLLM $VLLM_VERSION + overlay (${#overlay[@]} files): $dir @ $(hs_git -C "$dir" rev-parse --short=12 HEAD)"
