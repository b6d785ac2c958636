"""The checks of ``infinity doctor``, one function per check, each returning
:class:`Check` rows. Probes write only inside a temporary directory they
make (and remove) in the swap path or its nearest existing parent.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import resource
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..config.runtime import format_bytes
from ..system.sysinfo import mount_of
from ..io.swap.dir import LOCK_NAME

OK, WARN, FAIL = "OK", "WARN", "FAIL"
_NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "sshfs", "fuse.sshfs", "9p", "lustre", "gpfs", "beegfs")


@dataclass
class Check:
    """One row of the doctor's table; ``fix`` says what to do for WARN/FAIL."""

    target: str
    name: str
    status: str
    detail: str
    fix: str = ""


def nearest_existing(path: str) -> str:
    """``path`` or its nearest ancestor that exists."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return p


def free_bytes(where: str) -> int:
    """Bytes an unprivileged writer may still put on the filesystem of ``where``."""
    st = os.statvfs(where)
    return st.f_bavail * st.f_frsize


def check_link(path: str) -> Tuple[List[Check], Optional[str]]:
    """The swap path as a symbolic link: where it points and whether the
    swap-path rules allow it ([Note: ownership of swap files] in
    infinity/io/swap/dir.py: the configured path is followed, links below it
    are refused). Returns the rows and the directory probes may use (None:
    none); ``([], None)`` when ``path`` is not a link."""
    p = os.path.abspath(path)
    if not os.path.islink(p):
        return [], None
    target, real = os.readlink(p), os.path.realpath(p)
    if not os.path.exists(real):
        return [Check(path, "path", FAIL, f"a symbolic link to '{target}', which does not exist: initialize "
                      "cannot open it (infinity follows a link at the swap path but makes no folder through it)",
                      f"mkdir -m 700 -p '{real}', or point the link at an existing folder")], None
    if not os.path.isdir(real):
        return [Check(path, "path", FAIL, f"a symbolic link to '{target}', which is not a directory",
                      "point the link at a directory, or choose another swap path")], None
    ok = os.access(real, os.W_OK | os.X_OK)
    detail = (f"a symbolic link to '{target}' ('{real}'): allowed, infinity follows the swap path itself "
              "(links below it are refused)" + ("" if ok else f"; '{real}' is not writable by this user"))
    return [Check(path, "path", OK if ok else FAIL, detail,
                  "" if ok else f"chown {os.geteuid()} '{real}' or choose another swap path")], real if ok else None


def check_path(path: str) -> Tuple[List[Check], Optional[str]]:
    """Rows for existence/creatability, and the directory probes may use (None: none)."""
    rows, base = check_link(path)
    if rows:
        return rows, base
    p = os.path.abspath(path)
    anc = nearest_existing(p)
    if os.path.isdir(anc) and os.statvfs(anc).f_flag & os.ST_RDONLY:
        # Before access(): it reports a read-only mount as "not writable".
        mp = mount_of(anc)[0]
        return [Check(path, "writable", FAIL, f"'{anc}' is on a read-only filesystem ({mp})",
                      f"remount it read-write (mount -o remount,rw {mp}) or choose another swap path")], None
    if os.path.isdir(p):
        ok = os.access(p, os.W_OK | os.X_OK)
        return [Check(path, "path", OK if ok else FAIL, "exists" + ("" if ok else ", not writable by this user"),
                      "" if ok else f"chown {os.geteuid()} '{p}' or choose another swap path")], p if ok else None
    if os.path.exists(p):
        return [Check(path, "path", FAIL, "exists and is not a directory",
                      f"remove '{p}' or choose another swap path")], None
    if not os.path.isdir(anc):
        return [Check(path, "path", FAIL, f"cannot be created: '{anc}' is not a directory",
                      f"remove '{anc}' or choose another swap path")], None
    if not os.access(anc, os.W_OK | os.X_OK):
        return [Check(path, "path", FAIL, f"cannot be created: '{anc}' is not writable by uid {os.geteuid()}",
                      f"mkdir -m 700 '{p}' as the owner of '{anc}' and chown it, or choose another swap path")], None
    missing = os.path.relpath(p, anc)
    return [Check(path, "path", WARN, f"missing; infinity will create it ('{missing}' under '{anc}')",
                  f"mkdir -m 700 -p '{p}' beforehand to pin down its owner and mode")], anc


def check_fs(path: str, where: str) -> List[Check]:
    """Filesystem type and whether it is writable."""
    mp, fstype, opts = mount_of(where)
    rows = []
    ro = bool(os.statvfs(where).f_flag & os.ST_RDONLY)
    if ro:
        rows.append(Check(path, "writable", FAIL, f"the filesystem at {mp} is read-only",
                          f"remount it read-write (mount -o remount,rw {mp}) or choose another swap path"))
    if fstype == "tmpfs":
        rows.append(Check(path, "filesystem", WARN, f"tmpfs at {mp}: RAM-backed, so swap there uses RAM",
                          "put swap paths on a local NVMe/SSD filesystem (ext4, xfs)"))
    elif fstype in _NETWORK_FS:
        rows.append(Check(path, "filesystem", WARN, f"{fstype} at {mp}: a network filesystem",
                          "use a local NVMe/SSD filesystem: network latency stalls every fetch"))
    else:
        rows.append(Check(path, "filesystem", OK, f"{fstype} at {mp} ({opts.split(',')[0]})"))
    return rows


def check_direct(path: str, probe_dir: str) -> List[Check]:
    """O_DIRECT support and the smallest alignment the filesystem takes."""
    if not hasattr(os, "O_DIRECT"):
        return [Check(path, "O_DIRECT", WARN, "not offered by this OS", "buffered I/O is used")]
    name = os.path.join(probe_dir, "odirect.probe")
    buf = mmap.mmap(-1, 4096)  # page-aligned, as O_DIRECT wants
    try:
        fd = os.open(name, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return [Check(path, "O_DIRECT", WARN, "refused by the filesystem (EINVAL): infinity falls back to "
                          "buffered I/O, and the page cache becomes a hidden, unbudgeted tier",
                          "use a filesystem with O_DIRECT (ext4, xfs) for swap paths")]
        return [Check(path, "O_DIRECT", FAIL, f"cannot create a file: {exc.strerror}", "check the permissions")]
    try:
        align = 4096
        for size in (512, 4096):
            try:
                os.pwrite(fd, memoryview(buf)[:size], size)
                align = size
                break
            except OSError:
                continue
        return [Check(path, "O_DIRECT", OK, f"supported; alignment {align} bytes (infinity aligns to 4096)")]
    finally:
        os.close(fd)
        os.unlink(name)
        buf.close()


def check_space(path: str, where: str, need: Optional[int]) -> List[Check]:
    """Free space against ``need`` bytes (the run's share of this path)."""
    free = free_bytes(where)
    if need is None:
        return [Check(path, "free space", OK, f"{format_bytes(free)} free (no need given: --need or CONFIG)")]
    if need == 0:
        return [Check(path, "free space", OK, f"{format_bytes(free)} free; the run puts nothing on NVMe")]
    if free < need:
        return [Check(path, "free space", FAIL, f"{format_bytes(free)} free, the run needs {format_bytes(need)}",
                      f"free {format_bytes(need - free)}, add swap paths (they share the need), or offload less")]
    status = WARN if free < need * 1.2 else OK
    return [Check(path, "free space", status, f"{format_bytes(free)} free, the run needs {format_bytes(need)}",
                  "less than 20% headroom: other writers may fill the disk" if status == WARN else "")]


def check_bandwidth(path: str, probe_dir: str, nbytes: int, block_size: int, budget_s: float = 5.0) -> List[Check]:
    """Write then read ``nbytes`` through :class:`infinity.io.SwapStore` (at most ~``budget_s``)."""
    import torch

    from ..io import SwapStore
    data = torch.arange(nbytes // 4, dtype=torch.int32)
    out = torch.empty_like(data)
    store = SwapStore([os.path.join(probe_dir, "store")], capacity_bytes=nbytes, block_size=block_size,
                      checksum=False, staging_bytes=4 * block_size)
    try:
        t0 = time.perf_counter()
        store.write("probe", data).wait()
        tw = time.perf_counter() - t0
        rd = None
        if tw < budget_s / 2:
            t0 = time.perf_counter()
            store.read("probe", out).wait()
            rd = time.perf_counter() - t0
            if not torch.equal(out, data):
                return [Check(path, "bandwidth", FAIL, "read back differs from what was written",
                              "the disk or filesystem corrupts data: do not use it")]
        direct = store.direct[0]
    finally:
        store.close()
    mb = nbytes / 1e6
    detail = f"write {mb / tw:.0f} MB/s" + (f", read {mb / rd:.0f} MB/s" if rd else ", read skipped (slow write)")
    detail += f" ({format_bytes(nbytes)}, {'O_DIRECT' if direct else 'buffered'}, {format_bytes(block_size)} blocks)"
    slow = mb / tw < 200 or (rd is not None and mb / rd < 200)
    return [Check(path, "bandwidth", WARN if slow else OK, detail,
                  "below 200 MB/s: NVMe steps will be I/O bound; use a faster disk or several paths" if slow else "")]


def _lock_state(lock: str) -> Optional[str]:
    """The pid holding the lock file ``lock``, "" for a dead run's, None if absent."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        try:
            # LOCK_SH: conflicts with the holder's LOCK_EX; released at once.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return ""
        except BlockingIOError:
            # The first line is the pid; the run's record of its files follows (io/swap/record.py).
            return os.pread(fd, 32, 0).decode(errors="replace").split("\n")[0].strip() or "unknown"
    finally:
        os.close(fd)


def check_lock(path: str) -> List[Check]:
    """Whether a live run holds the swap directory (or a rank's subfolder)."""
    p = os.path.abspath(path)
    if not os.path.isdir(p):
        return [Check(path, "lock", OK, "no lock (directory absent)")]
    dirs = [p] + [os.path.join(p, d) for d in sorted(os.listdir(p)) if d.startswith("rank")]
    rows = []
    for d in dirs[1:]:
        if os.path.islink(d):  # as SwapStore refuses it (io/swap/dir.py _refuse_link)
            rows.append(Check(path, "lock", FAIL, f"'{d}' is a symbolic link (to '{os.readlink(d)}') below the "
                              "swap path: infinity refuses it (SwapPathUnsafeError), so no lock, swap file or "
                              "clean-up reaches the folder it leads to",
                              f"remove the link (rm '{d}') or give that folder as the swap path"))
    dirs = [d for d in dirs if not os.path.islink(d)]
    for d in dirs:
        state = _lock_state(os.path.join(d, LOCK_NAME))
        if state:
            rows.append(Check(path, "lock", FAIL, f"'{d}' is in use by a live run (pid {state})",
                              "give this run another swap path, or stop that run"))
        elif state == "":
            rows.append(Check(path, "lock", OK, f"'{d}' holds a dead run's lock: reclaimed at start"))
    return rows or [Check(path, "lock", OK, "not in use")]


def check_memlock(host_bytes: Optional[int]) -> List[Check]:
    """The memlock limit (``ulimit -l``) and whether page-locking works (HostPool)."""
    from ..io import HostPool
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    lim = "unlimited" if soft == resource.RLIM_INFINITY else format_bytes(soft)
    rows = []
    # Without a run's host budget, 1 GiB stands for "a host tier of any size".
    want = host_bytes if host_bytes is not None else 1 << 30
    low = soft != resource.RLIM_INFINITY and soft < want
    rows.append(Check("system", "memlock limit", WARN if low else OK, lim + (
        f", below the host budget {format_bytes(host_bytes)}" if low and host_bytes else
        ": a host tier above it is not page-locked (slower host-device copies)" if low else ""),
        "raise it (ulimit -l unlimited; limits.conf memlock, or docker --ulimit memlock=-1)" if low else ""))
    pool = HostPool(4 << 20, pin="auto", prefault=False)
    try:
        if pool.pinned:
            rows.append(Check("system", "pinning", OK, f"4 MiB page-locked with {pool.pin_method}"))
        else:
            rows.append(Check("system", "pinning", WARN, f"not page-locked: {pool.pin_reason}",
                              "raise the memlock limit (ulimit -l unlimited)"))
    finally:
        pool.close()
    return rows


def check_native() -> List[Check]:
    """The native library, its SIMD level and the io_uring backend."""
    from ..system import native
    info = native.info()
    if info["backend"] != "native":
        return [Check("system", "native library", WARN, f"not loaded: {info.get('reason')}",
                      "reinstall infinity (pip install .) so the native library is built")]
    rows = [Check("system", "native library", OK, f"{info['library']}; SIMD {info['simd']} (available "
                  f"{', '.join(info['simd_available'])}); {info['threads']} threads")]
    try:
        from ..io.engine import NativeEngine
        eng = NativeEngine("io_uring", 2, 1 << 20)
        eng.close()
        rows.append(Check("system", "io_uring", OK, "available"))
    except Exception as exc:  # noqa: BLE001 - any refusal means the thread pool runs
        rows.append(Check("system", "io_uring", WARN, f"unavailable ({exc}); the thread-pool engine runs",
                          "fine for most disks; io_uring needs Linux >= 5.1 and no seccomp block"))
    return rows


def check_cuda() -> List[Check]:
    """CUDA devices and their free memory, where present."""
    import torch
    if not torch.cuda.is_available():
        return [Check("system", "CUDA", OK, "no CUDA device: runs use device='cpu'")]
    rows = []
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        rows.append(Check("system", f"cuda:{i}", OK, f"{torch.cuda.get_device_name(i)}: {format_bytes(free)} free "
                          f"of {format_bytes(total)}"))
    return rows
