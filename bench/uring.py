#!/usr/bin/env python3
"""FUSE over io_uring against /dev/fuse (issue #15): the same mosaicfs mount options, the same
data, the two transports alternating in one run; median of the runs, ratio /dev/fuse time over
io_uring time (above 1: io_uring is faster).

All with entry and attribute timeouts 0 (every stat is a request). Workloads: a null round trip (getxattr of a name that is not there, answered at once), stat
with attribute and entry timeouts 0 (LOOKUP + GETATTR per call), open+close of a lower file
(read-only: OPEN with passthrough, FLUSH, RELEASE), the metadata mix of iobench with 1, 2 and 4
processes, write-many (open, 410-byte write, close per 4 KiB block of a lower file), and 4 KiB
random reads of a partial file (every read goes through the daemon). A second table gives the
context switches per request of the metadata mix over each transport.

The daemon runs as mount(8) and containers/storage start it: in the background, in a session
(and so a scheduler autogroup) of its own. `--foreground` runs it as a child of this script
(`-f`), in the script's session: over /dev/fuse that was about 2x slower per round trip, over
io_uring the same since the daemon raises its own autogroup there (docs/PERFORMANCE.md,
"Foreground and background daemons").

Usage: bench/uring.py [--quick] [--foreground]   (root; turns fuse.enable_uring on and restores it)
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suite import KernelUring  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.join(HERE, "..", "target", "release", "mosaicfs")
PARAM = "/sys/module/fuse/parameters/enable_uring"


def sh(cmd):
    return subprocess.run(cmd, shell=True, check=True, capture_output=True, text=True).stdout


def field(out, name):
    return float(out.split(name + "=")[1].split()[0])


class Mount:
    """A mosaicfs mount over `transport` whose upper and work dirs sit on a new ext4 file system
    (an image in /dev/shm): every run starts from the same empty upper. Reusing one upper file
    system measured ext4's inode allocator instead of the transport: after a run has created and
    deleted thousands of inodes, each create scans them (`recently_deleted`, up to a third of
    the CPU time in a profile of the metadata mix), and whichever transport ran second paid it."""

    foreground = False

    def __init__(self, root, transport, extra):
        self.root = root
        self.mnt = os.path.join(root, "mnt")
        self.fs = os.path.join(root, f"fs-{transport}")
        self.img = f"/dev/shm/mosaicfs-uring-bench-{transport}.img"
        self.opts = f"lowerdir={root}/lower,upperdir={self.fs}/upper,workdir={self.fs}/work," \
                    f"uring={'on' if transport == 'io_uring' else 'off'},complete_after=0,copy_whole=0,timeout=0{extra}"
        os.makedirs(self.mnt, exist_ok=True)
        os.makedirs(self.fs, exist_ok=True)

    def __enter__(self):
        sh(f"rm -f {self.img} && truncate -s 1G {self.img} && mkfs.ext4 -q {self.img} && "
           f"mount -o loop {self.img} {self.fs} && mkdir {self.fs}/upper {self.fs}/work")
        if not Mount.foreground:
            # As mount(8) starts it: the command returns once the mount is up.
            self.proc = None
            subprocess.run([BIN, "-o", self.opts, self.mnt], check=True)
            return self
        self.proc = subprocess.Popen([BIN, "-f", "-o", self.opts, self.mnt], stderr=subprocess.PIPE)
        for _ in range(500):
            if os.path.ismount(self.mnt):
                return self
            if self.proc.poll() is not None:
                self.__exit__()
                sys.exit("mosaicfs did not mount: " + self.proc.stderr.read().decode())
            time.sleep(0.01)
        sys.exit("mount did not come up")

    def __exit__(self, *exc):
        if os.path.ismount(self.mnt):
            subprocess.run(["umount", self.mnt], check=True)
        if self.proc:
            self.proc.wait()
        else:
            # The daemon lets go of the upper file system shortly after the unmount.
            for _ in range(500):
                if subprocess.run(["pgrep", "-f", self.fs], capture_output=True).returncode != 0:
                    break
                time.sleep(0.01)
        subprocess.run(["umount", self.fs], check=True)
        os.unlink(self.img)

    def path(self, *p):
        return os.path.join(self.mnt, *p)


def metamix(m, iobench, procs, n):
    dirs = []
    for i in range(procs):
        d = m.path(f"meta-{procs}-{i}")
        os.makedirs(d, exist_ok=True)
        dirs.append(d)
    start = time.perf_counter()
    ps = [subprocess.Popen([iobench, "metamix", d, str(n)], stdout=subprocess.PIPE, text=True) for d in dirs]
    ops = 0
    for p in ps:
        out, _ = p.communicate()
        ops += field(out, "ops")
    total = time.perf_counter() - start
    for d in dirs:
        os.rmdir(d)
    return ops / total


def context_switches():
    for line in open("/proc/stat"):
        if line.startswith("ctxt "):
            return int(line.split()[1])


def requests(m):
    out = subprocess.run([BIN, "status", "--json", m.mnt], check=True, capture_output=True, text=True).stdout
    return sum(v["count"] for v in json.loads(out)["requests"].values())


def run_once(m, iobench, q, switches):
    """One run of every workload on mount `m`; `switches[procs]` gets the context switches per
    request (the whole machine's, over the requests the daemon counted) of the metadata mix."""
    r = {}
    n = 5000 if q else 20000
    r["null round trip, getxattr ENODATA (µs)"] = field(sh(f"{iobench} nullrt {m.path('small')} {n}"), "avg_us")
    t = time.perf_counter()
    for _ in range(n // 4):
        os.stat(m.path("small"))
    r["stat, timeouts 0: LOOKUP + GETATTR (µs)"] = (time.perf_counter() - t) / (n // 4) * 1e6
    r["open + close of a lower file (µs)"] = field(sh(f"{iobench} openclose {m.path('ro')} {n // 2} RDONLY"), "avg_us")
    for procs in (1, 2, 4):
        before = (context_switches(), requests(m))
        r[f"metadata mix, {procs} process{'es' if procs > 1 else ''} (ops/s)"] = metamix(m, iobench, procs, 300 if q else 1000)
        switches.setdefault(procs, []).append((context_switches() - before[0]) / (requests(m) - before[1]))
    r["write-many over 16 MiB: open, 410 B write, close per 4 KiB (µs/op)"] = field(
        sh(f"{iobench} writemany {m.path('wmany')} 4096 410"), "avg_us")
    # A partial file: one block written, read at random through the daemon.
    with open(m.path("part"), "r+b") as f:
        f.write(b"x" * 4096)
    r["4 KiB random read of a partial file (µs)"] = field(sh(f"{iobench} randread {m.path('part')} 4096 50"), "avg_us")
    return r


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs", type=int, default=0)
    ap.add_argument("--foreground", action="store_true", help="run the daemon with -f, as a child")
    a = ap.parse_args()
    Mount.foreground = a.foreground
    runs = a.runs or (3 if a.quick else 5)
    if not os.path.exists(PARAM):
        sys.exit("this kernel has no FUSE over io_uring (CONFIG_FUSE_IO_URING)")
    root = tempfile.mkdtemp(prefix="mosaicfs-uring-bench-", dir="/var/tmp")
    iobench = os.path.join(root, "iobench")
    sh(f"cc -O2 -o {iobench} {HERE}/iobench.c")
    lower = os.path.join(root, "lower")
    os.makedirs(lower)
    for name, size in [("small", 100), ("ro", 4096), ("wmany", 16 << 20), ("part", 16 << 20)]:
        with open(os.path.join(lower, name), "wb") as f:
            f.write(os.urandom(size))
    results = {"/dev/fuse": [], "io_uring": []}
    switches = {"/dev/fuse": {}, "io_uring": {}}
    try:
        with KernelUring(True):
            for i in range(runs):
                for transport in (["/dev/fuse", "io_uring"] if i % 2 == 0 else ["io_uring", "/dev/fuse"]):
                    key = "io_uring" if transport == "io_uring" else "dev"
                    with Mount(root, key, "") as m:
                        results[transport].append(run_once(m, iobench, a.quick, switches[transport]))
    finally:
        sh(f"rm -rf {root}")
    rows = list(results["/dev/fuse"][0].keys())
    print(f"FUSE transport, median of {runs} runs, {time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, "
          f"kernel {os.uname().release}, daemon {'in the foreground (-f)' if a.foreground else 'in the background'}\n")
    print("| workload | /dev/fuse | io_uring | io_uring speed-up |")
    print("|---|---|---|---|")
    for row in rows:
        dev = statistics.median(r[row] for r in results["/dev/fuse"])
        ur = statistics.median(r[row] for r in results["io_uring"])
        speedup = ur / dev if "ops/s" in row else dev / ur
        print(f"| {row} | {dev:,.1f} | {ur:,.1f} | {speedup:.2f}x |")
    print("\nContext switches per request in the metadata mix (median):\n")
    print("| processes | /dev/fuse | io_uring |")
    print("|---|---|---|")
    for procs in sorted(switches["io_uring"]):
        print(f"| {procs} | {statistics.median(switches['/dev/fuse'][procs]):.2f} | "
              f"{statistics.median(switches['io_uring'][procs]):.2f} |")


if __name__ == "__main__":
    main()
