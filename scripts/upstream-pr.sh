#!/usr/bin/env bash
# Carve one patch of the series into a vLLM pull-request branch.
#
# usage: scripts/upstream-pr.sh PATCH [--repo DIR] [--base REF] [--out DIR]
#   PATCH       a series name (patches/PATCH.patch)
#   --repo DIR  a vLLM git checkout to put the branch in (default:
#               work/upstream-pr/vllm, a clone of the pin repository)
#   --base REF  the commit to branch from (default: tag 'pin' where the
#               repository has it, else VLLM_BASE_VERSION, v0.26.0). It must be
#               the pin: its commit id starts with VLLM_COMMIT, or its tree
#               equals the pin repository's.
#   --out DIR   where title.txt, body.md and commit-message.txt go
#               (default: out/upstream-pr/PATCH)
# The branch upstream/PATCH holds one commit: the patch applied with
# `git am -3` (it must apply on the pin alone), plus the overlay files it
# needs (scripts/prtool.py needs: imports, registry strings, build paths,
# transitively) added as new files, with the fork-only trailers
# (Upstream-Status, Drop-When, Fork-Test) stripped and Signed-off-by kept.
# Every Python file of the commit must byte-compile. The PR title is the
# patch subject; the body fills the pinned tree's
# .github/PULL_REQUEST_TEMPLATE.md. Nothing is pushed.
source "$(dirname "$0")/lib.sh"

name="" repo="" base="" out=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --repo) hs_need 'a directory' "$@"; repo=$2; shift ;;
    --base) hs_need 'a ref' "$@"; base=$2; shift ;;
    --out) hs_need 'a directory' "$@"; out=$2; shift ;;
    -h|--help) hs_usage; exit 0 ;;
    -*) hs_die "unknown argument: $1" ;;
    *) [[ -z "$name" ]] || hs_die "one patch at a time ($name, $1)"; name=$1 ;;
  esac
  shift
done
[[ -n "$name" ]] || hs_die "usage: scripts/upstream-pr.sh PATCH [--repo DIR] [--base REF]"
name=${name%.patch}; name=${name#patches/}
patch=$HS_PATCHES/$name.patch
[[ -f "$patch" ]] || hs_die "no patch '$name' (patches/$name.patch)"
hs_series_names | grep -qx -- "$name" || hs_die "'$name' is not in patches/series"
out=$(realpath -m "${out:-$HS_OUT/upstream-pr/$name}")

[[ -d "$HS_PIN_REPO" ]] || "$HS_ROOT/scripts/fetch.sh"
pin_tree=$(hs_git --git-dir="$HS_PIN_REPO" rev-parse 'pin^{tree}')
if [[ -z "$repo" ]]; then
  repo=$HS_WORK/upstream-pr/vllm
  if [[ ! -d "$repo/.git" ]]; then
    mkdir -p "$(dirname "$repo")"
    hs_run hs_git clone -q --local "$HS_PIN_REPO" "$repo"
  fi
  base=${base:-pin}
fi
repo=$(realpath "$repo")
[[ -d "$repo/.git" || -f "$repo/.git" ]] || hs_die "$repo is not a git checkout"
if [[ -z "$base" ]]; then
  if hs_git -C "$repo" rev-parse -q --verify 'pin^{commit}' >/dev/null; then base=pin; else base=$VLLM_BASE_VERSION; fi
fi
[[ -z "$(hs_git -C "$repo" status --porcelain --untracked-files=no 2>/dev/null)" ]] \
  || hs_die "$repo has uncommitted changes; commit or stash them first"
base_commit=$(hs_git -C "$repo" rev-parse --verify -q "$base^{commit}") || hs_die "$repo has no commit '$base'"
if [[ "$base_commit" != "$VLLM_COMMIT"* && "$(hs_git -C "$repo" rev-parse "$base^{tree}")" != "$pin_tree" ]]; then
  hs_die "$base ($base_commit) is not the pin: vLLM $VLLM_VERSION is commit $VLLM_COMMIT (or the tree of $HS_PIN_REPO)"
fi

branch=upstream/$name
hs_run hs_git -C "$repo" checkout -q -B "$branch" "$base_commit"
# The patch alone, 3-way, with its author kept; our committer identity.
if ! am_out=$(hs_git -C "$repo" am -q -3 --keep --keep-cr "$patch" 2>&1); then
  printf '%s\n' "$am_out" >&2
  hs_git -C "$repo" am --abort >/dev/null 2>&1 || true
  files=$(grep '^diff --git ' "$patch" | sed 's#^diff --git a/\([^ ]*\) .*#\1#' | sort -u)
  earlier=()
  while read -r other; do
    [[ "$other" == "$name" ]] && break
    while read -r f; do
      grep -q "^diff --git a/$f " "$HS_PATCHES/$other.patch" && { earlier+=("$other"); break; }
    done <<<"$files"
  done < <(hs_series_names)
  hs_die "patch '$name' does not apply on the pin by itself${earlier:+; earlier patches touching the same files: ${earlier[*]}}"
fi

# The overlay files it needs, folded into the same commit.
mapfile -t needed < <("$HS_PY" "$HS_ROOT/scripts/prtool.py" needs --root "$HS_ROOT" "$patch")
for f in "${needed[@]}"; do
  [[ -n "$f" ]] || continue
  if hs_git -C "$repo" cat-file -e "HEAD:$f" 2>/dev/null; then
    hs_die "overlay file $f already exists at $base: it cannot be added as a new file"
  fi
  mkdir -p "$repo/$(dirname "$f")"
  cp "$HS_OVERLAY/$f" "$repo/$f"
  hs_git -C "$repo" add -f -- "$f"
done
mkdir -p "$out"
"$HS_PY" "$HS_ROOT/scripts/prtool.py" message "$patch" > "$out/commit-message.txt"
author=$(hs_git -C "$repo" log -1 --format='%an <%ae>')
date=$(hs_git -C "$repo" log -1 --format='%aI')
hs_git -C "$repo" commit -q --amend --allow-empty --author="$author" --date="$date" -F "$out/commit-message.txt"

# Checks: Python byte-compiles; no fork-only trailer left; nothing else changed.
mapfile -t changed < <(hs_git -C "$repo" diff --name-only "$base_commit" HEAD)
pyfiles=()
for f in "${changed[@]}"; do [[ "$f" == *.py ]] && pyfiles+=("$repo/$f"); done
if [[ ${#pyfiles[@]} -gt 0 ]]; then
  "$HS_PY" - "${pyfiles[@]}" <<'EOF' || hs_die "a Python file of the branch does not compile"
import sys
for f in sys.argv[1:]:
    compile(open(f, encoding="utf-8").read(), f, "exec")
EOF
fi
msg=$(hs_git -C "$repo" log -1 --format=%B)
for t in Upstream-Status Drop-When Fork-Test; do
  grep -q "^$t:" <<<"$msg" && hs_die "trailer $t survived in the commit message"
done
grep -q '^Signed-off-by: ' <<<"$msg" || hs_die "the commit lost its Signed-off-by"

template=$repo/.github/PULL_REQUEST_TEMPLATE.md
[[ -f "$template" ]] || hs_die "$base has no .github/PULL_REQUEST_TEMPLATE.md"
subject=$(sed -n 1p "$out/commit-message.txt")
echo "$subject" > "$out/title.txt"
checked=("applies on vLLM $VLLM_VERSION ($base, $(hs_git -C "$repo" rev-parse --short=12 "$base_commit")) with \`git am -3\`"
         "${#changed[@]} files changed (${#needed[@]} new); ${#pyfiles[@]} Python files byte-compile")
args=()
for f in "${needed[@]}"; do [[ -n "$f" ]] && args+=(--new-file "$f"); done
for c in "${checked[@]}"; do args+=(--checked "$c"); done
"$HS_PY" "$HS_ROOT/scripts/prtool.py" body "$patch" --template "$template" "${args[@]}" > "$out/body.md"

echo "branch:  $branch in $repo ($(hs_git -C "$repo" rev-parse --short=12 HEAD) on $base)"
echo "title:   $subject"
echo "body:    $out/body.md"
echo "files:   ${#changed[@]} (${#needed[@]} overlay files folded in)"
echo "next:    git -C $repo push <your-fork> $branch, open the PR with title.txt/body.md, then"
echo "         scripts/stack.sh && cd work/vllm && stg edit $name   # Upstream-Status: Submitted <url>"
