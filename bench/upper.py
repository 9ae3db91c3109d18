#!/usr/bin/env python3
"""Metadata-heavy container work, the workloads of issue #13 (the memory upper layer): what the
writable layer's own cost is on each overlay. Same run, same layers, ratios.

Workloads (paper 003 gVisor rootfs overlay; issue #13):
  fsstress   mosaicfs-fsstress -p 20 -n 500, ten loops (the paper's `-n 500 -p 20 -l 10`;
             LTP's fsstress is not in the package registries here: src/bin/mosaicfs-fsstress.rs)
  untar      a 5,000-file tree (bench/suite.py's) into the mount
  git        `git clone` of a local repository (2,000 files, 20 commits) into the mount, then
             `git status` twice
  build      `make -j2` of a C project of 300 files baked into the lower layer (objects and
             the binary go to the upper layer)
  RSS        the mosaicfs daemon's resident memory grown per 10,000 upper files made

  data       a 256 MiB file written in the upper layer in 1 MiB writes and fsynced, read back
             whole after the caches are dropped, then 20,000 random 4 KiB reads of it: a
             memory upper serves file data through the daemon (no passthrough)

Columns: mosaicfs (upper=disk), mosaicfs upper=memory, kernel overlayfs with an ext4 upper,
kernel overlayfs with a tmpfs upper, fuse-overlayfs. For mosaicfs the run also prints the
daemon's CPU time per workload: a memory upper saves the upper layer's syscalls inside it and
nothing else (docs/PERFORMANCE.md, "What a memory upper can win").

Usage: bench/upper.py [--quick] [--also OPTS] [--uring] (root; needs fuse-overlayfs, git, gcc, make)
"""

import json
import os
import random
import shutil
import subprocess
import sys
import time

from suite import FreshFs, KernelUring, arguments, drop_caches, make_tree_tar, sh

HERE = os.path.dirname(os.path.abspath(__file__))
FSSTRESS = os.path.join(HERE, "..", "target", "release", "mosaicfs-fsstress")


class Setup:
    def __init__(self, root, quick):
        self.root, self.quick = root, quick
        self.lower = os.path.join(root, "lower")
        self.tar = os.path.join(root, "tree-5000.tar")
        self.repo = os.path.join(root, "repo")
        self.loops = 2 if quick else 10

    def prepare(self):
        make_project(os.path.join(self.lower, "proj"), 300)
        if not os.path.exists(self.tar):
            make_tree_tar(self.tar, 5000)
        if not os.path.exists(self.repo):
            make_repo(self.repo, 2000, 20)


def make_project(d, files):
    """A C project: `files` translation units of a few functions each, one header, a Makefile."""
    if os.path.exists(os.path.join(d, "Makefile")):
        return
    os.makedirs(os.path.join(d, "src"), exist_ok=True)
    with open(os.path.join(d, "src", "common.h"), "w") as f:
        f.write("#include <stdio.h>\n#include <string.h>\nstruct item { int id; char name[32]; double w; };\n")
        for i in range(files):
            f.write(f"int unit{i}(struct item *it, int n);\n")
    for i in range(files):
        with open(os.path.join(d, "src", f"unit{i}.c"), "w") as f:
            f.write('#include "common.h"\n')
            for j in range(6):
                f.write(f"static int helper{j}(struct item *it, int n) {{ int s = 0; for (int k = 0; k < n; k++) "
                        f"s += it[k].id * {j + 1} + (int)strlen(it[k].name) + (int)(it[k].w * {i % 7 + 1}); return s; }}\n")
            f.write(f"int unit{i}(struct item *it, int n) {{ return " + " + ".join(f"helper{j}(it, n)" for j in range(6)) + "; }\n")
    with open(os.path.join(d, "src", "main.c"), "w") as f:
        f.write('#include "common.h"\nint main(void) { struct item it[4] = {{1, "a", 1.0}}; long s = 0;\n')
        for i in range(files):
            f.write(f"  s += unit{i}(it, 4);\n")
        f.write('  printf("%ld\\n", s); return 0; }\n')
    with open(os.path.join(d, "Makefile"), "w") as f:
        f.write("SRC := $(wildcard src/*.c)\nOBJ := $(SRC:src/%.c=build/%.o)\n"
                "app: $(OBJ)\n\t$(CC) -o $@ $^\n"
                "build/%.o: src/%.c src/common.h | build\n\t$(CC) -O1 -c -o $@ $<\n"
                "build:\n\tmkdir -p build\n")


def make_repo(d, files, commits):
    """A git repository of `files` small text files and `commits` commits touching some."""
    rng = random.Random(13)
    os.makedirs(d)
    git = lambda *a: subprocess.run(["git", "-C", d, *a], check=True, capture_output=True)
    git("init", "-q")
    git("config", "user.email", "bench@mosaicfs")
    git("config", "user.name", "bench")
    for c in range(commits):
        todo = range(files) if c == 0 else rng.sample(range(files), files // 20)
        for i in todo:
            p = os.path.join(d, f"dir{i % 50}", f"f{i}.txt")
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "w") as f:
                f.write(f"{c} {i} " + "x" * rng.randint(50, 3000) + "\n")
        git("add", "-A")
        git("commit", "-q", "-m", f"commit {c}")


KINDS = ["mosaicfs", "overlay", "overlay-tmpfs", "fuse-overlayfs"]
MEMORY = "mosaicfs,upper=memory"


class Mount:
    def __init__(self, setup, kind, binary, extra=""):
        self.kind, self.setup, self.binary, self.extra = kind, setup, binary, extra
        self.dir = os.path.join(setup.root, "run-" + kind.replace("=", "-").replace(",", "-"))
        self.mnt = os.path.join(self.dir, "mnt")
        self.tmpfs = os.path.join(self.dir, "tmpfs")

    def __enter__(self):
        shutil.rmtree(self.dir, ignore_errors=True)
        os.makedirs(self.mnt)
        base = self.dir
        if self.kind == "overlay-tmpfs":
            os.makedirs(self.tmpfs)
            sh(f"mount -t tmpfs -o size=8g tmpfs {self.tmpfs}")
            base = self.tmpfs
        self.upper, self.work = os.path.join(base, "upper"), os.path.join(base, "work")
        os.makedirs(self.upper)
        os.makedirs(self.work)
        o = f"lowerdir={self.setup.lower},upperdir={self.upper},workdir={self.work}"
        if self.kind.startswith("mosaicfs"):
            sh(f"{self.binary} -o {o}{self.extra} {self.mnt}")
        elif self.kind.startswith("overlay"):
            sh(f"mount -t overlay overlay -o {o} {self.mnt}")
        else:
            sh(f"fuse-overlayfs -o {o} {self.mnt}")
        return self

    def __exit__(self, *exc):
        for _ in range(50):
            if subprocess.run(["umount", self.mnt], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        time.sleep(0.3)
        if self.kind == "overlay-tmpfs":
            subprocess.run(["umount", self.tmpfs], capture_output=True)
        shutil.rmtree(self.dir, ignore_errors=True)

    def path(self, *p):
        return os.path.join(self.mnt, *p)

    def daemon_pid(self):
        return next(p for p in os.listdir("/proc") if p.isdigit() and daemon_of(p, self.mnt))

    def daemon_cpu(self):
        """CPU time (user + system, s) the mosaicfs daemon has used so far, or None."""
        if not self.kind.startswith("mosaicfs"):
            return None
        with open(f"/proc/{self.daemon_pid()}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def daemon_rss_kib(self):
        if not self.kind.startswith("mosaicfs"):
            return None
        with open(f"/proc/{self.daemon_pid()}/status") as f:
            return int(next(l for l in f if l.startswith("VmRSS:")).split()[1])


def daemon_of(pid, mnt):
    """Whether process `pid` is the mosaicfs daemon serving `mnt`."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
    except OSError:
        return False
    return os.path.basename(args[0]) == b"mosaicfs" and mnt.encode() in args


def timed(m, daemon, name, cmd):
    os.sync()
    before = m.daemon_cpu()
    t0 = time.time()
    cmd()
    took = time.time() - t0
    if before is not None:
        daemon[name] = (m.daemon_cpu() - before, took)
    return took


def run_workloads(m, s, results, daemon):
    r, d = {}, {}
    # Memory per upper file, first, on the fresh mount (later the allocator has memory the
    # other workloads freed): 10,000 empty files made and kept (the kernel keeps them cached).
    if m.kind.startswith("mosaicfs"):
        os.makedirs(m.path("many"))
        before = m.daemon_rss_kib()
        for i in range(10000):
            open(m.path("many", f"f{i}"), "w").close()
        r["daemon RSS grown per 10,000 upper files (KiB)"] = m.daemon_rss_kib() - before
    stress = m.path("stress")

    def fsstress():
        for loop in range(s.loops):
            sh(f"{FSSTRESS} -d {stress}{loop} -p 20 -n 500 -s {loop + 1}")

    r["fsstress -p 20 -n 500, 10 loops (s)" if not s.quick else "fsstress -p 20 -n 500, 2 loops (s)"] = \
        timed(m, d, "fsstress", fsstress)
    os.makedirs(m.path("untar"))
    r["untar of a 5,000-file tree (s)"] = timed(m, d, "untar", lambda: sh(f"tar xf {s.tar} -C {m.path('untar')}"))
    r["git clone of a 2,000-file repository (s)"] = timed(
        m, d, "git clone", lambda: sh(f"git clone -q file://{s.repo} {m.path('clone')}"))
    r["git status, twice (s)"] = timed(
        m, d, "git status", lambda: (sh(f"git -C {m.path('clone')} status --porcelain"),
                                     sh(f"git -C {m.path('clone')} status --porcelain")))
    def build():
        shutil.rmtree(m.path("proj", "build"), ignore_errors=True)
        if os.path.exists(m.path("proj", "app")):
            os.unlink(m.path("proj", "app"))
        drop_caches()
        return timed(m, d, "build", lambda: sh(f"make -s -C {m.path('proj')} -j2"))

    # CPU-bound, and this VM's run-to-run spread (±5 %) is as large as the differences: median of 3.
    r["make -j2 of a 300-file C project in the lower layer, median of 3 (s)"] = sorted(build() for _ in range(3))[1]
    data_path(m, r, 64 if s.quick else 256)
    results[m.kind] = r
    daemon[m.kind] = d


def data_path(m, r, mib):
    """Sequential and random throughput of a file in the upper layer."""
    p = m.path("data.bin")
    chunk = os.urandom(1 << 20)
    t0 = time.time()
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for _ in range(mib):
        os.write(fd, chunk)
    os.fsync(fd)
    os.close(fd)
    r[f"write {mib} MiB in 1 MiB writes + fsync (MiB/s)"] = mib / (time.time() - t0)
    drop_caches()
    t0 = time.time()
    fd = os.open(p, os.O_RDONLY)
    while os.read(fd, 1 << 20):
        pass
    os.close(fd)
    r[f"read {mib} MiB, cold (MiB/s)"] = mib / (time.time() - t0)
    drop_caches()
    rng = random.Random(1)
    fd = os.open(p, os.O_RDONLY)
    t0 = time.time()
    n = 20000
    for _ in range(n):
        os.pread(fd, 4096, rng.randrange(mib * 256) * 4096)
    os.close(fd)
    r["random 4 KiB reads, cold (k/s)"] = n / (time.time() - t0) / 1000


def main():
    ap = arguments("/var/tmp/mosaicfs-bench-upper")
    a = ap.parse_args()
    with KernelUring(a.uring), FreshFs(a.root, "ext4") as root:
        s = Setup(root, a.quick)
        s.prepare()
        results, daemon = {}, {}
        kinds = [("mosaicfs", ""), (MEMORY, ",upper=memory")] + \
            [(f"mosaicfs,{x}", "," + x) for x in a.also] + [(k, "") for k in KINDS[1:]]
        for kind, extra in kinds:
            t0 = time.time()
            with Mount(s, kind, os.path.abspath(a.mosaicfs), extra) as m:
                run_workloads(m, s, results, daemon)
            print(f"# {kind}: {time.time() - t0:.0f} s", file=sys.stderr)
    report(a, kinds, results, daemon)


def report(a, kinds, results, daemon):
    cols = [k for k, _ in kinds]
    print(f"\nUpper-layer workloads (issue #13){' (quick)' if a.quick else ''}, "
          f"{time.strftime('%Y-%m-%d', time.gmtime())}, {os.cpu_count()} cores, {os.uname().release}, "
          f"layers on a fresh ext4 (loop){', kernel FUSE over io_uring on' if a.uring else ''}\n")
    print("| workload | " + " | ".join(cols) +
          " | upper=disk / upper=memory | overlayfs / memory | fuse-overlayfs / memory |")
    print("|" + "---|" * (len(cols) + 4))
    for w in results["mosaicfs"]:
        vals = [results[c].get(w) for c in cols]
        fmt = lambda v: "—" if v is None else (f"{v:.3g}" if v < 1000 else f"{v:,.0f}")
        m = results[MEMORY].get(w)
        # Times: peer / memory; rates (per second): memory / peer. Above 1: memory is faster.
        rate = "/s)" in w
        ratio = lambda p: "—" if p is None or m is None else f"{(m / p if rate else p / m):.2f}x"
        d, o, f = (results[k].get(w) for k in ("mosaicfs", "overlay", "fuse-overlayfs"))
        print(f"| {w} | " + " | ".join(fmt(v) for v in vals) + f" | {ratio(d)} | {ratio(o)} | {ratio(f)} |")
    print("\nRatios: how much faster upper=memory is than each (above 1: faster).")
    for kind in cols:
        if daemon.get(kind):
            print(f"\n{kind}: the daemon's CPU time (user + system) per workload:")
            for w, (cpu, wall) in daemon[kind].items():
                print(f"  {w}: {cpu:.2f} s of {wall:.2f} s")


if __name__ == "__main__":
    main()
