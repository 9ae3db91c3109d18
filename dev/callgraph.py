#!/usr/bin/env python3
"""The calls between the request files of the overlay core: for each file that holds an
`impl Overlay` block, which other such files' methods it calls (`self.method(`), by file.
docs/ARCHITECTURE.md ("Calls between the request files") shows its output; run it again after
moving a method. Each file's top comment says which of the others it may call ("May call:");
`--check` fails when a file calls one it does not name there (make test runs it).
Usage: dev/callgraph.py [--files | --cycles | --check]"""
import collections
import pathlib
import re
import sys

SRC = pathlib.Path(__file__).resolve().parent.parent / "src"
FILES = ["dir", "namei", "by_number", "metacopy", "copy_up", "attr", "fileattr", "io", "passthrough",
         "readdir", "completion", "overlay", "upper_meta", "sources"]


def path(name):
    return SRC / f"{name}.rs" if name == "overlay" else SRC / "overlay" / f"{name}.rs"


def code(name):
    text = path(name).read_text()
    return text.split("#[cfg(test)]")[0]


def main():
    owner = {}
    for f in FILES:
        for block in re.finditer(r"impl Overlay \{(.*?)\n\}\n", code(f), re.S):
            for fn in re.finditer(r"\n    (?:pub(?:\(\w+\))? )?fn (\w+)", block.group(1)):
                owner.setdefault(fn.group(1), f)
    calls = collections.defaultdict(lambda: collections.defaultdict(set))
    for f in FILES:
        for c in re.finditer(r"self\.(\w+)\(", code(f)):
            g = owner.get(c.group(1))
            if g and g != f:
                calls[f][g].add(c.group(1))
    if "--files" in sys.argv:
        for f in FILES:
            print(f"{f:11} -> {', '.join(sorted(calls[f])) or '-'}")
        return
    if "--check" not in sys.argv:
        for f in FILES:
            out = "; ".join(f"{g} ({', '.join(sorted(ms))})" for g, ms in sorted(calls[f].items()))
            print(f"{f:11} -> {out or '-'}")
    if "--check" in sys.argv:
        wrong = []
        for f in FILES:
            said = re.search(r"^//! May call[^:]*: (.*)\.$", path(f).read_text(), re.M)
            if not said:
                wrong.append(f"{path(f).relative_to(SRC.parent)}: no '//! May call ...: FILE, FILE.' line in its top comment")
                continue
            allowed = {a.strip() for a in said.group(1).split(",")}
            for g, ms in sorted(calls[f].items()):
                if g not in allowed:
                    wrong.append(f"{path(f).relative_to(SRC.parent)} calls {g}.rs ({', '.join(sorted(ms))}), which its "
                                 f"top comment does not allow: move the method down, or say why")
        if wrong:
            print("\n".join(wrong), file=sys.stderr)
            sys.exit(1)
        return
    if "--cycles" in sys.argv:
        print()
        for a in FILES:
            for b in FILES:
                if a < b and b in calls[a] and a in calls[b]:
                    print(f"{a} <-> {b}: {sorted(calls[a][b])} / {sorted(calls[b][a])}")


main()
