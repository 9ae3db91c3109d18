#!/usr/bin/env bash
# Writes the seed corpus of the fuzz targets (src/fuzzing.rs) into fuzz/corpus/: layers
# written by a real mosaicfs mount (memory images and journals, a partial-file mark) and
# values every overlay writes (stat overrides, redirects, origins, metacopy values, ACLs).
# The corpus is kept in the tree; run this again when a format changes. Needs root.
# Usage: fuzz/seed.sh [path/to/mosaicfs]
set -euo pipefail
top=$(cd "$(dirname "$0")/.." && pwd)
bin=$(realpath "${1:-$top/target/release/mosaicfs}")
out=$top/fuzz/corpus
t=$(mktemp -d)
trap 'umount "$t/m" 2>/dev/null || true; rm -rf "$t"' EXIT
mkdir -p "$t"/{l,u,w,m} "$out"/{partial_mark,memory_image,memory_journal,stat_override,redirect,origin,metacopy,posix_acl}

# A daemon in the foreground, unmounted and waited for, so that its layer is all written.
mount_run() { # OPTS, then commands run on $t/m
  local opts=$1; shift
  "$bin" -f -o "$opts" "$t/m" & local pid=$!
  until mountpoint -q "$t/m"; do sleep 0.05; done
  "$@"
  umount "$t/m"; wait "$pid"
}

printf 'lower file\n' > "$t/l/f"
head -c 65536 /dev/urandom > "$t/l/big"
mkdir "$t/l/ld"; printf 'x' > "$t/l/ld/inner"
mem="lowerdir=$t/l,upperdir=$t/u,workdir=$t/w,upper=memory"
first() {
  mkdir -p "$t/m/d/e"; printf 'new' > "$t/m/d/e/n"
  ln -s ../f "$t/m/d/link"; ln "$t/m/d/e/n" "$t/m/d/hard"
  mkfifo "$t/m/d/fifo"; setfattr -n user.k -v value "$t/m/d/e/n"
  truncate -s 20000 "$t/m/d/sparse"; printf 'tail' | dd of="$t/m/d/sparse" bs=1 seek=16000 conv=notrunc status=none
  printf 'w' | dd of="$t/m/big" bs=1 seek=5000 conv=notrunc status=none
  rm "$t/m/ld/inner"; sync "$t/m/d/e/n"
}
second() {
  mv "$t/m/d/e" "$t/m/moved"; rm "$t/m/d/hard"; chmod 600 "$t/m/f"; chown 7:8 "$t/m/moved/n"
  printf 'more' >> "$t/m/moved/n"; sync "$t/m/moved/n"
}
pair() { # NAME: the image and the journal as the memory_journal target takes them
  cp "$t/u/.mosaicfs-tree" "$out/memory_image/$1"
  python3 - "$t/u/.mosaicfs-tree" "$t/u/.mosaicfs-journal" "$out/memory_journal/$1" <<'PY'
import struct, sys
image, journal = open(sys.argv[1], 'rb').read(), open(sys.argv[2], 'rb').read()
open(sys.argv[3], 'wb').write(struct.pack('<I', len(image)) + image + journal)
PY
}
mount_run "$mem" first; pair first
mount_run "$mem" second; pair second

# A partial-file mark, as block-level copy-up writes it on a disk upper.
rm -rf "$t/u" "$t/w"; mkdir "$t/u" "$t/w"
head -c 8388608 /dev/urandom > "$t/l/huge"
mount_run "lowerdir=$t/l,upperdir=$t/u,workdir=$t/w" \
  sh -c "printf w | dd of='$t/m/huge' bs=1 seek=5000 conv=notrunc status=none"
getfattr --only-values -n trusted.mosaicfs.partial "$t/u/huge" > "$out/partial_mark/copy-up"

python3 - "$out" <<'PY'
import struct, sys, os
out = sys.argv[1]
def put(target, name, data):
    open(os.path.join(out, target, name), 'wb').write(data if isinstance(data, bytes) else data.encode())
put('partial_mark', 'v1', 'v1\nlayer=2\nvalid=8192\nsize=10000\nmtime=1700000000.5\npath=a/b c')
put('partial_mark', 'v2', 'v2\nlayer=1\nvalid=65536\nsize=1048576\nmtime=-3.999999999\nblock=65536\npath=usr/lib/x.so')
for i, v in enumerate(['0:0:0755:dir', '1000:1000:0644:file', '0:0:0600:char-1-3', '0:6:0660:block-8-0',
                       '0:0:0777:symlink', '5:5:0640:pipe', '5:5:0640:socket', '1:2:4755', '0:0:0644:file\0']):
    put('stat_override', f'v{i}', v)
for i, v in enumerate(['/a/b', 'sibling', '//a/./b/', '/usr/lib64']):
    put('redirect', f'v{i}', v)
for i, v in enumerate(['12345', '9223372036854785807', '2']):
    put('origin', f'v{i}', v)
put('metacopy', 'empty-digest', bytes([0, 4, 0, 0]))
put('metacopy', 'sha256', bytes([0, 36, 0, 1]) + bytes(range(32)))
def acl(entries):
    return struct.pack('<I', 2) + b''.join(struct.pack('<HHI', *e) for e in entries)
put('posix_acl', 'base', acl([(1, 6, 0xffffffff), (4, 4, 0xffffffff), (0x20, 4, 0xffffffff)]))
put('posix_acl', 'extended', acl([(1, 7, 0xffffffff), (2, 5, 1000), (4, 5, 0xffffffff),
                                  (8, 7, 100), (0x10, 5, 0xffffffff), (0x20, 0, 0xffffffff)]))
PY
echo "seeds written to $out"; find "$out" -type f | wc -l
