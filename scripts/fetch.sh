#!/usr/bin/env bash
# Fetch the pinned vLLM into the cache, verify its sha256, and turn the source
# into a pristine git repository (the base every generated tree starts from).
#
# usage: scripts/fetch.sh [--wheel] [--git URL [--ref REF]]
#   --wheel     also fetch and verify the pinned precompiled wheel
#   --git URL   take the source from a vLLM git repository (a mirror the user
#               has) instead of the PyPI sdist; REF defaults to the pinned tag.
#               The commit must match UPSTREAM's VLLM_COMMIT.
# Local files can stand in for downloads (offline machines):
#   HISPARSE_SDIST=/path/vllm-0.26.0.tar.gz  HISPARSE_WHEEL=/path/vllm-...whl
# Either way the sha256 must equal UPSTREAM's: a mismatch is an error, never
# a warning, and the bad file is not used.
source "$(dirname "$0")/lib.sh"

want_wheel=0 git_url="" git_ref=$VLLM_BASE_VERSION
while [[ $# -gt 0 ]]; do
  case $1 in
    --wheel) want_wheel=1 ;;
    --git) hs_need 'a URL' "$@"; git_url=$2; shift ;;
    --ref) hs_need 'a ref' "$@"; git_ref=$2; shift ;;
    -h|--help) hs_usage; exit 0 ;;
    *) hs_die "unknown argument: $1" ;;
  esac
  shift
done

mkdir -p "$HS_CACHE/pin"

# verify FILE SHA256 LABEL: says both digests and fails on mismatch.
verify() {
  local got
  got=$(hs_sha256 "$1")
  if [[ "$got" != "$2" ]]; then
    printf '[fetch.sh] error: sha256 mismatch for %s (%s): expected %s, got %s. The file is not the pinned release (corrupt download or tampered); delete it and re-run.\n' "$3" "$1" "$2" "$got" >&2
    return 1
  fi
}

# download URL DEST: curl first; pip (which honours the user's index and
# proxy settings) as the fallback.
download() {
  local url=$1 dest=$2 tmp
  tmp=$(mktemp -d)
  if curl -fsSL --retry 3 -o "$tmp/$(basename "$dest")" "$url"; then
    mv "$tmp/$(basename "$dest")" "$dest"
  else
    hs_log "curl failed for $url; trying pip download"
    local args=(--no-deps -d "$tmp" "vllm==$VLLM_VERSION")
    if [[ "$dest" == *.tar.gz ]]; then
      # pip builds sdist metadata: needs torch, setuptools-rust, setuptools-scm.
      VLLM_VERSION_OVERRIDE=$VLLM_VERSION VLLM_TARGET_DEVICE=empty \
        hs_run "$HS_PY" -m pip download --no-binary :all: --no-build-isolation "${args[@]}"
    else
      hs_run "$HS_PY" -m pip download --only-binary :all: "${args[@]}"
    fi
    mv "$tmp/$(basename "$dest")" "$dest"
  fi
  rm -rf "$tmp"
}

# ensure NAME URL SHA256 LOCAL_OVERRIDE -> prints the verified cached path
ensure_artifact() {
  local name=$1 url=$2 sha=$3 local_file=$4
  local dest=$HS_CACHE/pin/$name
  if [[ -n "$local_file" ]]; then
    [[ -f "$local_file" ]] || hs_die "no such file: $local_file (HISPARSE_SDIST / HISPARSE_WHEEL name a local $name)"
    verify "$local_file" "$sha" "$name" || exit 1
    [[ "$(realpath "$local_file")" == "$(realpath -m "$dest")" ]] || cp "$local_file" "$dest.part"
    [[ -f "$dest.part" ]] && mv "$dest.part" "$dest"
  elif [[ ! -f "$dest" ]]; then
    hs_log "downloading $name"
    download "$url" "$dest.part.$$"
    verify "$dest.part.$$" "$sha" "$name" || { rm -f "$dest.part.$$"; exit 1; }
    mv "$dest.part.$$" "$dest"
  fi
  verify "$dest" "$sha" "$name" || exit 1
  echo "$dest"
}

# Build the pin repository from the sdist: one commit with a fixed identity
# and date, tagged 'pin'. Reused while its recorded sha256 matches.
pin_from_sdist() {
  local sdist=$1
  local stamp="sdist-sha256: $VLLM_SDIST_SHA256"
  if [[ -d "$HS_PIN_REPO" ]] && hs_git --git-dir="$HS_PIN_REPO" cat-file -p pin 2>/dev/null | grep -q "$stamp"; then
    return 0
  fi
  hs_log "building pin repository $HS_PIN_REPO from $VLLM_SDIST_FILE"
  local tmp
  tmp=$(mktemp -d)
  tar -xzf "$sdist" -C "$tmp"
  local tree=$tmp/vllm-$VLLM_VERSION
  [[ -d "$tree/vllm" ]] || hs_die "sdist has no vllm-$VLLM_VERSION/vllm directory"
  rm -rf "$HS_PIN_REPO.tmp"
  hs_git init -q --bare "$HS_PIN_REPO.tmp"
  # -f: the sdist's own .gitignore files must not drop shipped files.
  hs_git --git-dir="$HS_PIN_REPO.tmp" --work-tree="$tree" add -f -A
  hs_git_fixed --git-dir="$HS_PIN_REPO.tmp" --work-tree="$tree" commit -q \
    -m "vLLM $VLLM_VERSION (PyPI sdist $VLLM_SDIST_FILE)" \
    -m "upstream-commit: $VLLM_COMMIT" -m "$stamp"
  hs_git_fixed --git-dir="$HS_PIN_REPO.tmp" tag -a pin -m "$stamp" HEAD
  rm -rf "$HS_PIN_REPO" "$tmp"
  mv "$HS_PIN_REPO.tmp" "$HS_PIN_REPO"
}

# Build the pin repository from a user's git mirror; the commit must match.
pin_from_git() {
  local url=$1 ref=$2
  local stamp="git-ref: $ref"
  rm -rf "$HS_PIN_REPO.tmp"
  hs_git init -q --bare "$HS_PIN_REPO.tmp"
  hs_run hs_git --git-dir="$HS_PIN_REPO.tmp" fetch -q --no-tags "$url" "$ref"
  local commit
  commit=$(hs_git --git-dir="$HS_PIN_REPO.tmp" rev-parse 'FETCH_HEAD^{commit}')
  if [[ "$commit" != "$VLLM_COMMIT"* ]]; then
    rm -rf "$HS_PIN_REPO.tmp"
    hs_die "commit mismatch: $url $ref is $commit, but the pin is $VLLM_COMMIT (UPSTREAM VLLM_COMMIT)"
  fi
  hs_git_fixed --git-dir="$HS_PIN_REPO.tmp" tag -a pin -m "$stamp" "$commit"
  rm -rf "$HS_PIN_REPO"
  mv "$HS_PIN_REPO.tmp" "$HS_PIN_REPO"
}

if [[ -n "$git_url" ]]; then
  pin_from_git "$git_url" "$git_ref"
else
  sdist=$(ensure_artifact "$VLLM_SDIST_FILE" "$VLLM_SDIST_URL" "$VLLM_SDIST_SHA256" "${HISPARSE_SDIST:-}")
  pin_from_sdist "$sdist"
fi
if [[ $want_wheel == 1 ]]; then
  ensure_artifact "$VLLM_WHEEL_FILE" "$VLLM_WHEEL_URL" "$VLLM_WHEEL_SHA256" "${HISPARSE_WHEEL:-}" > /dev/null
fi
hs_log "pin ready: $HS_PIN_REPO ($(hs_git --git-dir="$HS_PIN_REPO" rev-parse --short=12 'pin^{commit}'))"
