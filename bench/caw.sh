#!/usr/bin/env bash
# Copy-after-write benchmark (issue #4, paper 002 BAOverlay Tables 1 and 2): the same workload
# on mosaicfs, kernel overlayfs and fuse-overlayfs in one run.
#
#   1. write-many: for every 4 KiB block of a 2 GiB lower file, open + seek + write 410 bytes
#      + close — total time, first and average latency;
#   2. read-after-write: random 4 KiB reads of 20% of those blocks;
#   3. sequential read (cold cache, after a remount) of an untouched 1 GiB lower file, and of
#      the rewritten file (complete by then: on mosaicfs it is served by passthrough).
#
# Usage: bench/caw.sh [--quick]   (quick: 256 MiB files). Needs root.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bin=${MOSAICFS:-$here/../target/release/mosaicfs}
quick=0; [ "${1:-}" = --quick ] && quick=1
root=${BENCH_DIR:-/var/tmp/mosaicfs-bench-caw}
command -v fuse-overlayfs >/dev/null || apt-get install -y -qq fuse-overlayfs >/dev/null
cc -O2 -o "$root.iobench" "$here/iobench.c" 2>/dev/null || { mkdir -p "$(dirname "$root")"; cc -O2 -o "$root.iobench" "$here/iobench.c"; }
io="$root.iobench"
if [ $quick = 1 ]; then wsize=256M; rsize=256M; else wsize=2G; rsize=1G; fi
mkdir -p "$root/lower"
[ -f "$root/lower/written-$wsize" ] || head -c "$(numfmt --from=iec $wsize)" /dev/urandom > "$root/lower/written-$wsize"
[ -f "$root/lower/untouched-$rsize" ] || head -c "$(numfmt --from=iec $rsize)" /dev/urandom > "$root/lower/untouched-$rsize"

drop() { sync; echo 3 > /proc/sys/vm/drop_caches; }
mount_fs() {
  local kind=$1 d=$2 o="lowerdir=$root/lower,upperdir=$2/upper,workdir=$2/work"
  case $kind in
    mosaicfs) "$bin" -o "$o" "$d/mnt" ;;
    overlay) mount -t overlay overlay -o "$o" "$d/mnt" ;;
    fuse-overlayfs) fuse-overlayfs -o "$o" "$d/mnt" 2>/dev/null ;;
  esac
}
field() { sed -E "s/.*$1=([0-9.]+).*/\1/" <<<"$2"; }

declare -A r
for k in mosaicfs overlay fuse-overlayfs; do
  d="$root/run-$k"; rm -rf "$d"; mkdir -p "$d"/{upper,work,mnt}
  mount_fs $k "$d"; drop
  out=$("$io" writemany "$d/mnt/written-$wsize" 4096 410)
  r[$k,wtotal]=$(field total_s "$out"); r[$k,wfirst]=$(field first_us "$out"); r[$k,wavg]=$(field avg_us "$out")
  out=$("$io" randread "$d/mnt/written-$wsize" 4096 20)
  r[$k,rtotal]=$(field total_s "$out"); r[$k,ravg]=$(field avg_us "$out")
  if [ $k = mosaicfs ]; then
    # Wait for background completion: the rewritten file becomes a plain upper file.
    for _ in $(seq 600); do getfattr -n trusted.mosaicfs.partial "$d/upper/written-$wsize" >/dev/null 2>&1 || break; sleep 0.5; done
  fi
  umount "$d/mnt"; sleep 0.5; mount_fs $k "$d"; drop
  out=$("$io" seqread "$d/mnt/untouched-$rsize"); r[$k,seq_lower]=$(field mib_s "$out")
  drop
  out=$("$io" seqread "$d/mnt/written-$wsize"); r[$k,seq_done]=$(field mib_s "$out")
  umount "$d/mnt"; sleep 0.5; rm -rf "$d"
done

ratio() { python3 -c "a,b=float('$1'),float('$2'); print(f'{a/b:.3g}x' if b > 0 else '-')"; }
row() { # label key unit
  echo "| $1 | ${r[mosaicfs,$2]} | ${r[overlay,$2]} | ${r[fuse-overlayfs,$2]} | $(ratio "${r[mosaicfs,$2]}" "${r[overlay,$2]}") | $(ratio "${r[mosaicfs,$2]}" "${r[fuse-overlayfs,$2]}") |"
}
echo
echo "Copy-after-write benchmark, $(date -u +%Y-%m-%d), $(nproc) cores, $(uname -r), $(stat -f -c %T "$root")"
echo
echo "| workload | mosaicfs | kernel overlayfs | fuse-overlayfs | mosaicfs vs overlayfs | mosaicfs vs fuse-overlayfs |"
echo "|---|---|---|---|---|---|"
row "write-many, $wsize file: total (s)" wtotal
row "write-many: first write latency (us)" wfirst
row "write-many: average latency (us)" wavg
row "random 4 KiB reads of 20% of the blocks: total (s)" rtotal
row "random reads: average latency (us)" ravg
row "sequential read, untouched $rsize lower file (MiB/s)" seq_lower
row "sequential read, the rewritten file after remount (MiB/s)" seq_done
