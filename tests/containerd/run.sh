#!/usr/bin/env bash
# containerd on mosaicfs (issue #39): containerd's own snapshotter test suite against
# mosaicfs-snapshotter through the proxy, and containerd's overlayfs snapshotter as the
# reference (suite_test.go, blocks_test.go); then containerd itself, started here with its own
# root, state and socket, with mosaicfs-snapshotter as a proxy plugin: an image imported and
# unpacked into it, containers run with `ctr run --snapshotter mosaicfs`, a 1-byte write into a
# 64 MiB image file that leaves kilobytes in the container's layer, no mount left behind.
#
# Usage: tests/containerd/run.sh [target/release]   (needs root, Go, containerd, runc,
# busybox-static, and mosaicfs installed in PATH: make install)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bins=$(realpath "${1:-$here/../../target/release}")
export PATH=$PATH:/usr/local/go/bin
for tool in go containerd ctr runc busybox mount.fuse3 mosaicfs; do
  if ! command -v $tool >/dev/null; then
    echo "containerd test: '$tool' is missing (tests/deps.sh installs containerd, runc, busybox-static" \
      "and fuse3; Go from go.dev or apt golang-go; mosaicfs with make install)"
    exit 1
  fi
done

. "$here/../check.sh"

t=$(mktemp -d /var/tmp/mosaicfs-containerd.XXXXXX)
pids=()
cleanup() {
  for c in $(ctr_ -n t tasks ls -q 2>/dev/null); do ctr_ -n t tasks kill -s KILL "$c" >/dev/null 2>&1; done
  sleep 0.5
  for c in $(ctr_ -n t containers ls -q 2>/dev/null); do ctr_ -n t containers rm "$c" >/dev/null 2>&1; done
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  grep " $t/" /proc/self/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount -l 2>/dev/null
  rm -rf "$t"
}
[ -n "${KEEP:-}" ] || trap cleanup EXIT

# --- containerd's snapshotter suite, mosaicfs and the overlayfs reference ---
suite() {
  (cd "$here" && MOSAICFS_SNAPSHOTTER=$bins/mosaicfs-snapshotter go test -count=1 -v . -args -test.root) \
    > "$t/suite.log" 2>&1
}
check "containerd snapshotter suite: mosaicfs-snapshotter and overlayfs (go test)" suite
for s in Mosaicfs Overlayfs; do
  echo "     $s: $(grep -cE -- "--- PASS: Test${s}Snapshotter[A-Za-z]*/" "$t/suite.log") passed," \
    "$(grep -cE -- "--- FAIL: Test${s}Snapshotter[A-Za-z]*/" "$t/suite.log") failed," \
    "$(grep -cE -- "--- SKIP: Test${s}Snapshotter[A-Za-z]*/" "$t/suite.log") skipped by the suite"
done
grep -E -A 5 -- "--- FAIL" "$t/suite.log" | head -40 | sed 's/^/     /'

# --- containerd itself ---
. "$here/containerd.sh"

"$bins/mosaicfs-snapshotter" --address "$t/snapshotter.sock" --root "$t/snapshotter" > "$t/snapshotter.log" 2>&1 &
pids+=($!)
start_containerd mosaicfs="$t/snapshotter.sock"

# An image without a registry: busybox-static, and a second layer with a 64 MiB file.
busybox_layer "$t/l1" sh cat echo dd stat sync sleep true wc md5sum
mkdir -p "$t/l2/data"
head -c $((64 << 20)) /dev/urandom > "$t/l2/data/big"
"$here/oci-image.py" "$t/image.tar" mosaicfs-test:latest "$t/l1" "$t/l2"
img=docker.io/library/mosaicfs-test:latest

check "ctr images import unpacks into mosaicfs-snapshotter" \
  ctr_ -n t images import --snapshotter mosaicfs "$t/image.tar"
check "the image's layers are committed snapshots of mosaicfs" \
  sh -c "ctr --address $t/containerd.sock -n t snapshots --snapshotter mosaicfs ls | grep -c Committed | grep -qx 2"

check "ctr run --snapshotter mosaicfs runs a container" \
  sh -c "ctr --address $t/containerd.sock -n t run --rm --snapshotter mosaicfs $img c1 sh -c 'echo hello' | grep -qx hello"

# A container that writes 1 byte into the image's 64 MiB file and keeps running: its rootfs is
# a mosaicfs mount, and its layer holds a block, not the file.
want=$( (head -c 1000000 "$t/l2/data/big"; printf X; tail -c +1000002 "$t/l2/data/big") | md5sum | cut -d' ' -f1)
ctr_ -n t run -d --snapshotter mosaicfs "$img" c2 sh -c \
  'printf X | dd of=/data/big bs=1 seek=1000000 conv=notrunc 2>/dev/null; sync; touch /tmp/done; sleep 600' > /dev/null
for _ in $(seq 100); do ctr_ -n t tasks exec --exec-id w c2 true 2>/dev/null && \
  ctr_ -n t tasks exec --exec-id x c2 sh -c 'test -e /tmp/done' 2>/dev/null && break; sleep 0.1; done
check "the container's rootfs is a mosaicfs mount" \
  sh -c "grep -q '^mosaicfs $t/state/.*/c2/rootfs fuse.mosaicfs ' /proc/self/mounts"
check "the container reads its write and the rest of the file" \
  sh -c "ctr --address $t/containerd.sock -n t tasks exec --exec-id m c2 md5sum /data/big | grep -q $want"
usage=$(ctr_ -n t snapshots --snapshotter mosaicfs usage c2 | awk 'NR==2 {print $2 " " $3}')
echo "     snapshot usage after a 1-byte write into a 64 MiB image file: $usage"
check "a 1-byte write into a 64 MiB image file leaves less than 1 MiB in the layer ($usage)" \
  sh -c "ctr --address $t/containerd.sock -n t snapshots --snapshotter mosaicfs usage c2 | awk 'NR==2' | grep -Eq ' [0-9.]+ ?(B|KiB|kB) '"
ctr_ -n t tasks kill -s KILL c2 >/dev/null 2>&1
for _ in $(seq 100); do ctr_ -n t tasks ls -q | grep -q c2 || break; ctr_ -n t tasks rm c2 >/dev/null 2>&1; sleep 0.1; done
check "a child of the committed container layer, mounted with mount -t fuse3.mosaicfs, reads the write" sh -c "
  ctr --address $t/containerd.sock -n t snapshots --snapshotter mosaicfs commit c2-layer c2 &&
  ctr --address $t/containerd.sock -n t snapshots --snapshotter mosaicfs prepare c3 c2-layer >/dev/null &&
  mkdir -p $t/c3 && ctr --address $t/containerd.sock -n t snapshots --snapshotter mosaicfs mounts $t/c3 c3 | sh &&
  md5sum $t/c3/data/big | grep -q $want; rc=\$?; umount $t/c3; exit \$rc"
check "no mosaicfs mount is left once the containers are gone" \
  sh -c "ctr --address $t/containerd.sock -n t containers rm c2 >/dev/null; ! grep ' $t/' /proc/self/mounts | grep -q fuse.mosaicfs"
check "the snapshotter logged no error" sh -c "! grep -v -e '^mosaicfs-snapshotter: serving' $t/snapshotter.log"

summary containerd
