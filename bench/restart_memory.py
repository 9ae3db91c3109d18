#!/usr/bin/env python3
"""A memory upper (`upper=memory`) across kill -9 of its daemon (issue #57): how long the mount
goes unserved while the next daemon rebuilds the tree from the layer's image and journal and
the change log its holder kept (memory_upper/changes.rs), and what keeping that log costs.
Rootless, as Podman mounts them (user nobody in `unshare -Urm`).

Rows:
  kill window (ms)    a fresh memory-upper mount, N empty files made in 100 directories and
                      nothing fsynced, the daemon killed after 2.2 s: kill -9 to the answer of
                      a stat of the last file made (median of ROUNDS); every file is checked
                      there after it
  cost rows           the same workload on each FUSE peer and on mosaicfs' memory upper with
                      `restart=auto` (the default: the log) and `restart=off` (no log, no
                      holder): untar of 3,000 files (s), 2,000 small files made (s), 1,000
                      renames and chmods of them (s), a new 256 MiB file written in 1 MiB
                      writes (ms)

Usage: bench/restart_memory.py [--rounds N] [--root DIR]   (as root)
"""

import os
import shutil
import statistics
import subprocess
import sys
import time

from suite import (FO2, main_rootless, make_tree_tar, peer_arguments, sh, small_files, timed,
                   umount)

WINDOW_FILES = [0, 10000, 100000]
KINDS = ["fuse-overlayfs", "fuse-overlayfs-2.0", "memory", "memory-restart-off"]


def prepare(root):
    lower = os.path.join(root, "lower")
    if not os.path.exists(os.path.join(lower, ".ready")):
        os.makedirs(lower, exist_ok=True)
        make_tree_tar(os.path.join(root, "tree.tar"), 3000)
        open(os.path.join(lower, ".ready"), "w").close()
    return lower


def mount(kind, binary, lower, d):
    shutil.rmtree(d, ignore_errors=True)
    for sub in ["upper", "work", "mnt"]:
        os.makedirs(os.path.join(d, sub))
    o = f"lowerdir={lower},upperdir={d}/upper,workdir={d}/work"
    sh({
        "memory": f"{binary} -o {o},upper=memory {d}/mnt",
        "memory-restart-off": f"{binary} -o {o},upper=memory,restart=off {d}/mnt",
        "fuse-overlayfs-2.0": f"{FO2} -o {o} {d}/mnt",
        "fuse-overlayfs": f"fuse-overlayfs -o {o} {d}/mnt",
    }[kind])
    return os.path.join(d, "mnt")


def daemon_pid(binary, mnt):
    out = subprocess.run([binary, "status", mnt], capture_output=True, text=True).stdout
    line = next(l for l in out.splitlines() if l.startswith("daemon:"))
    return int(line.split("pid ")[1].split(",")[0])


def window(binary, lower, root, files):
    """kill -9 with `files` files made since the mount and nothing fsynced, to the answer of a
    stat of the last one (ms); then every file is looked for."""
    d = os.path.join(root, "rm-window")
    mnt = mount("memory", binary, lower, d)
    names = [f"d{i % 100}/f{i}" for i in range(files)]
    for i in range(min(files, 100)):
        os.mkdir(os.path.join(mnt, f"d{i}"))
    for n in names:
        os.close(os.open(os.path.join(mnt, n), os.O_CREAT | os.O_WRONLY, 0o644))
    last = os.path.join(mnt, names[-1] if names else "none")
    time.sleep(2.2)
    pid = daemon_pid(binary, mnt)
    t0 = time.perf_counter()
    os.kill(pid, 9)
    try:
        os.stat(last)
    except FileNotFoundError:
        assert not names, "the last file made is gone"
    took = (time.perf_counter() - t0) * 1000
    for n in names:
        assert os.path.exists(os.path.join(mnt, n)), f"{n} is gone after the kill"
    umount(mnt)
    shutil.rmtree(d, ignore_errors=True)
    return took


def renames(d):
    def run():
        for i in range(0, 2000, 2):
            p = os.path.join(d, f"f{i}")
            os.rename(p, p + ".r")
            os.chmod(p + ".r", 0o600)
    return timed(run)


def big_writes(mnt):
    def run():
        chunk = b"\x5a" * (1 << 20)
        fd = os.open(os.path.join(mnt, "written"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for _ in range(256):
            os.write(fd, chunk)
        os.close(fd)
    return timed(run) * 1000


ROWS = ["untar (s)", "small files (s)", "renames and chmods (s)",
        "256 MiB in 1 MiB writes (ms)"]


def run(a, root):
    lower = prepare(root)
    kinds = [k for k in KINDS if k != "fuse-overlayfs-2.0" or os.access(FO2, os.X_OK)]
    cost = {k: {r: [] for r in ROWS} for k in kinds}
    windows = {n: [] for n in WINDOW_FILES}
    for rnd in range(a.rounds):
        for kind in kinds:
            d = os.path.join(root, f"rm-{kind}")
            mnt = mount(kind, a.mosaicfs, lower, d)
            c = cost[kind]
            c["untar (s)"].append(timed(lambda: sh(f"tar -xf {root}/tree.tar -C {mnt}")))
            c["small files (s)"].append(small_files(os.path.join(mnt, "small")))
            c["renames and chmods (s)"].append(renames(os.path.join(mnt, "small")))
            c["256 MiB in 1 MiB writes (ms)"].append(big_writes(mnt))
            umount(mnt)
            shutil.rmtree(d, ignore_errors=True)
        for n in WINDOW_FILES:
            windows[n].append(window(a.mosaicfs, lower, root, n))
        print(f"# round {rnd + 1} done", file=sys.stderr)

    print(f"\nA memory upper across kill -9 of its daemon, "
          f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {os.cpu_count()} cores, "
          f"{os.uname().release}, rootless (user nobody, unshare -Urm), on a fresh ext4 (loop)\n")
    print(f"Kill window (kill -9 to the answer of a stat of the last file made), median of "
          f"{a.rounds}: " + ", ".join(f"{n:,} files made since the mount "
                                      f"{statistics.median(w):.1f} ms"
                                      for n, w in windows.items()) + ".\n")
    print(f"What the change log costs, median of {a.rounds} interleaved rounds:\n")
    print("| workload | " + " | ".join(kinds) + " | restart=off / auto |")
    print("|" + "---|" * (len(kinds) + 2))
    for row in ROWS:
        med = {k: statistics.median(cost[k][row]) for k in kinds}
        cells = " | ".join(f"{med[k]:,.3g}" for k in kinds)
        print(f"| {row} | {cells} | {med['memory-restart-off'] / med['memory']:.2f}x |")
    print("\nLast column above 1: the mount that survives its daemon is faster.")


def main():
    ap = peer_arguments("/var/tmp/mosaicfs-bench-restart-memory")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    main_rootless(a, __file__, run, prepare)


if __name__ == "__main__":
    main()
