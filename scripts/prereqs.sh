#!/usr/bin/env bash
# Check, and where possible install, what the series tooling needs before
# anything is downloaded. scripts/build.sh runs it first.
#
# usage: scripts/prereqs.sh [--tier cpu|gpu] [--check]
#   cpu (default)  git >= $GIT_MIN_VERSION, stg (stgit), curl, and python3 >= 3.11
#                  with venv (pip comes from ensurepip)
#   gpu            also nvcc (CUDA 13 toolkit) for the kernel extension
#   --check        never install; report what is missing and exit 1
# Missing Debian packages are installed with apt-get when run as root (the
# package lists are refreshed only when apt has no candidate). Otherwise the
# script stops with one error naming every missing package, before any
# download. A tool it installed that PATH does not reach (a trimmed PATH) is
# linked into .cache/tools/bin, which lib.sh puts first on PATH for every
# script. HISPARSE_STG=/path/to/stg names an stg binary explicitly.
source "$(dirname "$0")/lib.sh"

tier=cpu check_only=0
while [[ $# -gt 0 ]]; do
  case $1 in
    --tier) hs_need 'cpu or gpu' "$@"; tier=$2; shift ;;
    --check) check_only=1 ;;
    -h|--help) hs_usage; exit 0 ;;
    *) hs_die "unknown argument: $1" ;;
  esac
  shift
done
[[ $tier == cpu || $tier == gpu ]] || hs_die "--tier must be cpu or gpu, got '$tier'"

# version_ge A B: A >= B for dotted numeric versions.
version_ge() { [[ "$(printf '%s\n%s\n' "$2" "$1" | sort -V | head -n1)" == "$2" ]]; }

# Each check prints nothing when satisfied, else "debian-package|what is wrong".
check_git() {
  command -v git >/dev/null || { echo "git|git is not installed"; return; }
  local v; v=$(git --version | awk '{print $3}')
  version_ge "$v" "$GIT_MIN_VERSION" || echo "git|git $v is older than $GIT_MIN_VERSION"
}
check_stg() {
  if [[ -n "${HISPARSE_STG:-}" ]]; then
    [[ -x "$HISPARSE_STG" ]] || { echo "stgit|HISPARSE_STG=$HISPARSE_STG is not executable"; return; }
    link_tool stg "$HISPARSE_STG"
    return
  fi
  command -v stg >/dev/null && return
  # After this script installed the package: find its binary even when PATH
  # does not reach it.
  if [[ $installed == 1 ]]; then
    local bin; bin=$(dpkg -L stgit 2>/dev/null | grep -m1 '/bin/stg$' || true)
    if [[ -n "$bin" && -x "$bin" ]]; then link_tool stg "$bin"; return; fi
  fi
  echo "stgit|stg (stgit $STGIT_VERSION, the patch-stack editor) is not installed"
}
check_curl() {
  command -v curl >/dev/null || echo "curl|curl is not installed"
}
check_python() {
  local py; py=$(command -v "$HS_PY" || true)
  [[ -n "$py" ]] || { echo "python3-venv|$HS_PY is not installed"; return; }
  "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
    || { echo "python3|$HS_PY is $("$py" -c 'import platform; print(platform.python_version())' 2>/dev/null || echo '?'), 3.11+ is needed"; return; }
  "$py" -c 'import venv, ensurepip' 2>/dev/null || echo "python3-venv|$HS_PY has no venv/ensurepip module"
}
check_nvcc() {
  local nvcc=""
  for c in "${CUDA_HOME:+$CUDA_HOME/bin/nvcc}" /usr/local/cuda/bin/nvcc "$(command -v nvcc || true)"; do
    [[ -n "$c" && -x "$c" ]] && { nvcc=$c; break; }
  done
  # No Debian package carries CUDA 13: it is named, never installed.
  [[ -n "$nvcc" ]] || { echo "-|nvcc (CUDA 13 toolkit) not found: install it and set CUDA_HOME"; return; }
  local v; v=$("$nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
  version_ge "${v:-0}" 13.0 || echo "-|nvcc $v is older than 13.0 (set CUDA_HOME to a CUDA 13 toolkit)"
}

# link_tool NAME PATH: make PATH's binary reachable as NAME for every script.
link_tool() {
  mkdir -p "$HS_TOOLS"
  ln -sfn "$2" "$HS_TOOLS/$1"
  hs_log "$1: using $2 (linked into $HS_TOOLS)"
}

run_checks() {
  check_git; check_stg; check_curl; check_python
  if [[ $tier == gpu ]]; then check_nvcc; fi
}

installed=0
mapfile -t problems < <(run_checks)
if [[ ${#problems[@]} -gt 0 && $check_only == 0 && $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
  pkgs=()
  for p in "${problems[@]}"; do
    pkg=${p%%|*}
    [[ $pkg != - && " ${pkgs[*]} " != *" $pkg "* ]] && pkgs+=("$pkg")
  done
  if [[ ${#pkgs[@]} -gt 0 ]]; then
    # Refresh the package lists only when one of them has no candidate.
    for pkg in "${pkgs[@]}"; do
      if ! apt-cache policy "$pkg" 2>/dev/null | grep 'Candidate: [0-9]' >/dev/null; then
        hs_run apt-get update -q >/dev/null
        break
      fi
    done
    DEBIAN_FRONTEND=noninteractive hs_run apt-get install -y -q --no-install-recommends "${pkgs[@]}" >/dev/null \
      || hs_die "apt-get install ${pkgs[*]} failed"
    installed=1
    mapfile -t problems < <(run_checks)
  fi
fi
if [[ ${#problems[@]} -gt 0 ]]; then
  pkgs=() why=()
  for p in "${problems[@]}"; do
    [[ ${p%%|*} != - ]] && pkgs+=("${p%%|*}")
    why+=("${p#*|}")
  done
  hint=""
  [[ ${#pkgs[@]} -gt 0 ]] && hint=" Install the Debian package(s): sudo apt-get install ${pkgs[*]} (or run scripts/build.sh as root, which does)."
  hs_die "missing prerequisites: $(IFS=';'; echo "${why[*]}" | sed 's/;/; /g').$hint"
fi
hs_log "prerequisites ok ($tier tier): git $(git --version | awk '{print $3}'), $(stg --version 2>/dev/null | sed -n 's/^Stacked GIT /stgit /p'), $("$HS_PY" -c 'import platform; print("python", platform.python_version())')"
