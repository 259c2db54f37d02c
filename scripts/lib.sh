# shellcheck shell=bash
# Shared by every script: the pin (UPSTREAM), an isolated git, logging, paths.
# Source it; it does not run anything by itself.
set -euo pipefail

HS_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HS_CACHE=${HISPARSE_CACHE:-$HS_ROOT/.cache}
HS_WORK=${HISPARSE_WORK:-$HS_ROOT/work}
HS_OUT=${HISPARSE_OUT:-$HS_ROOT/out}
HS_PATCHES=${HISPARSE_PATCHES:-$HS_ROOT/patches}
HS_OVERLAY=${HISPARSE_OVERLAY:-$HS_ROOT/overlay}
HS_PY=${HISPARSE_SYSTEM_PYTHON:-python3}
# Tools that scripts/prereqs.sh linked for this checkout come first.
HS_TOOLS=$HS_CACHE/tools/bin
case ":$PATH:" in *":$HS_TOOLS:"*) ;; *) export PATH=$HS_TOOLS:$PATH ;; esac

hs_log() { printf '[%s] %s\n' "$(basename "$0")" "$*" >&2; }
hs_die() { printf '[%s] error: %s\n' "$(basename "$0")" "$*" >&2; exit 1; }
# An option's value, in the argument loop:
#   --out) hs_need 'a directory' "$@"; out=$2; shift ;;
# A missing value (no more arguments, or the next option) is a one-line error.
hs_need() { [[ -n ${3-} && $3 != -* ]] || hs_die "$2 needs $1"; }
# A count, after the loop: hs_positive_int --jobs "$jobs"
hs_positive_int() { [[ $2 =~ ^[1-9][0-9]*$ ]] || hs_die "$1 must be a positive integer, got '$2'"; }
# stgit, for the scripts that edit or read the stack (scripts/prereqs.sh installs it).
hs_require_stg() { command -v stg >/dev/null || hs_die "stgit is not installed (Debian: apt-get install stgit, or scripts/prereqs.sh as root)"; }
# Print, then run: scripts say exactly what they execute.
hs_run() { printf '+ %s\n' "$*" >&2; "$@"; }

# UPSTREAM is KEY=VALUE; read it without evaluating it as shell.
HS_UPSTREAM_KEYS=()
hs_read_upstream() {
  local key val
  while IFS='=' read -r key val; do
    [[ -z "$key" || "$key" == \#* ]] && continue
    [[ "$key" =~ ^[A-Z0-9_]+$ ]] || hs_die "UPSTREAM: bad key '$key'"
    printf -v "$key" '%s' "$val"
    export "${key?}"
    HS_UPSTREAM_KEYS+=("$key")
  done < "$HS_ROOT/UPSTREAM"
}
hs_read_upstream
HS_VERSION=$(tr -d '[:space:]' < "$HS_ROOT/VERSION")

# --help: the script's header comment, from after the shebang (and SPDX
# lines) to the first line of code, without the '#', with the pin's values
# for $KEY and ${KEY} of UPSTREAM. Scripts that run without lib.sh inline the
# awk part (tests/unit/test_cli.py checks every script's --help).
hs_usage() {
  local text key
  text=$(awk 'NR == 1 || /^# SPDX-/ { next } !/^#/ { exit } { sub(/^# ?/, ""); if (NF || n) { print; n++ } }' "$0")
  # Longest first: $VLLM_WHEEL_FILE is not $VLLM_WHEEL followed by _FILE.
  while read -r key; do
    text=${text//"\${$key}"/${!key}}
    text=${text//"\$$key"/${!key}}
  done < <(printf '%s\n' "${HS_UPSTREAM_KEYS[@]}" | awk '{ print length($0), $0 }' | sort -rn | cut -d' ' -f2)
  printf '%s\n' "$text"
}

# The GPU wheel's file name: scripts/build-wheel.sh writes it, build-image.sh
# and build.sh --tier gpu take it. linux_x86_64, not manylinux_2_28: built on
# glibc 2.36, the kernel library needs GLIBC_2.34 (README).
HS_GPU_WHEEL_PLAT=linux_x86_64
HS_GPU_WHEEL_NAME=vllm-$HS_VERSION-cp38-abi3-$HS_GPU_WHEEL_PLAT.whl

# Git with an isolated configuration: personal settings (diff.noprefix,
# diff.algorithm=histogram, signing, ...) must never change patch bytes.
# Fixed identities and dates make the generated tree's commit ids
# reproducible: same pin + overlay + series => same SHAs.
HS_BOT_NAME="HiSparse patch tooling"
HS_BOT_EMAIL="hisparse-tooling@invalid"
HS_FIXED_DATE="2026-07-25T00:00:00+0000"
hs_git() {
  GIT_CONFIG_NOSYSTEM=1 GIT_CONFIG_GLOBAL=/dev/null \
  GIT_COMMITTER_NAME="$HS_BOT_NAME" GIT_COMMITTER_EMAIL="$HS_BOT_EMAIL" \
  git -c diff.algorithm=myers -c core.abbrev=12 -c diff.renames=true \
      -c commit.gpgsign=false -c core.autocrlf=false -c core.safecrlf=false \
      -c init.defaultBranch=main -c advice.detachedHead=false \
      -c gc.auto=0 "$@"
}
# The same, for commits the tooling authors itself (pin import, overlay base).
hs_git_fixed() {
  GIT_AUTHOR_NAME="$HS_BOT_NAME" GIT_AUTHOR_EMAIL="$HS_BOT_EMAIL" \
  GIT_AUTHOR_DATE="$HS_FIXED_DATE" GIT_COMMITTER_DATE="$HS_FIXED_DATE" \
  hs_git "$@"
}

hs_sha256() { sha256sum "$1" | cut -d' ' -f1; }

# The series: one name per line; '#' lines are comments.
hs_series_names() {
  local f=${1:-$HS_PATCHES/series}
  [[ -f "$f" ]] || return 0
  grep -v -e '^#' -e '^[[:space:]]*$' "$f" || true
}

# Fingerprints of the series and the overlay: what a build or bundle was
# made from (recorded by build.sh, build-wheel.sh, bundle.sh; checked by
# test.sh and, without lib.sh, by test-gpu.sh on the GPU host).
# LC_ALL=C: the glob order (and so the sha) must not depend on the locale
# (en_US sorts kv-offload-* after kvcache-*, C before).
hs_series_sha256() { (LC_ALL=C; cat "$HS_PATCHES/series" "$HS_PATCHES"/*.patch) | sha256sum | cut -d' ' -f1; }
hs_series_sha() { hs_series_sha256 2>/dev/null | cut -c1-16; }
hs_overlay_sha() { "$HS_PY" "$HS_ROOT/scripts/patchtool.py" manifest --root "$HS_ROOT" | sha256sum | cut -c1-16; }

# Pristine pin as a git repository (built by fetch.sh).
HS_PIN_REPO=$HS_CACHE/pin/vllm-$VLLM_VERSION.git
