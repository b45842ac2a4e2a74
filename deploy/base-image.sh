#!/usr/bin/env bash
# A local base image with Python 3.11, made from Debian bookworm's packages, for machines that reach
# Debian's archive but no image registry (where `python:3.11-slim` cannot be pulled):
# mmdebstrap builds the root filesystem, `<engine> import` turns it into an image.
#
#   deploy/base-image.sh [TAG]     default localhost/maskwire-base:3.11-bookworm
#
# An image already present under TAG is kept (REBUILD=1 builds it again). ENGINE (podman or
# docker; default: podman when installed), DEBIAN_MIRROR and DEBIAN_SECURITY_MIRROR override the
# defaults. Needs root (or mmdebstrap's unshare mode) and mmdebstrap.
set -euo pipefail

tag=${1:-localhost/maskwire-base:3.11-bookworm}
engine=${ENGINE:-$(command -v podman >/dev/null && echo podman || echo docker)}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
security=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}

if [ -z "${REBUILD:-}" ] && "$engine" image inspect "$tag" >/dev/null 2>&1; then
  echo "base image $tag: present"
  exit 0
fi
command -v mmdebstrap >/dev/null || {
  echo "base-image.sh: mmdebstrap is not installed (apt-get install mmdebstrap)" >&2
  exit 1
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# minbase: the essential and required packages and apt (the worker image installs g++ with it).
# Documentation, manual pages and translations are left out (copyright files kept), also for what
# the images install later: the dpkg options stay in the root filesystem.
# The merged-usr hook lays out /usr as bookworm has it without the usrmerge package (and the Perl
# it pulls in).
mmdebstrap --variant=minbase --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
  --include=python3,python3-venv,ca-certificates,netbase \
  --aptopt='APT::Install-Recommends "false"' \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-exclude=/usr/share/info/*' \
  --customize-hook='chroot "$1" python3 -c "import sys, venv; assert sys.version_info[:2] == (3, 11), sys.version"' \
  bookworm "$work/rootfs.tar" \
  "deb $mirror bookworm main" \
  "deb $mirror bookworm-updates main" \
  "deb $security bookworm-security main"

"$engine" import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  "$work/rootfs.tar" "$tag"
echo "base image $tag: built"
