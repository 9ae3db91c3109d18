#!/usr/bin/env bash
# Docker on mosaicfs (issue #39): Docker Engine's fuse-overlayfs storage driver runs the
# `fuse-overlayfs` it finds in PATH; here that is mosaicfs, through a symlink in a directory of
# its own put first in dockerd's PATH (a system fuse-overlayfs stays as it is). dockerd is
# started here with its own data-root, exec-root and socket, and no networking. Checks: docker
# run, a 1-byte write into a 64 MiB image file that leaves kilobytes in the container's upper
# dir, docker diff, docker commit and a run of the committed image, docker build of a
# Dockerfile that appends to the large file, and no mount left behind.
#
# Usage: tests/docker/run.sh [path/to/mosaicfs]   (needs root, docker.io, busybox-static)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=$(realpath "${1:-$here/../../target/release/mosaicfs}")
. "$here/../check.sh"
require_tools "docker test" "tests/deps.sh installs docker.io, containerd, runc, busybox-static" \
  dockerd docker containerd runc busybox

t=$(mktemp -d /var/tmp/mosaicfs-docker.XXXXXX)
mkdir -p "$t/bin"
ln -s "$bin" "$t/bin/fuse-overlayfs"
dockerd_pid=
docker_() { DOCKER_BUILDKIT=0 docker -H "unix://$t/docker.sock" "$@"; }
cleanup() {
  docker_ rm -f $(docker_ ps -aq 2>/dev/null) >/dev/null 2>&1
  [ -n "$dockerd_pid" ] && kill "$dockerd_pid" 2>/dev/null && wait "$dockerd_pid" 2>/dev/null
  grep -E " $t/" /proc/self/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount -l 2>/dev/null
  rm -rf "$t"
}
[ -n "${KEEP:-}" ] || trap cleanup EXIT


PATH="$t/bin:$PATH" dockerd --data-root "$t/data" --exec-root "$t/exec" --pidfile "$t/docker.pid" \
  -H "unix://$t/docker.sock" --storage-driver fuse-overlayfs --bridge none --iptables=false \
  --ip-masq=false --ip-forward=false --exec-opt native.cgroupdriver=cgroupfs > "$t/dockerd.log" 2>&1 &
dockerd_pid=$!
for _ in $(seq 600); do docker_ version >/dev/null 2>&1 && break; sleep 0.1; done
check "dockerd runs the fuse-overlayfs driver with mosaicfs" \
  sh -c "docker -H unix://$t/docker.sock info 2>/dev/null | grep -q 'Storage Driver: fuse-overlayfs'"

# A base image without a registry (busybox-static), and a layer with a 64 MiB file on it.
mkdir -p "$t/rootfs"/{bin,etc,tmp,data} "$t/ctx"
cp "$(command -v busybox)" "$t/rootfs/bin/busybox"
for c in sh cat echo dd stat sync sleep true md5sum; do ln -s busybox "$t/rootfs/bin/$c"; done
tar -C "$t/rootfs" -cf "$t/rootfs.tar" .
head -c $((64 << 20)) /dev/urandom > "$t/ctx/big"
printf 'FROM mosaicfs-base\nCOPY big /data/big\n' > "$t/ctx/Dockerfile"
check "docker import and docker build make an image with a 64 MiB file" sh -c "
  DOCKER_BUILDKIT=0 docker -H unix://$t/docker.sock import $t/rootfs.tar mosaicfs-base >/dev/null &&
  DOCKER_BUILDKIT=0 docker -H unix://$t/docker.sock build -q -t mosaicfs-big $t/ctx >/dev/null"
check "docker run" sh -c "docker -H unix://$t/docker.sock run --rm --network none mosaicfs-big echo hello | grep -qx hello"

want=$( (head -c 1000000 "$t/ctx/big"; printf X; tail -c +1000002 "$t/ctx/big") | md5sum | cut -d' ' -f1)
check "a container writes 1 byte into the image's 64 MiB file" \
  docker_ run --name writer --network none mosaicfs-big sh -c \
  "printf X | dd of=/data/big bs=1 seek=1000000 conv=notrunc 2>/dev/null && md5sum /data/big | grep -q $want"
id=$(docker_ inspect -f '{{.GraphDriver.Data.UpperDir}}' writer)
used=$(du -sk "$id" | cut -f1)
echo "     the container's upper dir holds $used KiB (the file is 65536 KiB)"
check "the 1-byte write left less than 1 MiB in the container's upper dir ($used KiB)" test "$used" -lt 1024
check "docker diff shows the changed file" sh -c "docker -H unix://$t/docker.sock diff writer | grep -qx 'C /data/big'"
check "docker commit, and a run of the committed image reads the write" sh -c "
  docker -H unix://$t/docker.sock commit writer mosaicfs-committed >/dev/null &&
  docker -H unix://$t/docker.sock run --rm --network none mosaicfs-committed md5sum /data/big | grep -q $want"

want2=$( (head -c 1000000 "$t/ctx/big"; printf X; tail -c +1000002 "$t/ctx/big"; printf tail) | md5sum | cut -d' ' -f1)
printf 'FROM mosaicfs-committed\nRUN printf tail >> /data/big\n' > "$t/ctx/Dockerfile"
check "docker build appends to the large file of the committed image" sh -c "
  DOCKER_BUILDKIT=0 docker -H unix://$t/docker.sock build -q -t mosaicfs-appended $t/ctx >/dev/null &&
  docker -H unix://$t/docker.sock run --rm --network none mosaicfs-appended md5sum /data/big | grep -q $want2"
docker_ run -d --name sleeper --network none mosaicfs-base sleep 600 >/dev/null
check "a running container's rootfs is a mosaicfs mount" \
  sh -c "grep -q ' $t/data/fuse-overlayfs/[^ ]*/merged fuse.mosaicfs ' /proc/self/mounts"
docker_ rm -f sleeper >/dev/null 2>&1
docker_ rm -f writer >/dev/null 2>&1
check "no mosaicfs mount is left once the containers are gone" \
  sh -c "! grep ' $t/' /proc/self/mounts | grep -q fuse"

summary docker
