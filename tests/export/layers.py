#!/usr/bin/env python3
"""Applies OCI image layer tars to a model of a tree and compares trees: the checker of
`mosaicfs export` (tests/tools.rs, tests/podman/run.sh). Written from the OCI image spec's
rules for layers (whiteouts `.wh.NAME`, opaque markers `.wh..wh..opq`, hard links), with
Python's own tar reader, so that it shares nothing with the writer it checks.

  layers.py compare-dir DIR TAR...        TARs applied in order to an empty tree == DIR
  layers.py compare BASE_TAR TAR_A TAR_B  BASE+A == BASE+B
  layers.py diff-covered TAR PODMAN_DIFF  every path `podman diff` lists is in TAR

A tree model maps a path ('a/b') to (type, mode, uid, gid, mtime, content digest or link
target, xattrs) and hard link groups. Exit status 1 with the differences listed.
"""
import hashlib
import os
import stat
import sys
import tarfile

XATTRS_PODMAN = ("user.", "security.capability")


def digest_stream(f):
    h = hashlib.sha256()
    while True:
        b = f.read(1 << 20)
        if not b:
            return h.hexdigest()
        h.update(b)


class Tree:
    def __init__(self):
        self.entries = {}  # path -> dict
        self.group = {}  # path -> group id (hard links share one)
        self.next_group = 0

    def new_group(self):
        self.next_group += 1
        return self.next_group

    def remove(self, path):
        for p in [p for p in self.entries if p == path or p.startswith(path + "/")]:
            del self.entries[p]
            self.group.pop(p, None)

    def apply(self, tar_path):
        """The OCI rules: in each directory, an opaque marker removes what lower layers had
        there; `.wh.NAME` removes NAME; anything else replaces what was at its path."""
        added = set()
        with tarfile.open(tar_path) as t:
            members = t.getmembers()
            for m in members:
                name = m.name.rstrip("/")
                if name.startswith("./"):
                    name = name[2:]
                d, base = os.path.split(name)
                if base == ".wh..wh..opq":
                    for p in [p for p in self.entries if os.path.dirname(p) == d and p not in added]:
                        self.remove(p)
                    continue
                if base.startswith(".wh."):
                    self.remove(os.path.join(d, base[4:]))
                    continue
                if name in ("", "."):
                    continue
                xattrs = {
                    k[len("SCHILY.xattr."):]: v
                    for k, v in m.pax_headers.items()
                    if k.startswith("SCHILY.xattr.")
                }
                if m.islnk():
                    target = m.linkname.rstrip("/")
                    if target.startswith("./"):
                        target = target[2:]
                    if target not in self.entries:
                        raise SystemExit(f"{tar_path}: hard link {name} to missing {target}")
                    if name != target:
                        self.remove(name)
                    self.entries[name] = dict(self.entries[target])
                    self.group[name] = self.group[target]
                    added.add(name)
                    continue
                if m.isdir() and name in self.entries and self.entries[name]["type"] == "dir":
                    pass  # a directory replaces only the directory's own attributes
                else:
                    self.remove(name)
                e = {
                    "type": "dir" if m.isdir() else "file" if m.isreg() else "symlink" if m.issym()
                    else "chr" if m.ischr() else "blk" if m.isblk() else "fifo" if m.isfifo()
                    else m.type,
                    "mode": m.mode & 0o7777,
                    "uid": m.uid,
                    "gid": m.gid,
                    "mtime": int(m.mtime),
                    "xattrs": xattrs,
                }
                if m.isreg():
                    e["size"] = m.size
                    e["data"] = digest_stream(t.extractfile(m))
                elif m.issym():
                    e["data"] = m.linkname
                elif m.ischr() or m.isblk():
                    e["data"] = (m.devmajor, m.devminor)
                self.entries[name] = e
                self.group[name] = self.new_group()
                added.add(name)
        return self

    @staticmethod
    def of_dir(root):
        """The model of a directory on disk (a live mount)."""
        tree = Tree()
        inodes = {}
        for dirpath, dirnames, filenames in os.walk(root):
            for n in sorted(dirnames + filenames):
                full = os.path.join(dirpath, n)
                path = os.path.relpath(full, root)
                st = os.lstat(full)
                kind = (
                    "dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode)
                    else "symlink" if stat.S_ISLNK(st.st_mode) else "chr" if stat.S_ISCHR(st.st_mode)
                    else "blk" if stat.S_ISBLK(st.st_mode) else "fifo" if stat.S_ISFIFO(st.st_mode)
                    else "socket"
                )
                if kind == "socket":
                    continue
                try:
                    names = os.listxattr(full, follow_symlinks=False)
                except OSError:
                    names = []
                xattrs = {}
                for x in names:
                    try:
                        xattrs[x] = os.getxattr(full, x, follow_symlinks=False).decode(
                            "utf-8", "surrogateescape")
                    except OSError:
                        pass
                e = {
                    "type": kind,
                    "mode": stat.S_IMODE(st.st_mode),
                    "uid": st.st_uid,
                    "gid": st.st_gid,
                    "mtime": int(st.st_mtime),
                    "xattrs": xattrs,
                }
                if kind == "file":
                    e["size"] = st.st_size
                    with open(full, "rb") as f:
                        e["data"] = digest_stream(f)
                elif kind == "symlink":
                    e["data"] = os.readlink(full)
                elif kind in ("chr", "blk"):
                    e["data"] = (os.major(st.st_rdev), os.minor(st.st_rdev))
                tree.entries[path] = e
                # One inode number, one file: an overlay's numbers are unique, and a link
                # count cached by the kernel may lag behind a hard link made below it.
                if kind != "dir":
                    tree.group[path] = inodes.setdefault(st.st_ino, tree.new_group())
                else:
                    tree.group[path] = tree.new_group()
        return tree

    def copy(self):
        t = Tree()
        t.entries = {k: dict(v) for k, v in self.entries.items()}
        t.group = dict(self.group)
        t.next_group = self.next_group
        return t

    def links(self, path):
        g = self.group.get(path)
        return sorted(p for p, h in self.group.items() if h == g)


def normalise_xattrs(tree, prefixes):
    for e in tree.entries.values():
        e["xattrs"] = {k: v for k, v in e["xattrs"].items() if k.startswith(prefixes)}


def differences(a, b, name_a, name_b):
    out = []
    for p in sorted(set(a.entries) | set(b.entries)):
        ea, eb = a.entries.get(p), b.entries.get(p)
        if ea is None or eb is None:
            out.append(f"/{p}: only in {name_a if eb is None else name_b}")
            continue
        for k in sorted(set(ea) | set(eb)):
            if ea.get(k) != eb.get(k):
                out.append(f"/{p}: {k} {ea.get(k)!r} in {name_a}, {eb.get(k)!r} in {name_b}")
        if ea["type"] != "dir" and a.links(p) != b.links(p):
            out.append(f"/{p}: hard links {a.links(p)} in {name_a}, {b.links(p)} in {name_b}")
    return out


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "compare-dir":
        want = Tree.of_dir(args[0])
        got = Tree()
        for t in args[1:]:
            got.apply(t)
        diffs = differences(want, got, "the directory", "the layers")
    elif cmd == "compare":
        base = Tree().apply(args[0])
        a = base.copy().apply(args[1])
        b = base.copy().apply(args[2])
        normalise_xattrs(a, XATTRS_PODMAN)
        normalise_xattrs(b, XATTRS_PODMAN)
        diffs = differences(a, b, args[1], args[2])
    elif cmd == "diff-covered":
        with tarfile.open(args[0]) as t:
            names = {m.name.rstrip("/") for m in t.getmembers()}
        diffs = []
        for line in open(args[1]):
            kind, path = line.split(maxsplit=1)
            path = path.strip().lstrip("/")
            d, base = os.path.split(path)
            whiteout = os.path.join(d, ".wh." + base)
            covered = path in names or whiteout in names or any(
                path.startswith(p + "/") and os.path.join(p, ".wh..wh..opq") in names
                for p in names)
            if kind == "D" and path in names:
                covered = False
            if not covered:
                diffs.append(f"podman diff says {kind} /{path}; the export has no entry for it")
    else:
        raise SystemExit(__doc__)
    for d in diffs:
        print(d)
    if diffs:
        print(f"{len(diffs)} differences")
    sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
