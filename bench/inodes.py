#!/usr/bin/env python3
"""Memory per inode the kernel holds (issue #58): a lower layer with one directory of N empty
files, each FUSE overlay mounted fresh (as root, daemon in the background), caches dropped;
then lstat of every entry, and the daemon's RSS before, after, and after the kernel forgot the
inodes again (drop_caches). Per inode: (RSS after the walk - RSS idle) / N.

Usage: bench/inodes.py [--files N] [--rounds R]   (as root)
"""

import argparse
import os
import shutil
import statistics
import sys
import time

from suite import FreshFs, mount_overlay, peers, umount

HERE = os.path.dirname(os.path.abspath(__file__))
KINDS = [k for k in peers() if k != "overlay"]


def daemon_pid(mnt):
    """The process serving `mnt`: the one whose command line names it."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if any(a.endswith(mnt.encode()) for a in cmd[1:]) and b"mount" not in cmd[0]:
            return int(pid)
    raise RuntimeError(f"no daemon found for {mnt}")


def rss_kib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def drop_caches(what="3"):
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write(what)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--mosaicfs", default=os.path.join(HERE, "..", "target", "release", "mosaicfs"))
    a = ap.parse_args()
    binary = os.path.abspath(a.mosaicfs)
    rows = {k: {"idle": [], "walk": [], "forgot": [], "walk_s": []} for k in KINDS}
    with FreshFs("/var/tmp/mosaicfs-bench-inodes", "ext4", 4 << 30) as root:
        lower = os.path.join(root, "lower")
        big = os.path.join(lower, "big")
        os.makedirs(big)
        for i in range(a.files):
            open(os.path.join(big, f"f{i:07d}"), "w").close()
        for _ in range(a.rounds):
            for kind in KINDS:
                d = os.path.join(root, kind)
                shutil.rmtree(d, ignore_errors=True)
                mount_overlay(kind, binary, lower, d)
                mnt = os.path.join(d, "mnt")
                pid = daemon_pid(mnt)
                drop_caches()
                time.sleep(0.5)
                rows[kind]["idle"].append(rss_kib(pid))
                t0 = time.perf_counter()
                with os.scandir(os.path.join(mnt, "big")) as it:
                    for e in it:
                        os.lstat(e.path)
                rows[kind]["walk_s"].append(time.perf_counter() - t0)
                rows[kind]["walk"].append(rss_kib(pid))
                drop_caches("2")
                time.sleep(2)
                rows[kind]["forgot"].append(rss_kib(pid))
                umount(mnt)
                shutil.rmtree(d, ignore_errors=True)
    print(f"\nMemory per inode, {time.strftime('%Y-%m-%d', time.gmtime())}, {os.cpu_count()} cores, "
          f"{os.uname().release}, root, {a.files:,} empty files in one lower directory on a "
          f"fresh ext4, median of {a.rounds} rounds\n")
    print("| overlay | RSS idle (MiB) | after lstat of every entry (MiB) | bytes per inode | "
          "after drop_caches (MiB) | lstat walk (s) |")
    print("|---|---|---|---|---|---|")
    for kind in KINDS:
        med = {r: statistics.median(v) for r, v in rows[kind].items()}
        per = (med["walk"] - med["idle"]) * 1024 / a.files
        print(f"| {kind} | {med['idle'] / 1024:.1f} | {med['walk'] / 1024:.1f} | {per:,.0f} | "
              f"{med['forgot'] / 1024:.1f} | {med['walk_s']:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
