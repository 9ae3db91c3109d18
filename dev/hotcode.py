#!/usr/bin/env python3
"""Find the functions a mounted overlay runs, and write the linker script that keeps them together.

An idle daemon's resident memory is mostly its program's text, and the kernel maps a program's
pages in blocks around each fault: 64 KiB (fault-around), or a whole large folio of the page
cache (Linux 6.18 maps those entire; a file written in one go, as by the linker or a package
manager, is cached in folios of up to 2 MiB). So a request path that calls a few hundred
functions spread over 2.4 MB of text maps nearly all of it, in every daemon. Placed next to
each other, the same functions fill a few hundred KiB (docs/PERFORMANCE.md, "Idle mounts").

This script measures which functions those are, exactly rather than by sampling: it puts a
uprobe on every function of a release build (/sys/kernel/tracing, needs root), mounts an
overlay with it in the background as mount(8) would, counts the calls made by the time the
mount is up, runs the requests a container makes (`WORKLOAD` below: lookups, listings, reads,
writes, creates, renames, removals, attribute and xattr changes; then the fsstress-style mix
for breadth) and counts again (uprobe_profile). It writes src/hot.ld, which build.rs passes to
the linker: the functions that served requests first, the most called at the front (an idle
mount's lookups and listings map that front only), then those the daemon ran only while
mounting. Code the command runs before it forks to the background is not in the daemon's
page tables (fork copies none of a read-only file mapping's). One input-section pattern per
function, its hash a wildcard, so the list keeps matching as the code changes: a function
added since lands outside the hot region, which costs memory, never correctness.

Usage: dev/hotcode.py [--binary target/release/mosaicfs] [--out src/hot.ld]
       dev/hotcode.py --check [--binary ...]   (how much of src/hot.ld still matches)
Rerun after a change that moves the request path (a new module on it, a new dependency).
"""
import argparse
import fnmatch
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

TRACING = "/sys/kernel/tracing"
GROUP = "mosaicfs_hot"
# The functions on the command's stack when it forks the daemon (daemon.rs, `mount`).
FORK_PATH = r"_ZN8mosaicfs(3sys4fork|6daemon4main|6daemon5mount)17h"
# Per CPU, for the calls made while mounting (some 100,000 events).
MOUNT_TRACE_KB = 65536
# --check fails below this share of patterns naming a function of the binary.
CHECK_MATCHING = 0.8

# What a container's first minute does to its root file system, through the mount.
WORKLOAD = r"""
set -e
cd "$1"
ls -la etc usr/lib >/dev/null
stat etc/f1 >/dev/null
cat etc/f1 etc/f2 >/dev/null
find . -xdev >/dev/null
du -s . >/dev/null
echo more >> etc/f3
echo new > etc/new
truncate -s 100000 etc/big
dd if=/dev/zero of=etc/big bs=4k seek=7 count=1 conv=notrunc status=none
cat etc/big >/dev/null
sync etc/big
mkdir -p var/run/a/b
touch var/run/a/b/c
ln -s ../etc/f1 var/link
readlink var/link >/dev/null
ln etc/new etc/hard
mv etc/f4 etc/f4.moved
mv var/run/a var/run/b
rm etc/f5
rm -r var/run/b
rmdir usr/lib/empty
chmod 600 etc/f6
chown 1:1 etc/f7
touch -d @1 etc/f8
setfattr -n user.k -v v etc/f9
getfattr -d etc/f9 >/dev/null
setfattr -x user.k etc/f9
mkfifo var/fifo
rm var/fifo
mknod var/null c 1 3
python3 -c 'import os; os.write(os.open("etc", os.O_TMPFILE | os.O_WRONLY), b"x")'
cp -a etc etc.copy
rm -rf etc.copy
df . >/dev/null
stat -f . >/dev/null
# The workers the workload added let go again once quiet (`WorkerPool::shrink`).
sleep 1
"""

# What an idle mount also does, counted with its first listing: a big directory walked, then
# forgotten when the kernel reclaims its inodes (FORGET, the records of forgotten nodes, a
# lookup by record). Linked beside the mount's own code, the walk and the forgetting map
# little more of the program than the mount did.
FORGETTING = r"""
set -e
cd "$1"
ls -l usr/share/many >/dev/null
sync
echo 2 > /proc/sys/vm/drop_caches
stat usr/share/many/f7 >/dev/null
"""


def sh(cmd, **kw):
    return subprocess.run(cmd, shell=True, check=True, text=True, capture_output=True, **kw).stdout


def functions(binary):
    """(name, file offset) of each function of the binary's code, from its symbol table."""
    load = None
    for line in sh(f"readelf -lW {binary}").splitlines():
        f = line.split()
        if f and f[0] == "LOAD" and "E" in f[6:-1]:
            load = (int(f[1], 16), int(f[2], 16))
    if load is None:
        sys.exit(f"{binary}: no executable segment")
    offset, vaddr = load
    out = []
    for line in sh(f"nm -S --defined-only {binary}").splitlines():
        f = line.split()
        if len(f) == 4 and f[2] in "tT" and int(f[1], 16) > 0:
            out.append((f[3], int(f[0], 16) - vaddr + offset))
    return out


def tracefs_command(path, line, missing_ok=False):
    """One command to a tracefs control file, in a write of its own."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        os.write(fd, (line + "\n").encode())
    except OSError as e:
        if not missing_ok:
            raise OSError(e.errno, f"{path}: '{line}': {e.strerror}") from None
    finally:
        os.close(fd)


def write(path, value):
    with open(path, "w") as f:
        f.write(value)


def hit_counts(binary):
    """How often each probe of ours fired so far, by function index."""
    hits = {}
    for line in open(f"{TRACING}/uprobe_profile"):
        f = line.split()
        # "  PATH  EVENT  HITS", the event without its group.
        if len(f) == 3 and f[0] == binary and re.fullmatch(r"f\d+", f[1]):
            hits[int(f[1][1:])] = int(f[2])
    return hits


def pattern(symbol):
    """The input-section pattern for a function: its hash a wildcard (legacy Rust mangling),
    and the `.llvm.N` that ThinLTO appends to names it makes visible across units; the section
    may be `.text.unlikely.NAME` (cold functions) as well as `.text.NAME`."""
    name = re.sub(r"17h[0-9a-f]{16}E(\.llvm\.\d+)?$", "17h*", symbol)
    return ".text*." + re.sub(r"\.llvm\.\d+$", "*", name)


def profile(binary, fsstress, funcs):
    """The functions the daemon ran while mounting (traced, by thread: the command's own
    thread only runs until it has forked the daemon); hit counts once the mount is up, after
    its first listing and after the workload; and the functions whose first instruction
    uprobes refuse (a `lock` prefix, for one)."""
    t = tempfile.mkdtemp(prefix="mosaicfs-hot-")
    for d in ("l/etc", "l/usr/lib/empty", "u", "w", "m"):
        os.makedirs(f"{t}/{d}")
    for i in range(1, 30):
        with open(f"{t}/l/etc/f{i}", "w") as f:
            f.write(f"file {i}\n")
    os.makedirs(f"{t}/l/usr/share/many")
    for i in range(3000):
        open(f"{t}/l/usr/share/many/f{i}", "w").close()
    os.symlink("f1", f"{t}/l/etc/link")
    mnt = f"{t}/m"
    # The client of `mosaicfs status` runs from a copy: only the daemon's calls count.
    client = f"{t}/mosaicfs-client"
    shutil.copy(binary, client)
    events = f"{TRACING}/uprobe_events"
    tracing_on = open(f"{TRACING}/tracing_on").read().strip()
    buffer_kb = open(f"{TRACING}/buffer_size_kb").read().split()[0]
    refused = []
    try:
        step = time.time()
        for i, (_, off) in enumerate(funcs):
            tracefs_command(events, f"p:{GROUP}/f{i} {binary}:0x{off:x}")
        write(f"{TRACING}/tracing_on", "0")  # counts are kept without tracing the hits
        # One by one: uprobes refuse a few instructions (ENOTSUPP); those functions stay
        # outside the list.
        for i in range(len(funcs)):
            try:
                write(f"{TRACING}/events/{GROUP}/f{i}/enable", "1")
            except OSError:
                refused.append(i)
        print(f"{len(funcs)} probes ({len(refused)} refused) in {time.time() - step:.0f} s")
        step = time.time()
        write(f"{TRACING}/buffer_size_kb", str(MOUNT_TRACE_KB))
        write(f"{TRACING}/trace", "")
        write(f"{TRACING}/tracing_on", "1")
        # Workers added by demand leave within the workload (`WorkerPool::shrink`).
        env = dict(os.environ, MOSAICFS_TEST_SHRINK_AFTER_MS="300")
        sh(f"{binary} -o lowerdir={t}/l,upperdir={t}/u,workdir={t}/w {mnt}", env=env)
        time.sleep(1)
        write(f"{TRACING}/tracing_on", "0")
        started = hit_counts(binary)
        sh(f"ls -la {mnt} {mnt}/etc", input="")
        sh(f"bash -s {mnt}", input=FORGETTING)
        time.sleep(0.5)
        listed = hit_counts(binary)
        calls = [
            (int(m.group(1)), int(m.group(2)))
            for m in re.finditer(r"-(\d+)\s+\[\d+\][^\n]*?: f(\d+): ", open(f"{TRACING}/trace").read())
        ]
        overrun = sum(
            int(re.search(r"^overrun: (\d+)", open(f"{d}/stats").read(), re.M).group(1))
            for d in glob.glob(f"{TRACING}/per_cpu/cpu*")
        )
        if overrun:
            sys.exit(f"the trace of the mount lost {overrun} calls: raise MOUNT_TRACE_KB")
        command = calls[0][0] if calls else None
        in_daemon = {i for tid, i in calls if tid != command}
        write(f"{TRACING}/trace", "")
        sh(f"bash -s {mnt}", input=WORKLOAD)
        if os.path.exists(fsstress):
            os.makedirs(f"{mnt}/stress")
            sh(f"{fsstress} -d {mnt}/stress -p 2 -n 300")
        sh(f"{client} status {mnt}")
        time.sleep(1)
        ran = hit_counts(binary)
        print(f"mount and workload in {time.time() - step:.0f} s")
        return in_daemon, started, listed, ran, refused
    finally:
        write(f"{TRACING}/tracing_on", tracing_on)
        write(f"{TRACING}/buffer_size_kb", buffer_kb)
        subprocess.run(["umount", mnt])
        if os.path.exists(f"{TRACING}/events/{GROUP}"):
            write(f"{TRACING}/events/{GROUP}/enable", "0")
        others = [line for line in open(events) if not line.startswith(f"p:{GROUP}/")]
        if not others:  # removing all at once: one by one takes minutes
            os.close(os.open(events, os.O_WRONLY | os.O_TRUNC))
        for i in range(len(funcs)) if others else ():
            tracefs_command(events, f"-:{GROUP}/f{i}", missing_ok=True)
        shutil.rmtree(t, ignore_errors=True)


def check(binary, script):
    """Fail when src/hot.ld has gone stale: fewer than CHECK_MATCHING of its patterns name a
    function of the binary, or the binary has no hot region."""
    patterns = [m.group(1) for m in re.finditer(r"\*\(\.text\*\.(\S+)\)", open(script).read())]
    names = [name for name, _ in functions(binary)]
    matching = 0
    for p in patterns:
        rx = re.compile(fnmatch.translate(p))
        matching += any(rx.match(n) for n in names)
    share = matching / max(len(patterns), 1)
    sections = sh(f"readelf -SW {binary}")
    print(f"{script}: {matching} of {len(patterns)} patterns name a function of {binary}")
    if ".text.hot" not in sections:
        sys.exit(f"{binary} has no .text.hot section: was it linked without {script} (build.rs)?")
    if share < CHECK_MATCHING:
        sys.exit(
            f"{script} is stale (under {CHECK_MATCHING:.0%} of its patterns match): "
            f"run dev/hotcode.py as root on a release build and commit the new list"
        )


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--binary", default=os.path.join(here, "..", "target", "release", "mosaicfs"))
    ap.add_argument("--fsstress", default=None)
    ap.add_argument("--out", default=os.path.join(here, "..", "src", "hot.ld"))
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    binary = os.path.realpath(args.binary)
    if args.check:
        return check(binary, args.out)
    fsstress = args.fsstress or os.path.join(os.path.dirname(binary), "mosaicfs-fsstress")
    funcs = functions(binary)
    in_daemon, started, listed, ran, refused = profile(binary, fsstress, funcs)
    by_address = sorted(range(len(funcs)), key=lambda i: funcs[i][1])
    # What an idle mount has run: the daemon's start, a first listing, a walk forgotten.
    idle = [i for i in by_address if i in in_daemon or listed.get(i, 0) > started.get(i, 0)]
    # The daemon also runs what the command had entered before it forked: it returns there.
    idle += [i for i in by_address if re.match(FORK_PATH, funcs[i][0]) and i not in idle]
    in_idle = set(idle)
    # Then the other requests, the most called first; those probes refused are unknown, and
    # small: kept here.
    busy = [i for i in by_address if ran.get(i, 0) > listed.get(i, 0) and i not in in_idle]
    busy.sort(key=lambda i: listed.get(i, 0) - ran[i])
    busy += [i for i in refused if i not in in_idle]
    # What only the command ran before it forked the daemon stays out (counted for the
    # report): the daemon's page tables hold none of it, and a large folio of it beside the
    # requests' would be mapped.
    command = [
        i
        for i in by_address
        if started.get(i, 0) > 0 and i not in in_daemon and i not in in_idle
        and ran.get(i, 0) == started[i]
    ]
    seen = set()
    lines = []
    for title, group in (("an idle mount", idle), ("requests, the most called first", busy)):
        lines.append(f"    /* {title}: {len(group)} functions */")
        for i in group:
            p = pattern(funcs[i][0])
            if p not in seen:
                seen.add(p)
                lines.append(f"    *({p})")
    with open(args.out, "w") as f:
        f.write(
            "/* Generated by dev/hotcode.py: the functions a mounted overlay ran, kept together\n"
            "   so that an idle daemon maps few pages of its program (docs/PERFORMANCE.md). */\n"
            "SECTIONS\n{\n  .text.hot :\n  {\n" + "\n".join(lines) + "\n  }\n}\nINSERT BEFORE .text;\n"
        )
    print(
        f"of {len(funcs)} functions, an idle mount ran {len(idle)}, requests {len(busy)} more, "
        f"the command only {len(command)} (left out); {len(seen)} patterns in {args.out}"
    )


if __name__ == "__main__":
    main()
