#!/usr/bin/env bash
# A first write into a lazily pulled image file, on every overlay Podman can use (issue #59), in
# one run: containers/storage's kernel overlay driver, fuse-overlayfs 1.10 and 2.0 as
# mount_program, and mosaicfs as mount_program, each with a layer store of its own (an empty
# cache) taking the image's layers lazily from a registry on 127.0.0.1; and, for scale, the
# kernel overlay driver pulling the image whole. The registry, the layer store and the eStargz
# image (busybox, 500 small files, one file of random bytes) are tests/lazy's (tests/lazy/lib.sh).
#
# Rows: seconds to pull, to run a container that reads a small file, and for a 1-byte write
# into the middle of the big file (dd into a running container's merged tree, from the host);
# bytes the registry served for each; the container's upper layer afterwards.
#
# Usage: bench/lazy.sh [--big-mib N]   (as root; default 256)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=$(realpath "${MOSAICFS:-$here/../target/release/mosaicfs}")
fo2=${FUSE_OVERLAYFS_2:-/var/tmp/fo2/bin/fuse-overlayfs}
LAZY_BIG_MIB=256
while [ $# -gt 0 ]; do
  case $1 in
    --big-mib) LAZY_BIG_MIB=$2; shift 2 ;;
    *) echo "usage: bench/lazy.sh [--big-mib N]" >&2; exit 2 ;;
  esac
done
export LAZY_BIG_MIB
command -v fuse-overlayfs >/dev/null || apt-get install -y -qq fuse-overlayfs >/dev/null
. "$here/../tests/check.sh"
. "$here/../tests/lazy/lib.sh"

now() { date +%s.%N; }
since() { python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.3f}')" "$1" "$(now)"; }
mib() { python3 -c "import sys; print(f'{int(sys.argv[1]) / 1048576:.1f}')" "$1"; }

# peer NAME MOUNT_PROGRAM LAYER_STORE: one column of the table, as "key=value" lines in
# $t/NAME.result (Podman's storage root is $t/p<column>: its runroot path must stay short).
peer() {
  local name=$1 out=$t/$1.result start n
  export PODMAN_ROOT=p${#podman_roots[@]} MOUNT_PROGRAM=$2 LAYER_STORE=$3
  podman_roots+=("$PODMAN_ROOT")
  [ -n "$3" ] && { start_store "$3" || return 1; }
  sync; echo 3 > /proc/sys/vm/drop_caches
  n=$(log_lines); start=$(now)
  podman pull -q --tls-verify=false "$image" >/dev/null || return 1
  echo "pull_s=$(since "$start") pull_mib=$(mib "$(served_since "$n")")" > "$out"
  n=$(log_lines); start=$(now)
  podman run --rm "${RUN[@]}" "$image" cat /data/small/250 >/dev/null || return 1
  echo "run_s=$(since "$start") run_mib=$(mib "$(served_since "$n")")" >> "$out"
  # The write goes into the running container's merged tree from the host (the same mount
  # the container sees), so that it can be timed finely.
  podman run -d --name "w-$name" "${RUN[@]}" "$image" sleep 600 >/dev/null || return 1
  local merged; merged=$(podman inspect --format '{{.GraphDriver.Data.MergedDir}}' "w-$name")
  n=$(log_lines); start=$(now)
  printf x | dd of="$merged/data/big" bs=1 seek=100000000 conv=notrunc 2>/dev/null || return 1
  echo "write_s=$(since "$start") write_mib=$(mib "$(served_since "$n")")" >> "$out"
  echo "upper_kib=$(du -sk "$(podman inspect --format '{{.GraphDriver.Data.UpperDir}}' "w-$name")" | cut -f1)" >> "$out"
  podman rm -f -t 0 "w-$name" >/dev/null
  unset PODMAN_ROOT MOUNT_PROGRAM LAYER_STORE
}

names=(whole-pull overlay fuse-overlayfs)
peer whole-pull "" "" || echo "whole-pull failed"
peer overlay "" store-overlay || echo "overlay failed"
peer fuse-overlayfs "$(command -v fuse-overlayfs)" store-fo1 || echo "fuse-overlayfs failed"
if [ -x "$fo2" ]; then
  names+=(fuse-overlayfs-2.0)
  peer fuse-overlayfs-2.0 "$fo2" store-fo2 || echo "fuse-overlayfs 2.0 failed"
fi
names+=(mosaicfs)
peer mosaicfs "$bin" store-mosaicfs || echo "mosaicfs failed"

echo
echo "Lazily pulled image, $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(uname -r), root; image: busybox, 500 small files, ${LAZY_BIG_MIB} MiB file of random bytes, eStargz, registry on 127.0.0.1"
echo
python3 - "$t" "${names[@]}" <<'PY'
import sys
t, names = sys.argv[1], sys.argv[2:]
cols = {}
for n in names:
    try:
        cols[n] = dict(kv.split("=") for line in open(f"{t}/{n}.result") for kv in line.split())
    except OSError:
        cols[n] = {}
rows = [("pull (s)", "pull_s"), ("pull: served (MiB)", "pull_mib"),
        ("run, read a small file (s)", "run_s"), ("run: served (MiB)", "run_mib"),
        ("1-byte write into the big file (s)", "write_s"), ("write: served (MiB)", "write_mib"), ("container's upper after it (KiB)", "upper_kib")]
label = {"whole-pull": "overlay, whole pull", "overlay": "overlay, lazy"}
print("| | " + " | ".join(label.get(n, n + ", lazy") for n in names) + " |")
print("|---|" + "---|" * len(names))
for title, key in rows:
    print(f"| {title} | " + " | ".join(cols[n].get(key, "failed") for n in names) + " |")
ours = cols.get("mosaicfs", {})
if "write_s" in ours:
    print("\nThe 1-byte write, each lazy peer / mosaicfs (above 1: mosaicfs is better): " + ", ".join(
        f"{n} {float(cols[n]['write_s']) / float(ours['write_s']):.1f}x the time, "
        f"{float(cols[n]['write_mib']) / max(float(ours['write_mib']), 0.1):.1f}x the bytes"
        for n in names if n not in ("mosaicfs", "whole-pull") and "write_s" in cols[n]))
PY
