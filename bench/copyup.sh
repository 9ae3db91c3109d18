#!/usr/bin/env bash
# Copy-up benchmark (issue #3, papers 000 TranslayFS and 004 chown): the same workload on
# mosaicfs, kernel overlayfs and fuse-overlayfs in one run.
#
#   1. open(O_RDWR) + 1-byte write + close on lower files of 1 KiB .. 4 GiB (page cache dropped
#      before each), and the upper layer's disk use after it;
#   2. chown -R of a 1 GiB tree of 2,000 files: time and upper disk use.
#
# Usage: bench/copyup.sh [--quick]   (quick: largest file 100 MiB, tree 200 MiB). Needs root.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${MOSAICFS:-$here/../target/release/mosaicfs}
quick=0; [ "${1:-}" = --quick ] && quick=1
root=${BENCH_DIR:-/var/tmp/mosaicfs-bench}
command -v fuse-overlayfs >/dev/null || apt-get install -y -qq fuse-overlayfs >/dev/null

if [ $quick = 1 ]; then sizes="1K 4M 100M"; tree_files=200; else sizes="1K 4M 100M 1G 4G"; tree_files=2000; fi
mkdir -p "$root/lower"
for s in $sizes; do
  f="$root/lower/file-$s"
  [ -f "$f" ] || head -c "$(numfmt --from=iec "$s")" /dev/urandom > "$f"
done
if [ ! -f "$root/lower/tree/.done-$tree_files" ]; then
  rm -rf "$root/lower/tree"
  for i in $(seq 0 $((tree_files - 1))); do
    d="$root/lower/tree/d$((i % 50))"; mkdir -p "$d"
    head -c 524288 /dev/urandom > "$d/f$i"
  done
  touch "$root/lower/tree/.done-$tree_files"
fi

mount_fs() { # kind dir
  local kind=$1 d=$2
  rm -rf "$d" && mkdir -p "$d"/{upper,work,mnt}
  local o="lowerdir=$root/lower,upperdir=$d/upper,workdir=$d/work"
  case $kind in
    mosaicfs) "$bin" -o "$o" "$d/mnt" ;;
    overlay) mount -t overlay overlay -o "$o" "$d/mnt" ;;
    fuse-overlayfs) fuse-overlayfs -o "$o" "$d/mnt" ;;
  esac
}
unmount_fs() { umount "$1/mnt"; sleep 0.2; rm -rf "$1"; }
drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
one_byte_write() { # path -> seconds
  python3 - "$1" <<'PY'
import os, sys, time
p = sys.argv[1]
t = time.perf_counter()
fd = os.open(p, os.O_RDWR)
os.pwrite(fd, b"x", 0)
os.close(fd)
print(f"{(time.perf_counter() - t) * 1000:.3f}")
PY
}
kib() { du -sk "$1" | cut -f1; }

declare -A ms du
kinds="mosaicfs overlay fuse-overlayfs"
for k in $kinds; do
  d="$root/run-$k"
  for s in $sizes; do
    mount_fs "$k" "$d"; drop
    ms[$k,$s]=$(one_byte_write "$d/mnt/file-$s")
    du[$k,$s]=$(kib "$d/upper")
    unmount_fs "$d"
  done
  mount_fs "$k" "$d"; drop
  t0=$(date +%s%N); chown -R 1234:1234 "$d/mnt/tree"; t1=$(date +%s%N)
  ms[$k,chown]=$(( (t1 - t0) / 1000000 ))
  du[$k,chown]=$(kib "$d/upper")
  unmount_fs "$d"
done

ratio() { python3 -c "a,b=float('$1'),float('$2'); print(f'{a/b:.3g}x' if b > 0 else '-')"; }
echo
echo "Copy-up benchmark, $(date -u +%Y-%m-%d), $(nproc) cores, $(uname -r), root fs $(stat -f -c %T "$root")"
echo
echo "| workload | mosaicfs | kernel overlayfs | fuse-overlayfs | mosaicfs vs overlayfs | mosaicfs vs fuse-overlayfs |"
echo "|---|---|---|---|---|---|"
for s in $sizes; do
  echo "| 1-byte write to a $s lower file (ms) | ${ms[mosaicfs,$s]} | ${ms[overlay,$s]} | ${ms[fuse-overlayfs,$s]} | $(ratio "${ms[mosaicfs,$s]}" "${ms[overlay,$s]}") | $(ratio "${ms[mosaicfs,$s]}" "${ms[fuse-overlayfs,$s]}") |"
done
for s in $sizes; do
  echo "| upper disk use after it, $s file (KiB) | ${du[mosaicfs,$s]} | ${du[overlay,$s]} | ${du[fuse-overlayfs,$s]} | $(ratio "${du[mosaicfs,$s]}" "${du[overlay,$s]}") | $(ratio "${du[mosaicfs,$s]}" "${du[fuse-overlayfs,$s]}") |"
done
tree_mib=$(( tree_files / 2 ))
echo "| chown -R of $tree_files files, $tree_mib MiB (ms) | ${ms[mosaicfs,chown]} | ${ms[overlay,chown]} | ${ms[fuse-overlayfs,chown]} | $(ratio "${ms[mosaicfs,chown]}" "${ms[overlay,chown]}") | $(ratio "${ms[mosaicfs,chown]}" "${ms[fuse-overlayfs,chown]}") |"
echo "| upper disk use after chown -R (KiB) | ${du[mosaicfs,chown]} | ${du[overlay,chown]} | ${du[fuse-overlayfs,chown]} | $(ratio "${du[mosaicfs,chown]}" "${du[overlay,chown]}") | $(ratio "${du[mosaicfs,chown]}" "${du[fuse-overlayfs,chown]}") |"
