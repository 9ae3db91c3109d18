#!/usr/bin/env bash
# What 100 running containers cost in disk when each writes one byte into an image file (issue
# #55), with containers/storage's kernel overlay driver, fuse-overlayfs 1.10 and 2.0 as
# mount_program, and mosaicfs as mount_program, in one run.
#
# One image holds busybox and a 256 MiB file. N containers (default 100) start from it; each
# writes 1 byte into that file at offset 100,000,000 and keeps running. After the last one has
# written, the containers stay up --idle seconds (default 60: longer than any delay mosaicfs'
# completion waits), and the table gives `du` of their upper layers together (each container's
# GraphDriver UpperDir) and of the storage's whole overlay directory (the image layer
# included).
#
# Usage: bench/podman-space.sh [--containers N] [--idle S]   (as root; needs podman, runc)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=$(realpath "${MOSAICFS:-$here/../target/release/mosaicfs}")
fo2=${FUSE_OVERLAYFS_2:-/var/tmp/fo2/bin/fuse-overlayfs}
containers=100 idle=60
while [ $# -gt 0 ]; do
  case $1 in
    --containers) containers=$2; shift 2 ;;
    --idle) idle=$2; shift 2 ;;
    *) echo "usage: bench/podman-space.sh [--containers N] [--idle S]" >&2; exit 2 ;;
  esac
done
command -v podman >/dev/null || apt-get install -y -qq podman runc busybox-static fuse-overlayfs >/dev/null
root=${BENCH_DIR:-/var/tmp/mfs-ps}   # podman wants a short runroot path
rm -rf "$root"; mkdir -p "$root/rootfs"/{bin,etc,tmp,data}
cp "$(command -v busybox)" "$root/rootfs/bin/busybox"
for c in sh dd printf sleep test; do ln -s busybox "$root/rootfs/bin/$c"; done
echo "root:x:0:0:root:/root:/bin/sh" > "$root/rootfs/etc/passwd"
head -c $((256 << 20)) /dev/urandom > "$root/rootfs/data/image"
tar -C "$root/rootfs" -cf "$root/rootfs.tar" .
rm -rf "$root/rootfs"

setups=(overlay fuse-overlayfs)
[ -x "$fo2" ] && setups+=(fuse-overlayfs-2.0)
setups+=(mosaicfs)
source "$here/podman-setups.sh"
# Daemons of the last containers may still be exiting and podman still cleaning up: retried.
remove() { for _ in 1 2 3 4 5 6 7 8 9 10; do rm -rf "$1" 2>/dev/null && return; sleep 2; done; rm -rf "$1"; }
kib() { du -sx --block-size=1024 -c "$@" | tail -1 | cut -f1; }

declare -A uppers whole
for setup in "${setups[@]}"; do
  podman_for "$setup" import -q "$root/rootfs.tar" localhost/space:1 >/dev/null
  for i in $(seq "$containers"); do
    podman_for "$setup" run -d --name "c$i" --network none --ulimit nofile=20000:20000 --ulimit nproc=32768:32768 \
      localhost/space:1 sh -c \
      'printf X | dd of=/data/image bs=1 seek=100000000 count=1 conv=notrunc 2>/dev/null &&
       touch /tmp/written && exec sleep 100000' >/dev/null
  done
  for i in $(seq "$containers"); do
    until podman_for "$setup" exec "c$i" test -e /tmp/written; do sleep 0.2; done
  done
  sleep "$idle"
  dirs=()
  for i in $(seq "$containers"); do
    dirs+=("$(podman_for "$setup" inspect --format '{{.GraphDriver.Data.UpperDir}}' "c$i")")
  done
  uppers[$setup]=$(kib "${dirs[@]}")
  whole[$setup]=$(kib "$root/$setup/root/overlay")
  echo "# $setup: containers' uppers ${uppers[$setup]} KiB, overlay dir ${whole[$setup]} KiB" >&2
  podman_for "$setup" rm -af -t 0 >/dev/null
  podman_for "$setup" rmi -af >/dev/null 2>&1 || true
  remove "${root:?}/$setup"
done

echo
echo "Podman space, $(date -u +%Y-%m-%d), $(nproc) cores, $(uname -r), podman $(podman --version | awk '{print $3}'), root,"
echo "$containers running containers from one image, 1 byte written into its 256 MiB file by each, then $idle s idle"
echo
echo "| du (KiB) |$(printf ' %s |' "${setups[@]}")"
echo "|---|$(printf -- '---|%.0s' "${setups[@]}")"
row() { local name=$1; shift; local -n v=$1; local cells=""; for s in "${setups[@]}"; do cells+=" $(printf "%s" "${v[$s]}") |"; done; echo "| $name |$cells"; }
row "the containers' upper layers together" uppers
row "the storage's overlay directory (image layer included)" whole
remove "$root"
