#!/usr/bin/env bash
# Lazily pulled images under mosaicfs (issue #59): Podman runs a container from an eStargz image
# whose layers a layer store serves from a registry on 127.0.0.1 a chunk at a time, with mosaicfs
# as the overlay's mount program; a 1-byte write into a big file of the image fetches a chunk, not
# the file. Then the same under containerd, with mosaicfs-snapshotter taking the layers from a
# layer store (--layer-store) as `ctr-remote image rpull` names them. Everything is started here:
# Debian's docker-registry, the layer stores (tests/lazy/layers, built with Go from
# stargz-snapshotter's published module), containerd, an image made by this script.
#
# Bytes are counted from the registry's access log (the size of every response to a blob GET).
# The store prefetches nothing and fetches nothing in the background, so what it fetched was
# asked for by a reader. A layer Podman pulled whole instead of taking it from the store is a
# failure: every layer of the image must be one the store serves (containers/storage writes a
# file `additionallayer` into such a layer's directory; docs/ENGINES.md, "Lazily pulled images").
#
# Usage: tests/lazy/run.sh [path/to/mosaicfs]   (root; podman, runc, containerd, go; installs
# docker-registry and stargz-snapshotter's ctr-remote from Debian; mosaicfs-snapshotter in PATH)
# Env: LAZY_BIG_MIB (size of the big file, default 64), KEEP=1 (keep the work dir and daemons).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=$(realpath "${1:-$here/../../target/release/mosaicfs}")
. "$here/../check.sh"
. "$here/lib.sh"
podman_roots=(root whole)
start_store store
check "the layer store is mounted" mountpoint -q "$t/store"

# Every layer of the image is one the store serves (lazily), none was pulled whole:
# containers/storage makes such a layer's diff a link into the store and marks its directory.
layers_are_lazy() {
  local dirs d n=0
  dirs=$(podman image inspect --format '{{.GraphDriver.Data.LowerDir}}:{{.GraphDriver.Data.UpperDir}}' "$image") || return 1
  for d in ${dirs//:/ }; do
    n=$((n + 1))
    [ -f "$(dirname "$d")/additionallayer" ] ||
      { echo "layer $d was pulled whole, not served by the store"; return 1; }
  done
  [ "$n" -eq 2 ] || { echo "expected 2 layers, found $n: $dirs"; return 1; }
}

start=$(log_lines)
check "podman pull of the eStargz image" podman pull -q --tls-verify=false "$image"
check "every layer is served by the layer store" layers_are_lazy
pulled=$(served_since "$start")
check "the pull fetched under 4 MiB ($pulled bytes; the image is over $big_mib MiB)" test "$pulled" -lt $((4 << 20))
pulled_whole_is_seen() {
  PODMAN_ROOT=whole LAYER_STORE= podman pull -q --tls-verify=false "$image" >/dev/null || return 1
  ! PODMAN_ROOT=whole LAYER_STORE= layers_are_lazy
}
check "a pull without the layer store is seen as a whole pull" pulled_whole_is_seen

start=$(log_lines)
check "a container runs from the lazy image" \
  podman run --rm "${RUN[@]}" "$image" sh -c 'test "$(cat /data/small/250)" = "small file 250"'
ran=$(served_since "$start")
check "running it fetched under 4 MiB ($ran bytes)" test "$ran" -lt $((4 << 20))

# The 1-byte write: mosaicfs reads the block it lands in, the store fetches the chunk holding it.
start=$(log_lines)
check "a container writes 1 byte into the middle of the ${big_mib} MiB image file" \
  podman run --name writer "${RUN[@]}" "$image" sh -c '
    printf x | dd of=/data/big bs=1 seek=1000000 conv=notrunc 2>/dev/null && sync &&
    test "$(dd if=/data/big bs=1 skip=1000000 count=1 2>/dev/null)" = x'
wrote=$(served_since "$start")
echo "     the registry served $wrote bytes for the write"
check "the write fetched the chunk it lands in, under 8 MiB of the ${big_mib} MiB file" test "$wrote" -gt 0 -a "$wrote" -lt $((8 << 20))
upper_kib() { du -sk "$(podman inspect --format '{{.GraphDriver.Data.UpperDir}}' writer)" | cut -f1; }
check "the container's upper holds blocks, not the file ($(upper_kib) KiB)" test "$(upper_kib)" -lt 1024

# What the container sees is the image's bytes with the one byte changed.
python3 - "$t/big/data/big" "$t/expected" <<'EOF'
import sys
data = bytearray(open(sys.argv[1], "rb").read())
data[1000000] = ord("x")
open(sys.argv[2], "wb").write(data)
EOF
expected_sum=$(md5sum < "$t/expected" | cut -d' ' -f1)
check "podman commit of the container that wrote" podman commit -q writer localhost/lazy/written:1
whole_file_reads_right() {
  local sum
  sum=$(podman run --rm "${RUN[@]}" localhost/lazy/written:1 md5sum /data/big | cut -d' ' -f1)
  [ "$sum" = "$expected_sum" ] || { echo "md5 $sum, expected $expected_sum"; return 1; }
}
check "the committed image's file is the image's bytes with the one byte written" whole_file_reads_right

# --- containerd: mosaicfs-snapshotter taking the image's layers from a layer store ---
# ctr-remote (Debian's stargz-snapshotter package) pulls with the labels that name each layer's
# image and digest; the snapshotter commits the store's tree as the layer's snapshot and
# containerd fetches nothing more.
if ! command -v ctr-remote >/dev/null; then
  echo "lazy: installing stargz-snapshotter (ctr-remote)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq stargz-snapshotter >/dev/null
fi
require_tools "lazy pull" "make install puts mosaicfs-snapshotter in /usr/local/bin; tests/deps.sh installs containerd" \
  ctr-remote containerd ctr mosaicfs-snapshotter
. "$here/../containerd/containerd.sh"
containerd_cleanup() {
  ctr_ -n t tasks kill -s KILL lazy >/dev/null 2>&1
  for _ in $(seq 50); do ctr_ -n t tasks rm lazy >/dev/null 2>&1 || break; sleep 0.1; done
  ctr_ -n t containers rm lazy >/dev/null 2>&1
  ctr_ -n t images rm "$image" >/dev/null 2>&1
}
[ -n "${KEEP:-}" ] || trap 'containerd_cleanup; cleanup' EXIT
start_store store-ctd
mosaicfs-snapshotter --address "$t/snapshotter.sock" --root "$t/snapshotter" \
  --layer-store "$t/store-ctd" > "$t/snapshotter.log" 2>&1 &
pids+=($!)
start_containerd mosaicfs="$t/snapshotter.sock"  # not through check: its pid goes to pids
check "containerd runs with mosaicfs-snapshotter as a proxy plugin" ctr_ version
start=$(log_lines)
check "ctr-remote image rpull --snapshotter mosaicfs" \
  ctr-remote --address "$t/containerd.sock" -n t image rpull --plain-http --snapshotter mosaicfs "$image"
pulled=$(served_since "$start")
check "the pull fetched under 4 MiB ($pulled bytes)" test "$pulled" -lt $((4 << 20))
remote_snapshots() {
  local names n=0 s
  names=$(ctr_ -n t snapshots --snapshotter mosaicfs ls | awk 'NR > 1 && $NF == "Committed" {print $1}')
  for s in $names; do
    n=$((n + 1))
    ctr_ -n t snapshots --snapshotter mosaicfs info "$s" | grep -q '"containerd.io/snapshot/remote"' ||
      { echo "snapshot $s was unpacked, not taken from the layer store"; return 1; }
  done
  [ "$n" -eq 2 ] || { echo "expected 2 committed snapshots, found $n"; return 1; }
}
check "both layers are the layer store's (remote snapshots)" remote_snapshots
check "ctr run --snapshotter mosaicfs runs a container from the lazy layers" \
  sh -c "ctr --address $t/containerd.sock -n t run --rm --snapshotter mosaicfs $image once cat /data/small/7 | grep -qx 'small file 7'"

ctr_ -n t run -d --snapshotter mosaicfs "$image" lazy sleep 600 >/dev/null
rootfs=$t/state/io.containerd.runtime.v2.task/t/lazy/rootfs
for _ in $(seq 100); do grep -q " $rootfs fuse.mosaicfs " /proc/self/mounts && break; sleep 0.1; done
check "the container's rootfs is a mosaicfs mount over the store" grep -q " $rootfs fuse.mosaicfs " /proc/self/mounts
start=$(log_lines)
check "a 1-byte write into the running container's ${big_mib} MiB image file" \
  sh -c "printf x | dd of=$rootfs/data/big bs=1 seek=1000000 conv=notrunc 2>/dev/null && sync"
wrote=$(served_since "$start")
echo "     the registry served $wrote bytes for the write"
check "the write fetched the chunk it lands in, under 8 MiB" test "$wrote" -gt 0 -a "$wrote" -lt $((8 << 20))
layer_kib() { du -sk "$t/snapshotter/snapshots" | cut -f1; }
check "the snapshotter's layers hold blocks, not the file ($(layer_kib) KiB)" test "$(layer_kib)" -lt 1024
reads_back() {
  local sum; sum=$(md5sum < "$rootfs/data/big" | cut -d' ' -f1)
  [ "$sum" = "$expected_sum" ] || { echo "md5 $sum, expected $expected_sum"; return 1; }
}
check "the file reads back as the image's bytes with the one byte written" reads_back
containerd_cleanup
check "the snapshotter logged two layers taken from the store" \
  sh -c "test \$(grep -c 'taken from the layer store' $t/snapshotter.log) -eq 2"
check "the snapshotter logged no error" \
  sh -c "! grep -v -e '^mosaicfs-snapshotter: serving' -e 'taken from the layer store' $t/snapshotter.log"

summary lazy
