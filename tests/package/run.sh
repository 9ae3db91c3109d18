#!/usr/bin/env bash
# The install story (issue #38): the Debian package built from the tree (make deb), installed
# on this machine with dpkg and used as a user would — mount -t fuse.mosaicfs through its mount
# helper, the fstab line and the systemd mount unit it ships as examples (their mounts run as
# mount(8) and systemd would run them), the snapshotter service's command line — then purged;
# and the static binaries (make static) running with no library at all, in an empty chroot.
# What this machine had at the package's paths (make install's links) is put back afterwards.
#
# Usage: tests/package/run.sh   (needs root, dpkg; run from anywhere)
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
top=$(cd "$here/../.." && pwd)
. "$here/../check.sh"

if dpkg -s mosaicfs >/dev/null 2>&1; then
  echo "package test: a mosaicfs package is installed here already (dpkg --purge mosaicfs first)"
  exit 1
fi
deb=$(cd "$top" && make --no-print-directory deb | tail -1)
[ -f "$top/$deb" ] || { echo "package test: make deb did not build a package"; exit 1; }
deb=$top/$deb

t=$(mktemp -d /var/tmp/mosaicfs-package.XXXXXX)
owned=(/usr/bin/mosaicfs /usr/bin/mosaicfs-snapshotter /usr/sbin/mount.fuse.mosaicfs
       /usr/sbin/mount.fuse3.mosaicfs /usr/share/man/man1/mosaicfs.1.gz)
present=()
for p in "${owned[@]}"; do
  if [ -e "$p" ] || [ -L "$p" ]; then present+=("$p"); fi
done
[ ${#present[@]} -eq 0 ] || tar -cPf "$t/saved.tar" "${present[@]}"
# The modes of the directories the package installs into, compared at the end: a package
# test must leave the host as it found it.
dirs_state() { stat -c '%n %a %U' /usr /usr/bin /usr/sbin /usr/share /usr/share/doc /usr/share/man /usr/share/man/man1; }
dirs_before=$(dirs_state)
snap_pid=
cleanup() {
  [ -n "$snap_pid" ] && kill "$snap_pid" 2>/dev/null && wait "$snap_pid" 2>/dev/null
  grep -E " $t/" /proc/self/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount -l 2>/dev/null
  dpkg --purge mosaicfs >/dev/null 2>&1
  [ -f "$t/saved.tar" ] && tar -xPf "$t/saved.tar"
  rm -rf "$t"
}
trap cleanup EXIT

# Layers for the mounts: a 64 MiB lower file, an upper and a work dir, under $t/srv as the
# examples' /srv.
layers() { # DIR: fresh layers at DIR-image, DIR-rw/{upper,work}, mount point DIR
  rm -rf "$1" "$1-image" "$1-rw"
  mkdir -p "$1" "$1-image" "$1-rw/upper" "$1-rw/work"
  head -c 64M /dev/urandom > "$1-image/big"
}
# A 1-byte write into the big file through the mount at DIR: the upper file holds kilobytes,
# the bytes read back are the lower file's but one.
block_write() {
  printf x | dd of="$1/big" bs=1 seek=40000000 conv=notrunc status=none || return 1
  local kib; kib=$(du -k "$1-rw/upper/big" | cut -f1)
  [ "$kib" -lt 1024 ] || { echo "upper file holds $kib KiB after a 1-byte write"; return 1; }
  cmp -n 40000000 "$1/big" "$1-image/big" || return 1
  [ "$(dd if="$1/big" bs=1 skip=40000000 count=1 status=none)" = x ]
}

check "dpkg -i installs the package" dpkg -i "$deb"
check "it holds the binaries, the mount helpers, the man page and the examples" sh -c '
  files=$(dpkg -L mosaicfs)
  for f in /usr/bin/mosaicfs /usr/bin/mosaicfs-snapshotter /usr/sbin/mount.fuse.mosaicfs \
           /usr/sbin/mount.fuse3.mosaicfs /usr/share/man/man1/mosaicfs.1.gz \
           /usr/share/doc/mosaicfs/copyright /usr/share/doc/mosaicfs/examples/fstab \
           /usr/share/doc/mosaicfs/examples/srv-app.mount \
           /usr/share/doc/mosaicfs/examples/mosaicfs-snapshotter.service; do
    echo "$files" | grep -qx "$f" || { echo "missing: $f"; exit 1; }
  done
  [ "$(readlink /usr/sbin/mount.fuse.mosaicfs)" = /usr/bin/mosaicfs ]
  /usr/bin/mosaicfs --version && /usr/bin/mosaicfs-snapshotter --help >/dev/null
  zcat /usr/share/man/man1/mosaicfs.1.gz | grep -q "CONTAINERD SNAPSHOTTER"'
check "the package names its library dependencies and fuse3" sh -c \
  'dpkg-query -W -f="\${Depends}" mosaicfs | grep -E "libc6 \(>= 2\.[0-9]+\).*fuse3"'

layers "$t/srv/a"
check "mount -t fuse.mosaicfs runs the packaged binary" sh -c "
  mount -t fuse.mosaicfs mosaicfs $t/srv/a \
    -o lowerdir=$t/srv/a-image,upperdir=$t/srv/a-rw/upper,workdir=$t/srv/a-rw/work &&
  [ \"\$(findmnt -n -o FSTYPE --mountpoint $t/srv/a)\" = fuse.mosaicfs ] &&
  for p in /proc/[0-9]*; do [ \"\$(readlink \$p/exe)\" = /usr/bin/mosaicfs ] && exit 0; done; exit 1"
check "a 1-byte write through it copies a block, not the file" block_write "$t/srv/a"
umount "$t/srv/a" 2>/dev/null

# An upgrade of the package while a mount that survives its daemon is live: the package's
# postinst has a new daemon take the mount over (mosaicfs upgrade), a descriptor open across.
layers "$t/srv/u"
/usr/bin/mosaicfs -o "lowerdir=$t/srv/u-image,upperdir=$t/srv/u-rw/upper,workdir=$t/srv/u-rw/work,restart=on" "$t/srv/u"
exec 9<"$t/srv/u/big"
# And a mount another mosaicfs serves (a copy of the binary elsewhere), which the upgrade must
# leave alone.
layers "$t/srv/o"
cp /usr/bin/mosaicfs "$t/other-mosaicfs"
"$t/other-mosaicfs" -o "lowerdir=$t/srv/o-image,upperdir=$t/srv/o-rw/upper,workdir=$t/srv/o-rw/work,restart=on" "$t/srv/o"
other=$(/usr/bin/mosaicfs status "$t/srv/o" | sed -n 's/^daemon: pid \([0-9]*\),.*/\1/p')
check "dpkg -i of the package again upgrades a live mount in place" sh -c "
  before=\$(/usr/bin/mosaicfs status $t/srv/u | sed -n 's/^daemon: pid \\([0-9]*\\),.*/\\1/p')
  dpkg -i '$deb' >/dev/null &&
  /usr/bin/mosaicfs status $t/srv/u | grep -q 'daemons before this one: 1' &&
  after=\$(/usr/bin/mosaicfs status $t/srv/u | sed -n 's/^daemon: pid \\([0-9]*\\),.*/\\1/p') &&
  [ \"\$before\" != \"\$after\" ] && [ \"\$(readlink /proc/\$after/exe)\" = /usr/bin/mosaicfs ]"
check "… and a descriptor open before reads on" sh -c "cmp - '$t/srv/u-image/big' <&9"
exec 9<&-
umount "$t/srv/u" 2>/dev/null
check "… and leaves a mount another mosaicfs binary serves to it" sh -c "
  /usr/bin/mosaicfs status $t/srv/o | grep -q '^daemon: pid $other, .*binary $t/other-mosaicfs'"
umount "$t/srv/o" 2>/dev/null

# The examples as written, their /srv paths moved under $t.
ex=/usr/share/doc/mosaicfs/examples
layers "$t/srv/app"
sed "s#/srv/#$t/srv/#g" "$ex/fstab" > "$t/fstab"
check "the example fstab line mounts (mount --fstab)" sh -c "
  mount --fstab $t/fstab $t/srv/app && [ \"\$(findmnt -n -o FSTYPE --mountpoint $t/srv/app)\" = fuse.mosaicfs ]"
check "… and copies blocks" block_write "$t/srv/app"
umount "$t/srv/app" 2>/dev/null

layers "$t/srv/app"
unit=$(sed "s#/srv/#$t/srv/#g" "$ex/srv-app.mount")
key() { echo "$unit" | sed -n "s/^$1=//p"; }
check "the example mount unit is named after its mount point" sh -c '
  where=$(sed -n "s/^Where=//p" '"$ex"'/srv-app.mount)
  [ "$(echo "${where#/}" | tr / -).mount" = srv-app.mount ]'
# What systemd runs for a mount unit: mount -t TYPE -o OPTIONS WHAT WHERE.
check "the example mount unit mounts as systemd would mount it" sh -c "
  mount -t '$(key Type)' -o '$(key Options)' '$(key What)' '$(key Where)' &&
  [ \"\$(findmnt -n -o FSTYPE --mountpoint $t/srv/app)\" = fuse.mosaicfs ]"
check "… and copies blocks" block_write "$t/srv/app"
umount "$t/srv/app" 2>/dev/null

exec_start=$(sed -n 's/^ExecStart=//p' "$ex/mosaicfs-snapshotter.service" |
  sed "s#/run/#$t/run/#g; s#/var/lib/#$t/lib/#g")
# shellcheck disable=SC2086 # the unit's command line, split as systemd splits it
$exec_start > "$t/snapshotter.log" 2>&1 &
snap_pid=$!
check "the example snapshotter service's command serves its socket" sh -c "
  for _ in \$(seq 100); do [ -S $t/run/mosaicfs-snapshotter/mosaicfs-snapshotter.sock ] && exit 0
    kill -0 $snap_pid || break; sleep 0.1; done; cat $t/snapshotter.log; exit 1"
kill "$snap_pid" 2>/dev/null; wait "$snap_pid" 2>/dev/null; snap_pid=

check "dpkg --purge removes it all" sh -c '
  dpkg --purge mosaicfs >/dev/null &&
  for f in /usr/bin/mosaicfs /usr/sbin/mount.fuse.mosaicfs /usr/share/doc/mosaicfs; do
    [ ! -e "$f" ] && [ ! -L "$f" ] || { echo "left: $f"; exit 1; }
  done'

# The static binaries: no interpreter, no library; they run where nothing else is.
if (cd "$top" && make --no-print-directory static > "$t/static.log" 2>&1); then
  s=$top/target/static
  check "make static links both binaries statically" sh -c "
    for b in $s/mosaicfs $s/mosaicfs-snapshotter; do
      ldd \$b 2>&1 | grep -Eq 'statically linked|not a dynamic executable' || exit 1
      ldd \$b 2>&1 | grep -q '=>' && exit 1
    done; exit 0"
  mkdir -p "$t/empty-root"
  cp "$s/mosaicfs" "$t/empty-root/"
  check "the static binary runs in an empty root" chroot "$t/empty-root" /mosaicfs --version
  layers "$t/srv/s"
  "$s/mosaicfs" -o "lowerdir=$t/srv/s-image,upperdir=$t/srv/s-rw/upper,workdir=$t/srv/s-rw/work" "$t/srv/s"
  check "the static binary mounts and copies blocks" block_write "$t/srv/s"
  umount "$t/srv/s" 2>/dev/null
else
  failed=$((failed + 1)); echo "FAIL make static"; tail -25 "$t/static.log" | sed 's/^/     /'
fi

check "the host's directories keep their modes" sh -c '[ "$1" = "$2" ] || { echo "before: $1"; echo "after: $2"; exit 1; }' _ "$dirs_before" "$(dirs_state)"

summary "package test"
