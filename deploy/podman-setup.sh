#!/usr/bin/env bash
# Prepare this machine to build and run the images with podman (CI's container stage runs it):
# Debian's podman, podman-compose, mmdebstrap and runc where missing; the CNI plugin that gives a
# compose network its DNS (bookworm's podman 4.3 uses CNI, where containers resolve each other's
# service names only through dnsname); and the engine settings that run containers on a VM with
# cgroups in hybrid mode whose limits cannot be raised:
#   runtime = "runc"       crun refuses to start containers with cgroups in hybrid mode;
#   default_ulimits = []   podman otherwise raises RLIMIT_NOFILE / RLIMIT_NPROC in every container,
#                          which such a VM does not permit ("error setting rlimit type 7").
# Idempotent; run as root on Debian (bookworm: podman 4.3, podman-compose 1.0.3).
set -euo pipefail

packages=(podman podman-compose mmdebstrap runc uidmap slirp4netns fuse-overlayfs
  golang-github-containernetworking-plugin-dnsname)
conf=/etc/containers/containers.conf.d/50-maskwire.conf

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "podman-setup.sh: missing ${missing[*]}; install them as root with apt-get (Debian)" >&2
    exit 1
  fi
  echo "installing ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

want='# Written by deploy/podman-setup.sh (maskwire): runc, and no raised ulimits (hybrid cgroups VMs).
[containers]
default_ulimits = []

[engine]
runtime = "runc"'
if [ "$(cat "$conf" 2>/dev/null)" != "$want" ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "podman-setup.sh: $conf must be written as root" >&2
    exit 1
  fi
  mkdir -p "$(dirname "$conf")"
  printf '%s\n' "$want" >"$conf"
  echo "wrote $conf"
fi
podman --version
podman-compose version 2>/dev/null | grep -i "composer version" || true
