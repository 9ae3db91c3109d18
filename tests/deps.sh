#!/usr/bin/env bash
# Installs what `make test` needs from Debian's packages, when any of it is missing (as root;
# apt-get update first). Rust comes from rustup: Debian's rustc is too old for edition 2024.
set -euo pipefail
packages=(fuse3 fuse-overlayfs attr acl bc procps util-linux podman runc busybox-static zstd
  erofs-utils squashfuse squashfs-tools sshfs openssh-server glusterfs-server glusterfs-client
  xfsprogs btrfs-progs e2fsprogs python3 strace containerd docker.io protobuf-compiler uidmap bats
  docker-registry stargz-snapshotter curl)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "tests/deps.sh: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# Go builds containerd's snapshotter test suite (tests/containerd); Debian's is old but enough.
if ! command -v go >/dev/null && [ ! -x /usr/local/go/bin/go ]; then
  echo "tests/deps.sh: installing golang-go"
  apt-get install -y -qq golang-go >/dev/null
fi
command -v cargo >/dev/null || { echo "cargo is needed: install Rust with rustup (1.88 or later)"; exit 1; }
