#!/usr/bin/env bash
# Build the container image: ci/Dockerfile FROM the official vLLM 0.26.0
# OpenAI-server image (pinned by digest) + the GPU wheel (scripts/build-wheel.sh),
# with OCI labels for the pin, the series and overlay hashes and our commit.
#
# usage: scripts/build-image.sh [--dry-run] [--digest sha256:HEX] [--wheel WHEEL]
#                               [--engine docker|podman|buildah] [--name NAME]
#   --dry-run   print the plan (engine, base, wheel, labels, tags, the exact
#               command) and stop; needs no engine and no registry
#   --digest    the base image digest (else the environment's VLLM_IMAGE_DIGEST,
#               else UPSTREAM's); required: see ci/Dockerfile for how to read it
#   --wheel     the wheel to install (default: scripts/build-wheel.sh's
#               dist/gpu/vllm-<VERSION>-cp38-abi3-linux_x86_64.whl, built
#               first when missing)
#   --engine    force an engine (default: the first of docker, podman, buildah
#               whose daemon/runtime answers)
#   --name      image name (default: vllm-hisparse)
# Tags: NAME:<VERSION with + as -> (immutable) and NAME:<pin>-latest (moving).
source "$(dirname "$0")/lib.sh"

dry=0 digest=${VLLM_IMAGE_DIGEST:-} wheel="" engine="" name=vllm-hisparse
while [[ $# -gt 0 ]]; do
  case $1 in
    --dry-run) dry=1 ;;
    --digest) hs_need 'sha256:HEX' "$@"; digest=$2; shift ;;
    --wheel) hs_need 'a file' "$@"; wheel=$2; shift ;;
    --engine) hs_need 'docker, podman or buildah' "$@"; engine=$2; shift ;;
    --name) hs_need 'a name' "$@"; name=$2; shift ;;
    -h|--help) hs_usage; exit 0 ;;
    *) hs_die "unknown argument: $1" ;;
  esac
  shift
done
base=${VLLM_IMAGE:-docker.io/vllm/vllm-openai:v$VLLM_VERSION}
dockerfile=$HS_ROOT/ci/Dockerfile

# The digest: required, exact form.
if [[ -z "$digest" ]]; then
  hs_die "the base image digest is required (--digest sha256:..., VLLM_IMAGE_DIGEST, or VLLM_IMAGE_DIGEST= in UPSTREAM). These machines reach no registry; where one is reachable, read it with: docker buildx imagetools inspect $base  (or: skopeo inspect --format '{{.Digest}}' docker://$base)"
fi
[[ "$digest" =~ ^sha256:[0-9a-f]{64}$ ]] || hs_die "digest '$digest' is not sha256:<64 hex digits>"

# The engine: one that answers, unless forced.
engine_works() {
  case $1 in
    docker) command -v docker >/dev/null && docker info >/dev/null 2>&1 ;;
    podman) command -v podman >/dev/null && podman info >/dev/null 2>&1 ;;
    buildah) command -v buildah >/dev/null && buildah info >/dev/null 2>&1 ;;
    *) hs_die "unknown engine '$1' (docker, podman or buildah)" ;;
  esac
}
engine_note=""
if [[ -n "$engine" ]]; then
  engine_works "$engine" || engine_note="$engine does not answer here"
else
  for e in docker podman buildah; do
    if engine_works "$e"; then engine=$e; break; fi
  done
  if [[ -z "$engine" ]]; then
    found=""
    for e in docker podman buildah; do
      if command -v "$e" >/dev/null; then found+="$e "; fi
    done
    engine=docker
    engine_note="no engine answers here (${found:+found clients without a daemon: ${found% }; }install podman or buildah: apt-get install podman); the plan shows docker"
  fi
fi

# The wheel and what the labels say.
build_wheel=0
if [[ -z "$wheel" ]]; then
  wheel=$HS_ROOT/dist/gpu/$HS_GPU_WHEEL_NAME  # what scripts/build-wheel.sh writes
  [[ -f "$wheel" ]] || build_wheel=1
fi
if [[ $build_wheel == 1 ]]; then
  wheel_sha="(computed after scripts/build-wheel.sh)"
elif [[ ! -f "$wheel" ]]; then
  hs_die "no such wheel: $wheel"
else
  wheel=$(realpath "$wheel")
  [[ "$(basename "$wheel")" == "vllm-$HS_VERSION-"* ]] || hs_die "$(basename "$wheel") is not vllm $HS_VERSION (VERSION)"
  wheel_sha=$(hs_sha256 "$wheel")
fi
series_sha=$(hs_series_sha256)
overlay_sha=$("$HS_PY" "$HS_ROOT/scripts/patchtool.py" manifest --root "$HS_ROOT" | sha256sum | cut -d' ' -f1)
commit=$(git -C "$HS_ROOT" rev-parse HEAD 2>/dev/null || echo unknown)
[[ -z "$(git -C "$HS_ROOT" status --porcelain -- patches overlay scripts ci UPSTREAM VERSION 2>/dev/null)" ]] || commit="$commit-dirty"
source_url=${HISPARSE_SOURCE_URL:-$(git -C "$HS_ROOT" remote get-url origin 2>/dev/null || echo unknown)}
tag_version=${HS_VERSION//+/-}
tags=("$name:$tag_version" "$name:$VLLM_VERSION-latest")

plan_cmd() {
  local w_sha=$1
  local args=(-f "$dockerfile")
  local kv
  for kv in "VLLM_IMAGE=$base" "VLLM_IMAGE_DIGEST=$digest" "HISPARSE_VERSION=$HS_VERSION" \
            "HISPARSE_WHEEL=$(basename "$wheel")" "HISPARSE_WHEEL_SHA256=$w_sha" \
            "HISPARSE_COMMIT=$commit" "HISPARSE_SOURCE=$source_url" \
            "HISPARSE_SERIES_SHA256=$series_sha" "HISPARSE_OVERLAY_SHA256=$overlay_sha" \
            "VLLM_VERSION=$VLLM_VERSION" "VLLM_COMMIT=$VLLM_COMMIT"; do
    args+=(--build-arg "$kv")
  done
  local t
  for t in "${tags[@]}"; do args+=(-t "$t"); done
  case $engine in
    docker) cmd=(docker build "${args[@]}" "$(dirname "$wheel")") ;;
    podman) cmd=(podman build --format oci "${args[@]}" "$(dirname "$wheel")") ;;
    buildah) cmd=(buildah build --format oci "${args[@]}" "$(dirname "$wheel")") ;;
  esac
}

cat <<EOF
image plan ($( ((dry)) && echo dry run || echo build)):
  engine:   $engine${engine_note:+ ($engine_note)}
  base:     $base@$digest
  wheel:    $wheel$( ((build_wheel)) && echo " (missing: scripts/build-wheel.sh builds it first)")
  sha256:   $wheel_sha
  labels:   org.opencontainers.image.version=$HS_VERSION
            org.opencontainers.image.revision=$commit
            org.opencontainers.image.source=$source_url
            org.opencontainers.image.base.name=$base
            org.opencontainers.image.base.digest=$digest
            io.hisparse.vllm.version=$VLLM_VERSION
            io.hisparse.vllm.commit=$VLLM_COMMIT
            io.hisparse.series.sha256=$series_sha
            io.hisparse.overlay.sha256=$overlay_sha
            io.hisparse.wheel.sha256=$wheel_sha
  tags:     ${tags[*]}
EOF
plan_cmd "$wheel_sha"
printf '  command: '; printf '%q ' "${cmd[@]}"; echo
if [[ $dry == 1 ]]; then
  exit 0
fi

[[ -z "$engine_note" ]] || hs_die "cannot build: $engine_note"
if [[ $build_wheel == 1 ]]; then
  "$HS_ROOT/scripts/build-wheel.sh"
fi
wheel_sha=$(hs_sha256 "$wheel")
plan_cmd "$wheel_sha"
hs_run "${cmd[@]}"
# The labels that landed, read back from the image.
case $engine in
  docker|podman) got=$("$engine" image inspect --format '{{ index .Config.Labels "io.hisparse.series.sha256" }}' "${tags[0]}") ;;
  buildah) got=$(buildah inspect --type image --format '{{ index .OCIv1.Config.Labels "io.hisparse.series.sha256" }}' "${tags[0]}") ;;
esac
[[ "$got" == "$series_sha" ]] || hs_die "image ${tags[0]} carries series label '$got', expected $series_sha"
echo "image: ${tags[*]} (series $series_sha, wheel $wheel_sha)"
