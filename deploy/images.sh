#!/usr/bin/env bash
# Build the three images (grammar service, worker, gateway) from the repository root:
#
#   deploy/images.sh                 on python:3.11-slim (pulled from a registry)
#   deploy/images.sh --local-base    on a base made from Debian's packages (deploy/base-image.sh),
#                                    for machines that reach no image registry
#
# Environment: BASE_IMAGE (another base; with --local-base, the tag it is built under), ENGINE
# (podman or docker; default podman when installed), TORCH_VERSION (default 2.13.0), WHEELS (a
# directory holding torch-$TORCH_VERSION+cpu-*.whl: the worker image installs that wheel instead
# of downloading it; default $PIP_FIND_LINKS when that is a directory), PIP_CERT (a CA bundle for
# pip's downloads). Unchanged layers come from the engine's cache.
set -euo pipefail
cd "$(dirname "$0")/.."

engine=${ENGINE:-$(command -v podman >/dev/null && echo podman || echo docker)}
torch=${TORCH_VERSION:-2.13.0}
local_base=localhost/maskwire-base:3.11-bookworm
base=${BASE_IMAGE:-python:3.11-slim}
make_base=
for arg in "$@"; do
  case $arg in
    --local-base) base=${BASE_IMAGE:-$local_base} make_base=1 ;;
    *) echo "usage: deploy/images.sh [--local-base]" >&2; exit 2 ;;
  esac
done
version=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -1)

if [ -n "$make_base" ]; then
  ENGINE=$engine deploy/base-image.sh "$base"
fi

# A local torch CPU wheel goes into the build context (deploy/docker/wheels, never committed); the
# wheel's other dependencies then come from PyPI, where no torch+cpu exists to be confused with.
build_args=(--build-arg "BASE_IMAGE=$base" --build-arg "TORCH_VERSION=$torch")
# A CA bundle that pip must trust (behind a TLS-inspecting proxy): lent to the build steps that
# download as a build secret, kept out of the images.
if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ]; then
  build_args+=(--secret "id=pip-cert,src=$PIP_CERT")
fi
wheels=${WHEELS:-${PIP_FIND_LINKS:-}}
find deploy/docker/wheels -name '*.whl' -delete
if [ -d "$wheels" ]; then
  for whl in "$wheels"/torch-"$torch"+cpu-*.whl; do
    [ -e "$whl" ] || continue
    cp -l "$whl" deploy/docker/wheels/ 2>/dev/null || cp "$whl" deploy/docker/wheels/
    build_args+=(--build-arg TORCH_INDEX_URL=https://pypi.org/simple)
    echo "torch wheel: $whl"
    break
  done
fi

for name in grammar worker gateway; do
  dockerfile=deploy/docker/Dockerfile.$name
  podman_args=()
  # BuildKit reads <Dockerfile>.dockerignore by itself; podman is told. The OCI format (podman's
  # default) has no place for HEALTHCHECK: the Docker format keeps it.
  [ "$engine" = podman ] && podman_args=(--ignorefile "$dockerfile.dockerignore" --format docker)
  began=$SECONDS
  echo "=== maskwire-$name:$version on $base"
  "$engine" build "${build_args[@]}" "${podman_args[@]}" -f "$dockerfile" -t "maskwire-$name:$version" .
  echo "=== maskwire-$name:$version: $((SECONDS - began)) s"
done
"$engine" image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E "maskwire-(grammar|worker|gateway|base)"
