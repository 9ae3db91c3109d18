#!/usr/bin/env bash
# Runs a command with the kernel's FUSE over io_uring switched on and every mosaicfs mount
# asking for it (MOSAICFS_URING=auto: io_uring unless lower_timeout= or a layer on a store
# keeps /dev/fuse), then puts the module parameter back as it was.
set -euo pipefail
p=/sys/module/fuse/parameters/enable_uring
if [ ! -w "$p" ]; then
  echo "with-uring: $p is missing (kernel without CONFIG_FUSE_IO_URING): skipped: $*"
  exit 0
fi
before=$(cat "$p")
trap 'echo "$before" > "$p"' EXIT
echo Y > "$p"
MOSAICFS_URING=auto "$@"
