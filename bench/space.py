#!/usr/bin/env python3
"""What the writable layer costs in space a while after the writes (issue #55), on mosaicfs,
kernel overlayfs and fuse-overlayfs 1.10 and 2.0 in one run.

  many mounts  N mounts (default 100) over one lower layer holding a 256 MiB image file; each
               writes 1 byte into it through its mount and closes it. mosaicfs' mounts then sit
               idle for --idle seconds (default 60) before `du` of their uppers together; the
               peers copy the whole file up before the write returns, so their `du` is taken
               right after their writes (it cannot shrink), while mosaicfs' mounts idle.
  hot file     (--hot, root only) 4 KiB writes into one block of a 64 MiB lower file for 10 s
               through one open; then a new open of the file and fio's 4 KiB random writes for
               5 s: mosaicfs completes a file in sustained use where passthrough then serves it,
               so the new open writes at the speed of the upper file system.

--rootless runs every overlay as user nobody inside `unshare -Urm` (kernel overlayfs with
`userxattr`; no FUSE passthrough there), as rootless Podman does; /dev/fuse's mode is opened
for the run and put back.

Usage: bench/space.py [--mounts N] [--idle S] [--rootless] [--hot] [--root DIR]   (as root)
"""

import os
import shutil
import sys
import time

from suite import FreshFs, mount_overlay, peer_arguments, peers, run_rootless, sh, umount, write_random

IMAGE = 256 << 20


def du(paths):
    out = sh("du -s --block-size=1 -c " + " ".join(paths))
    return int(out.strip().splitlines()[-1].split()[0])


def write_one_byte(path):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, b"X", 100_000_000)
    finally:
        os.close(fd)


class Mounts:
    """`n` mounts of one kind over `lower`, each with its own upper and work dir."""

    def __init__(self, root, kind, n, lower, binary, rootless):
        self.dirs = [os.path.join(root, f"space-{kind}", str(i)) for i in range(n)]
        self.kind, self.lower, self.binary, self.rootless = kind, lower, binary, rootless

    def __enter__(self):
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
            mount_overlay(self.kind, self.binary, self.lower, d, self.rootless)
        return self

    def write(self):
        t0 = time.time()
        for d in self.dirs:
            write_one_byte(os.path.join(d, "mnt", "image"))
        return time.time() - t0

    def uppers(self):
        return [os.path.join(d, "upper") for d in self.dirs]

    def __exit__(self, *exc):
        for d in self.dirs:
            umount(os.path.join(d, "mnt"))
        shutil.rmtree(os.path.dirname(self.dirs[0]), ignore_errors=True)


def many_mounts(a, root, kinds):
    lower = os.path.join(root, "lower")
    if not os.path.exists(os.path.join(lower, "image")):
        os.makedirs(lower, exist_ok=True)
        write_random(os.path.join(lower, "image"), IMAGE)
    rows = {}
    with Mounts(root, "mosaicfs", a.mounts, lower, a.mosaicfs, a.rootless) as mine:
        took = mine.write()
        idle_from = time.time()
        rows["mosaicfs"] = (took, None)
        for kind in kinds[1:]:
            with Mounts(root, kind, a.mounts, lower, a.mosaicfs, a.rootless) as m:
                took = m.write()
                rows[kind] = (took, du(m.uppers()))
            print(f"# {kind}: done", file=sys.stderr)
        left = a.idle - (time.time() - idle_from)
        if left > 0:
            time.sleep(left)
        rows["mosaicfs"] = (rows["mosaicfs"][0], du(mine.uppers()))
    who = "rootless (user nobody, unshare -Urm)" if a.rootless else "root"
    print(f"\nSpace a while after the writes, {time.strftime('%Y-%m-%d', time.gmtime())}, "
          f"{os.cpu_count()} cores, {os.uname().release}, {who}: {a.mounts} mounts over one lower "
          f"layer, 1 byte written into its {IMAGE >> 20} MiB file through each; mosaicfs measured "
          f"after {a.idle} s idle\n")
    print("| overlay | all writes (s) | uppers together (KiB) | per mount (KiB) |")
    print("|---|---|---|---|")
    for kind in kinds:
        took, used = rows[kind]
        print(f"| {kind} | {took:.2f} | {used >> 10:,} | {(used >> 10) / a.mounts:,.0f} |")


def hot_file(a, root):
    """4 KiB writes into one block for 10 s, then a new open's random writes (fio), on
    mosaicfs and kernel overlayfs."""
    lower = os.path.join(root, "hot-lower")
    os.makedirs(lower, exist_ok=True)
    if not os.path.exists(os.path.join(lower, "hot")):
        write_random(os.path.join(lower, "hot"), 64 << 20)
    rows = {}
    for kind in ["mosaicfs", "overlay"]:
        d = os.path.join(root, f"hot-{kind}")
        shutil.rmtree(d, ignore_errors=True)
        mount_overlay(kind, a.mosaicfs, lower, d)
        path = os.path.join(d, "mnt", "hot")
        fd = os.open(path, os.O_RDWR)
        block, n, t0 = os.urandom(4096), 0, time.time()
        while time.time() - t0 < 10:
            os.pwrite(fd, block, 8192)
            n += 1
        os.close(fd)
        upper = os.path.join(d, "upper", "hot")
        waited = time.time()
        while kind == "mosaicfs" and partial(upper) and time.time() - waited < 30:
            time.sleep(0.1)
        complete = not partial(upper)
        out = sh(f"fio --name=w --filename={path} --rw=randwrite --bs=4k --size=64M --runtime=5 "
                 f"--time_based --ioengine=psync --output-format=terse --terse-version=3")
        iops = float(out.split(";")[48])
        rows[kind] = (n / 10, complete, iops)
        umount(os.path.join(d, "mnt"))
        shutil.rmtree(d, ignore_errors=True)
    print(f"\nA hot file, {time.strftime('%Y-%m-%d', time.gmtime())}, root: 4 KiB writes into one "
          f"block of a 64 MiB lower file for 10 s, then a new open's 4 KiB random writes (fio, 5 s)\n")
    print("| overlay | writes/s while hot | complete after | new open: writes/s | / kernel overlayfs |")
    print("|---|---|---|---|---|")
    for kind, (hot, complete, iops) in rows.items():
        print(f"| {kind} | {hot:,.0f} | {'yes' if complete else 'no'} | {iops:,.0f} | "
              f"{iops / rows['overlay'][2]:.2f}x |")


def partial(path):
    return any(n.endswith("mosaicfs.partial") for n in os.listxattr(path))


def main():
    ap = peer_arguments("/var/tmp/mosaicfs-bench-space")
    ap.add_argument("--mounts", type=int, default=100)
    ap.add_argument("--idle", type=int, default=60)
    ap.add_argument("--hot", action="store_true")
    a = ap.parse_args()
    a.mosaicfs = os.path.abspath(a.mosaicfs)
    kinds = ["mosaicfs"] + [k for k in peers() if k != "mosaicfs"]
    if a.inside:
        a.rootless = True
        many_mounts(a, a.root, kinds)
        return
    # The peers' copies need room: one 256 MiB copy per mount.
    fs_size = max(16 << 30, 2 * a.mounts * IMAGE)
    with FreshFs(a.root, "ext4", fs_size) as root:
        if a.rootless:
            run_rootless(root, __file__, ["--inside", "--root", root, "--mounts", str(a.mounts),
                                          "--idle", str(a.idle), "--mosaicfs", a.mosaicfs])
        else:
            many_mounts(a, root, kinds)
        if a.hot:
            hot_file(a, root)


if __name__ == "__main__":
    main()
