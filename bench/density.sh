#!/usr/bin/env bash
# Idle mounts (issue #42): N overlays mounted one after another, each daemon started the way
# mount(8) and containers/storage start it (in the background), for mosaicfs, fuse-overlayfs
# 1.10 (apt) and fuse-overlayfs 2.0 (built from its published source with cargo, when
# crates.io is reachable). Reports the time to mount all, and per daemon the resident memory
# and the threads, once every mount has been listed once (as a container start would).
# Resident memory is given three ways: RSS (counts the program's text and libc in every
# daemon, though the host holds them once), PSS (shares those pages out among the daemons
# that map them: what N daemons cost the host, divided by N) and anonymous memory (heap,
# stacks: each daemon's own).
#
# Usage: bench/density.sh [N]   (default 100). LAYERS=K gives each overlay K lower layers (as
# a container has one per image layer; default 1). Needs root.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# The daemon as installed (linked statically, make daemon), else cargo's dynamic build.
installed=$here/../target/$(rustc -vV | sed -n 's/^host: //p')/release/mosaicfs
[ -x "$installed" ] || installed=$here/../target/release/mosaicfs
bin=$(realpath "${MOSAICFS:-$installed}")
n=${1:-100}
t=${BENCH_DIR:-/var/tmp/mfs-density}
command -v fuse-overlayfs >/dev/null || apt-get install -y -qq fuse-overlayfs >/dev/null
fo2=${FUSE_OVERLAYFS2:-/var/tmp/fo2/bin/fuse-overlayfs}
if [ ! -x "$fo2" ]; then
  cargo install -q fuse-overlayfs --version 2.0.0 --root "$(dirname "$(dirname "$fo2")")" >/dev/null 2>&1 || fo2=""
fi

umount_all() { grep " $t/" /proc/self/mounts | awk '{print $2}' | xargs -r -n1 umount 2>/dev/null || true; }
trap umount_all EXIT
umount_all
layers=${LAYERS:-1}
rm -rf "$t"; mkdir -p "$t/lower"
for d in etc bin usr/lib; do mkdir -p "$t/lower/$d"; done
for i in $(seq 50); do echo "file $i" > "$t/lower/etc/f$i"; done
lowerdir=$t/lower
for k in $(seq 2 "$layers"); do
  mkdir -p "$t/lower$k/usr/lib/l$k"; echo "layer $k" > "$t/lower$k/usr/lib/l$k/f"
  lowerdir="$t/lower$k:$lowerdir"
done

declare -A secs rss pss anon threads
setups=(mosaicfs fuse-overlayfs-1.10)
[ -n "$fo2" ] && setups+=(fuse-overlayfs-2.0)
for s in "${setups[@]}"; do
  case $s in
    mosaicfs) prog=$bin ;;
    fuse-overlayfs-1.10) prog=$(command -v fuse-overlayfs) ;;
    fuse-overlayfs-2.0) prog=$fo2 ;;
  esac
  for i in $(seq "$n"); do mkdir -p "$t/$s/$i"/{u,w,m}; done
  sync
  # Each program starts out of the page cache, as after a boot: how a file's pages were last
  # cached changes how many a daemon maps (a file just written is cached in large folios,
  # and Linux 6.18 maps a large folio whole on a fault).
  dd if="$prog" iflag=nocache count=0 status=none
  a=$(date +%s%N)
  for i in $(seq "$n"); do
    "$prog" -o "lowerdir=$lowerdir,upperdir=$t/$s/$i/u,workdir=$t/$s/$i/w" "$t/$s/$i/m"
  done
  secs[$s]=$(python3 -c "print(f'{($(date +%s%N) - $a) / 1e9:.2f}')")
  for i in $(seq "$n"); do ls "$t/$s/$i/m/etc" >/dev/null; done
  sleep 1
  pids=$(pgrep -f -- "$t/$s/" || true)
  read -r r ps an th < <(for p in $pids; do
      echo "$(awk '/^VmRSS/ {print $2}' /proc/$p/status) $(awk '/^Pss:/ {print $2}' /proc/$p/smaps_rollup)" \
        "$(awk '/^RssAnon/ {print $2}' /proc/$p/status) $(ls /proc/$p/task | wc -l)"
    done | awk '{r += $1; p += $2; a += $3; t += $4; k++}
                END {printf "%.1f %.2f %.2f %.1f\n", r / k / 1024, p / k / 1024, a / k / 1024, t / k}')
  rss[$s]=$r; pss[$s]=$ps; anon[$s]=$an; threads[$s]=$th
  umount_all
done

echo
echo "Idle mounts, $(date -u +%Y-%m-%d), $(nproc) cores, $(uname -r), $n mounts of $layers lower layer(s) one after another, daemons in the background"
echo
printf '| per daemon |'; for s in "${setups[@]}"; do printf ' %s |' "$s"; done; echo
printf '|---|'; for s in "${setups[@]}"; do printf -- '---|'; done; echo
printf '| mounting %s overlays (s) |' "$n"; for s in "${setups[@]}"; do printf ' %s |' "${secs[$s]}"; done; echo
printf '| resident memory, RSS (MB) |'; for s in "${setups[@]}"; do printf ' %s |' "${rss[$s]}"; done; echo
printf '| resident memory, PSS (MB) |'; for s in "${setups[@]}"; do printf ' %s |' "${pss[$s]}"; done; echo
printf '| anonymous memory (MB) |'; for s in "${setups[@]}"; do printf ' %s |' "${anon[$s]}"; done; echo
printf '| threads |'; for s in "${setups[@]}"; do printf ' %s |' "${threads[$s]}"; done; echo
