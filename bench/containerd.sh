#!/usr/bin/env bash
# containerd benchmark (issue #39): one containerd, started here, with three snapshotters in
# one run — its built-in overlayfs snapshotter (kernel overlayfs), mosaicfs-snapshotter, and
# fuse-overlayfs-snapshotter (built from its public Go source, when Go and the module proxy
# are reachable) — on the same image (busybox-static and a layer with one big file):
#   1. container start: `ctr run --rm IMG true` (median of N);
#   2. a container that writes 1 byte into the image's big file: its run time (median of N,
#      caches dropped before each) and what its layer then holds on disk (du of the upper dir).
# All daemons run in the background, as users run them.
#
# Usage: bench/containerd.sh [--quick]   (quick: 256 MiB file, 3 runs; else 1 GiB, 7 runs).
# Needs root, containerd, runc, busybox-static; `make install` done (mosaicfs in PATH).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bins=$(realpath "${BINS:-$here/../target/release}")
export PATH=$PATH:/usr/local/go/bin
quick=0; [ "${1:-}" = --quick ] && quick=1
if [ $quick = 1 ]; then big_mib=256; runs=3; else big_mib=1024; runs=7; fi
command -v containerd >/dev/null || apt-get install -y -qq containerd runc busybox-static >/dev/null
command -v mosaicfs >/dev/null || { echo "mosaicfs is not in PATH: make install first"; exit 1; }

t=${BENCH_DIR:-/var/tmp/mfs-bc}
pids=()
. "$here/../tests/containerd/containerd.sh"
cleanup() {
  for c in $(ctr_ -n bench containers ls -q 2>/dev/null); do ctr_ -n bench tasks kill -s KILL "$c" >/dev/null 2>&1 || true; done
  sleep 0.3
  for c in $(ctr_ -n bench containers ls -q 2>/dev/null); do ctr_ -n bench tasks rm "$c" >/dev/null 2>&1 || true; ctr_ -n bench containers rm "$c" >/dev/null 2>&1 || true; done
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  grep " $t/" /proc/self/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
}
trap cleanup EXIT
cleanup
rm -rf "$t"; mkdir -p "$t"

snapshotters=(overlayfs mosaicfs)
"$bins/mosaicfs-snapshotter" --address "$t/mosaicfs.sock" --root "$t/mosaicfs" > "$t/mosaicfs.log" 2>&1 &
pids+=($!)
fo=""
if command -v go >/dev/null; then
  if go install github.com/containerd/fuse-overlayfs-snapshotter/v2/cmd/containerd-fuse-overlayfs-grpc@v2.1.7 \
      > "$t/go-install.log" 2>&1; then
    fo=$(go env GOPATH)/bin/containerd-fuse-overlayfs-grpc
    "$fo" "$t/fuse-overlayfs.sock" "$t/fuse-overlayfs" > "$t/fuse-overlayfs.log" 2>&1 &
    pids+=($!)
    snapshotters+=(fuse-overlayfs)
  else
    echo "fuse-overlayfs-snapshotter did not build here: its column is left out"
  fi
fi

plugins=(mosaicfs="$t/mosaicfs.sock")
[ -n "$fo" ] && plugins+=(fuse-overlayfs="$t/fuse-overlayfs.sock")
start_containerd "${plugins[@]}"

busybox_layer "$t/l1" sh true dd
mkdir -p "$t/l2/data"
head -c $((big_mib << 20)) /dev/urandom > "$t/l2/data/big"
"$here/../tests/containerd/oci-image.py" "$t/image.tar" bench:1 "$t/l1" "$t/l2"
rm -rf "$t/l2"
img=docker.io/library/bench:1

now() { date +%s%N; }
median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
upper_of() { # snapshotter, key: the upper dir of an active snapshot
  ctr_ -n bench snapshots --snapshotter "$1" mounts /x "$2" | grep -o 'upperdir=[^,]*' | cut -d= -f2
}
declare -A start write bytes
n=0
for s in "${snapshotters[@]}"; do
  ctr_ -n bench images import --snapshotter "$s" "$t/image.tar" >/dev/null
  n=$((n + 1)); ctr_ -n bench run --rm --snapshotter "$s" "$img" "warm$n" true
done
# Rounds interleave the snapshotters, so that the machine's drift falls on all of them alike.
for i in $(seq $runs); do
  for s in "${snapshotters[@]}"; do
    n=$((n + 1)); a=$(now); ctr_ -n bench run --rm --snapshotter "$s" "$img" "c$n" true
    echo "$s $(( ($(now) - a) / 1000 ))" >> "$t/start.txt"
  done
done
for i in $(seq $runs); do
  for s in "${snapshotters[@]}"; do
    sync; echo 3 > /proc/sys/vm/drop_caches
    n=$((n + 1)); a=$(now)
    ctr_ -n bench run --rm --snapshotter "$s" "$img" "c$n" sh -c 'printf X | dd of=/data/big bs=1 seek=100000000 conv=notrunc 2>/dev/null'
    echo "$s $(( ($(now) - a) / 1000 ))" >> "$t/write.txt"
  done
done
for s in "${snapshotters[@]}"; do
  start[$s]=$(awk -v s="$s" '$1 == s {print $2}' "$t/start.txt" | median)
  write[$s]=$(awk -v s="$s" '$1 == s {print $2}' "$t/write.txt" | median)
  n=$((n + 1))
  ctr_ -n bench run --snapshotter "$s" "$img" "keep$n" sh -c 'printf X | dd of=/data/big bs=1 seek=100000000 conv=notrunc 2>/dev/null'
  bytes[$s]=$(du -sB1 "$(upper_of "$s" "keep$n")" | cut -f1)
  ctr_ -n bench tasks rm "keep$n" >/dev/null 2>&1 || true
  ctr_ -n bench containers rm "keep$n" >/dev/null
done

ms() { python3 -c "print(f'{$1/1000:.0f}')"; }
ratio() { python3 -c "a,b=float('$1'),float('$2'); print(f'{b/a:.2f}x' if a > 0 else '-')"; }
echo
echo "containerd benchmark, $(date -u +%Y-%m-%d), $(nproc) cores, $(uname -r), containerd $(containerd --version | awk '{print $3}'), median of $runs runs, image file $big_mib MiB"
echo
header="| workload | mosaicfs-snapshotter | overlayfs snapshotter (kernel)"
[ -n "${start[fuse-overlayfs]:-}" ] && header+=" | fuse-overlayfs-snapshotter"
echo "$header | mosaicfs / overlayfs |"
echo "|---|---|---|$([ -n "${start[fuse-overlayfs]:-}" ] && echo -n '---|')---|"
row() { # label, array name, formatter
  local -n a=$2
  local line="| $1 | $($3 "${a[mosaicfs]}") | $($3 "${a[overlayfs]}")"
  [ -n "${a[fuse-overlayfs]:-}" ] && line+=" | $($3 "${a[fuse-overlayfs]}")"
  echo "$line | $(ratio "${a[overlayfs]}" "${a[mosaicfs]}") |"
}
kib() { python3 -c "print(f'{$1/1024:,.0f} KiB')"; }
row "ctr run --rm IMG true (ms)" start ms
row "1-byte write into the $big_mib MiB image file, whole run (ms)" write ms
row "upper layer after that write" bytes kib
