#!/usr/bin/env python3
"""Flat over time (issue #58): an hour of create / stat / rename / unlink churn over a tree of
100,000 lower files, with the kernel's caches dropped every minute, on each FUSE overlay in
turn (mounted fresh, as root, daemon in the background). The daemon's RSS is taken after
every minute's drop_caches; a row is printed every 5 minutes, and at the end the RSS over the
RSS after the first minute (issue #58: within 10%).

The churn, in a loop: lstat of a random lower file; create a file in a random directory of
the tree; rename a random file made by the churn to a new name, now and then into another
directory; unlink a random file made by the churn, or now and then a lower file (a whiteout);
keeping about 20,000 files of its own alive.

Usage: bench/soak.py [--minutes M] [--files N] [--only KIND,...]   (as root)
"""

import os
import random
import shutil
import subprocess
import sys
import time

from suite import FreshFs, mount_overlay, peer_arguments, peers, print_head, umount
from inodes import daemon_pid, drop_caches, rss_kib

DIRS = 100
LIVE = 20_000


def make_lower(root, files):
    lower = os.path.join(root, "lower")
    for d in range(DIRS):
        os.makedirs(os.path.join(lower, "tree", f"d{d:03d}"))
    for i in range(files):
        open(os.path.join(lower, "tree", f"d{i % DIRS:03d}", f"f{i:07d}"), "w").close()
    return lower


def own_memory(kind, binary, mnt):
    """What mosaicfs says of its memory (`mosaicfs status`: the allocator's figures, the
    inodes it knows), for the progress lines; nothing for the peers."""
    if kind != "mosaicfs":
        return ""
    out = subprocess.run([binary, "status", mnt], capture_output=True, text=True).stdout
    lines = [ln.strip() for ln in out.splitlines() if ln.startswith(("memory:", "inodes known"))]
    return "; " + "; ".join(lines)


def soak(kind, binary, root, lower, files, minutes):
    d = os.path.join(root, kind)
    shutil.rmtree(d, ignore_errors=True)
    mount_overlay(kind, binary, lower, d)
    mnt = os.path.join(d, "mnt")
    tree = os.path.join(mnt, "tree")
    rnd = random.Random(58)
    mine, serial, ops = [], 0, 0
    rss, private = [], []
    start = time.time()
    next_minute = start + 60
    while len(rss) < minutes:
        for _ in range(200):
            op = rnd.random()
            if op < 0.4:
                i = rnd.randrange(files)
                try:
                    os.lstat(os.path.join(tree, f"d{i % DIRS:03d}", f"f{i:07d}"))
                except FileNotFoundError:
                    pass  # a lower file the churn removed
            elif op < 0.65 or not mine:
                serial += 1
                p = os.path.join(tree, f"d{rnd.randrange(DIRS):03d}", f"n{serial:09d}")
                with open(p, "w") as f:
                    f.write("x")
                mine.append(p)
            elif op < 0.85:
                k = rnd.randrange(len(mine))
                serial += 1
                dest_dir = os.path.dirname(mine[k]) if rnd.random() < 0.8 else \
                    os.path.join(tree, f"d{rnd.randrange(DIRS):03d}")
                dest = os.path.join(dest_dir, f"r{serial:09d}")
                os.rename(mine[k], dest)
                mine[k] = dest
            else:
                if rnd.random() < 0.1:
                    i = rnd.randrange(files)
                    try:
                        os.unlink(os.path.join(tree, f"d{i % DIRS:03d}", f"f{i:07d}"))
                    except FileNotFoundError:
                        pass
                else:
                    os.unlink(mine.pop(rnd.randrange(len(mine))))
            while len(mine) > LIVE:
                os.unlink(mine.pop(rnd.randrange(len(mine))))
            ops += 1
        if time.time() >= next_minute:
            drop_caches()
            time.sleep(1)
            # Asked before RSS is read, so that every sample holds what answering took (the
            # code and stack of `mosaicfs status`), the first one included.
            own = own_memory(kind, binary, mnt)
            # Found again each time: a takeover (an upgrade, a restart) changes the daemon.
            pid = daemon_pid(mnt)
            rss.append(rss_kib(pid) / 1024)
            private.append(rss_kib(pid, "RssAnon") / 1024)
            next_minute += 60
            m = len(rss)
            print(f"# {kind}: minute {m}, RSS {rss[-1]:.1f} MiB (private {private[-1]:.1f}), "
                  f"{ops:,} operations{own}", file=sys.stderr, flush=True)
    umount(mnt)
    shutil.rmtree(d, ignore_errors=True)
    return rss, private, ops


def main():
    ap = peer_arguments("/var/tmp/mosaicfs-bench-soak")
    ap.add_argument("--minutes", type=int, default=60)
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--only", default="mosaicfs", help="comma-separated FUSE overlays (default mosaicfs)")
    a = ap.parse_args()
    binary = os.path.abspath(a.mosaicfs)
    kinds = [k for k in peers() if k != "overlay" and k in a.only.split(",")]
    results = {}
    with FreshFs(a.root, "ext4", 8 << 30) as root:
        lower = make_lower(root, a.files)
        for kind in kinds:
            results[kind] = soak(kind, binary, root, lower, a.files, a.minutes)
    # RSS counts the program's code the churn has run so far (file pages, shared and taken
    # back under pressure); the private part (RssAnon) is what the daemon holds itself.
    columns = [f"{k} {what}" for k in kinds for what in ("RSS", "private")]
    print_head("A soak", f"root, {a.files:,} lower files in {DIRS} directories, {a.minutes} "
               f"minutes of churn, caches dropped every minute; daemon RSS and its private "
               f"part (RssAnon), MiB, after each minute's drop_caches", "minute", columns)
    for m in sorted({1, *range(5, a.minutes + 1, 5), a.minutes}):
        print(f"| {m} | " + " | ".join(f"{results[k][0][m - 1]:.1f} | {results[k][1][m - 1]:.1f}"
                                       for k in kinds) + " |")
    print("| end / first minute | " + " | ".join(
        f"{results[k][0][-1] / results[k][0][0]:.2f}x | {results[k][1][-1] / results[k][1][0]:.2f}x"
        for k in kinds) + " |")
    print("| operations | " + " | ".join(f"{results[k][2]:,} | " for k in kinds) + " |")


if __name__ == "__main__":
    sys.exit(main())
