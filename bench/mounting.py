#!/usr/bin/env python3
"""How long a mount takes (issue #42): the command's start to its exit, the daemon started as
mount(8) and containers/storage start it (in the background), for mosaicfs as installed
(linked statically, `make daemon`), mosaicfs linked dynamically (`cargo build --release`),
fuse-overlayfs 1.10 (apt) and fuse-overlayfs 2.0 (built from its published source).

Interleaved: each round mounts one overlay with each program in turn, so that what the
machine does meanwhile falls on all of them alike; every mount stays until the end, as a
host's containers do (the mount table grows through the run). Prints the median and the
quartiles per program, and each one's ratio to fuse-overlayfs 2.0.

Usage: bench/mounting.py [ROUNDS]   (default 100). MOSAICFS=path replaces the installed build,
MOSAICFS_DYNAMIC=path the dynamic one, FUSE_OVERLAYFS2=path fuse-overlayfs 2.0. Needs root.
"""
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TOP = os.path.dirname(HERE)
DIR = os.environ.get("BENCH_DIR", "/var/tmp/mfs-mounting")


def host_triple():
    out = subprocess.run(["rustc", "-vV"], capture_output=True, text=True).stdout
    return next(l.split()[1] for l in out.splitlines() if l.startswith("host:"))


def programs():
    static = os.environ.get("MOSAICFS") or os.path.join(
        TOP, "target", host_triple(), "release", "mosaicfs")
    dynamic = os.environ.get("MOSAICFS_DYNAMIC") or os.path.join(TOP, "target", "release", "mosaicfs")
    fo2 = os.environ.get("FUSE_OVERLAYFS2", "/var/tmp/fo2/bin/fuse-overlayfs")
    if not os.access(fo2, os.X_OK):
        subprocess.run(["cargo", "install", "-q", "fuse-overlayfs", "--version", "2.0.0",
                        "--root", os.path.dirname(os.path.dirname(fo2))],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not shutil.which("fuse-overlayfs"):
        subprocess.run(["apt-get", "install", "-y", "-qq", "fuse-overlayfs"],
                       stdout=subprocess.DEVNULL)
    found = [("mosaicfs", static), ("mosaicfs (dynamic)", dynamic),
             ("fuse-overlayfs-1.10", shutil.which("fuse-overlayfs") or ""),
             ("fuse-overlayfs-2.0", fo2)]
    for name, path in found:
        if not os.access(path, os.X_OK):
            print(f"{name}: no program at '{path}', left out", file=sys.stderr)
    return [(n, p) for n, p in found if os.access(p, os.X_OK)]


def unmount_all():
    with open("/proc/self/mounts") as f:
        points = [l.split()[1] for l in f if l.split()[1].startswith(DIR + "/")]
    for p in reversed(points):
        subprocess.run(["umount", p], stderr=subprocess.DEVNULL)


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    progs = programs()
    unmount_all()
    shutil.rmtree(DIR, ignore_errors=True)
    os.makedirs(f"{DIR}/lower/etc")
    with open(f"{DIR}/lower/etc/hostname", "w") as f:
        f.write("bench\n")
    took = {name: [] for name, _ in progs}
    try:
        for r in range(rounds):
            for j, _ in enumerate(progs):
                for d in "uwm":
                    os.makedirs(f"{DIR}/{j}/{r}/{d}")
            for j, (name, prog) in enumerate(progs):
                d = f"{DIR}/{j}/{r}"
                start = time.perf_counter()
                subprocess.run([prog, "-o", f"lowerdir={DIR}/lower,upperdir={d}/u,workdir={d}/w",
                                f"{d}/m"], stderr=subprocess.DEVNULL, check=True)
                took[name].append(time.perf_counter() - start)
    finally:
        unmount_all()
    base = statistics.median(took.get("fuse-overlayfs-2.0") or [float("nan")])
    print(f"\nMounting, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, {os.uname().release}, "
          f"{rounds} interleaved rounds (up to {rounds * len(progs)} mounts live), "
          "daemons in the background\n")
    print("| program | median (ms) | quartiles (ms) | vs fuse-overlayfs 2.0 |")
    print("|---|---|---|---|")
    for name, t in took.items():
        q = statistics.quantiles(t, n=4)
        med = statistics.median(t)
        print(f"| {name} | {med * 1e3:.2f} | {q[0] * 1e3:.2f}–{q[2] * 1e3:.2f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
