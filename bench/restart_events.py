#!/usr/bin/env python3
"""A partial file's writer passing through (`partial_passthrough=on`, root: pre-content events
need CAP_SYS_ADMIN) while its mount's daemon is killed (issue #57). The writer opens an
untouched 1 GiB lower file write-only and writes one byte into a new block every 2 ms; each such
write waits on a pre-content event until the daemon has filled its block. The daemon is killed
KILLS times, 2.2 s apart; the next one answers the events the last left and fills on.

Rows:
  write (ms)          the median write, and the longest write within 100 ms of each kill
                      (median and max over the kills): how long a writer passing through waits
                      across a kill
  restart=off         the same writer on a mount that ends with its daemon: what its first
                      write after the kill gets (the guardian's EIO)

Usage: bench/restart_events.py [--kills K] [--root DIR]   (as root)
"""

import argparse
import os
import shutil
import statistics
import subprocess
import threading
import time

from suite import FreshFs, sh, umount, write_random


def daemon_pid_of(binary, mnt):
    out = subprocess.run([binary, "status", mnt], capture_output=True, text=True).stdout
    line = next(l for l in out.splitlines() if l.startswith("daemon:"))
    return int(line.split("pid ")[1].split(",")[0])


def writer(mnt, stop, out):
    """Writes a byte into a new block every 2 ms until `stop`; (start time, seconds, error)."""
    fd = os.open(os.path.join(mnt, "big"), os.O_WRONLY)
    block = 0
    while not stop.is_set():
        t = time.perf_counter()
        try:
            os.pwrite(fd, b"x", block * 4096 * 61 % (1 << 30) + 5)
            out.append((t, time.perf_counter() - t, None))
        except OSError as e:
            out.append((t, time.perf_counter() - t, e.strerror))
            break
        block += 1
        time.sleep(0.002)
    try:
        os.close(fd)
    except OSError:
        pass  # restart=off: the mount ended with its daemon


def session(binary, root, lower, opts, kills):
    d = os.path.join(root, "ev")
    shutil.rmtree(d, ignore_errors=True)
    for sub in ["upper", "work", "mnt"]:
        os.makedirs(os.path.join(d, sub))
    mnt = os.path.join(d, "mnt")
    sh(f"{binary} -o lowerdir={lower},upperdir={d}/upper,workdir={d}/work,partial_passthrough=on,"
       f"complete_after=0,complete_ratio=0,copy_whole=0{opts} {mnt}")
    stop, writes, killed = threading.Event(), [], []
    th = threading.Thread(target=writer, args=(mnt, stop, writes))
    th.start()
    for _ in range(kills):
        time.sleep(2.2)
        if not th.is_alive():
            break
        pid = daemon_pid_of(binary, mnt)
        killed.append(time.perf_counter())
        os.kill(pid, 9)
    time.sleep(0.5)
    stop.set()
    th.join()
    umount(mnt)
    subprocess.run(["umount", "-l", mnt], capture_output=True)
    shutil.rmtree(d, ignore_errors=True)
    return writes, killed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default="/var/tmp/mosaicfs-bench-events")
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--mosaicfs", default=os.path.join(os.path.dirname(__file__), "..", "target",
                                                       "release", "mosaicfs"))
    a = ap.parse_args()
    binary = os.path.abspath(a.mosaicfs)
    with FreshFs(a.root, "ext4", 4 << 30) as root:
        lower = os.path.join(root, "lower")
        os.makedirs(lower)
        write_random(os.path.join(lower, "big"), 1 << 30)
        writes, killed = session(binary, root, lower, "", a.kills)
        errors = [w for w in writes if w[2]]
        near = [max((w[1] for w in writes if k - 0.1 <= w[0] <= k + 0.1), default=0) * 1000
                for k in killed]
        off, _ = session(binary, root, lower, ",restart=off", 1)
    print(f"\nA writer passing through across kills of the daemon, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, "
          f"{os.uname().release}, root, layers on a fresh ext4 (loop)\n")
    print(f"restart=auto: {len(writes):,} writes into new blocks, {len(errors)} failed; median "
          f"write {statistics.median(w[1] for w in writes) * 1000:.2f} ms; the longest write "
          f"within 100 ms of each of {len(killed)} kills: median {statistics.median(near):.1f} ms, "
          f"max {max(near):.1f} ms.")
    last = off[-1] if off else None
    print(f"restart=off: the writer's last write "
          f"{'failed: ' + last[2] if last and last[2] else 'did not fail'}.")
    if errors:
        raise SystemExit(f"writes failed across the kills: {errors[:3]}")


if __name__ == "__main__":
    main()
