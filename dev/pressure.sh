#!/usr/bin/env bash
# Runs a command beside what a busy, memory-pressed host does to it: every second the kernel
# drops its caches (dentries, inodes, pages: `echo 3 > drop_caches`) and a tmpfs is mounted and
# unmounted; with --busy, two CPU-bound loops run as well. The suite must pass under it (issue
# #56). Everything it starts ends with the command; the host is left as it was.
#
# Usage: dev/pressure.sh [--busy] COMMAND...   (as root)
set -uo pipefail
busy=0
[ "${1:-}" = --busy ] && { busy=1; shift; }
scratch=$(mktemp -d /tmp/mosaicfs-pressure.XXXXXX)
pids=()
(
  while :; do
    echo 3 > /proc/sys/vm/drop_caches
    mount -t tmpfs -o size=1m pressure "$scratch" && umount "$scratch"
    sleep 1
  done
) &
pids+=($!)
if [ $busy = 1 ]; then
  for _ in 1 2; do (while :; do :; done) & pids+=($!); done
fi
stop() {
  kill "${pids[@]}" 2>/dev/null
  wait "${pids[@]}" 2>/dev/null
  umount "$scratch" 2>/dev/null
  rmdir "$scratch"
}
trap stop EXIT
"$@"
