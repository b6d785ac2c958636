"""What memory this process may use: the RAM available on the machine and
the limit of its memory cgroup (v2 ``memory.max``, v1
``memory.limit_in_bytes``), the tightest of every level up the hierarchy.

A container or a batch scheduler's job sees the machine's ``MemAvailable``
but is killed at its cgroup's limit (SIGKILL, no message), so budgets are
sized from the smaller of the two.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

__all__ = ["MemoryLimit", "cgroup_limit", "available_ram", "describe"]

_UNLIMITED = 1 << 60  # v1 writes ~2**63 rounded down to a page for "no limit"


@dataclass(frozen=True)
class MemoryLimit:
    """A memory cgroup's limit and usage (bytes) and where it was read."""

    limit: int
    usage: int
    path: str

    @property
    def headroom(self) -> int:
        return max(0, self.limit - self.usage)


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text in ("", "max"):
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _levels(rel: str) -> List[str]:
    """``/a/b/c`` -> ``["/a/b/c", "/a/b", "/a", "/"]``."""
    out, cur = [], "/" + rel.strip("/")
    while True:
        out.append(cur)
        if cur == "/":
            return out
        cur = os.path.dirname(cur)


def cgroup_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Optional[MemoryLimit]:
    """The tightest memory limit of this process's cgroups (v2 and v1), or None if none is set."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":  # v2: one unified hierarchy
            for base in (root, os.path.join(root, "unified")):
                found += _scan(base, rel, "memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            found += _scan(os.path.join(root, "memory"), rel, "memory.limit_in_bytes", "memory.usage_in_bytes")
    return min(found, key=lambda m: m.headroom, default=None)


def _scan(base: str, rel: str, limit_file: str, usage_file: str) -> List[MemoryLimit]:
    out = []
    for level in _levels(rel):
        d = os.path.join(base, level.lstrip("/"))
        limit = _read_int(os.path.join(d, limit_file))
        if limit is None or limit >= _UNLIMITED:
            continue
        usage = _read_int(os.path.join(d, usage_file)) or 0
        out.append(MemoryLimit(limit, usage, os.path.join(d, limit_file)))
    return out


def _kib_field(path: str, key: str) -> Optional[int]:
    """Bytes of the ``key:  N kB`` line of a /proc file, None if absent."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _mem_available() -> int:
    got = _kib_field("/proc/meminfo", "MemAvailable")
    return got if got is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def rss_bytes(peak: bool = False) -> int:
    """This process's resident bytes now, or with ``peak`` the most since it
    started or since :func:`reset_peak_rss` (the kernel's VmRSS / VmHWM)."""
    got = _kib_field("/proc/self/status", "VmHWM" if peak else "VmRSS")
    if got is not None:
        return got
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def locked_bytes() -> int:
    """Bytes of this process's memory locked in RAM (the kernel's VmLck; 0 where unknown)."""
    return _kib_field("/proc/self/status", "VmLck") or 0


def trim_heap() -> None:
    """Hands the C heap's free memory back to the OS (glibc ``malloc_trim``;
    a no-op elsewhere): the allocator keeps what large temporaries freed."""
    try:
        import ctypes
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


def reset_peak_rss() -> None:
    """Resets the kernel's peak mark (VmHWM), so it covers only what follows (Linux)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def available_ram() -> int:
    """Bytes this process may still take: the machine's ``MemAvailable``,
    or its cgroup's headroom (limit minus usage) if that is smaller."""
    free = _mem_available()
    lim = cgroup_limit()
    return min(free, lim.headroom) if lim is not None else free


def describe() -> str:
    """The figures behind :func:`available_ram`, for error messages."""
    from ..config.runtime import format_bytes
    text = f"MemAvailable {format_bytes(_mem_available())}"
    lim = cgroup_limit()
    if lim is not None:
        text += (f", cgroup limit {format_bytes(lim.limit)} ({lim.path}) of which {format_bytes(lim.usage)} "
                 "in use")
    return text


RAM_FILESYSTEMS = ("tmpfs", "ramfs")


def mount_of(path: str, mounts: str = "/proc/mounts") -> Tuple[str, str, str]:
    """``(mount point, filesystem type, options)`` of the mount holding ``path``."""
    real = os.path.realpath(path)
    best = ("/", "?", "")
    try:
        with open(mounts) as f:
            for line in f:
                parts = line.split()
                if len(parts) < 4:
                    continue
                mp = parts[1].replace("\\040", " ")
                if (real == mp or real.startswith(mp.rstrip("/") + "/")) and len(mp) >= len(best[0]):
                    best = (mp, parts[2], parts[3])
    except OSError:
        pass
    return best
