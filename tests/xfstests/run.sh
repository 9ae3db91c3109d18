#!/usr/bin/env bash
# xfstests' generic tests on mosaicfs (issue #40). xfstests travels with the repository as
# vendor/xfstests/xfstests-COMMIT.tar.xz (kdave/xfstests, GPL-2.0; it is not packaged by
# Debian); this script builds it once under $XFSTESTS_WORK, then runs it with FSTYP=fuse:
# each "device" is a mosaicfs overlay whose lower, upper and work dirs sit on an XFS image of
# their own, mounted by `mount -t fuse.mosaicfs` (the helper make install puts in /usr/sbin).
# xfstests cannot mkfs a FUSE file system, so the scratch layers are emptied before each test
# and each test runs in a ./check of its own.
#
# Results are compared with tests/xfstests/expected (one line per test: name, expected
# outcome — pass, notrun, fail — and why); a test expected to pass that does not fails the run.
#
# Usage: tests/xfstests/run.sh [--quick | --all | generic/NNN ...]
#   --quick  the tests marked quick in `expected` (under 10 s each here): part of make test
#   --all    every test in `expected`                               (default)
#   names    just those tests; prints each outcome
# The mosaicfs mounted is the one /usr/sbin/mount.fuse.mosaicfs runs (make install's).
# Env: XFSTESTS_FS=ext4 puts the layers on ext4 instead of XFS (file handles: generic/477),
# XFSTESTS_WORK (build and layers, default /var/tmp/mosaicfs-xfstests), XFSTESTS_KEEP=1
# keeps the mounts at the end, MOSAICFS_OPTS=a,b adds mount options (passthrough=off,writeback=auto:
# the kernel's writeback cache).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
work=${XFSTESTS_WORK:-/var/tmp/mosaicfs-xfstests}
tarball=$(ls "$top"/vendor/xfstests/xfstests-*.tar.xz | head -1)
expected=$here/expected

"$here/deps.sh" || exit 1
[ -x /usr/sbin/mount.fuse.mosaicfs ] || { echo "xfstests: mount.fuse.mosaicfs is missing (make install)"; exit 1; }

# Build once per tarball.
src=$work/xfstests
stamp=$work/built-$(basename "$tarball")
if [ ! -f "$stamp" ]; then
  echo "xfstests: building $(basename "$tarball") in $src"
  rm -rf "$src" "$work"/built-*
  mkdir -p "$work"
  tar -xJf "$tarball" -C "$work" || exit 1
  # A mosaicfs mount's type is fuse.mosaicfs; FSTYP=fuse expects what df shows to read
  # "fuse", as it maps fuse.glusterfs to glusterfs.
  sed -i "s|-e 's/fuse.glusterfs/glusterfs/'|-e 's/fuse.mosaicfs/fuse/' &|" "$src/common/rc"
  grep -q "fuse.mosaicfs/fuse" "$src/common/rc" || { echo "xfstests: common/rc changed: update run.sh"; exit 1; }
  if ! (cd "$src" && make -j"$(nproc)" > "$work/build.log" 2>&1); then
    tail -30 "$work/build.log"; echo "xfstests: build failed (log: $work/build.log)"; exit 1
  fi
  touch "$stamp"
fi

# The users xfstests runs unprivileged steps as (its README: fsgqa, fsgqa2, 123456-fsgqa),
# made here for the run and removed after it when this machine had none.
made_users=()
for u in fsgqa fsgqa2 123456-fsgqa; do
  if ! id "$u" >/dev/null 2>&1; then
    useradd -M -d / -U "$u" && made_users+=("$u")
  fi
done

# The layers' file systems and the mount points.
mnt_of() { echo "$work/$1-layers"; }
unmount_all() {
  for d in "$work/test" "$work/scratch" "$(mnt_of test)" "$(mnt_of scratch)"; do
    while mountpoint -q "$d"; do umount "$d" 2>/dev/null || umount -l "$d"; done
  done
}
cleanup() {
  unmount_all
  rm -f "$work"/*.img
  for u in "${made_users[@]}"; do userdel "$u" 2>/dev/null; done
}
[ -n "${XFSTESTS_KEEP:-}" ] || trap cleanup EXIT
unmount_all
for dev in test scratch; do
  img=$work/$dev.img
  rm -f "$img"
  truncate -s 8G "$img"
  # XFS: FSTYP=fuse makes xfstests expect 1,000 xattrs on a file (generic/020), more than one
  # ext4 block holds.
  case "${XFSTESTS_FS:-xfs}" in
    xfs) mkfs.xfs -q -f "$img" ;;
    ext4) mkfs.ext4 -q -F "$img" ;;
    *) echo "xfstests: XFSTESTS_FS takes xfs or ext4"; exit 1 ;;
  esac
  mkdir -p "$(mnt_of $dev)" "$work/$dev"
  mount -o loop "$img" "$(mnt_of $dev)" || exit 1
  mkdir -p "$(mnt_of $dev)"/{lower,upper,work}
done
layers() { local d; d=$(mnt_of "$1"); echo "lowerdir=$d/lower,upperdir=$d/upper,workdir=$d/work${MOSAICFS_OPTS:+,$MOSAICFS_OPTS}"; }
cat > "$src/local.config" <<CONFIG
export FSTYP=fuse
export FUSE_SUBTYP=.mosaicfs
export TEST_DEV=mosaicfs-test
export TEST_DIR=$work/test
export SCRATCH_DEV=mosaicfs-scratch
export SCRATCH_MNT=$work/scratch
export TEST_FS_MOUNT_OPTS="-o $(layers test)"
export MOUNT_OPTIONS="-o $(layers scratch)"
CONFIG

# The tests to run.
case "${1:---all}" in
  --quick) mapfile -t tests < <(awk '!/^#/ && NF && $3 == "quick" {print $1}' "$expected") ;;
  --all) mapfile -t tests < <(awk '!/^#/ && NF {print $1}' "$expected") ;;
  *) tests=("$@") ;;
esac
# Under the writeback cache some outcomes differ (expected.writeback says which and why).
overrides=/dev/null
case ",${MOSAICFS_OPTS:-}," in
  *,writeback=auto,*|*,writeback=on,*|*,writeback=1,*) overrides=$here/expected.writeback ;;
esac
expect_of() {
  awk -v t="$1" '$1 == t {print $2; exit}' "$overrides" "$expected"
}

passed=0; notrun=0; failed=0; unexpected=()
results=$work/results.txt
: > "$results"
for t in "${tests[@]}"; do
  # A fresh scratch device for each test: what mkfs would give.
  while mountpoint -q "$work/scratch"; do umount "$work/scratch" || sleep 0.2; done
  d=$(mnt_of scratch)
  rm -rf "$d"/{lower,upper,work}
  mkdir -p "$d"/{lower,upper,work}
  start=$(date +%s)
  out=$(cd "$src" && ./check "$t" 2>&1)
  took=$(( $(date +%s) - start ))
  # ./check prints "Passed all 1 tests" for a test that did not run, after "Not run:".
  if echo "$out" | grep -q "^Not run:"; then
    got=notrun; notrun=$((notrun + 1))
  elif echo "$out" | grep -q "^Passed all"; then
    got=pass; passed=$((passed + 1))
  else
    got=fail; failed=$((failed + 1))
  fi
  why=""
  [ "$got" = notrun ] && why=$(echo "$out" | grep -m1 "\[not run\]" | sed 's/.*\[not run\] //')
  [ "$got" = fail ] && why=$(echo "$out" | grep -m1 -E "output mismatch|failed|_check" | sed 's/^ *//')
  want=$(expect_of "$t")
  printf '%-12s %-7s %4ss  %s\n' "$t" "$got" "$took" "$why" | tee -a "$results"
  if [ -n "$want" ] && [ "$want" = pass ] && [ "$got" != pass ]; then
    unexpected+=("$t: expected to pass, $got")
    [ "$got" = fail ] && cp -r "$src/results/$t.out.bad" "$work/" 2>/dev/null
  elif [ -n "$want" ] && [ "$want" != "$got" ]; then
    echo "             (expected $want: update tests/xfstests/expected)"
  fi
done

echo "xfstests on mosaicfs: ${#tests[@]} tests, $passed passed, $notrun not run, $failed failed (results: $results)"
if [ ${#unexpected[@]} -gt 0 ]; then
  printf 'UNEXPECTED: %s\n' "${unexpected[@]}"
  echo "(the failed tests' output: $src/results/)"
  exit 1
fi
