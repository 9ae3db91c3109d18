#!/usr/bin/env bash
# The same xfstests generic tests on kernel overlayfs (`./check -overlay`), for the side-by-side
# column of tests/xfstests/expected (issue #40): what kernel overlayfs passes, mosaicfs must
# pass, or the list says why not (the reason being FUSE itself).
#
# Each base file system is XFS on a loop device (as run.sh's layers); xfstests makes the
# overlay's lower, upper and work dirs on it and mounts kernel overlayfs with the kernel's
# default options. Not part of make test (about 25 minutes for all 633).
#
# Usage: tests/xfstests/kernel-overlay.sh [--all | generic/NNN ...]
#   prints one line per test (name, outcome, seconds, reason) and writes them to
#   $XFSTESTS_WORK/kernel-results.txt; writes each outcome into the `kernel:` column of
#   tests/xfstests/expected; then lists the tests kernel overlayfs passes and mosaicfs is not
#   expected to pass (the reason next to each must be FUSE's).
# Env: XFSTESTS_WORK (default /var/tmp/mosaicfs-xfstests-kernel; the build is shared with
# run.sh's when that is present).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
work=${XFSTESTS_WORK:-/var/tmp/mosaicfs-xfstests-kernel}
expected=$here/expected
built=/var/tmp/mosaicfs-xfstests/xfstests

"$here/deps.sh" || exit 1
if [ ! -x "$built/check" ] || [ ! -f "$built/ltp/fsstress" ]; then
  echo "kernel-overlay: build xfstests first: tests/xfstests/run.sh generic/001"; exit 1
fi
mkdir -p "$work"
src=$work/xfstests
# A copy of the build of its own: local.config and results differ from run.sh's.
if [ ! -f "$src/check" ]; then
  cp -a "$built" "$src" || exit 1
fi

made_users=()
for u in fsgqa fsgqa2 123456-fsgqa; do
  if ! id "$u" >/dev/null 2>&1; then
    useradd -M -d / -U "$u" && made_users+=("$u")
  fi
done
loops=()
cleanup() {
  for d in "$work/test" "$work/scratch"; do
    while mountpoint -q "$d"; do umount -R "$d" 2>/dev/null || umount -l "$d"; done
  done
  for l in "${loops[@]}"; do losetup -d "$l" 2>/dev/null; done
  rm -f "$work"/*.img
  for u in "${made_users[@]}"; do userdel "$u" 2>/dev/null; done
}
trap cleanup EXIT
declare -A dev
for d in test scratch; do
  img=$work/$d.img
  rm -f "$img"
  truncate -s 8G "$img"
  mkfs.xfs -q -f "$img"
  dev[$d]=$(losetup -f --show "$img") || exit 1
  loops+=("${dev[$d]}")
  mkdir -p "$work/$d"
done
cat > "$src/local.config" <<CONFIG
export FSTYP=xfs
export TEST_DEV=${dev[test]}
export TEST_DIR=$work/test
export SCRATCH_DEV=${dev[scratch]}
export SCRATCH_MNT=$work/scratch
CONFIG

case "${1:---all}" in
  --all) mapfile -t tests < <(awk '!/^#/ && NF {print $1}' "$expected") ;;
  *) tests=("$@") ;;
esac

results=$work/kernel-results.txt
: > "$results"
for t in "${tests[@]}"; do
  start=$(date +%s)
  out=$(cd "$src" && ./check -overlay "$t" 2>&1)
  took=$(( $(date +%s) - start ))
  if echo "$out" | grep -q "^Not run:"; then got=notrun
  elif echo "$out" | grep -q "^Passed all"; then got=pass
  else got=fail
  fi
  why=""
  [ "$got" = notrun ] && why=$(echo "$out" | grep -m1 "\[not run\]" | sed 's/.*\[not run\] //')
  [ "$got" = fail ] && why=$(echo "$out" | grep -m1 -E "output mismatch|failed|_check" | sed 's/^ *//')
  printf '%-12s %-7s %4ss  %s\n' "$t" "$got" "$took" "$why" | tee -a "$results"
done

# The kernel column of `expected`: name, mosaicfs outcome, speed, kernel:OUTCOME, why.
python3 - "$results" "$expected" <<'PY'
import re, sys
kernel = dict(l.split()[:2] for l in open(sys.argv[1]) if l.strip())
out = []
for line in open(sys.argv[2]).read().splitlines():
    f = line.split(None, 3)
    if line.startswith("#") or len(f) < 3 or f[0] not in kernel:
        out.append(line)
        continue
    rest = f[3] if len(f) > 3 else ""
    rest = re.sub(r"^kernel:\S+\s*", "", rest)
    out.append(f"{f[0]:<12} {f[1]:<7} {f[2]:<6} kernel:{kernel[f[0]]:<7} {rest}".rstrip())
open(sys.argv[2], "w").write("\n".join(out) + "\n")
PY
# Kernel overlayfs passes, mosaicfs is not expected to: each needs its reason in `expected`.
echo "kernel overlayfs passes, mosaicfs does not (tests/xfstests/expected says why):"
awk '!/^#/ && NF && $4 == "kernel:pass" && $2 != "pass" { print "  " $0 }' "$expected"
