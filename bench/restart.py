#!/usr/bin/env python3
"""A mount that outlives its daemon (issue #57): what kill -9 of the daemon does to each FUSE
peer's mount, how long mosaicfs' mount goes unserved while its holder starts the next daemon
(and during `mosaicfs upgrade`), and what surviving costs (mosaicfs with the default
`restart=auto` beside `restart=off`). Rootless, as Podman mounts them (user nobody in
`unshare -Urm`: no passthrough, so every mosaicfs mount here survives its daemon by default).

Rows:
  after kill -9       a stat of a new name right after the daemon is killed: answered (with the
                      time it waited) or the error (every peer but mosaicfs: ENOTCONN)
  kill window (ms)    kill -9 to the answer of a stat of a new name, median and max of KILLS
                      (each daemon killed after 2.2 s of service)
  upgrade (ms)        `mosaicfs upgrade`: the time it reports (the request to the new daemon's
                      first answer) and the longest stat a concurrent loop waited meanwhile
  pending (ms)        the kill window with N copy-after-write blocks left pending by a writer
                      that holds its file open (`caw_workers=0`, `copy_after_write=always`): the
                      next daemon writes them into the file before it serves
  cost rows           untar of 3,000 files (s), 2,000 small files made (s), 5,000 random
                      4 KiB overwrites of a 64 MiB lower file (us each), a 1-byte write into an
                      untouched 256 MiB lower file (ms, cold cache), a new 256 MiB file written
                      in 1 MiB writes (ms)

Usage: bench/restart.py [--rounds N] [--kills K] [--root DIR]   (as root)
"""

import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

from suite import (FO2, main_rootless, make_tree_tar, overwrites, peer_arguments, sh, small_files,
                   timed, umount, write_random)

KINDS = ["fuse-overlayfs", "fuse-overlayfs-2.0", "mosaicfs", "mosaicfs-restart-off"]


def prepare(root):
    lower = os.path.join(root, "lower")
    if not os.path.exists(os.path.join(lower, ".ready")):
        os.makedirs(lower, exist_ok=True)
        write_random(os.path.join(lower, "image"), 64 << 20)
        write_random(os.path.join(lower, "big"), 256 << 20)
        make_tree_tar(os.path.join(root, "tree.tar"), 3000)
        open(os.path.join(lower, ".ready"), "w").close()
    return lower


def mount(kind, binary, lower, d):
    for sub in ["upper", "work", "mnt"]:
        os.makedirs(os.path.join(d, sub), exist_ok=True)
    o = f"lowerdir={lower},upperdir={d}/upper,workdir={d}/work"
    sh({
        "mosaicfs": f"{binary} -o {o} {d}/mnt",
        "mosaicfs-restart-off": f"{binary} -o {o},restart=off {d}/mnt",
        "fuse-overlayfs-2.0": f"{FO2} -o {o} {d}/mnt",
        "fuse-overlayfs": f"fuse-overlayfs -o {o} {d}/mnt",
    }[kind])


def daemon_pid(kind, binary, mnt):
    if kind.startswith("mosaicfs"):
        out = subprocess.run([binary, "status", mnt], capture_output=True, text=True).stdout
        line = next(l for l in out.splitlines() if l.startswith("daemon:"))
        return int(line.split("pid ")[1].split(",")[0])
    out = subprocess.run(["pgrep", "-f", "--", mnt], capture_output=True, text=True).stdout
    return int(out.split()[0])


def after_kill(kind, binary, mnt, n):
    """Kills the daemon; how long a stat of a new name then waits, or its error."""
    pid = daemon_pid(kind, binary, mnt)
    t0 = time.perf_counter()
    os.kill(pid, 9)
    try:
        os.stat(os.path.join(mnt, f"new-{n}"))
    except FileNotFoundError:
        return time.perf_counter() - t0
    except OSError as e:
        return e.strerror
    return time.perf_counter() - t0


def daemon_from_proc(mnt):
    """The daemon's pid, from /proc: starting `mosaicfs status` would close this process's
    descriptors at the child's exec, and that close fills the file's pending blocks."""
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            args = open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")
            zombie = ") Z " in open(f"/proc/{p}/stat").read()
        except OSError:
            continue
        if args[0] != b"mosaicfs-holder" and mnt.encode() in args and not zombie:
            return int(p)
    raise RuntimeError(f"no daemon serves {mnt}")


def pending_window(binary, lower, root, blocks):
    """kill -9 with `blocks` blocks pending to the answer of a stat of a new name (ms)."""
    d = os.path.join(root, "rs-pending")
    shutil.rmtree(d, ignore_errors=True)
    for sub in ["upper", "work", "mnt"]:
        os.makedirs(os.path.join(d, sub))
    mnt = os.path.join(d, "mnt")
    sh(f"{binary} -o lowerdir={lower},upperdir={d}/upper,workdir={d}/work,caw_workers=0,"
       f"copy_after_write=always,complete_after=0 {mnt}")
    fd = os.open(os.path.join(mnt, "big"), os.O_RDWR)
    for i in range(blocks):
        os.pwrite(fd, b"x", i * 16384 + 7)
    time.sleep(2.2)
    pid = daemon_from_proc(mnt)
    t0 = time.perf_counter()
    os.kill(pid, 9)
    try:
        os.stat(os.path.join(mnt, "new"))
    except FileNotFoundError:
        pass
    took = (time.perf_counter() - t0) * 1000
    assert os.pread(fd, 1, (blocks - 1) * 16384 + 7) == b"x", "a pending write was lost"
    os.close(fd)
    umount(mnt)
    shutil.rmtree(d, ignore_errors=True)
    return took


PENDING = [1, 1000, 16000]


def upgrade(binary, mnt):
    """`mosaicfs upgrade` with a stat loop beside it: (reported ms, longest stat in ms)."""
    longest, stop = [0.0], threading.Event()

    def loop():
        i = 0
        while not stop.is_set():
            t = time.perf_counter()
            try:
                os.stat(os.path.join(mnt, f"u-{i}"))
            except FileNotFoundError:
                pass
            longest[0] = max(longest[0], time.perf_counter() - t)
            i += 1
    th = threading.Thread(target=loop)
    th.start()
    time.sleep(0.05)
    out = subprocess.run([binary, "upgrade", mnt], capture_output=True, text=True, check=True)
    time.sleep(0.05)
    stop.set()
    th.join()
    reported = float(out.stdout.split(" in ")[1].split(" ms")[0])
    return reported, longest[0] * 1000


def costs(mnt, root, rnd):
    out = {}
    out["untar (s)"] = timed(lambda: sh(f"tar -xf {root}/tree.tar -C {mnt}"))
    out["small files (s)"] = small_files(os.path.join(mnt, "small"))
    out["overwrites 4 KiB (us)"] = overwrites(os.path.join(mnt, "image"), 5000, rnd)

    def first_write():
        fd = os.open(os.path.join(mnt, "big"), os.O_WRONLY)
        os.pwrite(fd, b"x", 100 << 20)
        os.close(fd)
    out["1-byte write, 256 MiB lower (ms)"] = timed(first_write) * 1000

    # The largest WRITEs: a surviving mount's are 1,016 KiB (its workers read requests through
    # pipes that must hold one whole), 1 MiB otherwise.
    def big_writes():
        chunk = b"\x5a" * (1 << 20)
        fd = os.open(os.path.join(mnt, "written"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for _ in range(256):
            os.write(fd, chunk)
        os.close(fd)
    out["256 MiB in 1 MiB writes (ms)"] = timed(big_writes) * 1000
    return out


COST_ROWS = ["untar (s)", "small files (s)", "overwrites 4 KiB (us)",
             "1-byte write, 256 MiB lower (ms)", "256 MiB in 1 MiB writes (ms)"]


def run(a, root):
    lower = prepare(root)
    kinds = [k for k in KINDS if k != "fuse-overlayfs-2.0" or os.access(FO2, os.X_OK)]
    cost = {k: {r: [] for r in COST_ROWS} for k in kinds if k.startswith("mosaicfs")}
    killed = {}
    for rnd in range(a.rounds):
        for kind in kinds:
            d = os.path.join(root, f"rs-{kind}")
            shutil.rmtree(d, ignore_errors=True)
            mount(kind, a.mosaicfs, lower, d)
            mnt = os.path.join(d, "mnt")
            if kind in cost:
                for row, v in costs(mnt, root, rnd).items():
                    cost[kind][row].append(v)
            if rnd == 0:
                killed[kind] = after_kill(kind, a.mosaicfs, mnt, 0)
            umount(mnt)
            if isinstance(killed.get(kind), str):
                subprocess.run(["umount", "-l", mnt], capture_output=True)
            shutil.rmtree(d, ignore_errors=True)
        print(f"# round {rnd + 1} done", file=sys.stderr)
    d = os.path.join(root, "rs-window")
    shutil.rmtree(d, ignore_errors=True)
    mount("mosaicfs", a.mosaicfs, lower, d)
    mnt = os.path.join(d, "mnt")
    windows = []
    for n in range(1, a.kills + 1):
        # A daemon killed within 2 s of its start is replaced after a 5 ms pause (a holder never
        # spins on a daemon killed at once): the kills here find daemons serving for longer.
        time.sleep(2.2)
        windows.append(after_kill("mosaicfs", a.mosaicfs, mnt, n) * 1000)
    upgrades = [upgrade(a.mosaicfs, mnt) for _ in range(a.kills)]
    umount(mnt)
    shutil.rmtree(d, ignore_errors=True)
    pending = {n: statistics.median(pending_window(a.mosaicfs, lower, root, n)
                                    for _ in range(3)) for n in PENDING}

    print(f"\nA mount that outlives its daemon, {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} "
          f"UTC, {os.cpu_count()} cores, {os.uname().release}, rootless (user nobody, "
          f"unshare -Urm), layers on a fresh ext4 (loop)\n")
    print("| after kill -9 of the daemon | " + " | ".join(kinds) + " |")
    print("|" + "---|" * (len(kinds) + 1))
    cells = [f"answered after {v * 1000:.1f} ms" if isinstance(v, float) else v
             for v in (killed[k] for k in kinds)]
    print("| a stat of a new name | " + " | ".join(cells) + " |")
    print(f"\nmosaicfs, {a.kills} kills in a row: kill -9 to the answer of a stat of a new name "
          f"median {statistics.median(windows):.1f} ms, max {max(windows):.1f} ms. "
          f"{a.kills} upgrades (`mosaicfs upgrade`): reported median "
          f"{statistics.median(u[0] for u in upgrades):.1f} ms (max "
          f"{max(u[0] for u in upgrades):.1f}); the longest stat of a loop beside them: median "
          f"{statistics.median(u[1] for u in upgrades):.1f} ms, max "
          f"{max(u[1] for u in upgrades):.1f} ms.\n")
    print("The kill window with copy-after-write blocks left pending (the next daemon writes "
          "them first), median of 3: " + ", ".join(f"{n:,} blocks {ms:.1f} ms"
                                                   for n, ms in pending.items()) + ".\n")
    print(f"What surviving costs, median of {a.rounds} interleaved rounds:\n")
    print("| workload | mosaicfs (restart=auto) | restart=off | restart=off / auto |")
    print("|---|---|---|---|")
    for row in COST_ROWS:
        on = statistics.median(cost["mosaicfs"][row])
        off = statistics.median(cost["mosaicfs-restart-off"][row])
        print(f"| {row} | {on:,.3g} | {off:,.3g} | {off / on:.2f}x |")
    print("\nLast column above 1: the surviving mount is faster.")


def main():
    ap = peer_arguments("/var/tmp/mosaicfs-bench-restart")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kills", type=int, default=10)
    a = ap.parse_args()
    main_rootless(a, __file__, run, prepare, ["--kills", str(a.kills)])


if __name__ == "__main__":
    main()
