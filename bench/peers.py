#!/usr/bin/env python3
"""Every peer, the everyday workloads, root or rootless (issue #55): kernel overlayfs,
fuse-overlayfs 1.10 and 2.0 and mosaicfs in one run, each daemon in the background as its
users start it.

With --rootless every overlay is mounted by user nobody inside `unshare -Urm`, as rootless
Podman mounts them: kernel overlayfs with `userxattr`, the FUSE daemons without FUSE
passthrough (it needs CAP_SYS_ADMIN in the initial user namespace) and without fanotify.
/dev/fuse's mode is opened for the run and put back. Caches are emptied with
posix_fadvise(DONTNEED) on the files read (drop_caches needs root of the initial namespace).
Every timed row starts after a sync, so that none pays for the dirty pages of an earlier row or
peer.

Rows (one mount per peer, kept until the end):
  first write     1 byte into a 1 GiB lower file: open, pwrite, close (ms)
  seq read cold   a 512 MiB lower file in 1 MiB reads, its pages dropped first (MiB/s)
  seq read warm   the same again (MiB/s)
  random read     20,000 4 KiB reads at random offsets of that file, warm (us each)
  new file        256 MiB written in 1 MiB writes and fsynced (MiB/s)
  overwrites      5,000 4 KiB writes at random offsets of a 64 MiB lower image file, one
                  open, its copy-up included (us each)
  untar           3,000 files (bench/suite.py's tree) into the mount (s)
  stat walk       lstat of every entry of that tree (s)
  rm -rf          of that tree (s)
  metadata mix    2,000 rounds of create, write 100 B, chmod, rename, stat, unlink (s)
  sqlite          300 transactions on a 48 MB lower database (s)
  upper size      du of the upper dir a minute after the last workload (KiB)

With --uring the administrator's switch for FUSE over io_uring is turned on for the run (and
put back), and mosaicfs runs twice per round: over /dev/fuse (`uring=off`) and over io_uring
(`uring=on`, column mosaicfs-uring). The other peers do not use it.

With --writeback mosaicfs also runs with `writeback=auto` (column mosaicfs-writeback): what
the kernel's writeback cache gives where nothing passes through (bench/writeback.py measures
it on its own).

Usage: bench/peers.py [--rootless] [--uring] [--writeback] [--rounds N] [--root DIR]
       (as root)
"""

import os
import random
import shutil
import sqlite3
import statistics
import sys
import time

from suite import (FreshFs, KernelUring, make_tree_tar, metadata_mix, mount_overlay,
                   peer_arguments, peers, run_rootless, sh, stat_walk, umount, write_random)

ROWS = [
    ("first write (ms)", "low"), ("seq read cold (MiB/s)", "high"), ("seq read warm (MiB/s)", "high"),
    ("random read 4 KiB (us)", "low"), ("new file write (MiB/s)", "high"),
    ("overwrites 4 KiB (us)", "low"), ("untar 3,000 files (s)", "low"), ("stat walk (s)", "low"),
    ("rm -rf (s)", "low"), ("metadata mix (s)", "low"), ("sqlite 300 transactions (s)", "low"),
    ("upper a minute later (KiB)", "low"),
]


def prepare(root):
    lower = os.path.join(root, "lower")
    stamp = os.path.join(lower, ".ready")
    if os.path.exists(stamp):
        return lower
    os.makedirs(lower, exist_ok=True)
    write_random(os.path.join(lower, "gig"), 1 << 30)
    write_random(os.path.join(lower, "seq"), 512 << 20)
    write_random(os.path.join(lower, "image"), 64 << 20)
    db = os.path.join(lower, "db.sqlite")
    con = sqlite3.connect(db, isolation_level=None)
    con.execute("PRAGMA page_size=4096")
    con.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, k INTEGER, v BLOB)")
    con.execute("BEGIN")
    con.executemany("INSERT INTO t VALUES(?,?,randomblob(2000))", ((i, i) for i in range(20000)))
    con.execute("COMMIT")
    con.close()
    make_tree_tar(os.path.join(root, "tree.tar"), 3000)
    open(stamp, "w").close()
    return lower


def drop(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_all(path):
    fd = os.open(path, os.O_RDONLY)
    n, t0 = 0, time.perf_counter()
    while True:
        b = os.read(fd, 1 << 20)
        if not b:
            break
        n += len(b)
    took = time.perf_counter() - t0
    os.close(fd)
    return n / took / (1 << 20)


def settle():
    """Writes back what earlier rows and peers left dirty, so that no row pays for another's
    page cache (the other overlays copy 1 GiB up at the first write)."""
    os.sync()


def workloads(mnt, lower, root):
    out = {}
    p = lambda *n: os.path.join(mnt, *n)
    settle()
    t0 = time.perf_counter()
    fd = os.open(p("gig"), os.O_WRONLY)
    os.pwrite(fd, b"X", 500_000_000)
    os.close(fd)
    out["first write (ms)"] = (time.perf_counter() - t0) * 1e3
    settle()
    drop(os.path.join(lower, "seq"))
    drop(p("seq"))
    out["seq read cold (MiB/s)"] = read_all(p("seq"))
    out["seq read warm (MiB/s)"] = read_all(p("seq"))
    rng = random.Random(1)
    fd = os.open(p("seq"), os.O_RDONLY)
    t0 = time.perf_counter()
    for _ in range(20000):
        os.pread(fd, 4096, rng.randrange(0, (512 << 20) // 4096) * 4096)
    out["random read 4 KiB (us)"] = (time.perf_counter() - t0) / 20000 * 1e6
    os.close(fd)
    settle()
    block = os.urandom(1 << 20)
    t0 = time.perf_counter()
    fd = os.open(p("new"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for _ in range(256):
        os.write(fd, block)
    os.fsync(fd)
    os.close(fd)
    out["new file write (MiB/s)"] = 256 / (time.perf_counter() - t0)
    settle()
    page = os.urandom(4096)
    t0 = time.perf_counter()
    fd = os.open(p("image"), os.O_RDWR)
    for _ in range(5000):
        os.pwrite(fd, page, rng.randrange(0, (64 << 20) // 4096) * 4096)
    os.close(fd)
    out["overwrites 4 KiB (us)"] = (time.perf_counter() - t0) / 5000 * 1e6
    settle()
    t0 = time.perf_counter()
    sh(f"tar -xf {root}/tree.tar -C {mnt}")
    out["untar 3,000 files (s)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    stat_walk(p("src"))
    out["stat walk (s)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    shutil.rmtree(p("src"))
    out["rm -rf (s)"] = time.perf_counter() - t0
    settle()
    t0 = time.perf_counter()
    metadata_mix(p("mix"))
    out["metadata mix (s)"] = time.perf_counter() - t0
    settle()
    t0 = time.perf_counter()
    con = sqlite3.connect(p("db.sqlite"), isolation_level=None)
    for i in range(300):
        con.execute("BEGIN")
        con.execute("UPDATE t SET k=k+1, v=randomblob(2000) WHERE id=?", ((i * 7919) % 20000,))
        con.execute("COMMIT")
    con.close()
    out["sqlite 300 transactions (s)"] = time.perf_counter() - t0
    return out


def run(a, root, kinds):
    lower = prepare(root)
    results = {k: {r: [] for r, _ in ROWS} for k in kinds}
    for rnd in range(a.rounds):
        dirs = {}
        for kind in kinds:  # interleaved: every peer once per round
            d = os.path.join(root, f"run-{rnd}-{kind}")
            shutil.rmtree(d, ignore_errors=True)
            mount_overlay(kind, a.mosaicfs, lower, d, a.rootless, uring=kind == "mosaicfs-uring"
                          if a.uring else None)
            dirs[kind] = d
            for row, v in workloads(os.path.join(d, "mnt"), lower, root).items():
                results[kind][row].append(v)
            print(f"# round {rnd + 1}: {kind} done", file=sys.stderr)
        time.sleep(60)
        for kind, d in dirs.items():
            used = int(sh(f"du -s --block-size=1 {d}/upper").split()[0])
            results[kind]["upper a minute later (KiB)"].append(used >> 10)
            umount(os.path.join(d, "mnt"))
            shutil.rmtree(d, ignore_errors=True)
    who = "rootless (user nobody, unshare -Urm)" if a.rootless else "root"
    print(f"\nPeers, {time.strftime('%Y-%m-%d', time.gmtime())}, {os.cpu_count()} cores, "
          f"{os.uname().release}, {who}, layers on a fresh ext4 (loop), daemons in the background, "
          f"median of {a.rounds} interleaved round(s)\n")
    uring = " | mosaicfs-uring / 2.0" if "mosaicfs-uring" in kinds else ""
    head = ("| workload | " + " | ".join(kinds) + " | mosaicfs / fuse-overlayfs 1.10 | mosaicfs / 2.0"
            + uring + " |")
    print(head)
    print("|" + "---|" * (len(kinds) + 3 + bool(uring)))
    for row, better in ROWS:
        med = {k: statistics.median(results[k][row]) for k in kinds}

        def ratio(peer, ours="mosaicfs"):
            if peer not in med or not med[peer] or not med.get(ours):
                return "—"
            r = med[peer] / med[ours] if better == "low" else med[ours] / med[peer]
            return f"{r:.2f}x"

        cells = " | ".join(f"{med[k]:,.3g}" if med[k] < 100 else f"{med[k]:,.0f}" for k in kinds)
        extra = f" | {ratio('fuse-overlayfs-2.0', 'mosaicfs-uring')}" if uring else ""
        print(f"| {row} | {cells} | {ratio('fuse-overlayfs')} | {ratio('fuse-overlayfs-2.0')}{extra} |")
    print("\nRatios: how many times better mosaicfs is (above 1: ahead).")


def main():
    ap = peer_arguments("/var/tmp/mosaicfs-bench-peers")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--uring", action="store_true")
    ap.add_argument("--writeback", action="store_true")
    a = ap.parse_args()
    a.mosaicfs = os.path.abspath(a.mosaicfs)
    kinds = (peers() + (["mosaicfs-uring"] if a.uring else [])
             + (["mosaicfs-writeback"] if a.writeback else []))
    if a.inside:
        a.rootless = True
        run(a, a.root, kinds)
        return
    with FreshFs(a.root, "ext4", 24 << 30) as root, KernelUring(a.uring):
        prepare(root)
        if not a.rootless:
            run(a, root, kinds)
            return
        run_rootless(root, __file__, ["--inside", "--root", root, "--rounds", str(a.rounds),
                                      "--mosaicfs", a.mosaicfs] + (["--uring"] if a.uring else [])
                      + (["--writeback"] if a.writeback else []))

if __name__ == "__main__":
    main()
