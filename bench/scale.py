#!/usr/bin/env python3
"""A million entries (issue #58): every overlay over a lower layer with one directory of N empty
files (`big`) and an image-like tree of N files three levels deep (`tree`: 100 directories of
100 directories of N/10,000 files), each overlay mounted fresh, as root, on a fresh ext4.

Operations, each after the kernel's caches were dropped:
  list      the names of `big` (readdir only)
  lstat     lstat of every entry of `big`, timed per 100,000
  find      `find tree -type f | wc -l`
  du        `du -s tree`
  untar     `tar -xf` of `tree` (as a tar made beforehand) into the upper, timed per 100,000
            files (tar's checkpoints)
  rm        `rm -rf` of what the untar made
Then the daemon's peak RSS (VmHWM), and for each timed-per-100,000 operation the slowest
100,000 over the fastest: flat is near 1 (issue #58: no operation may slow down with the
number of entries the daemon has seen).

Not part of make test: it takes about half an hour with a million entries.

Usage: bench/scale.py [--files N] [--only KIND,...]   (as root; N a multiple of 100,000)
"""

import os
import shutil
import subprocess
import sys
import time

from suite import FreshFs, mount_overlay, peer_arguments, peers, print_head, umount
from inodes import daemon_pid, drop_caches

STEP = 100_000


def make_lower(root, files):
    """`big`, `tree` and `tree.tar` (the tree again, for the untar), made once."""
    lower = os.path.join(root, "lower")
    big = os.path.join(lower, "big")
    os.makedirs(big)
    for i in range(files):
        open(os.path.join(big, f"f{i:07d}"), "w").close()
    per_leaf = files // 10_000
    for a in range(100):
        for b in range(100):
            d = os.path.join(lower, "tree", f"d{a:02d}", f"d{b:02d}")
            os.makedirs(d)
            for c in range(per_leaf):
                open(os.path.join(d, f"f{c:04d}"), "w").close()
    subprocess.run(["tar", "-C", lower, "-cf", os.path.join(root, "tree.tar"), "tree"], check=True)
    return lower


def timed(f):
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def lstat_steps(path):
    """Seconds for each 100,000 lstat calls over the entries of `path`."""
    steps, t0, n = [], time.perf_counter(), 0
    with os.scandir(path) as it:
        for e in it:
            os.lstat(e.path)
            n += 1
            if n % STEP == 0:
                now = time.perf_counter()
                steps.append(now - t0)
                t0 = now
    return steps


def untar_steps(tar, into, files):
    """Untars `tar` into `into`; seconds for each 100,000 files, from tar's checkpoints (an
    empty file is one 512-byte header, and a checkpoint comes every 20-block record)."""
    marks = os.path.join(os.path.dirname(tar), "checkpoints")
    if os.path.exists(marks):
        os.unlink(marks)
    os.makedirs(into)
    every = STEP // 20
    t0 = time.time()
    untar = subprocess.run(["tar", "-xf", tar, "-C", into, f"--checkpoint={every}",
                            f"--checkpoint-action=exec=date +%s.%N >> {marks}"],
                           stderr=subprocess.PIPE, text=True)
    if untar.returncode != 0:
        raise RuntimeError(f"untar into {into} failed: {untar.stderr[-2000:]}")
    total = time.time() - t0
    times = [t0] + [float(x) for x in open(marks).read().split()]
    steps = [b - a for a, b in zip(times, times[1:])][: files // STEP]
    return total, steps


def peak_rss_mib(pid):
    if pid is None:
        return None
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return None


def run_one(kind, binary, root, lower, files):
    d = os.path.join(root, kind)
    shutil.rmtree(d, ignore_errors=True)
    mount_overlay(kind, binary, lower, d)
    mnt = os.path.join(d, "mnt")
    pid = None if kind == "overlay" else daemon_pid(mnt)
    r = {}

    def cold(name, f):
        drop_caches()
        r[name] = timed(f)

    cold("list", lambda: sum(1 for _ in os.scandir(os.path.join(mnt, "big"))))
    drop_caches()
    r["lstat_steps"] = lstat_steps(os.path.join(mnt, "big"))
    r["lstat"] = sum(r["lstat_steps"])
    count = []
    cold("find", lambda: count.append(subprocess.run(
        f"find {mnt}/tree -type f | wc -l", shell=True, capture_output=True, text=True).stdout.strip()))
    if count[0] != str(files):
        raise RuntimeError(f"{kind}: find counted {count[0]} files, not {files}")
    cold("du", lambda: subprocess.run(["du", "-s", f"{mnt}/tree"], check=True, capture_output=True))
    drop_caches()
    r["untar"], r["untar_steps"] = untar_steps(os.path.join(root, "tree.tar"), f"{mnt}/untar", files)
    cold("rm", lambda: subprocess.run(["rm", "-rf", f"{mnt}/untar"], check=True))
    r["rss"] = peak_rss_mib(pid)
    umount(mnt)
    shutil.rmtree(d, ignore_errors=True)
    return r


def flatness(steps):
    return max(steps) / min(steps) if steps else None


def main():
    ap = peer_arguments("/var/tmp/mosaicfs-bench-scale")
    ap.add_argument("--files", type=int, default=1_000_000)
    ap.add_argument("--only", default="", help="comma-separated overlays (default: every peer)")
    a = ap.parse_args()
    if a.files % STEP:
        sys.exit(f"--files must be a multiple of {STEP:,}")
    binary = os.path.abspath(a.mosaicfs)
    kinds = [k for k in peers() if not a.only or k in a.only.split(",")]
    # An inode per 4 KiB: the layers and the untar hold three times --files inodes, more than
    # ext4's default of one per 16 KiB gives a file system of this size.
    with FreshFs(a.root, "ext4", 32 << 30, "-i 4096") as root:
        t0 = time.perf_counter()
        lower = make_lower(root, a.files)
        print(f"# lower layer made in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        results = {}
        for kind in kinds:
            print(f"# {kind}", file=sys.stderr)
            results[kind] = run_one(kind, binary, root, lower, a.files)
    print_head("A million entries", f"root, {a.files:,} empty files in one lower directory and "
               f"{a.files:,} in a tree three levels deep, fresh ext4, each overlay mounted "
               f"fresh, caches dropped before each operation", "", kinds)
    rows = [("list the big directory (s)", "list", "{:.2f}"),
            ("lstat every entry (s)", "lstat", "{:.2f}"),
            ("find -type f \\| wc -l of the tree (s)", "find", "{:.2f}"),
            ("du -s of the tree (s)", "du", "{:.2f}"),
            ("untar the tree into the upper (s)", "untar", "{:.1f}"),
            ("rm -rf of it (s)", "rm", "{:.1f}")]
    for title, key, fmt in rows:
        print(f"| {title} | " + " | ".join(fmt.format(results[k][key]) for k in kinds) + " |")
    print("| daemon's peak RSS (MiB) | " + " | ".join(
        "—" if results[k]["rss"] is None else f"{results[k]['rss']:.0f}" for k in kinds) + " |")
    for title, key in [("lstat", "lstat_steps"), ("untar", "untar_steps")]:
        print(f"| {title}: slowest 100,000 / fastest | " + " | ".join(
            f"{flatness(results[k][key]):.2f}" for k in kinds) + " |")
    print("\nSeconds per 100,000, first to last:")
    for k in kinds:
        for title, key in [("lstat", "lstat_steps"), ("untar", "untar_steps")]:
            print(f"- {k}, {title}: " + " ".join(f"{s:.2f}" for s in results[k][key]))


if __name__ == "__main__":
    sys.exit(main())
