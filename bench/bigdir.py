#!/usr/bin/env python3
"""Changes in a big directory: the time of one metadata change, in a lower directory of 1,000
entries and in one of 16,000, on every overlay in one run (each mounted fresh on a fresh ext4;
as root, or with --rootless as user nobody in `unshare -Urm`, kernel overlayfs with `userxattr`). An overlay whose change lists the directory (to count its subdirectories, say)
pays per entry: its column at 16,000 is many times the one at 1,000. Flat is near 1.

Each operation is timed over 200 calls in the directory, the names made by the script:
  create   open(O_CREAT) of a new file
  rename   a new file to another new name
  mkdir    a new directory
  rmdir    one made by mkdir
  unlink   a lower file (a whiteout)
  chmod    a lower file (its copy-up)

Not part of make test. Usage: bench/bigdir.py [--rootless] [--mosaicfs PATH] [--root DIR]
"""

import os
import shutil
import sys
import time

from suite import FreshFs, mount_overlay, peer_arguments, peers, print_head, run_rootless, umount

SIZES = [1_000, 16_000]
CALLS = 200


def make_lower(root):
    lower = os.path.join(root, "lower")
    for n in SIZES:
        d = os.path.join(lower, f"big{n}")
        os.makedirs(d)
        for i in range(n):
            with open(os.path.join(d, f"L{i}"), "w") as f:
                f.write("x")
    return lower


def per_call_ms(f):
    t = time.perf_counter()
    for i in range(CALLS):
        f(i)
    return (time.perf_counter() - t) / CALLS * 1000


def operations(d):
    """Each operation's milliseconds a call in directory `d` of the mount."""
    p = lambda name: os.path.join(d, name)  # noqa: E731
    for i in range(CALLS):  # the files rename moves, made beforehand
        open(p(f"r{i}"), "w").close()
    return {
        "create": per_call_ms(lambda i: open(p(f"c{i}"), "w").close()),
        "rename": per_call_ms(lambda i: os.rename(p(f"r{i}"), p(f"q{i}"))),
        "mkdir": per_call_ms(lambda i: os.mkdir(p(f"d{i}"))),
        "rmdir": per_call_ms(lambda i: os.rmdir(p(f"d{i}"))),
        "unlink": per_call_ms(lambda i: os.unlink(p(f"L{i}"))),
        "chmod": per_call_ms(lambda i: os.chmod(p(f"L{CALLS + i}"), 0o600)),
    }


def run_one(kind, binary, root, lower, rootless):
    d = os.path.join(root, kind)
    shutil.rmtree(d, ignore_errors=True)
    mount_overlay(kind, binary, lower, d, rootless)
    mnt = os.path.join(d, "mnt")
    try:
        return {n: operations(os.path.join(mnt, f"big{n}")) for n in SIZES}
    finally:
        umount(mnt)
        shutil.rmtree(d, ignore_errors=True)


def run(root, binary, rootless):
    kinds = peers()
    lower = os.path.join(root, "lower")
    results = {k: run_one(k, binary, root, lower, rootless) for k in kinds}
    small, big = SIZES
    who = "rootless (user nobody, unshare -Urm)" if rootless else "root"
    print_head("Changes in a big directory", f"{who}, ms per call ({CALLS} calls) in a lower "
               f"directory of {small:,} entries / of {big:,}, fresh ext4, each overlay mounted "
               "fresh", "operation", kinds)
    for op in results[kinds[0]][small]:
        cells = [f"{results[k][small][op]:.3f} / {results[k][big][op]:.3f}" for k in kinds]
        print(f"| {op} | " + " | ".join(cells) + " |")
    print(f"| slowest {big:,} / {small:,} | " + " | ".join(
        f"{max(results[k][big][op] / results[k][small][op] for op in results[k][small]):.1f}"
        for k in kinds) + " |")


def main():
    a = peer_arguments("/var/tmp/mosaicfs-bench-bigdir").parse_args()
    binary = os.path.abspath(a.mosaicfs)
    if a.inside:
        run(a.root, binary, True)
        return
    with FreshFs(a.root, "ext4", 4 << 30) as root:
        make_lower(root)
        if a.rootless:
            run_rootless(root, __file__, ["--inside", "--root", root, "--mosaicfs", binary])
        else:
            run(root, binary, False)


if __name__ == "__main__":
    sys.exit(main())
