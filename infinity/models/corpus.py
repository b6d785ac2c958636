"""Text every Python installation carries, for runs that must not download
anything (the main job, its test): the standard library's docstrings."""

from __future__ import annotations

import os
import re
import sysconfig

__all__ = ["stdlib_corpus"]

_DOC_STRING = re.compile(r'"""(.*?)"""', re.S)
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib2to3",
              "turtledemo", "tkinter", "ensurepip"}


def stdlib_corpus(max_bytes: int = 2 << 20) -> bytes:
    """English prose every Python installation carries: the long triple-quoted
    strings (docstrings, mostly) of the standard library's modules, in a fixed
    order, lines stripped, non-ASCII bytes replaced by '?'; at most
    ``max_bytes`` bytes. Reads files only; imports nothing."""
    root = sysconfig.get_paths()["stdlib"]
    out, n = [], 0
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS)
        for name in sorted(f for f in files if f.endswith(".py")):
            with open(os.path.join(d, name), encoding="utf-8", errors="replace") as fh:
                src = fh.read()
            for m in _DOC_STRING.finditer(src):
                doc = m.group(1)
                if len(doc) > 300 and doc.count(" ") > len(doc) / 12:  # prose, not tables or code
                    doc = "\n".join(line.strip() for line in doc.strip().splitlines())
                    out.append(doc)
                    n += len(doc) + 2
            if n >= max_bytes:
                return "\n\n".join(out).encode("ascii", errors="replace")[:max_bytes]
    if n < 4096:
        raise FileNotFoundError(f"the standard library at {root} has no docstrings to train on")
    return "\n\n".join(out).encode("ascii", errors="replace")[:max_bytes]
