#!/usr/bin/env bash
# Turn the generated tree into an editable stgit stack whose patch names equal
# the series file names (house style: the name never comes from the subject).
#
# usage: scripts/stack.sh [--to DIR] [--force]      apply + stg init + uncommit
#        scripts/stack.sh --refresh-base [--to DIR]  rebuild an existing stack
#                                                    on pin + current overlay/
# Edit with stg (stg goto/refresh/new/edit), then scripts/export.sh.
# Uses `stg uncommit NAME...` rather than importing mbox files: stgit 0.19's
# mbox import garbles descriptions.
source "$(dirname "$0")/lib.sh"

dir=$HS_WORK/vllm refresh=0 pass=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --to) hs_need 'a directory' "$@"; dir=$2; shift ;;
    --refresh-base) refresh=1 ;;
    --force) pass+=(--force) ;;
    -h|--help) hs_usage; exit 0 ;;
    *) hs_die "unknown argument: $1" ;;
  esac
  shift
done
dir=$(realpath -m "$dir")
hs_require_stg
# stgit records stack metadata as commits: give it an identity; the
# developer's own identity still applies to the patches they write later.
export GIT_AUTHOR_NAME=${GIT_AUTHOR_NAME:-$HS_BOT_NAME} GIT_AUTHOR_EMAIL=${GIT_AUTHOR_EMAIL:-$HS_BOT_EMAIL}
export GIT_COMMITTER_NAME=${GIT_COMMITTER_NAME:-$HS_BOT_NAME} GIT_COMMITTER_EMAIL=${GIT_COMMITTER_EMAIL:-$HS_BOT_EMAIL}
stg_() { (cd "$dir" && GIT_CONFIG_NOSYSTEM=1 stg "$@"); }

mapfile -t names < <(hs_series_names)

if [[ $refresh == 1 ]]; then
  # Rebuild the stack on pin + current overlay/ from its own patches. (stgit
  # 0.19's `stg rebase` resets author dates, which would change the bytes of
  # every patch; git am keeps them.)
  [[ -d "$dir/.git" ]] || hs_die "$dir is not a stack; run scripts/stack.sh first"
  [[ -z "$(hs_git -C "$dir" status --porcelain --untracked-files=no)" ]] \
    || hs_die "$dir has uncommitted changes; stg refresh them into a patch first"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  HISPARSE_PATCHES=$tmp/patches "$HS_ROOT/scripts/export.sh" --from "$dir"
  HISPARSE_PATCHES=$tmp/patches "$HS_ROOT/scripts/stack.sh" --to "$dir" --force
  hs_log "stack rebuilt on overlay base $(hs_git -C "$dir" rev-parse --short=12 refs/patches/base)"
  exit 0
fi

"$HS_ROOT/scripts/apply.sh" --to "$dir" "${pass[@]}"
hs_run stg_ init
if [[ ${#names[@]} -gt 0 ]]; then
  reversed=()
  for ((i = ${#names[@]} - 1; i >= 0; i--)); do reversed+=("${names[$i]}"); done
  hs_run stg_ uncommit -- "${reversed[@]}" >/dev/null
fi
got=$(stg_ series --noprefix)
want=$(printf '%s\n' "${names[@]}")
[[ "$got" == "${want%$'\n'}" ]] || hs_die "stg series differs from patches/series:"$'\n'"$got"
hs_log "stack ready in $dir: ${#names[@]} patches (stg series)"
