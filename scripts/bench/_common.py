"""Helpers shared by the benchmarks in scripts/bench/: this process's resident
set from /proc/self/status, a child process of a bench that reports its
figures as JSON on its last line of output, and a results file written where
its folder may not exist yet.

A bench run as ``python scripts/bench/NAME.py`` has this folder first on
sys.path, so ``from _common import ...`` finds this file (and so does a child
started with the bench's own ``__file__``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS: resident now, VmHWM: its
    peak); RuntimeError naming the field when the kernel has none."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def rss_bytes(field: str = "VmHWM") -> int:
    """status_kib in bytes: peak (VmHWM) or current (VmRSS) resident set size."""
    return status_kib(field) * 1024


def run_json_child(script: str, args: list, env: dict | None = None) -> tuple[dict | None, subprocess.CompletedProcess]:
    """Runs ``python script *args`` to its end, output captured; returns (the
    JSON object on its last line of stdout, or None when it failed, the
    finished process: its returncode and stderr for the caller's message)."""
    p = subprocess.run([sys.executable, script, *args], env=env, capture_output=True, text=True, check=False)
    if p.returncode != 0:
        return None, p
    return json.loads(p.stdout.strip().splitlines()[-1]), p


def write_json(path, obj, **dumps_kw) -> Path:
    """Writes ``json.dumps(obj, indent=1, **dumps_kw)`` to ``path``, making its folder."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(obj, indent=1, **dumps_kw))
    return out
