#!/usr/bin/env bash
# Rootless Podman on mosaicfs: the case fuse-overlayfs exists for. A plain user runs Podman with
# mosaicfs as its overlay mount_program; containers/storage starts it as root of the user's
# user namespace (ids from /etc/subuid), where it mounts FUSE and keeps its xattrs as
# user.mosaicfs.*. Checks: an image imported and run, a container that writes into a 4 MiB
# image file (block-level copy-up), creates, chowns to a mapped id, renames and deletes;
# podman diff; podman commit and a run of the committed image; no mount left behind.
#
# The run makes a user (mosaicfs-rootless) with subordinate ids, and gives /dev/fuse mode 0666
# (as distributions ship it; needed to open it without root) while it runs; all three are put
# back as they were at the end.
#
# Usage: tests/podman/rootless.sh [path/to/mosaicfs]   (needs root, podman, runc, busybox-static,
# newuidmap from uidmap)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=$(realpath "${1:-$here/../../target/release/mosaicfs}")
. "$here/../check.sh"
require_tools "rootless podman test" "tests/deps.sh installs podman, runc, busybox-static, uidmap" \
  podman runc busybox newuidmap runuser

user=mosaicfs-rootless
t=$(mktemp -d /var/tmp/mosaicfs-rootless.XXXXXX)
chmod 755 "$t"
made_user=0
fuse_mode=$(stat -c %a /dev/fuse)
cleanup() {
  if id "$user" >/dev/null 2>&1; then
    podman rm -af >/dev/null 2>&1
    # Rootless Podman's pause process (it holds the user namespace) and anything left.
    pkill -KILL -u "$user" 2>/dev/null
  fi
  chmod "$fuse_mode" /dev/fuse
  if [ $made_user = 1 ]; then
    userdel "$user" 2>/dev/null
    sed -i "/^$user:/d" /etc/subuid /etc/subgid
  fi
  rm -rf "$t"
}
[ -n "${KEEP:-}" ] || trap cleanup EXIT

if ! id "$user" >/dev/null 2>&1; then
  useradd -M -d "$t/home" -s /bin/sh "$user" && made_user=1
fi
for f in /etc/subuid /etc/subgid; do
  grep -q "^$user:" "$f" 2>/dev/null || echo "$user:300000:65536" >> "$f"
done
chmod 666 /dev/fuse
uid=$(id -u "$user")
mkdir -p "$t/home" "$t/run"
chown "$user:" "$t/home" "$t/run"
chmod 700 "$t/run"
install -m 755 "$bin" "$t/mosaicfs"
# Records how containers/storage calls the mount program, then runs mosaicfs.
cat > "$t/mount-program" <<WRAP
#!/bin/sh
echo "\$*" >> "$t/run/calls.log"
exec "$t/mosaicfs" "\$@"
WRAP
chmod 755 "$t/mount-program"

as_user() {
  runuser -u "$user" -- env HOME="$t/home" XDG_RUNTIME_DIR="$t/run" PATH=/usr/sbin:/usr/bin:/sbin:/bin "$@"
}
podman() {
  as_user podman --root "$t/home/storage" --runroot "$t/run/storage" --storage-driver overlay \
    --storage-opt overlay.mount_program="$t/mount-program" --runtime runc --cgroup-manager cgroupfs \
    --events-backend file "$@"
}
RUN=(--network none)


mkdir -p "$t/rootfs"/{bin,etc,data}
cp "$(command -v busybox)" "$t/rootfs/bin/busybox"
for c in sh ls cat echo mv rm mkdir wc stat dd od tail test; do
  ln -s busybox "$t/rootfs/bin/$c"
done
echo "root:x:0:0:root:/:/bin/sh" > "$t/rootfs/etc/passwd"
echo "image line 1" > "$t/rootfs/data/log"
echo "delete me" > "$t/rootfs/data/delete"
echo "rename me" > "$t/rootfs/data/rename"
head -c 4194304 /dev/urandom > "$t/rootfs/data/big"
find "$t/rootfs" -exec touch -h -d "2024-01-01 00:00:00" {} +
tar -C "$t/rootfs" -cf "$t/rootfs.tar" .
chmod 644 "$t/rootfs.tar"

check "rootless podman import" podman import "$t/rootfs.tar" localhost/mosaic-rootless:base
check "a rootless container writes, chowns, renames and deletes" \
  podman run --name work "${RUN[@]}" localhost/mosaic-rootless:base sh -c '
    set -e
    echo "image line 2" >> /data/log
    dd if=/dev/zero of=/data/big bs=1 count=3 seek=1000000 conv=notrunc 2>/dev/null
    echo new > /data/new && chown 33:44 /data/new
    test "$(stat -c %u:%g /data/new)" = 33:44
    mv /data/rename /data/renamed && rm /data/delete
    test "$(tail -1 /data/log)" = "image line 2"'
check "containers/storage ran mosaicfs as the user's mount program" grep -q "lowerdir=.*upperdir=" "$t/run/calls.log"
diff_lists_changes() {
  podman diff work > "$t/diff" || return 1
  for want in "C /data/log" "C /data/big" "A /data/new" "A /data/renamed" "D /data/rename" "D /data/delete"; do
    grep -qx "$want" "$t/diff" || { echo "missing: $want"; cat "$t/diff"; return 1; }
  done
}
check "podman diff lists every change" diff_lists_changes
check "rootless podman commit" podman commit -q work localhost/mosaic-rootless:committed
check "the committed image shows every change, owners and the written bytes" \
  podman run --rm "${RUN[@]}" localhost/mosaic-rootless:committed sh -c '
    set -e
    test "$(tail -1 /data/log)" = "image line 2"
    test "$(stat -c %u:%g /data/new)" = 33:44
    test "$(cat /data/renamed)" = "rename me" && test ! -e /data/rename && test ! -e /data/delete
    test "$(wc -c < /data/big)" -eq 4194304
    test "$(dd if=/data/big bs=1 skip=1000000 count=3 2>/dev/null | od -An -tx1)" = " 00 00 00"'
# Mounts of this test's storage only: the namespace also sees the host's mounts, which may hold
# other mosaicfs mounts (a benchmark, another suite) while this runs.
no_mount_left() {
  podman rm -a >/dev/null || return 1
  ! podman unshare grep fuse.mosaicfs /proc/self/mounts | grep -q " $t/"
}
check "no mosaicfs mount is left after the containers ended" no_mount_left

summary "rootless podman"
