#!/usr/bin/env python3
"""The mosaicfs benchmark suite (issue #5): the same workloads on mosaicfs, kernel overlayfs and
fuse-overlayfs in one run, printed as a table of ratios. Run it through bench/run.sh.

Workloads (papers 000 TranslayFS Fig 13/14, 002 BAOverlay, FxMark):
  write-once, write-many, read-after-write, partial-block stride, random small writes on lower
  files; aligned fio sequential/random reads of an untouched lower file; fio writes and reads of
  a copied-up file; sequential write of a new (upper) file; a read of a partially modified
  file; a metadata mix; untar of a 5,000-file tree then find + stat; FxMark DRBL and DWOL with
  1, 2 and 4 processes.
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def sh(cmd, **kw):
    return subprocess.run(cmd, shell=True, check=True, capture_output=True, text=True, **kw).stdout


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def write_random(path, size):
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 1 << 20)
            f.write(os.urandom(n))
            left -= n


def make_tree_tar(path, files, pkgs=7):
    """A synthetic source tree: `files` small files of 200 B to 8 KiB in 40 x `pkgs` nested
    directories."""
    rng = random.Random(5)
    tmp = path + ".d"
    shutil.rmtree(tmp, ignore_errors=True)
    for i in range(files):
        d = os.path.join(tmp, f"src/mod{i % 40}/pkg{i % pkgs}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"file{i}.c"), "wb") as f:
            f.write(os.urandom(rng.randint(200, 8000)))
    with tarfile.open(path, "w") as t:
        t.add(os.path.join(tmp, "src"), arcname="src")
    shutil.rmtree(tmp)


class Setup:
    def __init__(self, root, quick):
        self.root = root
        self.quick = quick
        self.size = (64 if quick else 512) << 20
        self.lower = os.path.join(root, "lower")
        self.tar = os.path.join(root, f"tree-{5000}.tar")
        self.iobench = os.path.join(root, "iobench")

    def prepare(self):
        os.makedirs(os.path.join(self.lower, "data"), exist_ok=True)
        stamp = os.path.join(self.lower, f".ready-{self.size}")
        if not os.path.exists(stamp):
            for name in ["big", "wonce", "wmany", "raw", "stride", "smallw", "partmod", "copied"]:
                write_random(os.path.join(self.lower, "data", name), self.size if name == "big" else self.size // 4)
            for i in range(4):
                write_random(os.path.join(self.lower, "data", f"fx-{i}"), 4096)
            open(stamp, "w").close()
        if not os.path.exists(self.tar):
            make_tree_tar(self.tar, 5000)
        # Read every lower file once: the virtual disk's host cache is then equally warm for
        # every file system measured (dropping the guest's cache does not empty the host's),
        # instead of only for those measured after the first.
        for name in os.listdir(os.path.join(self.lower, "data")):
            with open(os.path.join(self.lower, "data", name), "rb") as f:
                while f.read(1 << 20):
                    pass
        sh(f"cc -O2 -o {self.iobench} {HERE}/iobench.c")


FILESYSTEMS = ["mosaicfs", "overlay", "fuse-overlayfs"]
# fuse-overlayfs 2.0 (upstream's Rust rewrite), built from its published source by bench/run.sh
# with `cargo install`; its column is left out when it is not there.
FO2 = os.environ.get("FUSE_OVERLAYFS2", "/var/tmp/fo2/bin/fuse-overlayfs")


def timed(f):
    """Seconds `f()` takes, started after a sync."""
    os.sync()
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def overwrites(path, count, rnd, size=64 << 20):
    """`count` 4 KiB writes at random block offsets of the `size`-byte file `path`, one open,
    close included: microseconds each, started after a sync."""
    page, rng = os.urandom(4096), random.Random(rnd)

    def run():
        fd = os.open(path, os.O_RDWR)
        for _ in range(count):
            os.pwrite(fd, page, rng.randrange(0, size // 4096) * 4096)
        os.close(fd)
    return timed(run) / count * 1e6


def small_files(d, count=2000):
    """Makes directory `d` with `count` files of one 100-byte write each: seconds."""
    def run():
        os.mkdir(d)
        for i in range(count):
            fd = os.open(os.path.join(d, f"f{i}"), os.O_WRONLY | os.O_CREAT, 0o644)
            os.write(fd, b"x" * 100)
            os.close(fd)
    return timed(run)


def stat_walk(top):
    """lstat of every entry below `top`."""
    for d, dirs, files in os.walk(top):
        for n in dirs + files:
            os.lstat(os.path.join(d, n))


def metadata_mix(mix, rounds=2000):
    """`rounds` rounds of create, write 100 B, chmod, rename, stat, unlink in the new
    directory `mix`."""
    os.makedirs(mix)
    for i in range(rounds):
        a, b = os.path.join(mix, f"a{i}"), os.path.join(mix, f"b{i}")
        fd = os.open(a, os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, b"x" * 100)
        os.close(fd)
        os.chmod(a, 0o600)
        os.rename(a, b)
        os.stat(b)
        os.unlink(b)


def mount_overlay(kind, binary, lower, d, rootless=False, uring=None):
    """Mounts overlay `kind` (mosaicfs, overlay, fuse-overlayfs, fuse-overlayfs-2.0,
    mosaicfs-uring, mosaicfs-writeback) of `lower` with upper, work and mount point under `d`, as its users mount
    it; `rootless`: in a user namespace, where kernel overlayfs needs `userxattr`. `uring`: for
    mosaicfs, over io_uring (True) or /dev/fuse (False) rather than its default."""
    for sub in ["upper", "work", "mnt"]:
        os.makedirs(os.path.join(d, sub), exist_ok=True)
    o = f"lowerdir={lower},upperdir={d}/upper,workdir={d}/work"
    transport = "" if uring is None else (",uring=on" if uring else ",uring=off")
    sh({
        "mosaicfs": f"{binary} -o {o}{transport} {d}/mnt",
        "mosaicfs-uring": f"{binary} -o {o}{transport} {d}/mnt",
        "mosaicfs-writeback": f"{binary} -o {o}{transport},writeback=auto {d}/mnt",
        "overlay": f"mount -t overlay overlay -o {o}{',userxattr' if rootless else ''} {d}/mnt",
        "fuse-overlayfs-2.0": f"{FO2} -o {o} {d}/mnt",
        "fuse-overlayfs": f"fuse-overlayfs -o {o} {d}/mnt",
    }[kind])


PEERS = ["overlay", "fuse-overlayfs", "fuse-overlayfs-2.0", "mosaicfs"]


def peers():
    """The overlays a peer script compares: fuse-overlayfs 2.0 when it was built."""
    return [k for k in PEERS if k != "fuse-overlayfs-2.0" or os.access(FO2, os.X_OK)]


def peer_arguments(root):
    """The options of the scripts that run every peer as root or rootless (space.py,
    peers.py); `--inside` is the script run again in the user namespace."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rootless", action="store_true")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", default=root)
    ap.add_argument("--mosaicfs", default=os.path.join(HERE, "..", "target", "release", "mosaicfs"))
    return ap


def print_head(what, details, first, columns):
    """A table's caption — what, the time, the machine, then `details` — and its header row
    (`first`, then one column each)."""
    print(f"\n{what}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} "
          f"cores, {os.uname().release}, {details}\n")
    print(f"| {first} | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))


def umount(path):
    """Unmounts `path`, retrying while it is busy (a daemon's last requests), 10 s at most."""
    for _ in range(100):
        if subprocess.run(["umount", path], capture_output=True).returncode == 0:
            return
        time.sleep(0.1)
    print(f"# could not unmount {path}", file=sys.stderr)


def main_rootless(a, script, run, prepare, extra=()):
    """The main of a script that runs every peer rootless: `run(a, root)` as user nobody in a
    user namespace (the script run again with `--inside`) on a fresh ext4 that `prepare(root)`
    filled; `extra`: the script's own arguments to pass on."""
    a.mosaicfs = os.path.abspath(a.mosaicfs)
    if a.inside:
        run(a, a.root)
        return
    with FreshFs(a.root, "ext4", 8 << 30) as root:
        prepare(root)
        run_rootless(root, script, ["--inside", "--root", root, "--rounds", str(a.rounds),
                                    "--mosaicfs", a.mosaicfs, *extra])


def run_rootless(root, script, args):
    """Runs bench script `script` with `args` as user nobody in a new user and mount namespace
    (`unshare -Urm`, as rootless Podman runs its mount program), on `root`, which it gives to
    nobody; /dev/fuse is opened to users for the run and its mode put back."""
    before = os.stat("/dev/fuse").st_mode & 0o7777
    os.chmod("/dev/fuse", 0o666)
    try:
        sh(f"chown -R nobody:nogroup {root}")
        subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                        "unshare", "-Urm", "/usr/bin/python3", os.path.abspath(script)] + args,
                       check=True)
    finally:
        os.chmod("/dev/fuse", before)


class Mount:
    def __init__(self, setup, kind, binary, extra=""):
        self.kind, self.setup, self.binary, self.extra = kind, setup, binary, extra
        self.dir = os.path.join(setup.root, "run-" + kind.replace("=", "-").replace(",", "-"))
        self.mnt = os.path.join(self.dir, "mnt")

    def __enter__(self):
        shutil.rmtree(self.dir, ignore_errors=True)
        for d in ["upper", "work", "mnt"]:
            os.makedirs(os.path.join(self.dir, d))
        self.mount()
        return self

    def mount(self):
        o = f"lowerdir={self.setup.lower},upperdir={self.dir}/upper,workdir={self.dir}/work"
        if self.kind.startswith("mosaicfs"):
            sh(f"{self.binary} -o {o}{self.extra} {self.mnt}")
        elif self.kind == "overlay":
            sh(f"mount -t overlay overlay -o {o} {self.mnt}")
        elif self.kind == "fuse-overlayfs-2.0":
            sh(f"{FO2} -o {o} {self.mnt}")
        else:
            sh(f"fuse-overlayfs -o {o} {self.mnt}")

    def unmount(self):
        for _ in range(50):
            if subprocess.run(["umount", self.mnt], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)
        time.sleep(0.3)

    def remount(self):
        """The same layers, unmounted and mounted again."""
        self.unmount()
        self.mount()

    def __exit__(self, *exc):
        self.unmount()
        shutil.rmtree(self.dir, ignore_errors=True)

    def path(self, *p):
        return os.path.join(self.mnt, *p)


def fio(path, rw, bs, size=None, io_limit=None, runtime=None, fsync_end=True):
    args = ["fio", "--name=w", f"--filename={path}", f"--rw={rw}", f"--bs={bs}", "--ioengine=psync",
            "--output-format=json", "--randrepeat=1", "--norandommap"]
    if size:
        args.append(f"--size={size}")
    if io_limit:
        args.append(f"--io_size={io_limit}")
    if runtime:
        args += [f"--runtime={runtime}", "--time_based=0"]
    if fsync_end and "write" in rw:
        args.append("--end_fsync=1")
    out = json.loads(subprocess.run(args, check=True, capture_output=True, text=True).stdout)
    job = out["jobs"][0]
    side = job["write"] if "write" in rw else job["read"]
    return side["bw"] / 1024.0, side["iops"]  # MiB/s, IOPS


def median(run, times=3):
    return sorted(run() for _ in range(times))[times // 2]


def run_workloads(m, s, results):
    q = s.quick
    data = lambda n: m.path("data", n)
    r = {}
    drop_caches()
    r["write-once: seq 4 KiB writes over a lower file (MiB/s)"] = fio(data("wonce"), "write", "4k")[0]
    r["write-many: random 4 KiB writes to a lower file (IOPS)"] = fio(
        data("wmany"), "randwrite", "4k", io_limit=f"{s.size // 2}")[1]
    fio(data("raw"), "write", "4k")
    r["read-after-write: seq read of what was just written (MiB/s)"] = fio(data("raw"), "read", "64k")[0]
    out = sh(f"{s.iobench} stride {data('stride')} 4096 410")
    r["partial-block stride: 410 B at every 4 KiB, then fsync (s)"] = float(out.split("total_s=")[1].split()[0])
    r["random small writes: 512 B random writes to a lower file (IOPS)"] = fio(
        data("smallw"), "randwrite", "512", io_limit="8m" if q else "32m")[1]
    # The virtual disk's host cache makes single cold reads and fsync-bound writes bimodal on
    # this kind of machine (native ext4 reads alternate between ~2 and ~7 GB/s): the target
    # workloads report the median of seven (reads) and five (writes) runs.
    def cold_read():
        drop_caches()
        return fio(data("big"), "read", "1m")[0]

    r["untouched lower file: seq read, cold cache (MiB/s)"] = median(cold_read, 7)
    r["untouched lower file: random 4 KiB reads (IOPS)"] = fio(data("big"), "randread", "4k", io_limit="16m" if q else "64m")[1]
    # A copied-up file: one byte written first (every overlay copies it up then).
    with open(data("copied"), "r+b") as f:
        f.write(b"x")
    r["copied-up file: seq 1 MiB writes (MiB/s)"] = fio(data("copied"), "write", "1m")[0]
    r["copied-up file: random 4 KiB writes (IOPS)"] = fio(data("copied"), "randwrite", "4k", io_limit="16m" if q else "64m")[1]
    def new_file():
        if os.path.exists(m.path("newfile")):
            os.unlink(m.path("newfile"))
        os.sync()
        return fio(m.path("newfile"), "write", "1m", size=f"{s.size // 4}")[0]

    r["new upper file: seq 1 MiB writes (MiB/s)"] = median(new_file, 5)
    with open(data("partmod"), "r+b") as f:
        for off in range(0, s.size // 4, 65536):
            f.seek(off)
            f.write(b"m")
    drop_caches()
    r["partially modified file: seq read (MiB/s)"] = fio(data("partmod"), "read", "1m")[0]
    os.makedirs(m.path("meta"))
    out = sh(f"{s.iobench} metamix {m.path('meta')} {500 if q else 3000}")
    r["metadata mix: create, stat, rename, mkdir, readdir, unlink, rmdir (ops/s)"] = float(out.split("ops_s=")[1])
    os.makedirs(m.path("untar"))
    t0 = time.time()
    sh(f"tar xf {s.tar} -C {m.path('untar')}")
    r["untar of a 5,000-file tree (s)"] = time.time() - t0
    t0 = time.time()
    sh(f"find {m.path('untar')} -type f -print0 | xargs -0 stat > /dev/null")
    r["find + stat of the 5,000 files (s)"] = time.time() - t0
    secs = 1 if q else 3
    for n in (1, 2, 4):
        out = sh(f"{s.iobench} fxmark drbl {m.path('data')} {n} {secs}")
        r[f"FxMark DRBL, {n} process{'es' if n > 1 else ''} (ops/s)"] = float(out.split("ops_s=")[1])
    for n in (1, 2, 4):
        for i in range(n):
            with open(data(f"fx-{i}"), "r+b") as f:
                f.write(b"w")  # copy up first, then measure overwrites
        out = sh(f"{s.iobench} fxmark dwol {m.path('data')} {n} {secs}")
        r[f"FxMark DWOL, {n} process{'es' if n > 1 else ''} (ops/s)"] = float(out.split("ops_s=")[1])
    results[m.kind] = r


LOWER_IS_BETTER = "(s)"


def arguments(root):
    """The options every script of the suite takes; --fs is added by each."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--root", default=root)
    ap.add_argument("--mosaicfs", default=os.path.join(HERE, "..", "target", "release", "mosaicfs"))
    ap.add_argument("--also", action="append", default=[], help="extra mosaicfs options to run as another column")
    ap.add_argument("--uring", action="store_true",
                    help="switch the kernel's FUSE over io_uring on for the run (and back): mosaicfs' default "
                         "uring=auto then uses it; add --also uring=off for a /dev/fuse column")
    return ap


class KernelUring:
    """With `on`, FUSE over io_uring switched on in the kernel for the block's duration, then put
    back as it was (fuse-overlayfs' libfuse does not use it; kernel overlayfs is not FUSE). A
    SIGTERM (`kill`, `timeout`) ends the block as an exception does, so the switch is put back
    then too: left on, it turned every later mount of the machine, tests included, to io_uring."""

    PARAM = "/sys/module/fuse/parameters/enable_uring"

    def __init__(self, on):
        self.on = on
        self.before = None
        self.sigterm = None

    def __enter__(self):
        if self.on:
            if not os.path.exists(self.PARAM):
                sys.exit("this kernel has no FUSE over io_uring (CONFIG_FUSE_IO_URING)")
            self.before = open(self.PARAM).read().strip()
            self.sigterm = signal.signal(signal.SIGTERM, lambda sig, _: sys.exit(128 + sig))
            with open(self.PARAM, "w") as f:
                f.write("Y")
        return self

    def __exit__(self, *exc):
        if self.before is not None:
            with open(self.PARAM, "w") as f:
                f.write(self.before)
            signal.signal(signal.SIGTERM, self.sigterm)


def main():
    ap = arguments("/var/tmp/mosaicfs-bench-suite")
    ap.add_argument("--fs", choices=["ext4", "xfs", "btrfs", "here"], default="ext4",
                    help="ext4, xfs (reflink=1), btrfs: the layers sit on a fresh file system of that kind "
                         "(loop device) made under --root; here: directly in --root")
    a = ap.parse_args()
    with KernelUring(a.uring):
        if a.fs != "here":
            with FreshFs(a.root, a.fs) as root:
                run_suite(a, root)
        else:
            run_suite(a, a.root)


# ext4's inode tables and journal are written at mkfs (fast on the sparse image), not by the
# kernel's ext4lazyinit thread in the minutes after the mount, whose writes landed in whichever
# rows ran first (a new file's 256 MiB written at 280 or 825 MiB/s in two runs).
MKFS = {"ext4": "mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0", "xfs": "mkfs.xfs -q -f -m reflink=1", "btrfs": "mkfs.btrfs -q -f"}


class FreshFs:
    """A new file system on a loop device, as under /var/lib/containers on a host (a journaled
    ext4, or XFS / btrfs, where upper and lower layers can share extents). The root file system
    of these VMs has no journal, and there ext4 scans for recently deleted inodes on every create
    (`recently_deleted`), which made create-heavy workloads depend on what the previous file
    system measured had deleted."""

    def __init__(self, root, kind, size=16 << 30, mkfs_options=""):
        self.image = root.rstrip("/") + ".img"
        self.mnt = os.path.join(root, kind)
        self.mkfs = f"{MKFS[kind]} {mkfs_options}".strip()
        self.size = size

    def __enter__(self):
        os.makedirs(self.mnt, exist_ok=True)
        subprocess.run(["umount", self.mnt], capture_output=True)
        if os.path.exists(self.image):
            os.unlink(self.image)
        with open(self.image, "wb") as f:
            f.truncate(self.size)
        sh(f"{self.mkfs} {self.image}")
        sh(f"mount -o loop {self.image} {self.mnt}")
        return self.mnt

    def __exit__(self, *exc):
        # Retried: a FUSE daemon still exiting keeps the file system busy for a moment, and a
        # single try left the loop mount behind (its image unlinked under it).
        umount(self.mnt)
        os.unlink(self.image)


def run_suite(a, root):
    s = Setup(root, a.quick)
    s.prepare()
    results = {}
    kinds = [("mosaicfs", "")] + [(f"mosaicfs,{x}", "," + x) for x in a.also] + [("overlay", ""), ("fuse-overlayfs", "")]
    fo2 = os.access(FO2, os.X_OK)
    if fo2:
        kinds.append(("fuse-overlayfs-2.0", ""))
    for kind, extra in kinds:
        t0 = time.time()
        with Mount(s, kind, os.path.abspath(a.mosaicfs), extra) as m:
            run_workloads(m, s, results)
        print(f"# {kind}: {time.time() - t0:.0f} s", file=sys.stderr)
    cols = [k for k, _ in kinds]
    where = f"layers on a fresh {a.fs} (loop)" if a.fs != "here" else f"layers in {a.root}"
    where += ", kernel FUSE over io_uring on" if a.uring else ""
    print(f"\nBenchmark suite{' (quick)' if a.quick else ''}, {time.strftime('%Y-%m-%d', time.gmtime())}, "
          f"{os.cpu_count()} cores, {os.uname().release}, files of {s.size >> 20} MiB, {where}\n")
    head = "| workload | " + " | ".join(cols) + " | mosaicfs / overlayfs | mosaicfs / fuse-overlayfs |"
    if fo2:
        head += " mosaicfs / fuse-overlayfs 2.0 |"
    print(head)
    print("|" + "---|" * (len(cols) + 3 + fo2))
    for w in results["mosaicfs"]:
        vals = [results[c][w] for c in cols]
        m, o, f = results["mosaicfs"][w], results["overlay"][w], results["fuse-overlayfs"][w]
        # Ratios are "how much better is mosaicfs": for times, the inverse.
        better = (lambda x, y: y / x) if LOWER_IS_BETTER in w else (lambda x, y: x / y)
        fmt = lambda v: f"{v:.3g}" if v < 1000 else f"{v:,.0f}"
        line = f"| {w} | " + " | ".join(fmt(v) for v in vals) + f" | {better(m, o):.2f}x | {better(m, f):.2f}x |"
        if fo2:
            line += f" {better(m, results['fuse-overlayfs-2.0'][w]):.2f}x |"
        print(line)
    mo = results["mosaicfs"]
    print("\nRatios are 'times better than the peer' (for times, peer time / mosaicfs time). The cold read is")
    print("the median of seven runs, the new-file writes of five.")
    targets = [
        ("reads of untouched lower files >= 0.9x overlayfs", mo["untouched lower file: seq read, cold cache (MiB/s)"] / results["overlay"]["untouched lower file: seq read, cold cache (MiB/s)"], 0.9),
        ("writes to complete files >= 0.9x overlayfs", mo["new upper file: seq 1 MiB writes (MiB/s)"] / results["overlay"]["new upper file: seq 1 MiB writes (MiB/s)"], 0.9),
        ("metadata mix >= 2x fuse-overlayfs", mo["metadata mix: create, stat, rename, mkdir, readdir, unlink, rmdir (ops/s)"] / results["fuse-overlayfs"]["metadata mix: create, stat, rename, mkdir, readdir, unlink, rmdir (ops/s)"], 2.0),
        ("DRBL scaling 1 -> 2 processes >= 1.8x", mo["FxMark DRBL, 2 processes (ops/s)"] / mo["FxMark DRBL, 1 process (ops/s)"], 1.8),
    ]
    if fo2:
        mix = "metadata mix: create, stat, rename, mkdir, readdir, unlink, rmdir (ops/s)"
        untar = "untar of a 5,000-file tree (s)"
        targets += [
            ("metadata mix >= 1.5x fuse-overlayfs 2.0 (issue #42)", mo[mix] / results["fuse-overlayfs-2.0"][mix], 1.5),
            ("untar >= 1.5x fuse-overlayfs 2.0 (issue #42)", results["fuse-overlayfs-2.0"][untar] / mo[untar], 1.5),
        ]
    print("\nTargets (issues #5, #42):")
    for name, value, goal in targets:
        print(f"- {name}: {value:.2f} -> {'met' if value >= goal else 'NOT met'}")


if __name__ == "__main__":
    main()
