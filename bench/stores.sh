#!/usr/bin/env bash
# Image layers on a shared store (issue #16): an image in an additional image store on a
# GlusterFS volume (one brick on a local directory, the glusterfs FUSE client), used by a node's
# own storage root with mosaicfs, fuse-overlayfs and the kernel overlay driver, in one run:
#   1. `podman run --rm IMAGE true`;
#   2. a read of the image's 1,000 small files through a mounted container (`podman mount`).
# Cold: page cache dropped and the GlusterFS client mounted afresh (its own caches gone) before
# each run. Warm: the same again at once. Medians of N runs; ratios are the peer's time over
# mosaicfs' (above 1: mosaicfs is faster).
#
# Usage: bench/stores.sh [--quick]   (quick: 3 runs, else 7). Needs root, glusterfs-server,
# glusterfs-client, podman, runc, busybox-static, fuse-overlayfs. Starts its own glusterd.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=$(realpath "${MOSAICFS:-$here/../target/release/mosaicfs}")
runs=7; [ "${1:-}" = --quick ] && runs=3
for t in glusterd glusterfs podman runc busybox fuse-overlayfs; do
  command -v $t >/dev/null || { echo "bench/stores.sh needs $t: apt-get install glusterfs-server glusterfs-client podman runc busybox-static fuse-overlayfs" >&2; exit 2; }
done
if gluster --mode=script volume list >/dev/null 2>&1; then
  echo "a glusterd already runs on this machine (port 24007): stop it first" >&2; exit 2
fi
root=${BENCH_DIR:-/var/tmp/mfs-bs}   # podman wants a short runroot path
host=$(hostname -I | awk '{print $1}')
[ -n "$host" ] || { echo "GlusterFS needs a non-loopback address; this machine has none" >&2; exit 2; }
volume=mfsbench
vol=$root/vol
setups=(mosaicfs fuse-overlayfs overlay)
# MOSAICFS_MOUNTOPT=a,b: options for mosaicfs (storage.conf mountopt); SETUPS="mosaicfs": fewer.
read -r -a setups <<< "${SETUPS:-${setups[*]}}"

client_pid=
mount_client() {
  # Its output to a file: a child holding the terminal's pipe would hold up `$(...)`.
  glusterfs -N --volfile-server="$host" --volfile-id=$volume "$vol" >> "$root/client.log" 2>&1 &
  client_pid=$!
  for _ in $(seq 200); do mountpoint -q "$vol" && return; sleep 0.05; done
  echo "the GlusterFS client did not mount $vol" >&2; exit 1
}
umount_client() {
  umount "$vol" 2>/dev/null || umount -l "$vol"
  wait "$client_pid" 2>/dev/null || true
}
glusterd_pid=
cleanup() {
  set +e
  for s in "${setups[@]}"; do podman_for "$s" rm -af >/dev/null 2>&1; done
  mountpoint -q "$vol" && umount_client
  gluster --mode=script volume stop $volume force >/dev/null 2>&1
  gluster --mode=script volume delete $volume >/dev/null 2>&1
  pkill -f "brick-name $root/brick " 2>/dev/null
  [ -n "$glusterd_pid" ] && kill "$glusterd_pid" && wait "$glusterd_pid" 2>/dev/null
  rm -rf "$root"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

rm -rf "$root"; mkdir -p "$root"/{brick,glusterd,rootfs/bin,rootfs/data} "$vol"
glusterd -N --log-file="$root/glusterd.log" \
  --xlator-option management.working-directory="$root/glusterd" >/dev/null 2>&1 & glusterd_pid=$!
for _ in $(seq 200); do gluster --mode=script volume list >/dev/null 2>&1 && break; sleep 0.1; done
gluster --mode=script volume create $volume "$host:$root/brick" force >/dev/null
gluster --mode=script volume start $volume >/dev/null
mount_client

cp "$(command -v busybox)" "$root/rootfs/bin/busybox"
for c in sh true cat; do ln -s busybox "$root/rootfs/bin/$c"; done
python3 -c "
import os, sys
for i in range(1000):
    with open(os.path.join(sys.argv[1], f'f{i:04}'), 'wb') as f:
        f.write(os.urandom(512 + (i * 37) % 7680))
" "$root/rootfs/data"
tar -C "$root/rootfs" -cf "$root/rootfs.tar" .

conf() { # setup -> storage.conf of the node's root for it
  local setup=$1 f=$root/$1.conf
  {
    echo '[storage]'
    echo 'driver = "overlay"'
    echo "graphroot = \"$root/$setup/root\""
    echo "runroot = \"$root/$setup/run\""
    echo '[storage.options]'
    echo "additionalimagestores = [\"$vol/store\"]"
    echo '[storage.options.overlay]'
    case $setup in
      mosaicfs) echo "mount_program = \"$bin\""
        [ -n "${MOSAICFS_MOUNTOPT:-}" ] && echo "mountopt = \"$MOSAICFS_MOUNTOPT\"" ;;
      fuse-overlayfs) echo 'mount_program = "/usr/bin/fuse-overlayfs"' ;;
    esac
  } > "$f"
  echo "$f"
}
podman_for() { # setup, then podman args
  local setup=$1; shift
  local c
  case $setup in
    store) c=$root/store.conf ;;
    *) c=$root/$setup.conf ;;
  esac
  CONTAINERS_STORAGE_CONF=$c podman --runtime runc --cgroup-manager cgroupfs --events-backend file "$@"
}
# The machine that pulls images into the store: containers/storage's own overlay driver does not
# work on a FUSE file system, so it uses a mount program too.
printf '[storage]\ndriver = "overlay"\ngraphroot = "%s"\nrunroot = "%s"\n[storage.options.overlay]\nmount_program = "%s"\n' \
  "$vol/store" "$root/store-run" "$bin" > "$root/store.conf"
podman_for store import -q "$root/rootfs.tar" localhost/shared:1 >/dev/null
for s in "${setups[@]}"; do conf "$s" >/dev/null; done

RUN=(--rm --network none --ulimit nofile=20000:20000 --ulimit nproc=32768:32768)
now() { date +%s%N; }
ms_since() { echo $(( ($(now) - $1) / 1000000 )); }
median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
cold() { sync; echo 3 > /proc/sys/vm/drop_caches; umount_client; mount_client; }

declare -A run_cold run_warm read_cold read_warm
for s in "${setups[@]}"; do
  podman_for $s run "${RUN[@]}" localhost/shared:1 true   # the node's first use
  cold_times=() warm_times=()
  for _ in $(seq $runs); do
    cold; t=$(now); podman_for $s run "${RUN[@]}" localhost/shared:1 true; cold_times+=("$(ms_since $t)")
  done
  for _ in $(seq $runs); do
    t=$(now); podman_for $s run "${RUN[@]}" localhost/shared:1 true; warm_times+=("$(ms_since $t)")
  done
  run_cold[$s]=$(printf '%s\n' "${cold_times[@]}" | median)
  run_warm[$s]=$(printf '%s\n' "${warm_times[@]}" | median)
  podman_for $s create -q --name reader localhost/shared:1 true >/dev/null
  cold_times=() warm_times=()
  for _ in $(seq $runs); do
    cold
    merged=$(podman_for $s mount reader)
    t=$(now); cat "$merged"/data/* > /dev/null; cold_times+=("$(ms_since $t)")
    t=$(now); cat "$merged"/data/* > /dev/null; warm_times+=("$(ms_since $t)")
    podman_for $s umount reader >/dev/null
  done
  read_cold[$s]=$(printf '%s\n' "${cold_times[@]}" | median)
  read_warm[$s]=$(printf '%s\n' "${warm_times[@]}" | median)
  podman_for $s rm -f reader >/dev/null
done

ratio() { python3 -c "import sys; a,b=sys.argv[1:]; print(f'{float(b)/float(a):.2f}x' if '-' not in (a,b) and float(a) > 0 else '-')" "$1" "$2"; }
row() { # label, array name
  local -n a=$2
  local m=${a[mosaicfs]:--} f=${a[fuse-overlayfs]:--} o=${a[overlay]:--}
  echo "| $1 | $m | $f | $o | $(ratio $m $f) | $(ratio $m $o) |"
}
echo
echo "Image on a GlusterFS additional image store, $(date -u +%Y-%m-%d), $(nproc) cores, $(uname -r), glusterfs $(glusterfs --version | awk 'NR==1 {print $2}'), podman $(podman --version | awk '{print $3}'), median of $runs runs"
echo
echo "| workload (ms, lower is better) | mosaicfs | fuse-overlayfs | kernel overlay driver | fuse-overlayfs / mosaicfs | overlay / mosaicfs |"
echo "|---|---|---|---|---|---|"
row "podman run --rm IMAGE true, cold" run_cold
row "podman run --rm IMAGE true, warm" run_warm
row "read 1,000 small image files, cold" read_cold
row "read 1,000 small image files, warm" read_warm
