#!/usr/bin/env bash
# containers/storage's own test suite (tests/*.bats, the library Podman, Buildah and CRI-O keep
# their layers with) on its overlay driver with mosaicfs as the mount program, as
# fuse-overlayfs' CI runs it with fuse-overlayfs: layers created, applied from tarballs,
# diffed, mounted, copied, deleted; images and containers on top. containers/storage computes
# every diff and change list through a fresh mount of the layer.
#
# The suite and the containers-storage tool come from the Go module proxy (the module's source
# holds tests/), pinned below, built once under $STORAGE_WORK.
#
# Usage: tests/storage/run.sh [MOSAICFS] [BATS-FILE...]   (default: the installed mosaicfs,
# every test). Env: STORAGE_WORK (default /var/tmp/mosaicfs-storage).
set -euo pipefail
version=v1.59.1
daemon=$(readlink -f "${1:-$(command -v mosaicfs)}")
shift || true
work=${STORAGE_WORK:-/var/tmp/mosaicfs-storage}
export GOPATH=$work/gopath GOFLAGS=-mod=mod
PATH=$PATH:/usr/local/go/bin

command -v go >/dev/null || { echo "storage: Go is missing (tests/deps.sh installs it)"; exit 1; }
. "$(dirname "$0")/../need.sh"
need storage bats:bats

src=$work/storage-$version
if [ ! -x "$src/containers-storage" ]; then
  echo "storage: building containers-storage $version in $src"
  mkdir -p "$work"
  dir=$(go mod download -json "github.com/containers/storage@$version" 2>> "$work/build.log" |
    python3 -c 'import json,sys; print(json.load(sys.stdin)["Dir"])')
  rm -rf "$src"
  cp -r "$dir" "$src"
  chmod -R u+w "$src"
  # The module's vendor/ is incomplete as the proxy serves it: dependencies come from the proxy.
  rm -rf "$src/vendor"
  if ! (cd "$src" && go build -tags "exclude_graphdriver_btrfs no_libsubid" \
    -o containers-storage ./cmd/containers-storage) > "$work/build.log" 2>&1; then
    tail -20 "$work/build.log"; echo "storage: build failed (log: $work/build.log)"; exit 1
  fi
fi

cd "$src/tests"
log=$work/bats.log
start=$(date +%s)
set +e
JOBS=1 STORAGE_DRIVER=overlay STORAGE_OPTION=overlay.mount_program=$daemon \
  unshare -m bash ./test_runner.bash "$@" > "$log" 2>&1
rc=$?
set -e
passed=$(grep -c '^ok ' "$log" || true)
skipped=$(grep -c '^ok .* # skip' "$log" || true)
if [ $rc -eq 0 ]; then
  echo "storage: containers/storage $version tests on mosaicfs: $passed ok in $(( $(date +%s) - start )) s;" \
    "$skipped of them skipped by the suite (its id-mapping tests with any mount program, reflink" \
    "dedup, FreeBSD-only tests)"
else
  echo "storage: FAILED (log: $log):"
  grep -A15 '^not ok' "$log" | head -60 | sed 's/^/    /'
  exit 1
fi
