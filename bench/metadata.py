#!/usr/bin/env python3
"""Metadata against the newest peer (issue #42): the fsstress-style mix (mosaicfs-fsstress: 4,000
random creates, writes, reads, truncates, stats, listings, renames, links, unlinks, mkdirs and
rmdirs per process, each checked against a model) with one and two processes, the namespace mix
of iobench (create, stat, rename, mkdir, listing, unlink, rmdir; every listed entry counts as an
op) with one and two processes, and an untar of 2,000 small files, on kernel overlayfs, fuse-overlayfs 1.10 (apt),
fuse-overlayfs 2.0 (built from its published source by bench/run.sh) and mosaicfs over
/dev/fuse and over io_uring; every daemon started as mount(8) and containers/storage start it,
in the background (`--foreground`: mosaicfs with -f as a child of this script, for comparison).

Each round mounts every overlay afresh, in a rotated order, with its upper and work dirs on a
new ext4 (an image in /dev/shm: after thousands of creates and unlinks ext4 scans recently
deleted inodes on each create, and whichever overlay ran second would pay for the first).
Reports the median and range of the rounds, mosaicfs' ratio to fuse-overlayfs 2.0, and from
`mosaicfs status --json` the requests per operation and the daemon's time per request by
opcode, next to the system calls the workload itself makes (strace -c on kernel overlayfs).

Usage: bench/metadata.py [--rounds N] [--quick] [--foreground] [--only NAME,...]   (root;
MOSAICFS=path: the build to measure, MOSAICFS_BASE=path: another build beside it,
MOSAICFS_FSSTRESS=path: the workload tool, else beside MOSAICFS or in target/release)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from suite import KernelUring, make_tree_tar  # noqa: E402
BIN = os.path.realpath(os.environ.get("MOSAICFS", os.path.join(HERE, "..", "target", "release", "mosaicfs")))
# Another mosaicfs build to run beside this one (a column "mosaicfs-base", over /dev/fuse):
# how per-opcode before/after figures for docs/PERFORMANCE.md are taken in one run.
BASE = os.environ.get("MOSAICFS_BASE")
# The workload tool: beside MOSAICFS, else the one cargo built (a static daemon is built alone,
# under target/HOST/release).
FSSTRESS = next(
    (os.path.realpath(p) for p in (
        os.environ.get("MOSAICFS_FSSTRESS", ""),
        os.path.join(os.path.dirname(BIN), "mosaicfs-fsstress"),
        os.path.join(HERE, "..", "target", "release", "mosaicfs-fsstress"),
    ) if p and os.access(p, os.X_OK)),
    "mosaicfs-fsstress")
FO2 = os.environ.get("FUSE_OVERLAYFS2", "/var/tmp/fo2/bin/fuse-overlayfs")
URING = "/sys/module/fuse/parameters/enable_uring"
FILES = 2000
STRESS_OPS = 4000  # per process


def sh(cmd, **kw):
    return subprocess.run(cmd, shell=True, check=True, capture_output=True, text=True, **kw).stdout


def field(out, name):
    return float(out.split(name + "=")[1].split()[0])


def make_tar(path):
    """2,000 files of 200 B to 8 KiB in 120 directories, as a source tree or a package."""
    make_tree_tar(path, FILES, pkgs=3)


class Overlay:
    """One overlay of `kind` over `lower`, its upper and work dirs on a fresh ext4."""

    foreground = False

    def __init__(self, root, kind):
        self.kind, self.root = kind, root
        self.mnt = os.path.join(root, "mnt")
        self.fs = os.path.join(root, "fs")
        self.img = "/dev/shm/mosaicfs-metadata-bench.img"
        self.proc = None
        self.pid = None

    def __enter__(self):
        os.makedirs(self.mnt, exist_ok=True)
        os.makedirs(self.fs, exist_ok=True)
        sh(f"rm -f {self.img} && truncate -s 2G {self.img} && mkfs.ext4 -q {self.img} && "
           f"mount -o loop {self.img} {self.fs} && mkdir {self.fs}/upper {self.fs}/work")
        o = f"lowerdir={self.root}/lower,upperdir={self.fs}/upper,workdir={self.fs}/work"
        if self.kind == "overlay":
            sh(f"mount -t overlay overlay -o {o} {self.mnt}")
        elif self.kind == "fuse-overlayfs-1.10":
            sh(f"fuse-overlayfs -o {o} {self.mnt}")
        elif self.kind == "fuse-overlayfs-2.0":
            sh(f"{FO2} -o {o} {self.mnt}")
        else:
            o += ",uring=" + ("on" if self.kind == "mosaicfs-io_uring" else "off")
            binary = BASE if self.kind == "mosaicfs-base" else BIN
            if Overlay.foreground:
                self.proc = subprocess.Popen([binary, "-f", "-o", o, self.mnt], stderr=subprocess.DEVNULL)
                for _ in range(500):
                    if os.path.ismount(self.mnt):
                        break
                    time.sleep(0.01)
            else:
                sh(f"{binary} -o {o} {self.mnt}")
        return self

    def __exit__(self, *exc):
        for _ in range(100):
            if subprocess.run(["umount", self.mnt], capture_output=True).returncode == 0:
                break
            time.sleep(0.05)
        if self.proc:
            self.proc.wait()
        # Daemons in the background let go of the upper file system just after the unmount.
        for _ in range(200):
            if subprocess.run(["umount", self.fs], capture_output=True).returncode == 0:
                break
            time.sleep(0.05)
        os.unlink(self.img)

    def path(self, *p):
        return os.path.join(self.mnt, *p)

    def daemon_cpu(self):
        """CPU seconds the daemon serving this mount has used so far, every thread counted
        (utime + stime of /proc/PID/stat: threads that ended included), or None for the kernel's
        overlay. The daemon is the process whose command line names the mount point."""
        if self.kind == "overlay":
            return None
        if self.pid is None:
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        args = f.read().split(b"\0")
                except OSError:
                    continue
                if self.mnt.encode() in args and int(pid) != os.getpid():
                    self.pid = int(pid)
                    break
            else:
                return None
        with open(f"/proc/{self.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def requests(self):
        """mosaicfs' requests so far by opcode: (count, daemon µs)."""
        if not self.kind.startswith("mosaicfs"):
            return {}
        out = sh(f"{BASE if self.kind == 'mosaicfs-base' else BIN} status --json {self.mnt}")
        return {k: (v["count"], v["total_us"]) for k, v in json.loads(out)["requests"].items()}


def metamix(o, iobench, procs, n):
    dirs = [o.path(f"mix-{procs}-{i}") for i in range(procs)]
    for d in dirs:
        os.makedirs(d)
    start = time.perf_counter()
    ps = [subprocess.Popen([iobench, "metamix", d, str(n)], stdout=subprocess.PIPE, text=True) for d in dirs]
    ops = sum(field(p.communicate()[0], "ops") for p in ps)
    took = time.perf_counter() - start
    for d in dirs:
        os.rmdir(d)
    return ops / took, ops


def fsstress(o, procs, n):
    d = o.path(f"stress-{procs}")
    os.makedirs(d)
    out = sh(f"{FSSTRESS} -d {d} -p {procs} -n {n} -r 0")
    secs = float(out.split(" renamers, ")[1].split(" s,")[0])
    # fuse-overlayfs 2.0's rm -rf of the tree can fail once ("fts_read failed: No such file or
    # directory"); a second pass removes the rest.
    for _ in range(3):
        if subprocess.run(["rm", "-rf", d], capture_output=True).returncode == 0:
            break
    return procs * n / secs, procs * n


def untar(o, tar):
    d = o.path("untar")
    os.makedirs(d)
    start = time.perf_counter()
    sh(f"tar xf {tar} -C {d}")
    return time.perf_counter() - start


def delta(after, before):
    return {k: (c - before.get(k, (0, 0))[0], us - before.get(k, (0, 0))[1])
            for k, (c, us) in after.items() if c - before.get(k, (0, 0))[0]}


def run_round(o, iobench, tar, n, seen, cpu):
    """Each workload once on overlay `o`; `seen[workload]` collects mosaicfs' requests and
    `cpu[row]` the workload's time and the daemon's CPU time, per operation (µs)."""
    r = {}

    def timed(row, run, units):
        before_cpu, start = o.daemon_cpu(), time.perf_counter()
        value, ops = run()
        took, after_cpu = time.perf_counter() - start, o.daemon_cpu()
        r[row] = value
        if before_cpu is not None and after_cpu is not None:
            per = units or ops
            cpu.setdefault(row, []).append((took / per * 1e6, (after_cpu - before_cpu) / per * 1e6))
        return ops

    for procs in (1, 2):
        before = o.requests()
        row = f"fsstress-style mix, {procs} process{'es' if procs > 1 else ''} (ops/s)"
        ops = timed(row, lambda: fsstress(o, procs, STRESS_OPS), None)
        if o.kind.startswith("mosaicfs"):
            seen.setdefault(f"stress{procs}", []).append((delta(o.requests(), before), ops))
    for procs in (1, 2):
        before = o.requests()
        row = f"namespace mix (iobench metamix), {procs} process{'es' if procs > 1 else ''} (ops/s)"
        ops = timed(row, lambda: metamix(o, iobench, procs, n), None)
        if o.kind.startswith("mosaicfs"):
            seen.setdefault(f"mix{procs}", []).append((delta(o.requests(), before), ops))
    before = o.requests()
    row = f"untar of {FILES:,} files (s)"
    timed(row, lambda: (untar(o, tar), FILES), FILES)
    if o.kind.startswith("mosaicfs"):
        seen.setdefault("untar", []).append((delta(o.requests(), before), FILES))
    return r


def syscalls(cmd):
    """System calls `cmd` makes (strace -c -f), by name."""
    out = subprocess.run(["strace", "-f", "-c", "-o", "/dev/stdout", "sh", "-c", cmd],
                         check=True, capture_output=True, text=True).stdout
    calls = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] != "total":
            calls[parts[-1]] = int(parts[3])
    return calls


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--foreground", action="store_true", help="mosaicfs with -f, a child of this script")
    ap.add_argument("--only", default="", help="comma-separated overlays to run")
    a = ap.parse_args()
    Overlay.foreground = a.foreground
    rounds = a.rounds or (3 if a.quick else 6)
    n = 300 if a.quick else 800
    kinds = ["overlay", "fuse-overlayfs-1.10", "mosaicfs", "mosaicfs-io_uring"]
    if os.access(FO2, os.X_OK):
        kinds.insert(2, "fuse-overlayfs-2.0")
    else:
        print(f"fuse-overlayfs 2.0 not found at {FO2} (bench/run.sh builds it): its column is left out",
              file=sys.stderr)
    if not os.path.exists(URING):
        kinds.remove("mosaicfs-io_uring")
    if BASE:
        kinds.insert(kinds.index("mosaicfs"), "mosaicfs-base")
    if a.only:
        kinds = [k for k in kinds if k in a.only.split(",")]
    root = tempfile.mkdtemp(prefix="mosaicfs-metadata-bench-", dir="/var/tmp")
    iobench = os.path.join(root, "iobench")
    sh(f"cc -O2 -o {iobench} {HERE}/iobench.c")
    os.makedirs(os.path.join(root, "lower", "etc"))
    tar = os.path.join(root, "tree.tar")
    make_tar(tar)
    results = {k: [] for k in kinds}
    cpu = {k: {} for k in kinds}
    seen = {k: {} for k in kinds}
    try:
        with KernelUring(os.path.exists(URING)):
            for i in range(rounds):
                order = kinds[i % len(kinds):] + kinds[:i % len(kinds)]
                for kind in order:
                    with Overlay(root, kind) as o:
                        results[kind].append(run_round(o, iobench, tar, n, seen[kind], cpu[kind]))
                print(f"# round {i + 1} of {rounds} done", file=sys.stderr)
            # What the workloads ask of the kernel, for the requests-per-operation table.
            with Overlay(root, "overlay") as o:
                os.makedirs(o.path("stress"))
                stress_calls = syscalls(f"{FSSTRESS} -d {o.path('stress')} -p 1 -n {STRESS_OPS} -r 0")
                os.makedirs(o.path("mix"))
                mix_calls = syscalls(f"{iobench} metamix {o.path('mix')} {n}")
                os.makedirs(o.path("untar"))
                tar_calls = syscalls(f"tar xf {tar} -C {o.path('untar')}")
    finally:
        sh(f"rm -rf {root}")

    rows = list(results[kinds[0]][0].keys())
    print(f"\nMetadata, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, kernel {os.uname().release}, "
          f"median (min-max) of {rounds} interleaved rounds, fresh mounts, upper on a new ext4, "
          f"mosaicfs {'in the foreground (-f)' if a.foreground else 'in the background'}\n")
    print("| workload | " + " | ".join(kinds) + (" | mosaicfs / fuse-overlayfs 2.0 |" if "fuse-overlayfs-2.0" in kinds else " |"))
    print("|---|" + "---|" * len(kinds) + ("---|" if "fuse-overlayfs-2.0" in kinds else ""))
    med = {}
    for row in rows:
        cells = []
        for k in kinds:
            v = [r[row] for r in results[k]]
            med[k, row] = statistics.median(v)
            fmt = (lambda x: f"{x:.2f}") if "(s)" in row else (lambda x: f"{x:,.0f}")
            cells.append(f"{fmt(med[k, row])} ({fmt(min(v))}–{fmt(max(v))})")
        line = f"| {row} | " + " | ".join(cells) + " |"
        if "fuse-overlayfs-2.0" in kinds:
            for m in ("mosaicfs-base", "mosaicfs", "mosaicfs-io_uring"):
                if m in kinds:
                    x, y = med[m, row], med["fuse-overlayfs-2.0", row]
                    line += f" {m.replace('mosaicfs', '').lstrip('-') or '/dev/fuse'}: {(y / x if '(s)' in row else x / y):.2f}x"
            line += " |"
        print(line)

    # Where a one-process workload's time goes: while the daemon works its caller waits, so a
    # daemon that took no CPU at all would still leave the rest (the workload, its system calls,
    # the kernel's FUSE client and the wake-ups between the two): the best ratio to fuse-overlayfs
    # 2.0 any daemon could reach without the kernel sending fewer requests.
    daemons = [k for k in kinds if cpu[k]]
    if daemons:
        print("\nTime per operation and the daemon's CPU time in it (µs, medians; untar: per file)"
              + (", and the ratio to fuse-overlayfs 2.0 a daemon taking no CPU would reach" if "fuse-overlayfs-2.0" in daemons else "") + ":\n")
        print("| workload | " + " | ".join(f"{k}: time, daemon CPU" for k in daemons) + " |")
        print("|---|" + "---|" * len(daemons))
        for row in rows:
            if row not in cpu[daemons[0]]:
                continue
            cells = []
            for k in daemons:
                t = statistics.median(x[0] for x in cpu[k][row])
                c = statistics.median(x[1] for x in cpu[k][row])
                cell = f"{t:.0f}, {c:.0f}"
                one_process = ", 1 process " in row or row.startswith("untar")
                if one_process and k.startswith("mosaicfs") and "fuse-overlayfs-2.0" in daemons:
                    fo2 = statistics.median(x[0] for x in cpu["fuse-overlayfs-2.0"][row])
                    cell += f" (no-CPU bound {fo2 / max(t - c, 1e-9):.2f}x)"
                cells.append(cell)
            print(f"| {row.rsplit(' (', 1)[0]} | " + " | ".join(cells) + " |")

    per = {"stress1": "op of the 1-process fsstress-style mix", "stress2": "op of the 2-process fsstress-style mix",
           "mix1": "op of the 1-process namespace mix", "mix2": "op of the 2-process namespace mix",
           "untar": "file of the untar"}
    calls = {"stress1": stress_calls, "mix1": mix_calls, "untar": tar_calls}
    units = {"untar": FILES}
    for kind in [k for k in kinds if k.startswith("mosaicfs")]:
        print(f"\nRequests {kind} received (median of the rounds), per operation, and the daemon's time per request:\n")
        print("| workload | system calls per op (workload) | requests per op | by opcode: requests per op, µs each |")
        print("|---|---|---|---|")
        for w, label in per.items():
            samples = seen[kind].get(w, [])
            if not samples:
                continue
            ops = statistics.median(s[1] for s in samples)
            ops_units = units.get(w) or ops
            names = sorted({k for s, _ in samples for k in s}, key=lambda k: -statistics.median(s.get(k, (0, 0))[0] for s, _ in samples))
            total = statistics.median(sum(c for c, _ in s.values()) for s, _ in samples)
            detail = []
            for name in names:
                c = statistics.median(s.get(name, (0, 0))[0] for s, _ in samples)
                us = statistics.median(s[name][1] / s[name][0] for s, _ in samples if name in s)
                if c / ops_units >= 0.01:
                    detail.append(f"{name} {c / ops_units:.2f} × {us:.1f}")
            sc = ""
            if w in calls:
                sc = f"{sum(calls[w].values()) / ops_units:.2f}"
            print(f"| per {label} | {sc} | {total / ops_units:.2f} | {', '.join(detail)} |")


if __name__ == "__main__":
    main()
