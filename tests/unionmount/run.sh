#!/usr/bin/env bash
# unionmount-testsuite on mosaicfs: the suite kernel overlayfs is tested with (xfstests'
# overlay/1xx run it) and fuse-overlayfs runs in its CI (`./run --ov --fuse=fuse-overlayfs`).
# It opens, creates, truncates, links, renames and removes files, symlinks and directories of
# a lower layer through the overlay, checks every result and error against its model of the
# layers, and in the `--ov=N` modes turns the upper layer into a lower one and mounts again
# (stacked layers), N times per test. The suite travels with the repository as
# vendor/unionmount-testsuite/*.tar.xz (GPL-2.0; see the README there).
#
# Every mode runs in a mount namespace of its own (`unshare -m`); the suite mounts tmpfs
# layers on /lower, /upper and /base, which are made here when missing and removed after.
#
# Two things are changed in how it runs. The overlay it leaves mounted at its end is unmounted
# (see below). And its `umount` of a layer's file system right after it
# unmounted the overlay is retried while busy. umount(2) of a FUSE mount returns before the
# daemon has exited and closed its descriptors, for every FUSE overlay (fuse-overlayfs 2.0 too:
# 1 of 165 unmounts beside two busy loops, mosaicfs 1 of 174); the retries are counted and
# printed, and a layer still busy after 10 s fails the run.
#
# Usage: tests/unionmount/run.sh [MODE...]   (MODE: the suite's own flags, e.g. "--ov=3 --verify";
# default: every mode below). The mosaicfs mounted is the one /usr/sbin/mount.fuse.mosaicfs runs.
# Env: UNIONMOUNT_WORK (default /var/tmp/mosaicfs-unionmount).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
work=${UNIONMOUNT_WORK:-/var/tmp/mosaicfs-unionmount}
tarball=$(ls "$top"/vendor/unionmount-testsuite/unionmount-testsuite-*.tar.xz | head -1)

[ -x /usr/sbin/mount.fuse.mosaicfs ] || { echo "unionmount: mount.fuse.mosaicfs is missing (make install)"; exit 1; }
. "$here/../need.sh"
need unionmount python3:python3 mksquashfs:squashfs-tools mkfs.erofs:erofs-utils xz:xz-utils || exit 1

rm -rf "$work"
mkdir -p "$work/bin"
tar -xJf "$tarball" -C "$work" || exit 1
suite=$work/unionmount-testsuite

# `umount` as the suite calls it: retried while the target is busy (see above).
retries=$work/retries
cat > "$work/bin/umount" <<EOF
#!/bin/sh
for i in \$(seq 500); do
  err=\$(/bin/umount "\$@" 2>&1) && exit 0
  case "\$err" in
    *"target is busy"*) [ "\$i" = 1 ] && echo "\$*" >> "$retries"; sleep 0.02 ;;
    *) echo "\$err" >&2; exit 32 ;;
  esac
done
echo "\$err (still busy after 10 s)" >&2
exit 32
EOF
chmod +x "$work/bin/umount"

made=()
for d in /lower /upper /base /mnt; do
  [ -d "$d" ] || { mkdir "$d" && made+=("$d"); }
done
cleanup() { for d in "${made[@]}"; do rmdir "$d" 2>/dev/null; done; }
trap cleanup EXIT

# The suite's flags: --fuse= must follow --ov[=N]. redirect_dir=off with --xdev: renames of
# lower directories must fail with EXDEV (rename-exdev), as on fuse-overlayfs.
if [ $# -gt 0 ]; then
  modes=("$@")
else
  modes=("--ov" "--ov=3 --verify" "--ov --samefs" "--ov --maxfs=2" "--ov --squashfs"
    "--ov --erofs" "--ov --xdev redirect_dir=off")
fi
failed=0
for mode in "${modes[@]}"; do
  set -- $mode
  first=$1; shift
  opts=""
  flags=()
  for a in "$@"; do
    case "$a" in
      --*) flags+=("$a") ;;
      *) opts=$a ;;
    esac
  done
  : > "$retries"
  log=$work/$(echo "$mode" | tr -c 'a-z0-9\n' '_').log
  start=$(date +%s)
  # The suite ends by mounting the overlay again "for further playing": unmounted here, in its
  # namespace, or the daemon (in that namespace) would keep the namespace alive, and the
  # namespace its mount — and a copy of every mount the host had when it was made.
  (cd "$suite" && PATH=$work/bin:$PATH UNIONMOUNT_MNTOPTIONS=${opts:-rw} \
    unshare -m sh -c './run "$@"; rc=$?
      for m in /mnt /base/m; do
        if mountpoint -q "$m"; then umount "$m" || umount -l "$m"; fi
      done
      exit $rc' run "$first" --fuse=mosaicfs "${flags[@]}") > "$log" 2>&1
  rc=$?
  tests=$(grep -ac '^TEST ' "$log")
  busy=$(wc -l < "$retries")
  if [ $rc -eq 0 ]; then
    echo "unionmount $mode: $tests checks passed in $(( $(date +%s) - start )) s ($busy unmounts of a layer retried)"
  else
    failed=1
    echo "unionmount $mode: FAILED after $tests checks (log: $log):"
    tail -n 15 "$log" | sed 's/^/    /'
  fi
done
exit $failed
