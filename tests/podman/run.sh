#!/usr/bin/env bash
# Podman end to end on mosaicfs (issue #6): containers/storage runs mosaicfs as its overlay
# mount_program. Builds a busybox image without any registry, then checks: a container that
# creates, modifies, renames and deletes files and writes to a file of the image; podman commit
# and a run of the committed image; podman build of a multi-layer image; user-namespace id
# mapping; the options containers/storage passes (volatile); a container's write/fsync loop
# across ten kills of its daemon and an upgrade; no mount left behind.
#
# Usage: tests/podman/run.sh [path/to/mosaicfs]   (needs root, podman, runc, busybox-static)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=$(realpath "${1:-$here/../../target/release/mosaicfs}")
. "$here/../check.sh"
require_tools "podman test" "tests/deps.sh installs podman, runc, busybox-static" podman runc busybox

t=$(mktemp -d /var/tmp/mosaicfs-podman.XXXXXX)
cat > "$t/mount-program" <<WRAP
#!/bin/sh
# Records how containers/storage calls the mount program, then runs mosaicfs.
echo "\$*" >> "$t/calls.log"
exec "$bin" "\$@"
WRAP
chmod +x "$t/mount-program"
# MOSAICFS_OPTS=a,b: storage.conf's mountopt, which containers/storage passes to every mount
# (e.g. upper=memory).
mountopt=()
[ -n "${MOSAICFS_OPTS:-}" ] && mountopt=(--storage-opt "overlay.mountopt=$MOSAICFS_OPTS")
podman() {
  command podman --root "$t/root" --runroot "$t/runroot" --storage-driver overlay \
    --storage-opt overlay.mount_program="$t/mount-program" "${mountopt[@]}" \
    --runtime runc --cgroup-manager cgroupfs --events-backend file "$@"
}
RUN=(--network none --ulimit nofile=20000:20000 --ulimit nproc=32768:32768)
cleanup() {
  podman rm -af >/dev/null 2>&1
  podman rmi -af >/dev/null 2>&1
  grep " $t/" /proc/self/mounts | awk '{print $2}' | xargs -r -n1 umount -l 2>/dev/null
  rm -rf "$t"
}
[ -n "${KEEP:-}" ] || trap cleanup EXIT


# An image built from busybox-static, imported without a registry.
mkdir -p "$t/rootfs"/{bin,etc,tmp,data,root}
cp "$(command -v busybox)" "$t/rootfs/bin/busybox"
for c in sh ls cat echo mv rm mkdir touch wc head tail stat id grep dd sync ln chmod test true sleep; do
  ln -s busybox "$t/rootfs/bin/$c"
done
echo "root:x:0:0:root:/root:/bin/sh" > "$t/rootfs/etc/passwd"
echo "root:x:0:" > "$t/rootfs/etc/group"
echo "image line 1" > "$t/rootfs/data/log"
echo "keep me" > "$t/rootfs/data/keep"
echo "delete me" > "$t/rootfs/data/delete"
echo "rename me" > "$t/rootfs/data/rename"
head -c 4194304 /dev/urandom > "$t/rootfs/data/big"
mkdir -p "$t/rootfs/data/tree/sub" "$t/rootfs/data/other"
echo a > "$t/rootfs/data/tree/a"; echo c > "$t/rootfs/data/tree/sub/c"; echo x > "$t/rootfs/data/other/x"
# Image files are old, as in real images: containers/storage's diff compares mtimes at one-second
# granularity against tar-imported files (nanoseconds 0), so a change made within the second of
# the import would go unseen on any storage driver.
find "$t/rootfs" -exec touch -h -d "2024-01-01 00:00:00" {} +
tar -C "$t/rootfs" -cf "$t/rootfs.tar" .
check "podman import of a busybox rootfs" podman import "$t/rootfs.tar" localhost/mosaic-test:base

check "a container creates, modifies, renames and deletes files" \
  podman run --name work "${RUN[@]}" localhost/mosaic-test:base sh -c '
    set -e
    echo created > /data/new
    echo "image line 2" >> /data/log
    mv /data/rename /data/renamed
    rm /data/delete
    mkdir -p /data/dir/sub && echo deep > /data/dir/sub/f
    dd if=/dev/zero of=/data/big bs=1 count=3 seek=1000000 conv=notrunc 2>/dev/null
    test "$(cat /data/log)" = "image line 1
image line 2"
    test ! -e /data/delete && test "$(cat /data/renamed)" = "rename me"'
check "containers/storage calls mosaicfs with fuse-overlayfs options" grep -q "lowerdir=.*upperdir=.*workdir=" "$t/calls.log"
check "podman commit of the container" podman commit -q work localhost/mosaic-test:committed
check "the committed image shows every change" \
  podman run --rm "${RUN[@]}" localhost/mosaic-test:committed sh -c '
    set -e
    test "$(cat /data/new)" = created
    test "$(tail -1 /data/log)" = "image line 2"
    test ! -e /data/rename && test "$(cat /data/renamed)" = "rename me"
    test ! -e /data/delete
    test "$(cat /data/keep)" = "keep me"
    test "$(cat /data/dir/sub/f)" = deep
    test "$(wc -c < /data/big)" -eq 4194304'
written_bytes_are_zero() {
  podman run --rm "${RUN[@]}" localhost/mosaic-test:committed dd if=/data/big bs=1 skip=1000000 count=3 2>/dev/null \
    | od -An -tx1 | grep -q '00 00 00'
}
check "the image file written in the container is whole in the committed image" written_bytes_are_zero

# mosaicfs export (issue #14): the layer of a container as an OCI layer, compared with the
# layer podman commit computes (containers/storage's naive diff through a fresh mount).
EXPORT_CHANGES='
    set -e
    echo created > /data/new && ln /data/new /data/newlink && ln -s new /data/sym
    echo "image line 2" >> /data/log
    chown 1:1 /data/keep && chmod 640 /data/keep
    rm /data/delete && mv /data/rename /data/renamed
    mv /data/tree /data/moved && echo more > /data/moved/sub/d
    rm -rf /data/other && mkdir /data/other && echo new > /data/other/n
    dd if=/dev/zero of=/data/big bs=1 count=3 seek=1000000 conv=notrunc 2>/dev/null'
check "a container for export makes every kind of change" \
  podman run --name exp "${RUN[@]}" localhost/mosaic-test:base sh -c "$EXPORT_CHANGES"
layer_of() { podman inspect "$1" --format "{{.GraphDriver.Data.$2}}"; }
export_offline() {
  # The mount podman used may still be ending (an unmount does not wait for the daemon).
  for _ in $(seq 50); do
    "$bin" export -q -o "$t/exp-ours.tar" --lowerdir="$(layer_of exp LowerDir)" \
      --upperdir="$(layer_of exp UpperDir)" --workdir="$(layer_of exp WorkDir)" 2>"$t/export.err" && return 0
    grep -q "in use" "$t/export.err" || break
    sleep 0.2
  done
  cat "$t/export.err"; return 1
}
check "mosaicfs export of the stopped container's layer" export_offline
image_layers() { # image, dir: the image's layer tars, oldest first, listed in dir/layers
  rm -rf "$2" && mkdir -p "$2" && podman save -q --format docker-archive -o "$2/image.tar" "$1" &&
    tar -xf "$2/image.tar" -C "$2" &&
    python3 -c 'import json,sys; [print(l) for l in json.load(open(sys.argv[1]))[0]["Layers"]]' \
      "$2/manifest.json" > "$2/layers"
}
export_matches_commit() {
  podman commit -q exp localhost/mosaic-test:exp >/dev/null && image_layers localhost/mosaic-test:exp "$t/img" || return 1
  python3 "$here/../export/layers.py" compare "$t/img/$(head -1 "$t/img/layers")" \
    "$t/exp-ours.tar" "$t/img/$(tail -1 "$t/img/layers")"
}
check "the export gives the tree podman commit's layer gives" export_matches_commit
export_covers_diff() {
  podman diff exp > "$t/exp.diff" && python3 "$here/../export/layers.py" diff-covered "$t/exp-ours.tar" "$t/exp.diff"
}
check "every change podman diff lists is in the export" export_covers_diff
export_live() {
  podman run -d --name live "${RUN[@]}" localhost/mosaic-test:base sh -c "$EXPORT_CHANGES; touch /ready; sleep 600" >/dev/null || return 1
  for _ in $(seq 100); do [ -e "$(layer_of live MergedDir)/ready" ] && break; sleep 0.1; done
  local merged; merged=$(layer_of live MergedDir)
  "$bin" export -q "$merged" --zstd -o "$t/live.tar.zst" && zstd -dqf "$t/live.tar.zst" -o "$t/live.tar" &&
    python3 "$here/../export/layers.py" compare-dir "$merged" "$t/img/$(head -1 "$t/img/layers")" "$t/live.tar"
  local r=$?
  podman rm -f -t 0 live >/dev/null 2>&1
  return $r
}
check "mosaicfs export of a running container's mount shows its merged view" export_live

mkdir -p "$t/ctx"
echo "copied into the image" > "$t/ctx/file"
cat > "$t/ctx/Containerfile" <<'CF'
FROM localhost/mosaic-test:base
RUN echo built > /built && echo "image line 2" >> /data/log
COPY file /copied
RUN rm /data/keep && mkdir /newdir && echo x > /newdir/x
CF
check "podman build of a multi-layer image" podman build -q --network none -t localhost/mosaic-test:built "$t/ctx"
layers_of_built() {
  test "$(podman image inspect --format '{{len .RootFS.Layers}}' localhost/mosaic-test:built)" -ge 4
}
check "the built image has three more layers" layers_of_built
check "the built image runs with every step applied" \
  podman run --rm "${RUN[@]}" localhost/mosaic-test:built sh -c '
    set -e
    test "$(cat /built)" = built
    test "$(cat /copied)" = "copied into the image"
    test ! -e /data/keep
    test "$(cat /newdir/x)" = x
    test "$(tail -1 /data/log)" = "image line 2"'

check "user-namespace id mapping (uidmapping/gidmapping)" \
  podman run --rm "${RUN[@]}" --uidmap 0:100000:65536 --gidmap 0:100000:65536 localhost/mosaic-test:base sh -c '
    set -e
    test "$(stat -c %u:%g /data/keep)" = 0:0
    echo "mapped" >> /data/log && tail -1 /data/log | grep -q mapped
    echo new > /tmp/new && test "$(stat -c %u /tmp/new)" = 0
    test -e /etc/hosts'
check "containers/storage passed uidmapping and volatile" \
  sh -c "grep -q 'uidmapping=' '$t/calls.log' && grep -q 'volatile' '$t/calls.log'"
# A container's read/write/fsync loop across ten kills of its mount's daemon and one
# `mosaicfs upgrade` (docs/ROBUSTNESS.md, "A daemon that ends"): the holder containers/storage's
# mount left behind starts the next daemon, and the loop sees no error.
LOOP='
    i=0
    while [ ! -e /data/stop ]; do
      i=$((i + 1))
      echo "line $i" | dd of=/data/loop oflag=append conv=notrunc,fsync status=none || { echo "ERROR write $i"; exit 1; }
      test "$(tail -n 1 /data/loop)" = "line $i" || { echo "ERROR read $i"; exit 1; }
      echo "$i" > /data/count.new && sync /data/count.new && mv /data/count.new /data/count || { echo "ERROR rename $i"; exit 1; }
      ls /data >/dev/null || { echo "ERROR list $i"; exit 1; }
    done
    test "$(wc -l < /data/loop)" -eq "$i" || { echo "ERROR lines"; exit 1; }
    echo "done $i"'
daemon_of() { "$bin" status "$1" | sed -n "s/^daemon: pid \([0-9]*\).*/\1/p"; }
takeovers_of() { "$bin" status "$1" | sed -n "s/.*daemons before this one: \([0-9]*\).*/\1/p"; }
survives_kills() {
  podman run -d --name loop "${RUN[@]}" localhost/mosaic-test:base sh -c "$LOOP" >/dev/null || return 1
  local merged k old
  merged=$(layer_of loop MergedDir)
  for _ in $(seq 100); do [ -s "$merged/data/count" ] && break; sleep 0.1; done
  local restart; restart=$("$bin" status "$merged" | grep "^restart:")
  case "$restart" in
    # The io_uring pass of the suite: a ring does not outlive its daemon (docs/ROBUSTNESS.md).
    "restart: no ("*io_uring*)
      echo "$restart"; touch "$merged/data/stop"; podman wait loop >/dev/null
      podman rm -f -t 0 loop >/dev/null 2>&1; return 0 ;;
  esac
  for k in $(seq 10); do
    old=$(daemon_of "$merged")
    [ -n "$old" ] || { echo "no daemon serves $merged"; return 1; }
    kill -9 "$old"
    for _ in $(seq 300); do [ "$(takeovers_of "$merged" 2>/dev/null)" = "$k" ] && break; sleep 0.05; done
    [ "$(takeovers_of "$merged")" = "$k" ] || { echo "no daemon took over after kill $k"; return 1; }
    sleep 0.2
  done
  "$bin" upgrade "$merged" || return 1
  sleep 0.5
  local before; before=$(cat "$merged/data/count")
  touch "$merged/data/stop"
  test "$(podman wait loop)" = 0 || { podman logs loop; return 1; }
  local out; out=$(podman logs loop)
  podman rm -f -t 0 loop >/dev/null 2>&1
  echo "$out"
  case "$out" in *ERROR*) return 1 ;; esac
  test "${out#done }" -ge "$before"
}
check "a container's write/fsync loop outlives ten kills of its daemon and an upgrade" survives_kills

check "no mosaicfs mount is left after the containers ended" \
  sh -c "! grep -q 'fuse.mosaicfs' /proc/self/mounts || ! grep ' $t/' /proc/self/mounts | grep -q fuse.mosaicfs"

summary podman
