#!/usr/bin/env bash
# The benchmark suite: the same workloads on mosaicfs, kernel overlayfs and fuse-overlayfs in
# one run, printed as a table of ratios (see suite.py for the workloads).
#
# Usage: bench/run.sh [--quick] [--also passthrough=all]   (quick: under 3 minutes). Needs root.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
for tool in fio fuse-overlayfs cc; do
  command -v $tool >/dev/null || { apt-get install -y -qq fio fuse-overlayfs gcc >/dev/null; break; }
done
[ -x "$here/../target/release/mosaicfs" ] || (cd "$here/.." && cargo build --release)
exec python3 "$here/suite.py" "$@"
