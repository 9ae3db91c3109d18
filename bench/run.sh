#!/usr/bin/env bash
# The benchmark suite: the same workloads on mosaicfs, kernel overlayfs and fuse-overlayfs in
# one run, printed as a table of ratios (see suite.py for the workloads).
#
# Usage: bench/run.sh [--sustained] [--quick] [--also passthrough=all] [--fs ext4|xfs|btrfs|here] [--uring]
#   (quick: under 3 minutes; --fs: what the layers sit on, default a fresh ext4; --sustained:
#   the rows of sustained.py, I/O after the first write, issue #11; --uring: with the kernel's
#   FUSE over io_uring on, which mosaicfs then uses). Needs root.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
for tool in fio fuse-overlayfs cc mkfs.xfs mkfs.btrfs; do
  command -v $tool >/dev/null || { apt-get install -y -qq fio fuse-overlayfs gcc xfsprogs btrfs-progs >/dev/null; break; }
done
[ -x "$here/../target/release/mosaicfs" ] || (cd "$here/.." && cargo build --release)
# fuse-overlayfs 2.0, upstream's Rust rewrite, from its published source (crates.io); the suite
# leaves its column out when it cannot be built.
fo2=${FUSE_OVERLAYFS2:-/var/tmp/fo2/bin/fuse-overlayfs}
[ -x "$fo2" ] || cargo install -q fuse-overlayfs --version 2.0.0 --root "$(dirname "$(dirname "$fo2")")" \
  >/dev/null 2>&1 || echo "fuse-overlayfs 2.0 did not build: its column is left out" >&2
export FUSE_OVERLAYFS2=$fo2
script=suite.py
[ "${1:-}" = --sustained ] && { script=sustained.py; shift; }
exec python3 "$here/$script" "$@"
