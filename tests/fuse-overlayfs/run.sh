#!/usr/bin/env bash
# fuse-overlayfs' own test scripts on mosaicfs, the drop-in test: the scripts its CI runs
# (tests/test-*.sh and tests/unlink.sh of fuse-overlayfs 2.0, pinned in
# vendor/fuse-overlayfs-tests; GPL-2.0, its COPYING inside) call `fuse-overlayfs` with its
# options and check copy-up, directories, hard links, mmap, passthrough, read-only mounts,
# renames, special files, symlinks, xattrs and a stress run, reading the upper dir directly
# where they care how it looks. Here `fuse-overlayfs` in their PATH runs mosaicfs. Left out:
# alpine.sh and fedora-installs.sh (they pull images from registries) and unpriv.sh (rootless
# Podman's `podman unshare`; tests/podman/rootless.sh covers rootless use).
#
# Usage: tests/fuse-overlayfs/run.sh [MOSAICFS] [SCRIPT...]   (default: the installed mosaicfs,
# every script). Env: FO_TESTS_WORK (default /var/tmp/mosaicfs-fo-tests).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
daemon=$(readlink -f "${1:-$(command -v mosaicfs)}")
shift || true
work=${FO_TESTS_WORK:-/var/tmp/mosaicfs-fo-tests}
tarball=$(ls "$top"/vendor/fuse-overlayfs-tests/fuse-overlayfs-tests-*.tar.xz | head -1)

# What the scripts use: fuse2fs (mmap's layers), gcc, getfattr/setfattr, mkfifo, md5sum.
. "$here/../need.sh"
need "fuse-overlayfs tests" fuse2fs:fuse2fs gcc:gcc setfattr:attr || exit 1

rm -rf "$work"
mkdir -p "$work/bin"
tar -xJf "$tarball" -C "$work" || exit 1
printf '#!/bin/sh\nexec "%s" "$@"\n' "$daemon" > "$work/bin/fuse-overlayfs"
# The scripts unmount the file system under an overlay's layers right after the overlay
# (test-passthrough.sh: `umount mlower; umount ext2`). Unmounting a FUSE mount does not wait
# for its daemon (the kernel sends DESTROY only to block-device FUSE mounts), and until the
# daemon has exited its descriptors keep the layers' file system busy: 1-10 ms on a busy
# machine here for mosaicfs and fuse-overlayfs 2.0 alike, ~90 ms for 1.10; CI once lost that
# race. So `umount` in their PATH retries a busy target for up to 10 s.
cat > "$work/bin/umount" <<EOF
#!/bin/sh
for _ in \$(seq 100); do
  out=\$("$(command -v umount)" "\$@" 2>&1) && exit 0
  case "\$out" in *busy*) sleep 0.1 ;; *) break ;; esac
done
echo "\$out" >&2
exit 32
EOF
chmod +x "$work/bin/fuse-overlayfs" "$work/bin/umount"

cd "$work/fuse-overlayfs-tests/tests"
scripts=("$@")
[ ${#scripts[@]} -gt 0 ] || scripts=(test-*.sh unlink.sh)
passed=0; failed=0
for s in "${scripts[@]}"; do
  log=$work/$s.log
  start=$(date +%s)
  if PATH=$work/bin:$PATH bash "$s" > "$log" 2>&1; then
    passed=$((passed + 1)); echo "ok   $s ($(( $(date +%s) - start )) s)"
  else
    failed=$((failed + 1)); echo "FAIL $s (log: $log)"; tail -n 20 "$log" | sed 's/^/     /'
  fi
done
echo "fuse-overlayfs tests on mosaicfs: $passed passed, $failed failed"
[ $failed -eq 0 ]
