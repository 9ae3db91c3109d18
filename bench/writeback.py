#!/usr/bin/env python3
"""What the kernel's writeback cache gives and costs where nothing passes through (issue #55):
mosaicfs with `writeback=off` (the default) and `writeback=auto` beside fuse-overlayfs 1.10
(which always asks for the cache) and 2.0, rootless as Podman mounts them (user nobody in
`unshare -Urm`: no FUSE passthrough), interleaved rounds, medians.

Rows (one mount per peer and round):
  new file N      64 MiB written into a new file in N-byte writes, then close (MiB/s)
  overwrites      5,000 4 KiB writes at random offsets of a 64 MiB lower file, one open,
                  close included (us each)
  small files     2,000 files made with one 100-byte write each (s)
  rm small files  rm -rf of them (s)
  untar           3,000 files (bench/suite.py's tree) (s)
  rm -rf tree     of that tree (s)

Every row starts after a sync. Usage: bench/writeback.py [--rounds N] [--root DIR]   (as root)
"""

import os
import shutil
import statistics
import sys
import time

from suite import (main_rootless, make_tree_tar, mount_overlay, overwrites, peer_arguments, peers,
                   sh, small_files, timed, umount, write_random)

ROWS = [("new file 1 MiB (MiB/s)", "high"), ("new file 4 KiB (MiB/s)", "high"),
        ("new file 512 B (MiB/s)", "high"), ("overwrites 4 KiB (us)", "low"),
        ("small files (s)", "low"), ("rm small files (s)", "low"), ("untar (s)", "low"),
        ("rm -rf tree (s)", "low")]
KINDS = [k for k in peers() if k != "overlay"] + ["mosaicfs-writeback"]


def prepare(root):
    lower = os.path.join(root, "lower")
    if not os.path.exists(os.path.join(lower, ".ready")):
        os.makedirs(lower, exist_ok=True)
        write_random(os.path.join(lower, "image"), 64 << 20)
        make_tree_tar(os.path.join(root, "tree.tar"), 3000)
        open(os.path.join(lower, ".ready"), "w").close()
    return lower


def workloads(mnt, root, rnd):
    out = {}
    for size, row in ((1 << 20, ROWS[0][0]), (4096, ROWS[1][0]), (512, ROWS[2][0])):
        buf = os.urandom(size)

        def write_new():
            fd = os.open(os.path.join(mnt, "new"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            for _ in range((64 << 20) // size):
                os.write(fd, buf)
            os.close(fd)
        out[row] = 64 / timed(write_new)
    out["overwrites 4 KiB (us)"] = overwrites(os.path.join(mnt, "image"), 5000, rnd)
    small = os.path.join(mnt, "small")
    out["small files (s)"] = small_files(small)
    out["rm small files (s)"] = timed(lambda: shutil.rmtree(small))
    out["untar (s)"] = timed(lambda: sh(f"tar -xf {root}/tree.tar -C {mnt}"))
    out["rm -rf tree (s)"] = timed(lambda: shutil.rmtree(os.path.join(mnt, "src")))
    return out


def run(a, root):
    lower = prepare(root)
    results = {k: {r: [] for r, _ in ROWS} for k in KINDS}
    for rnd in range(a.rounds):
        for kind in KINDS:
            d = os.path.join(root, f"wb-{kind}")
            shutil.rmtree(d, ignore_errors=True)
            mount_overlay(kind, a.mosaicfs, lower, d, True)
            for row, v in workloads(os.path.join(d, "mnt"), root, rnd).items():
                results[kind][row].append(v)
            umount(os.path.join(d, "mnt"))
            shutil.rmtree(d, ignore_errors=True)
        print(f"# round {rnd + 1} done", file=sys.stderr)
    print(f"\nThe writeback cache, {time.strftime('%Y-%m-%d', time.gmtime())}, {os.cpu_count()} "
          f"cores, {os.uname().release}, rootless (user nobody, unshare -Urm), layers on a fresh "
          f"ext4 (loop), median of {a.rounds} interleaved rounds\n")
    print("| workload | " + " | ".join(KINDS) + " | writeback / off |")
    print("|" + "---|" * (len(KINDS) + 2))
    for row, better in ROWS:
        med = {k: statistics.median(results[k][row]) for k in KINDS}
        on, off = med["mosaicfs-writeback"], med["mosaicfs"]
        ratio = on / off if better == "high" else off / on
        cells = " | ".join(f"{med[k]:,.3g}" if med[k] < 100 else f"{med[k]:,.0f}" for k in KINDS)
        print(f"| {row} | {cells} | {ratio:.2f}x |")
    print("\nmosaicfs: writeback=off (the default); mosaicfs-writeback: writeback=auto. "
          "Last column above 1: the cache is better.")


def main():
    ap = peer_arguments("/var/tmp/mosaicfs-bench-writeback")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    main_rootless(a, __file__, run, prepare)


if __name__ == "__main__":
    main()
