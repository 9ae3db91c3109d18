#!/usr/bin/env python3
"""Differential test: the same random operations on kernel overlayfs and on mosaicfs, over
copies of the same two lower layers. Every operation's result (its value, or its errno) must be
the same on both, and every 100 operations the whole merged trees must match: names, types,
modes, owners, sizes, link counts, contents, symlink targets, `user.*` xattrs, and which names
are hard links of one file. Both are unmounted and mounted again every 500 operations.

Usage: tests/differential.py MOSAICFS [SEEDS] [OPS] [EXTRA_OPTIONS]
  e.g. tests/differential.py target/release/mosaicfs 1,2,3 1500 ,upper=memory
Root only. Exits 1 with the differing operation and the operations before it.

Kernel overlayfs runs with redirect_dir=on (directories from lower layers can be renamed, as on
mosaicfs) and index=on (a copied-up hard link keeps its other lower names, as on mosaicfs).
Where mosaicfs differs on purpose, the test does not look:
- a character device 0/0 made through the merged view is a device on mosaicfs (marked with
  `mosaicfs.device`, docs/FORMAT.md) and a whiteout on kernel overlayfs, which hides it, so no
  such mknod is made;
- link counts of lower hard links: kernel overlayfs counts every lower name from the first
  copy-up on, through its index; mosaicfs counts the names it has joined so far (README, "Known
  differences"), so the lower layers hold no hard links (tests/overlay.rs covers them).
Operations as users 1000 and 65534 (a forked child) check permissions too.
"""

import ctypes
import errno
import hashlib
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
import time

libc = ctypes.CDLL(None, use_errno=True)
DIRS = ["", "a", "a/b", "c", "d", "a/b/e", "x", "a/y"]
LEAVES = [f"f{i}" for i in range(14)] + ["n1", "n2", "inner", "sub"]


def check(ret):
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def build_lower(root):
    """Two lower layers with overlapping directories, files of several sizes (some with xattrs),
    symlinks (relative, and dangling), subdirectories and FIFOs."""
    r = random.Random(1234)
    for layer in ("l1", "l2"):
        base = os.path.join(root, layer)
        os.makedirs(base)
        for d in DIRS[1:6]:
            if r.random() < 0.8:
                os.makedirs(os.path.join(base, d), exist_ok=True)
        for i in range(12):
            d = os.path.join(base, r.choice(DIRS[:6]))
            if not os.path.isdir(d):
                continue
            p = os.path.join(d, f"f{i}")
            kind = r.random()
            if kind < 0.6:
                with open(p, "wb") as f:
                    f.write(os.urandom(r.choice([0, 10, 4096, 5000, 70000, 300000])))
                os.chmod(p, r.choice([0o644, 0o600, 0o755, 0o444]))
                if r.random() < 0.3:
                    os.setxattr(p, "user.k", b"v" + bytes([65 + i]))
            elif kind < 0.75:
                os.symlink(r.choice(["f1", "../f2", "a", "nowhere"]), p)
            elif kind < 0.85:
                os.mkdir(p)
                with open(os.path.join(p, "inner"), "w") as f:
                    f.write("inner " + layer)
            else:
                os.mkfifo(p)


def outcome(fn):
    try:
        return ("ok", fn())
    except OSError as e:
        return ("err", errno.errorcode.get(e.errno, e.errno))


def as_user(fn, uid):
    """`outcome(fn)` in a child process running as `uid`."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out = repr(outcome(fn))
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = repr(("exception", str(e)))
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    return eval(data.decode())  # noqa: S307 - our own child's repr


def with_fd(path, flags, fn, mode=0o640):
    fd = os.open(path, flags | os.O_NONBLOCK, mode)  # O_NONBLOCK: a FIFO does not wait
    try:
        return fn(fd)
    finally:
        os.close(fd)


def write_at(m, p, flags, off, data):
    def go(fd):
        if flags & (os.O_WRONLY | os.O_RDWR):
            if not flags & os.O_APPEND:
                os.lseek(fd, off, os.SEEK_SET)
            os.write(fd, data)
        return os.fstat(fd).st_size
    return with_fd(f"{m}/{p}", flags, go)


def read_at(m, p, off, n):
    return with_fd(f"{m}/{p}", os.O_RDONLY, lambda fd: hashlib.md5(os.pread(fd, n, off)).hexdigest())


def fallocate(m, p, mode, off, length):
    def go(fd):
        check(libc.fallocate(fd, mode, ctypes.c_long(off), ctypes.c_long(length)))
        return os.fstat(fd).st_size
    return with_fd(f"{m}/{p}", os.O_WRONLY, go)


def tmpfile_linked(m, p):
    def go(fd):
        os.write(fd, b"tmpfile")
        os.link(f"/proc/self/fd/{fd}", f"{m}/{p}")
    return with_fd(f"{m}/{os.path.dirname(p)}", os.O_TMPFILE | os.O_WRONLY, go, 0o600)


def copy_range(m, p, q):
    return with_fd(f"{m}/{p}", os.O_RDONLY, lambda a: with_fd(
        f"{m}/{q}", os.O_WRONLY, lambda b: os.copy_file_range(a, b, 10000, 100, 200)))


def renameat2(a, b, flags):
    check(libc.renameat2(-100, a.encode(), -100, b.encode(), flags))


def stat_key(s):
    """What both must agree on in a stat (a directory's size and link count are the file
    system's own; times depend on when each ran)."""
    is_dir = stat.S_ISDIR(s.st_mode)
    return (stat.S_IFMT(s.st_mode), stat.S_IMODE(s.st_mode), s.st_uid, s.st_gid,
            0 if is_dir else s.st_size, 0 if is_dir else s.st_nlink)


class Ops:
    """Random operations over a small pool of names, so they meet each other often."""

    def __init__(self, seed):
        self.rnd = random.Random(seed)

    def path(self):
        r = self.rnd
        d = r.choice(DIRS + [""] * 3)
        n = r.choice(LEAVES) if r.random() < 0.9 else r.choice(["a", "c", "d", "x"])
        return f"{d}/{n}" if d else n

    def next(self):
        """(description, function of the mount point)"""
        r, p = self.rnd, self.path()
        k = r.random()
        if k < 0.03:
            q, fl = self.path(), r.choice([1, 2])  # RENAME_NOREPLACE, RENAME_EXCHANGE
            return ("renameat2", p, q, fl), lambda m: renameat2(f"{m}/{p}", f"{m}/{q}", fl)
        if k < 0.05:
            mode = r.choice([0, 1, 3, 0x10])  # allocate, keep size, punch hole, zero range
            off, n = r.choice([0, 4096, 5000, 100000]), r.choice([1, 4096, 70000])
            return ("fallocate", p, mode, off, n), lambda m: fallocate(m, p, mode, off, n)
        if k < 0.06:
            return ("O_TMPFILE + link", p), lambda m: tmpfile_linked(m, p)
        if k < 0.07:
            q = self.path()
            return ("copy_file_range", p, q), lambda m: copy_range(m, p, q)
        if k < 0.08:
            n = r.choice(["trusted.overlay.opaque", "trusted.overlay.redirect", "user.overlay.opaque"])
            return ("setxattr", p, n), lambda m: os.setxattr(f"{m}/{p}", n, b"y")
        if k < 0.28:
            flags = r.choice([os.O_WRONLY, os.O_RDWR, os.O_WRONLY | os.O_TRUNC, os.O_WRONLY | os.O_CREAT,
                              os.O_WRONLY | os.O_CREAT | os.O_EXCL, os.O_WRONLY | os.O_APPEND,
                              os.O_RDONLY | os.O_CREAT, os.O_RDWR | os.O_CREAT | os.O_TRUNC])
            off = r.choice([0, 1, 4095, 4096, 8191, 65536, 299999, 400000])
            data = bytes([r.randrange(256)]) * r.choice([1, 100, 4096, 5000])
            names = "|".join(n for n in ("O_WRONLY", "O_RDWR", "O_CREAT", "O_EXCL", "O_TRUNC", "O_APPEND")
                             if flags & getattr(os, n)) or "O_RDONLY"
            return ("open+write", p, names, off, len(data)), lambda m: write_at(m, p, flags, off, data)
        if k < 0.36:
            off, n = r.choice([0, 4000, 65536, 299000]), r.choice([10, 5000, 100000])
            return ("read", p, off, n), lambda m: read_at(m, p, off, n)
        if k < 0.42:
            size = r.choice([0, 1, 4096, 5000, 100000, 500000])
            return ("truncate", p, size), lambda m: os.truncate(f"{m}/{p}", size)
        if k < 0.51:
            q = self.path()
            return ("rename", p, q), lambda m: os.rename(f"{m}/{p}", f"{m}/{q}")
        if k < 0.55:
            q = self.path()
            return ("link", p, q), lambda m: os.link(f"{m}/{p}", f"{m}/{q}")
        if k < 0.59:
            t = r.choice(["f1", "../a", "../../f2", "nowhere"])
            return ("symlink", t, p), lambda m: os.symlink(t, f"{m}/{p}")
        if k < 0.65:
            return ("unlink", p), lambda m: os.unlink(f"{m}/{p}")
        if k < 0.70:
            return ("rmdir", p), lambda m: os.rmdir(f"{m}/{p}")
        if k < 0.76:
            return ("mkdir", p), lambda m: os.mkdir(f"{m}/{p}", 0o750)
        if k < 0.80:
            mode = r.choice([0o600, 0o755, 0o4755, 0o1777, 0o000])
            return ("chmod", p, oct(mode)), lambda m: os.chmod(f"{m}/{p}", mode)
        if k < 0.83:
            u = r.choice([0, 1000, 65534])
            return ("lchown", p, u), lambda m: os.lchown(f"{m}/{p}", u, u)
        if k < 0.86:
            t = r.choice([0, 1000000000, 1700000000])
            return ("utime", p, t), lambda m: os.utime(f"{m}/{p}", (t, t), follow_symlinks=False)
        if k < 0.90:
            n = r.choice(["user.k", "user.j"])
            v = bytes([65 + r.randrange(20)]) * r.choice([1, 10, 300])
            return ("setxattr", p, n, len(v)), lambda m: os.setxattr(f"{m}/{p}", n, v)
        if k < 0.92:
            n = r.choice(["user.k", "user.j"])
            return ("removexattr", p, n), lambda m: os.removexattr(f"{m}/{p}", n)
        if k < 0.95:
            return ("listdir", p), lambda m: sorted(os.listdir(f"{m}/{p}"))
        if k < 0.97:
            return ("mkfifo", p), lambda m: os.mkfifo(f"{m}/{p}", 0o640)
        if k < 0.98:
            return ("readlink", p), lambda m: os.readlink(f"{m}/{p}")
        return ("lstat", p), lambda m: stat_key(os.lstat(f"{m}/{p}"))


def tree(mnt):
    """Every name under `mnt` with what both must agree on, and the hard link groups."""
    out, by_ino = {}, {}
    for dirpath, dirs, files in os.walk(mnt):
        for n in dirs + files:
            p = os.path.join(dirpath, n)
            rel = os.path.relpath(p, mnt)
            s = os.lstat(p)
            key = stat_key(s)
            body = None
            if stat.S_ISREG(s.st_mode):
                with open(p, "rb") as f:
                    body = hashlib.md5(f.read()).hexdigest()
            elif stat.S_ISLNK(s.st_mode):
                body = os.readlink(p)
            xattrs = outcome(lambda: sorted(
                (x, os.getxattr(p, x, follow_symlinks=False))
                for x in os.listxattr(p, follow_symlinks=False) if x.startswith("user.")))
            out[rel] = (key, body, xattrs)
            if not stat.S_ISDIR(s.st_mode):
                by_ino.setdefault(s.st_ino, []).append(rel)
    return out, sorted(sorted(v) for v in by_ino.values() if len(v) > 1)


class Overlay:
    def __init__(self, root, name, mosaicfs, extra):
        # Mount points three levels down, in a directory of their own: a symlink with `../..`
        # in it leads out of the mount into that directory, a different one for each.
        self.mnt = os.path.join(root, name, "x", "y", "m")
        self.upper, self.work = os.path.join(root, name, "u"), os.path.join(root, name, "w")
        for d in (self.mnt, self.upper, self.work):
            os.makedirs(d)
        self.lower = f"{root}/l1:{root}/l2"
        self.mosaicfs, self.extra, self.proc = mosaicfs, extra, None

    def mount(self):
        opts = f"lowerdir={self.lower},upperdir={self.upper},workdir={self.work}"
        if self.mosaicfs is None:
            # With index=on the kernel refuses an upper dir another overlay still uses. A mount
            # namespace made on the host while the overlay was mounted (unshare -m, a container
            # starting) holds a copy of it after our umount, until that namespace ends: wait.
            deadline = time.monotonic() + 30
            while True:
                done = subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                                       opts + ",redirect_dir=on,index=on,metacopy=off", self.mnt],
                                      capture_output=True, text=True)
                if done.returncode == 0:
                    return
                if "busy" not in done.stderr or time.monotonic() > deadline:
                    sys.exit(f"mount of kernel overlayfs at {self.mnt}: {done.stderr.strip()}")
                time.sleep(0.2)
        self.proc = subprocess.Popen([self.mosaicfs, "-f", "-o", opts + self.extra, self.mnt])
        deadline = time.monotonic() + 10
        while not os.path.ismount(self.mnt):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                sys.exit("mosaicfs did not mount")
            time.sleep(0.01)

    def unmount(self):
        # A busy machine's df or findmnt statfs-ing every mount holds it for a moment: EBUSY
        # then is not this test's business, so try again for a while.
        deadline = time.monotonic() + 10
        while os.path.ismount(self.mnt):
            done = subprocess.run(["umount", self.mnt], capture_output=True, text=True)
            if done.returncode == 0:
                break
            if "busy" not in done.stderr or time.monotonic() > deadline:
                sys.exit(f"umount {self.mnt}: {done.stderr.strip()}")
            time.sleep(0.1)
        if self.proc:
            self.proc.wait()
            self.proc = None


def run(mosaicfs, seed, nops, extra):
    root = tempfile.mkdtemp(prefix="mosaicfs-differential-", dir="/var/tmp")
    kernel, ours = Overlay(root, "kernel", None, ""), Overlay(root, "mosaicfs", mosaicfs, extra)
    build_lower(root)
    ops, user = Ops(seed), random.Random(seed + 1)
    history, failures = [], []
    try:
        kernel.mount()
        ours.mount()
        for i in range(nops):
            what, fn = ops.next()
            if user.random() < 0.2:
                uid = user.choice([1000, 65534])
                what += (f"as uid {uid}",)
                got = (as_user(lambda: fn(kernel.mnt), uid), as_user(lambda: fn(ours.mnt), uid))
            else:
                got = (outcome(lambda: fn(kernel.mnt)), outcome(lambda: fn(ours.mnt)))
            history.append(f"{i}: {what}: {got[0]}" + ("" if got[0] == got[1] else f" / mosaicfs {got[1]}"))
            if got[0] != got[1]:
                failures.append(f"operation {i} {what}: kernel overlayfs {got[0]}, mosaicfs {got[1]}")
            if i % 100 == 99 or failures:
                (tk, gk), (tm, gm) = tree(kernel.mnt), tree(ours.mnt)
                for p in sorted(set(tk) | set(tm)):
                    if tk.get(p) != tm.get(p):
                        failures.append(f"after operation {i}, {p}: kernel overlayfs {tk.get(p)}, mosaicfs {tm.get(p)}")
                if gk != gm:
                    failures.append(f"after operation {i}, hard links: kernel overlayfs {gk}, mosaicfs {gm}")
            if failures:
                print("\n".join(history[-40:]) + "\n" + "\n".join(failures))
                return False
            if i % 500 == 499:
                for o in (kernel, ours):
                    o.unmount()
                    o.mount()
        return True
    finally:
        for o in (kernel, ours):
            try:
                o.unmount()
            except subprocess.CalledProcessError as e:
                print(f"unmount of {o.mnt}: {e}")
        shutil.rmtree(root, ignore_errors=True)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    mosaicfs = os.path.abspath(sys.argv[1])
    seeds = [int(s) for s in (sys.argv[2] if len(sys.argv) > 2 else "1,2,3").split(",")]
    nops = int(sys.argv[3]) if len(sys.argv) > 3 else 1500
    extra = sys.argv[4] if len(sys.argv) > 4 else ""
    for seed in seeds:
        start = time.monotonic()
        if not run(mosaicfs, seed, nops, extra):
            sys.exit(f"differential test: seed {seed}, {nops} operations{extra}: mosaicfs differs from kernel overlayfs")
        print(f"differential test: seed {seed}, {nops} operations{extra}: same as kernel overlayfs "
              f"({time.monotonic() - start:.0f} s)")


if __name__ == "__main__":
    main()
