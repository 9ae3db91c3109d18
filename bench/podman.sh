#!/usr/bin/env bash
# Podman benchmark (issue #6, paper 002 BAOverlay Fig 3): the same containers on three storage
# setups in one run — containers/storage's native kernel overlay driver, fuse-overlayfs as
# mount_program, and mosaicfs as mount_program:
#   1. `podman run` of a trivial command (median of N runs);
#   2. a container that appends one line to a 1 GiB log file baked into its image.
#
# Usage: bench/podman.sh [--quick]   (quick: 256 MiB log, 3 runs). Needs root, podman, runc.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=$(realpath "${MOSAICFS:-$here/../target/release/mosaicfs}")
quick=0; [ "${1:-}" = --quick ] && quick=1
command -v podman >/dev/null || apt-get install -y -qq podman runc busybox-static fuse-overlayfs >/dev/null
if [ $quick = 1 ]; then log_mib=256; runs=3; else log_mib=1024; runs=7; fi
root=${BENCH_DIR:-/var/tmp/mfs-bp}   # podman wants a short runroot path
rm -rf "$root"; mkdir -p "$root/rootfs"/{bin,etc,tmp,var/log}
cp "$(command -v busybox)" "$root/rootfs/bin/busybox"
for c in sh echo true cat tail wc; do ln -s busybox "$root/rootfs/bin/$c"; done
echo "root:x:0:0:root:/root:/bin/sh" > "$root/rootfs/etc/passwd"
python3 -c "
import os, sys
line = b'2026-01-01T00:00:00Z app: request served in 1.2 ms, status 200, bytes 5120\\n'
with open(sys.argv[1], 'wb') as f:
    f.write(line * ((int(sys.argv[2]) << 20) // len(line)))
" "$root/rootfs/var/log/app.log" $log_mib
find "$root/rootfs" -exec touch -h -d "2024-01-01" {} +
tar -C "$root/rootfs" -cf "$root/rootfs.tar" .

source "$here/podman-setups.sh"
RUN=(--rm --network none --ulimit nofile=20000:20000 --ulimit nproc=32768:32768)
now() { date +%s%N; }
median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

declare -A trivial append
for setup in mosaicfs overlay fuse-overlayfs; do
  podman_for $setup import -q "$root/rootfs.tar" localhost/bench:1 >/dev/null
  podman_for $setup run "${RUN[@]}" localhost/bench:1 true  # warm up
  trivial[$setup]=$(for _ in $(seq $runs); do
    s=$(now); podman_for $setup run "${RUN[@]}" localhost/bench:1 true; echo $(( ($(now) - s) / 1000000 )); done | median)
  append[$setup]=$(for _ in $(seq $runs); do
    sync; echo 3 > /proc/sys/vm/drop_caches
    s=$(now); podman_for $setup run "${RUN[@]}" localhost/bench:1 sh -c 'echo "one more line" >> /var/log/app.log'
    echo $(( ($(now) - s) / 1000000 )); done | median)
  podman_for $setup rmi -af >/dev/null 2>&1 || true
done
ratio() { python3 -c "a,b=float('$1'),float('$2'); print(f'{b/a:.2f}x' if a > 0 else '-')"; }
echo
echo "Podman benchmark, $(date -u +%Y-%m-%d), $(nproc) cores, $(uname -r), podman $(podman --version | awk '{print $3}'), median of $runs runs"
echo
echo "| workload (ms, lower is better) | mosaicfs | kernel overlay driver | fuse-overlayfs | overlay / mosaicfs | fuse-overlayfs / mosaicfs |"
echo "|---|---|---|---|---|---|"
echo "| podman run of a trivial command | ${trivial[mosaicfs]} | ${trivial[overlay]} | ${trivial[fuse-overlayfs]} | $(ratio ${trivial[mosaicfs]} ${trivial[overlay]}) | $(ratio ${trivial[mosaicfs]} ${trivial[fuse-overlayfs]}) |"
echo "| podman run appending a line to a $log_mib MiB log in the image | ${append[mosaicfs]} | ${append[overlay]} | ${append[fuse-overlayfs]} | $(ratio ${append[mosaicfs]} ${append[overlay]}) | $(ratio ${append[mosaicfs]} ${append[fuse-overlayfs]}) |"
rm -rf "$root"
