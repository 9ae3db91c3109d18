#!/bin/bash
# Builds the Debian package of mosaicfs from this tree: target/debian/mosaicfs_VERSION_ARCH.deb.
# Usage: packaging/deb.sh   (or: make deb). Needs dpkg-dev (installed here when missing).
#
# The package holds what `make install PREFIX=/usr` installs (both binaries, the mount helpers
# for mount -t fuse.mosaicfs / fuse3.mosaicfs, the man page) plus the docs and the examples
# (an fstab line, a systemd mount unit, a service for the containerd snapshotter). Its library
# dependencies are computed by dpkg-shlibdeps from the binaries; fuse3 gives fusermount3, which
# mounts as a plain user need.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v dpkg-shlibdeps >/dev/null; then
    echo "installing dpkg-dev (dpkg-shlibdeps) to build the package"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dpkg-dev >/dev/null
fi

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
arch=$(dpkg --print-architecture)
out=target/debian
stage=$out/stage
rm -rf "$stage"
mkdir -p "$stage/DEBIAN"

make --no-print-directory install DESTDIR="$PWD/$stage" PREFIX=/usr SBINDIR=/usr/sbin >/dev/null
gzip -9n "$stage/usr/share/man/man1/mosaicfs.1"

doc=$stage/usr/share/doc/mosaicfs
install -d "$doc/examples"
install -m 0644 README.md "$doc/"
install -m 0644 docs/FORMAT.md docs/ARCHITECTURE.md docs/ROBUSTNESS.md docs/KERNEL-NOTES.md "$doc/"
install -m 0644 packaging/examples/* "$doc/examples/"
{
    echo "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/"
    echo "Upstream-Name: mosaicfs"
    echo
    echo "Files: *"
    echo "License: Apache-2.0"
    echo " On Debian systems the full text of the Apache License 2.0 is in"
    echo " /usr/share/common-licenses/Apache-2.0."
} >"$doc/copyright"
{
    echo "mosaicfs ($version) unstable; urgency=medium"
    echo
    echo "  * Built from the source tree at $(git rev-parse --short HEAD 2>/dev/null || echo unknown)."
    echo
    echo " -- mosaicfs developers <mosaicfs@localhost>  $(date -R)"
} | gzip -9n >"$doc/changelog.Debian.gz"

# Library dependencies of the binaries, as Debian computes them (libc6 (>= 2.34), ...).
# dpkg-shlibdeps wants a debian/control; give it one in a scratch directory.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/debian"
printf 'Source: mosaicfs\n\nPackage: mosaicfs\nArchitecture: any\n' >"$scratch/debian/control"
bins=("$PWD/$stage/usr/bin/mosaicfs" "$PWD/$stage/usr/bin/mosaicfs-snapshotter")
shlibs=$(cd "$scratch" && dpkg-shlibdeps -O "${bins[@]}" 2>/dev/null | sed -n 's/^shlibs:Depends=//p')

size=$(du -sk --exclude=DEBIAN "$stage" | cut -f1)
cat >"$stage/DEBIAN/control" <<CONTROL
Package: mosaicfs
Version: $version
Architecture: $arch
Maintainer: mosaicfs developers <mosaicfs@localhost>
Installed-Size: $size
Depends: ${shlibs:+$shlibs, }fuse3
Suggests: podman | containerd | docker.io
Section: admin
Priority: optional
Description: overlay file system for container storage that copies blocks, not files
 mosaicfs is a userspace (FUSE) overlay file system for container root file
 systems: read-only image layers under one writable layer. Where kernel
 overlayfs and fuse-overlayfs copy a whole file up the first time it is opened
 for writing, mosaicfs copies only the blocks written, off the write's critical
 path, and only metadata on chown and chmod. It reads and writes the layers of
 kernel overlayfs and fuse-overlayfs, mounts with mount -t fuse.mosaicfs, serves
 Podman and Docker as their mount program and containerd through
 mosaicfs-snapshotter.
CONTROL
# After an upgrade, every live mount that survives its daemon and is served by the packaged
# binary gets the new binary in place (mosaicfs upgrade; the others keep the old daemon until
# they are mounted again). A mount another mosaicfs serves (a build of one's own, a copy a
# container engine runs) is left to it.
cat >"$stage/DEBIAN/postinst" <<'POSTINST'
#!/bin/sh
set -e
if [ "$1" = configure ] && [ -n "$2" ]; then
    awk '$0 ~ / - fuse\.mosaicfs / { print $5 }' /proc/self/mountinfo | while read -r mnt; do
        mnt=$(printf '%b' "$mnt")
        /usr/bin/mosaicfs status "$mnt" 2>/dev/null | grep -q '^daemon: .*, binary /usr/bin/mosaicfs$' ||
            continue
        /usr/bin/mosaicfs upgrade "$mnt" --binary /usr/bin/mosaicfs ||
            echo "mosaicfs: $mnt keeps its old daemon until it is mounted again" >&2
    done
fi
exit 0
POSTINST
chmod 0755 "$stage/DEBIAN/postinst"
(cd "$stage" && find . -type f ! -path './DEBIAN/*' -printf '%P\0' | sort -z | xargs -0 md5sum) \
    >"$stage/DEBIAN/md5sums"

deb="$out/mosaicfs_${version}_${arch}.deb"
dpkg-deb --root-owner-group -Zxz --build "$stage" "$deb" >/dev/null
echo "$deb"
