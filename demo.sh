#!/usr/bin/env bash
# Builds nothing itself (make demo builds first): mounts a demo overlay whose lower layer holds a
# 256 MiB file, writes one byte into it through the mount, and shows that the upper layer got
# one block, not a copy of the file, and still one block 15 s later. Needs root and /dev/fuse.
set -euo pipefail
bin=${MOSAICFS:-$(dirname "$0")/target/release/mosaicfs}
demo=${DEMO_DIR:-/tmp/mosaicfs-demo}
umount "$demo/merged" 2>/dev/null || true
rm -rf "$demo" && mkdir -p "$demo"/{lower,upper,work,merged}

echo "== lower layer: a 256 MiB database file and a config file"
head -c $((256 << 20)) /dev/urandom > "$demo/lower/database.img"
echo "listen=80" > "$demo/lower/app.conf"
ls -l "$demo/lower"

echo "== mount: mosaicfs -o lowerdir=$demo/lower,upperdir=$demo/upper,workdir=$demo/work $demo/merged"
"$bin" -o "lowerdir=$demo/lower,upperdir=$demo/upper,workdir=$demo/work" "$demo/merged"

echo "== write 1 byte at offset 100,000,000 of database.img through the mount"
start=$(date +%s%N)
printf 'X' | dd of="$demo/merged/database.img" bs=1 seek=100000000 conv=notrunc status=none
echo "   took $(( ($(date +%s%N) - start) / 1000000 )) ms"
echo "== chown app.conf (metadata-only copy-up)"
chown 1000:1000 "$demo/merged/app.conf"

echo "== upper layer: apparent size vs. disk use"
du -h --apparent-size "$demo/upper/database.img" | sed 's/^/   apparent: /'
du -h "$demo/upper/database.img" | sed 's/^/   on disk:  /'
echo "== the partial-file mark (docs/FORMAT.md)"
getfattr --absolute-names -n trusted.mosaicfs.partial "$demo/upper/database.img" 2>/dev/null | sed 's/^/   /' || true

echo "== 15 s later, longer than any delay in the defaults: still one block, not a copy"
echo "   (a partial file is completed only where that pays: docs/PERFORMANCE.md)"
sleep 15
du -h "$demo/upper/database.img" | sed 's/^/   on disk:  /'
"$bin" status "$demo/merged" | grep -E 'served by passthrough|inode [0-9]+:' | sed 's/^ */   /'

echo "== merged view reads lower blocks plus the one new block"
cmp <(head -c 100000000 "$demo/lower/database.img") <(head -c 100000000 "$demo/merged/database.img") && echo "   bytes before the write: from the lower layer"
[ "$(dd if="$demo/merged/database.img" bs=1 skip=100000000 count=1 status=none)" = X ] && echo "   byte 100,000,000: X"
ls -ln "$demo/merged/app.conf" | sed 's/^/   /'

echo "== unmount: umount $demo/merged"
umount "$demo/merged"
