#!/usr/bin/env python3
"""Sustained I/O on files a container has written (issue #11): what happens after the first
write, on mosaicfs, kernel overlayfs and fuse-overlayfs in one run, on a fresh file system.

Rows (paper 002 BAOverlay Table 1 and section 5, FxMark DWOL, a database baked into an image):
  - the FUSE round trip (a getxattr the file system answers at once) and an open + close of a
    complete file: the floors that the rows bounded by requests are compared with;
  - the first write to a 1 GiB lower file, and the upper layer's disk use right after it;
  - write-many: for every 4 KiB block of a lower file, open + write 410 B + close;
  - stride: 1 byte at every 4 KiB of a 256 MiB lower file through one descriptor, then fsync;
  - fio bs=1k rw=write:3k (BAOverlay's 3 KiB holes) over a 256 MiB lower file;
  - fio sequential 4 KiB and 128 KiB writes after an open(O_WRONLY) + close of the lower file;
  - DWOL: 4 KiB overwrites of block 0 through one descriptor, of a file written and closed a
    second before (a 4 KiB file, as FxMark's, and a 256 MiB one);
  - SQLite: a database of about 90 MB in the lower layer, updated through the mount with small
    transactions, first with a rollback journal, then in WAL mode; integrity_check after each
    phase and after a remount.

Run it through bench/run-sustained.sh (root; installs what it needs).
"""

import json
import os
import random
import sqlite3
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suite import FILESYSTEMS, FreshFs, KernelUring, Mount, arguments, drop_caches, fio, sh, write_random  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MIB = 1 << 20


class Setup:
    def __init__(self, root, quick):
        self.root = root
        self.quick = quick
        self.many = (256 if quick else 1024) * MIB
        self.size = 256 * MIB
        self.txns = 500 if quick else 2000
        # Requests each mosaicfs column answered during each SQLite phase (the rows' floors).
        self.requests = {}
        self.lower = os.path.join(root, "lower")
        self.iobench = os.path.join(root, "iobench")

    def file(self, name):
        return os.path.join(self.lower, name)

    def prepare(self):
        os.makedirs(self.lower, exist_ok=True)
        files = {"first": 1024 * MIB, "reopen": 100 * MIB, "reopenrw": 100 * MIB,
                 "holes4k": self.size, "wmany": self.many, "stride": self.size, "holes": self.size,
                 "fio4k": self.size, "fio128k": self.size, "dwol/fx-0": 4096, "dwolbig/fx-0": self.size}
        for name, size in files.items():
            p = self.file(name)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            if not os.path.exists(p) or os.path.getsize(p) != size:
                write_random(p, size)
        if not os.path.exists(self.file("db.sqlite")):
            make_db(self.file("db.sqlite"))
        for name in list(files) + ["db.sqlite"]:
            with open(self.file(name), "rb") as f:
                while f.read(MIB):
                    pass
        sh(f"cc -O2 -o {self.iobench} {HERE}/iobench.c")

    def io(self, *args):
        out = sh(" ".join([self.iobench] + [str(a) for a in args]))
        return {k: float(v) for k, v in (f.split("=") for f in out.split())}


ROWS = 300_000


def make_db(path):
    """About 90 MB: 300,000 rows of ~250 random bytes with an index, as an image might ship."""
    tmp = path + ".tmp"
    if os.path.exists(tmp):
        os.unlink(tmp)
    con = sqlite3.connect(tmp)
    con.execute("PRAGMA page_size=4096")
    con.execute("CREATE TABLE t(id INTEGER PRIMARY KEY, k INTEGER, v BLOB)")
    rng = random.Random(1)
    con.executemany("INSERT INTO t VALUES(?,?,?)",
                    ((i, rng.randrange(1 << 30), rng.randbytes(250)) for i in range(ROWS)))
    con.execute("CREATE INDEX tk ON t(k)")
    con.commit()
    con.close()
    os.rename(tmp, path)


def sqlite_phase(path, mode, txns, seed):
    """`txns` transactions of 4 updates and 1 insert each, in journal mode `mode`; seconds."""
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("PRAGMA synchronous=FULL")
    got = con.execute(f"PRAGMA journal_mode={mode}").fetchone()[0]
    assert got.lower() == mode.lower(), f"journal_mode {mode} refused: {got}"
    rng = random.Random(seed)
    t0 = time.time()
    for _ in range(txns):
        con.execute("BEGIN")
        for _ in range(4):
            con.execute("UPDATE t SET v=?, k=? WHERE id=?",
                        (rng.randbytes(250), rng.randrange(1 << 30), rng.randrange(ROWS)))
        con.execute("INSERT INTO t(k, v) VALUES(?, ?)", (rng.randrange(1 << 30), rng.randbytes(250)))
        con.execute("COMMIT")
    secs = time.time() - t0
    con.close()
    return secs


def integrity(path, rows):
    con = sqlite3.connect(path)
    ok = con.execute("PRAGMA integrity_check").fetchone()[0]
    n = con.execute("SELECT count(*) FROM t").fetchone()[0]
    con.close()
    if ok != "ok" or n != rows:
        raise SystemExit(f"SQLite database {path} damaged: integrity_check={ok!r}, rows={n} (want {rows})")


def upper_kib(m, name):
    p = os.path.join(m.dir, "upper", name)
    return os.stat(p).st_blocks // 2 if os.path.exists(p) else 0


def settled():
    """Writes back what earlier rows left dirty, so that each row pays for its own writeback
    only (the loop device's writeback competes for the CPU with whatever runs next)."""
    os.sync()


def run_workloads(m, s, results):
    r = {}
    lower_file = m.path("dwol", "fx-0")
    # The layers, or the previous column's files, may still be on their way to the disk: the
    # loop device's writeback competes for the CPU (39 µs measured for 19 µs over io_uring).
    settled()
    r["null round trip: getxattr answered ENODATA (us)"] = s.io("nullrt", lower_file, 20000)["avg_us"]
    with open(m.path("complete"), "wb") as f:
        f.write(b"c" * 4096)
    r["open(O_WRONLY) + close of a complete file (us)"] = s.io("openclose", m.path("complete"), 20000, "WRONLY")["avg_us"]
    drop_caches()
    t0 = time.time()
    with open(m.path("first"), "r+b") as f:
        f.write(b"1")
    r["first write: 1 byte into a 1 GiB lower file (ms)"] = (time.time() - t0) * 1000
    r["upper disk use right after it (KiB)"] = upper_kib(m, "first")
    # Issue #37: what the first write leaves for the opens and writes after it.
    for name, flags, what in (("reopen", os.O_WRONLY, "O_WRONLY"), ("reopenrw", os.O_RDWR, "O_RDWR")):
        fd = os.open(m.path(name), flags)
        os.pwrite(fd, b"1", 50 * MIB)
        os.close(fd)
        settled()
        t0 = time.time()
        os.close(os.open(m.path(name), flags))
        r[f"second open({what}) + close of a 100 MiB file after a 1-byte write (ms)"] = (time.time() - t0) * 1000
        fd = os.open(m.path(name), flags)
        os.pwrite(fd, b"2", 10 * MIB)
        os.close(fd)
        r[f"upper disk use after two {what} opens with a 1-byte write each (KiB)"] = upper_kib(m, name)
    settled()
    out = s.io("pwrites", m.path("holes4k"), 4096, 5000)
    r["4 KiB pwrites into blocks not yet written, every 32 KiB, one O_WRONLY open (us)"] = out["avg_us"]
    out = s.io("pwrites", m.path("holes4k"), 4096, 5000)
    r["the same blocks written again (us)"] = out["avg_us"]
    drop_caches()
    settled()
    r[f"write-many: open + 410 B + close per 4 KiB of a {s.many >> 20} MiB file (s)"] = s.io(
        "writemany", m.path("wmany"), 4096, 410)["total_s"]
    settled()
    r["stride: 1 B per 4 KiB over 256 MiB, one open, fsync (s)"] = s.io("stride", m.path("stride"), 4096, 1)["total_s"]
    settled()
    r["fio bs=1k rw=write:3k over 256 MiB (MiB/s)"] = fio(m.path("holes"), "write:3k", "1k")[0]
    for bs in ("4k", "128k"):
        os.close(os.open(m.path(f"fio{bs}"), os.O_WRONLY))
        settled()
        r[f"fio write bs={bs} after open(O_WRONLY) + close (MiB/s)"] = fio(m.path(f"fio{bs}"), "write", bs)[0]
    for d, what in (("dwol", "4 KiB"), ("dwolbig", "256 MiB")):
        with open(m.path(d, "fx-0"), "r+b") as f:
            f.write(b"w" * 4096)
        settled()
        time.sleep(1)
        out = sh(f"{s.iobench} fxmark dwol {m.path(d)} 1 {1 if s.quick else 3}")
        r[f"DWOL on a {what} file written a second before (ops/s)"] = float(out.split("ops_s=")[1])
    db = m.path("db.sqlite")
    phases = (("SQLite: rollback-journal transactions (s)", "DELETE"), ("SQLite: WAL transactions (s)", "WAL"))
    for done, (row, mode) in enumerate(phases, 1):
        settled()
        before = answered_requests(m)
        r[row] = sqlite_phase(db, mode, s.txns, done)
        if before is not None:
            s.requests.setdefault(m.kind, {})[row] = answered_requests(m) - before
        integrity(db, ROWS + done * s.txns)
    results[m.kind] = r


def answered_requests(m):
    """How many requests a caller of a mosaicfs mount has waited for so far (`mosaicfs status
    --json`), or None for the other file systems. FORGET gets no answer, and the kernel sends
    RELEASE and RELEASEDIR in the background after close(2) has returned."""
    if not m.kind.startswith("mosaicfs"):
        return None
    out = json.loads(sh(f"{m.binary} status {m.mnt} --json"))
    unwaited = ("FORGET", "BATCH_FORGET", "RELEASE", "RELEASEDIR")
    return sum(v["count"] for op, v in out["requests"].items() if op not in unwaited)


def remount_check(m, s):
    """After an unmount and a new mount of the same layers, the database is whole."""
    integrity(m.path("db.sqlite"), ROWS + 2 * s.txns)


LOWER_IS_BETTER = ("(s)", "(us)", "(ms)", "(KiB)")


def main():
    ap = arguments("/var/tmp/mosaicfs-bench-sustained")
    ap.add_argument("--fs", choices=["ext4", "xfs", "btrfs"], default="ext4")
    a = ap.parse_args()
    with KernelUring(a.uring), FreshFs(a.root, a.fs) as root:
        s = Setup(root, a.quick)
        s.prepare()
        results = {}
        kinds = [("mosaicfs", "")] + [(f"mosaicfs,{x}", "," + x) for x in a.also] + \
            [(k, "") for k in FILESYSTEMS if k != "mosaicfs"]
        for kind, extra in kinds:
            t0 = time.time()
            with Mount(s, kind, os.path.abspath(a.mosaicfs), extra) as m:
                run_workloads(m, s, results)
                m.remount()
                remount_check(m, s)
            print(f"# {kind}: {time.time() - t0:.0f} s", file=sys.stderr)
        report(a, s, kinds, results)


def report(a, s, kinds, results):
    cols = [k for k, _ in kinds]
    print(f"\nSustained I/O after copy-up{' (quick)' if s.quick else ''}, "
          f"{time.strftime('%Y-%m-%d', time.gmtime())}, {os.cpu_count()} cores, {os.uname().release}, "
          f"layers on a fresh {a.fs} (loop){', kernel FUSE over io_uring on' if a.uring else ''}\n")
    print("| workload | " + " | ".join(cols) + " | mosaicfs / overlayfs | mosaicfs / fuse-overlayfs |")
    print("|" + "---|" * (len(cols) + 3))
    fmt = lambda v: f"{v:.3g}" if v < 1000 else f"{v:,.0f}"
    for w in results["mosaicfs"]:
        m, o, f = results["mosaicfs"][w], results["overlay"][w], results["fuse-overlayfs"][w]
        better = (lambda x, y: y / x if x else float("inf")) if w.endswith(LOWER_IS_BETTER) else (lambda x, y: x / y)
        print(f"| {w} | " + " | ".join(fmt(results[c][w]) for c in cols) +
              f" | {better(m, o):.2f}x | {better(m, f):.2f}x |")
    print("\nRatios are 'times better than the peer' (for times and sizes, peer / mosaicfs).")
    rt = results["mosaicfs"]["null round trip: getxattr answered ENODATA (us)"]
    wm = [w for w in results["mosaicfs"] if w.startswith("write-many")][0]
    ops = s.many // 4096
    print(f"Floors on mosaicfs (requests x its round trip of {rt:.1f} us): write-many, one OPEN per "
          f"iteration: {ops * rt / 1e6:.2f} s (measured {results['mosaicfs'][wm]:.2f} s); stride, one WRITE "
          f"per 4 KiB: {s.size // 4096 * rt / 1e6:.2f} s; fio 4 KiB writes through the daemon: "
          f"{4096 / rt / 1.048576:.0f} MiB/s.")
    for row, n in s.requests.get("mosaicfs", {}).items():
        kernel = results["overlay"][row]
        per_txn = n / s.txns
        print(f"{row.split(' (')[0]}: {per_txn:.1f} requests per transaction (counted by `mosaicfs status`); "
              f"floor = kernel overlayfs' time + requests x round trip = {kernel:.2f} + "
              f"{n * rt / 1e6:.2f} = {kernel + n * rt / 1e6:.2f} s (measured {results['mosaicfs'][row]:.2f} s).")


if __name__ == "__main__":
    main()
