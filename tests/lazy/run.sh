#!/usr/bin/env bash
# Lazily pulled images under mosaicfs (issue #59): Podman runs a container from an eStargz image
# whose layers a layer store serves from a registry on 127.0.0.1 a chunk at a time, with mosaicfs
# as the overlay's mount program; a 1-byte write into a big file of the image fetches a chunk, not
# the file. Everything is started here: Debian's docker-registry, the layer store (tests/lazy/layers,
# built with Go from stargz-snapshotter's published module), an image made by this script.
#
# Bytes are counted from the registry's access log (the size of every response to a blob GET).
# The store prefetches nothing and fetches nothing in the background, so what it fetched was
# asked for by a reader. A layer Podman pulled whole instead of taking it from the store is a
# failure: every layer of the image must be one the store serves (containers/storage writes a
# file `additionallayer` into such a layer's directory; docs/ENGINES.md, "Lazily pulled images").
#
# Usage: tests/lazy/run.sh [path/to/mosaicfs]   (root, podman, runc, docker-registry, go)
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

summary lazy
