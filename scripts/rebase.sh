#!/usr/bin/env bash
# Move the series onto another vLLM release and report what that takes.
# The pin does not move: UPSTREAM, VERSION and patches/ are not touched.
#
# usage: scripts/rebase.sh VERSION [--sha256 HEX] [--report DIR]
#   VERSION      a vLLM release on PyPI, e.g. 0.27.1
#   --sha256     the sdist's expected sha256 (default: the digest PyPI's
#                index publishes for the file; HISPARSE_REBASE_SDIST=/path
#                uses a local file, still checked)
#   --report DIR where the report goes (default: results/rebase/VERSION)
# Steps: fetch + hash-check vllm-VERSION.tar.gz and build its pin repository
# (.cache/pin/vllm-VERSION.git, like scripts/fetch.sh); the current series on
# the current pin (old range); the new pin + overlay (overlay files that exist
# upstream replace them and are reported as collisions) and every patch in
# order with `git am`, then `git am -3`, else recorded as a conflict and
# skipped (new range); `git range-diff old new`.
# Report: range-diff.txt, summary.md (per patch: unchanged / needed work /
# conflicts; unmatched range-diff pairs listed with their interdiff; seams:
# each upstream function a patch hunk sits in, same or changed; collisions:
# overlay paths and packages, connector names, config keys and classes),
# summary.json, UPSTREAM.candidate (the values a pin move would write).
# The trees stay in work/rebase/VERSION/{old,new} for resolving conflicts.
source "$(dirname "$0")/lib.sh"

target="" want_sha="" report=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --sha256) hs_need 'a digest' "$@"; want_sha=$2; shift ;;
    --report) hs_need 'a directory' "$@"; report=$2; shift ;;
    -h|--help) hs_usage; exit 0 ;;
    -*) hs_die "unknown argument: $1" ;;
    *) target=$1 ;;
  esac
  shift
done
[[ "$target" =~ ^[0-9]+\.[0-9]+\.[0-9]+([a-z0-9.]*)?$ ]] || hs_die "usage: scripts/rebase.sh VERSION (e.g. 0.27.1)"
[[ "$target" != "$VLLM_VERSION" ]] || hs_die "$target is the pin already"
report=$(realpath -m "${report:-$HS_ROOT/results/rebase/$target}")
wdir=$HS_WORK/rebase/$target
sdist_file=vllm-$target.tar.gz
mkdir -p "$HS_CACHE/pin" "$wdir"

# 1. The new release's sdist: URL and digest from PyPI's index, verified.
index_json=$wdir/pypi-index.json
wheel_file="" wheel_url="" wheel_sha=""
if [[ -z "${HISPARSE_REBASE_SDIST:-}" ]]; then
  hs_run curl -fsSL --retry 3 -H 'Accept: application/vnd.pypi.simple.v1+json' \
    -o "$index_json" "${HISPARSE_PYPI_SIMPLE:-https://pypi.org/simple}/vllm/"
  read -r sdist_url index_sha wheel_file wheel_url wheel_sha < <("$HS_PY" - "$index_json" "$target" <<'EOF'
import json, sys
files = json.load(open(sys.argv[1]))["files"]
v = sys.argv[2]
sd = [f for f in files if f["filename"] == f"vllm-{v}.tar.gz"]
wh = [f for f in files if f["filename"].startswith(f"vllm-{v}-") and f["filename"].endswith("abi3-manylinux_2_28_x86_64.whl")]
if not sd:
    sys.exit(f"PyPI has no vllm-{v}.tar.gz")
w = wh[0] if wh else {"filename": "-", "url": "-", "hashes": {"sha256": "-"}}
print(sd[0]["url"], sd[0]["hashes"]["sha256"], w["filename"], w["url"], w["hashes"]["sha256"])
EOF
  ) || hs_die "could not find vllm $target on PyPI"
  want_sha=${want_sha:-$index_sha}
  [[ "$want_sha" == "$index_sha" ]] || hs_die "--sha256 $want_sha differs from PyPI's published digest $index_sha for $sdist_file"
  if [[ ! -f "$HS_CACHE/pin/$sdist_file" ]]; then
    hs_run curl -fsSL --retry 3 -o "$HS_CACHE/pin/$sdist_file.part" "$sdist_url"
    mv "$HS_CACHE/pin/$sdist_file.part" "$HS_CACHE/pin/$sdist_file"
  fi
  sdist=$HS_CACHE/pin/$sdist_file
else
  sdist=$HISPARSE_REBASE_SDIST sdist_url="file://$sdist"
  [[ -n "$want_sha" ]] || hs_die "HISPARSE_REBASE_SDIST needs --sha256 (the digest it must have)"
fi
got=$(hs_sha256 "$sdist")
if [[ "$got" != "$want_sha" ]]; then
  [[ -n "${HISPARSE_REBASE_SDIST:-}" ]] || rm -f "$sdist"
  hs_die "sha256 mismatch for $sdist_file: expected $want_sha, got $got (not the release; the file is not used)"
fi
hs_log "$sdist_file: sha256 $got ok"

# 2. Its pin repository, built by fetch.sh itself under a pin record for the
#    new release (the real UPSTREAM is never written).
new_commit=$(tar -xzOf "$sdist" "vllm-$target/vllm/_version.py" 2>/dev/null | sed -n "s/.*__version__ = version = '.*+g\([0-9a-f]*\)'.*/\1/p; s/.*commit_id = .*'g\{0,1\}\([0-9a-f]\{7,40\}\)'.*/\1/p" | head -n1)
new_commit=${new_commit:-unknown}
shadow=$wdir/root
rm -rf "$shadow"; mkdir -p "$shadow"
ln -s "$HS_ROOT/scripts" "$shadow/scripts"
cp "$HS_ROOT/VERSION" "$shadow/VERSION"
{
  grep -v -e '^VLLM_BASE_VERSION=' -e '^VLLM_VERSION=' -e '^VLLM_COMMIT=' -e '^VLLM_SDIST_' -e '^VLLM_WHEEL_' "$HS_ROOT/UPSTREAM"
  echo "VLLM_BASE_VERSION=v$target"
  echo "VLLM_VERSION=$target"
  echo "VLLM_COMMIT=$new_commit"
  echo "VLLM_SDIST_FILE=$sdist_file"
  echo "VLLM_SDIST_URL=$sdist_url"
  echo "VLLM_SDIST_SHA256=$want_sha"
  echo "VLLM_WHEEL_FILE=$wheel_file"
  echo "VLLM_WHEEL_URL=$wheel_url"
  echo "VLLM_WHEEL_SHA256=$wheel_sha"
} > "$shadow/UPSTREAM"
HISPARSE_CACHE=$HS_CACHE HISPARSE_SDIST=$sdist "$shadow/scripts/fetch.sh"
new_pin=$HS_CACHE/pin/vllm-$target.git

# 3. The old range: the series on the current pin.
old=$wdir/old new=$wdir/new
"$HS_ROOT/scripts/apply.sh" --to "$old" --force >/dev/null
old_base=$(hs_git -C "$old" rev-parse refs/patches/base) old_top=$(hs_git -C "$old" rev-parse refs/patches/top)

# 4. The new range: new pin + overlay, then each patch: am, am -3, or conflict.
rm -rf "$new"
hs_run hs_git clone -q --local "$new_pin" "$new"
hs_git -C "$new" checkout -q -b hisparse 'pin^{commit}'
hs_git -C "$new" update-ref refs/patches/upstream-head HEAD
# The old range's objects (pin blobs included): git am -3 needs the blobs
# named on the patches' index lines.
hs_git -C "$new" fetch -q "$old" "+refs/patches/*:refs/old/*"
mapfile -t overlay < <(cd "$HS_OVERLAY" && find . -type f ! -name MANIFEST ! -path '*/__pycache__/*' | sed 's#^\./##' | LC_ALL=C sort)
: > "$wdir/collisions.txt"
for f in "${overlay[@]}"; do
  hs_git -C "$new" cat-file -e "HEAD:$f" 2>/dev/null && echo "$f" >> "$wdir/collisions.txt"
done
(cd "$HS_OVERLAY" && cp --parents "${overlay[@]}" "$new/")
hs_git -C "$new" add -f -- "${overlay[@]}"
hs_git_fixed -C "$new" commit -q --allow-empty -m "overlay: import (rebase onto $target)"
hs_git -C "$new" update-ref refs/patches/base HEAD
: > "$wdir/apply.tsv"
while read -r name; do
  [[ -n "$name" ]] || continue
  p=$HS_PATCHES/$name.patch
  if hs_git -C "$new" am -q --keep --keep-cr --committer-date-is-author-date "$p" >/dev/null 2>&1; then
    printf '%s\tclean\n' "$name" >> "$wdir/apply.tsv"
    continue
  fi
  hs_git -C "$new" am --abort >/dev/null 2>&1 || true
  if out3=$(hs_git -C "$new" am -q -3 --keep --keep-cr --committer-date-is-author-date "$p" 2>&1); then
    printf '%s\t3way\n' "$name" >> "$wdir/apply.tsv"
  else
    files=$(hs_git -C "$new" diff --name-only --diff-filter=U | tr '\n' ' ')
    [[ -n "$files" ]] || files=$(grep -oE '(patch failed|does not exist in index|already exists in index): [^:]+' <<<"$out3" | sed 's/.*: //' | sort -u | tr '\n' ' ' || true)
    [[ -n "$files" ]] || files="($(grep -m1 -E '^(error|fatal):' <<<"$out3" || echo 'git am -3 failed'))"
    printf '%s\tconflict\t%s\n' "$name" "${files% }" >> "$wdir/apply.tsv"
    hs_git -C "$new" am --abort >/dev/null 2>&1 || true
  fi
done < <(hs_series_names)
hs_git -C "$new" update-ref refs/patches/top HEAD
new_base=$(hs_git -C "$new" rev-parse refs/patches/base) new_top=$(hs_git -C "$new" rev-parse HEAD)

# 5. range-diff and the report.
mkdir -p "$report"
hs_git -C "$new" range-diff --no-color "refs/old/base..refs/old/top" "$new_base..$new_top" > "$report/range-diff.txt"
hs_git -C "$new" range-diff --no-color --no-patch "refs/old/base..refs/old/top" "$new_base..$new_top" > "$wdir/range-diff-short.txt"
{
  sed -n '/^VLLM_BASE_VERSION=/,$p' "$shadow/UPSTREAM" | grep -E '^(VLLM_|#)'
} > "$report/UPSTREAM.candidate"
"$HS_PY" "$HS_ROOT/scripts/rebasetool.py" report --root "$HS_ROOT" --target "$target" \
  --old "$old" --new "$new" --apply "$wdir/apply.tsv" --collisions "$wdir/collisions.txt" \
  --range-diff "$wdir/range-diff-short.txt" --sdist-sha256 "$want_sha" --sdist-url "$sdist_url" \
  --new-commit "$new_commit" --out "$report"
echo "report: $report/summary.md"
sed -n '/^## Headline/,/^## /p' "$report/summary.md" | sed '$d'
