#!/usr/bin/env python3
"""Where the time of the metadata rows goes, rootless (issue #55): for each FUSE overlay, the
requests the kernel sends for each row and the wall time per request, and for mosaicfs the
share of that time spent in the daemon. What is left once the daemon's share is taken out is
the kernel and the round trip, which no daemon can shorten: it bounds how far ahead of another
FUSE overlay any daemon can be on the same requests.

Rows as bench/peers.py runs them: untar of 3,000 files, lstat of every entry, rm -rf, and the
metadata mix (2,000 rounds of create, write 100 B, chmod, rename, stat, unlink). Each overlay
is mounted by user nobody in `unshare -Urm`, one at a time, over the same lower layer; the
requests are counted from outside by the kernel's `fuse:fuse_request_send` tracepoint (perf,
as root), and mosaicfs' daemon time per request comes from `mosaicfs status --json`.

Usage: bench/floor.py [--rounds N] [--root DIR]   (as root; needs perf)
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suite import (FO2, FreshFs, make_tree_tar, metadata_mix, mount_overlay, sh,  # noqa: E402
                   stat_walk, umount)

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = ["untar", "stat walk", "rm -rf", "metadata mix"]
FUSE_PEERS = ["fuse-overlayfs", "fuse-overlayfs-2.0", "mosaicfs"]


def daemon_us(binary, mnt):
    """Requests mosaicfs served so far and the microseconds it spent on them."""
    out = json.loads(sh(f"{binary} status {mnt} --json"))
    reqs = out["requests"]
    return sum(r["count"] for r in reqs.values()), sum(r["total_us"] for r in reqs.values())


def inside(a):
    """One peer's rows, in the user namespace: prints one JSON line per row."""
    root, kind = a.root, a.kind
    d = os.path.join(root, f"run-{kind}")
    shutil.rmtree(d, ignore_errors=True)
    mount_overlay(kind, a.mosaicfs, os.path.join(root, "lower"), d, rootless=True)
    mnt = os.path.join(d, "mnt")
    p = lambda *n: os.path.join(mnt, *n)

    work = {
        "untar": lambda: sh(f"tar -xf {root}/tree.tar -C {mnt}"),
        "stat walk": lambda: stat_walk(p("src")),
        "rm -rf": lambda: shutil.rmtree(p("src")),
        "metadata mix": lambda: metadata_mix(p("mix")),
    }
    for row in ROWS:
        os.sync()
        before = daemon_us(a.mosaicfs, mnt) if kind == "mosaicfs" else (0, 0)
        print(json.dumps({"mark": row}), flush=True)
        sys.stdin.readline()  # the recorder runs
        t0 = time.perf_counter()
        work[row]()
        took = time.perf_counter() - t0
        after = daemon_us(a.mosaicfs, mnt) if kind == "mosaicfs" else (0, 0)
        print(json.dumps({"row": row, "s": took, "daemon_requests": after[0] - before[0],
                          "daemon_us": after[1] - before[1]}), flush=True)
        sys.stdin.readline()  # the recorder stopped
    umount(mnt)
    shutil.rmtree(d, ignore_errors=True)


def one_round(a, root, kind):
    """Runs `kind` rootless, each row under its own perf recording (the workload waits for
    the recorder between rows); returns {row: (seconds, requests, daemon us, daemon requests)}."""
    data = os.path.join(root, "perf.data")
    before = os.stat("/dev/fuse").st_mode & 0o7777
    os.chmod("/dev/fuse", 0o666)
    out = {}
    try:
        sh(f"chown -R nobody:nogroup {root}")
        w = subprocess.Popen(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                              "unshare", "-Urm", "/usr/bin/python3", os.path.abspath(__file__),
                              "--inside", "--kind", kind, "--root", root, "--mosaicfs",
                              a.mosaicfs], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
        for line in w.stdout:
            msg = json.loads(line)
            if "mark" in msg:
                perf = subprocess.Popen(["perf", "record", "-q", "-a", "-e",
                                         "fuse:fuse_request_send", "-o", data],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(1)  # recording before the row starts
                w.stdin.write("go\n")
                w.stdin.flush()
            elif "row" in msg:
                perf.send_signal(2)
                perf.wait()
                events = sh(f"perf script -i {data} -F comm,event,trace 2>/dev/null")
                n = sum(1 for line in events.splitlines()
                        if line.split()[:1] in (["python3"], ["tar"]))
                out[msg["row"]] = (msg["s"], n, msg["daemon_us"], msg["daemon_requests"])
                w.stdin.write("go\n")
                w.stdin.flush()
        if w.wait():
            sys.exit(f"{kind}: the rows failed")
    finally:
        os.chmod("/dev/fuse", before)
        if os.path.exists(data):
            os.unlink(data)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--root", default="/var/tmp/mosaicfs-bench-floor")
    ap.add_argument("--mosaicfs", default=os.path.join(HERE, "..", "target", "release", "mosaicfs"))
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kind", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.mosaicfs = os.path.abspath(a.mosaicfs)
    if a.inside:
        return inside(a)
    kinds = [k for k in FUSE_PEERS if k != "fuse-overlayfs-2.0" or os.access(FO2, os.X_OK)]
    got = {k: {r: [] for r in ROWS} for k in kinds}
    with FreshFs(a.root, "ext4", 4 << 30) as root:
        os.makedirs(os.path.join(root, "lower"), exist_ok=True)
        make_tree_tar(os.path.join(root, "tree.tar"), 3000)
        for _ in range(a.rounds):
            for kind in kinds:
                for row, v in one_round(a, root, kind).items():
                    got[kind][row].append(v)
    print(f"\nRequests and their cost, {time.strftime('%Y-%m-%d', time.gmtime())}, "
          f"{os.cpu_count()} cores, {os.uname().release}, rootless (user nobody, unshare -Urm), "
          f"median of {a.rounds} round(s)\n")
    print("| row | " + " | ".join(f"{k}: s, requests, us/request" for k in kinds)
          + " | mosaicfs daemon us/request | floor us/request | most any daemon could lead "
          "fuse-overlayfs 2.0 by |")
    print("|---|" + "---|" * (len(kinds) + 3))
    for row in ROWS:
        cells, med = [], {}
        for k in kinds:
            s = statistics.median(v[0] for v in got[k][row])
            n = statistics.median(v[1] for v in got[k][row])
            med[k] = (s, n)
            cells.append(f"{s:.3f} s, {n:,.0f}, {s / n * 1e6:.1f}" if n else f"{s:.3f} s, 0, —")
        dus = statistics.median(v[2] / v[3] if v[3] else 0 for v in got["mosaicfs"][row])
        s, n = med["mosaicfs"]
        floor = s / n * 1e6 - dus if n else 0
        fo2 = med.get("fuse-overlayfs-2.0")
        lead = f"{fo2[0] / (fo2[1] * floor * 1e-6):.2f}x" if fo2 and fo2[1] and floor > 0 else "—"
        print(f"| {row} | " + " | ".join(cells) + f" | {dus:.1f} | {floor:.1f} | {lead} |")
    print("\nfloor: mosaicfs' wall time per request less its daemon time, the kernel's and the "
          "round trip's share; the last column is fuse-overlayfs 2.0's time over its requests "
          "at that floor, what a daemon that takes no time at all could reach.")


if __name__ == "__main__":
    main()
