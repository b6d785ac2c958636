"""One swap directory of a :class:`~infinity.io.SwapStore`: its lock file, its
data file (O_DIRECT when the filesystem allows it) and the allocator of the
extents in that file. Who owns what in the directory, and what is removed
when: ``swap_dir`` ([Note: ownership of swap files])."""

from __future__ import annotations

import ctypes
import errno as _errno
import fcntl
import logging
import os
from typing import List, Optional

from ..engine import ALIGN
from ..errors import SwapFullError
from ..extent_allocator import ExtentAllocator
from ..host_pool import warn_once
from . import record
from .dir import LOCK_NAME, Left, acquire_lock, open_dir, path_error, reclaim, remove_own, remove_own_dir

__all__ = ["LOCK_NAME", "SwapPath"]

# Reclaimed and leftover files are logged, not warned: they are events of a
# run (a dead run left files), not a fault in the caller's code, and
# warnings' once-per-call-site filter would hide them from the next start.
# Unconfigured, logging prints WARNING records to stderr.
log = logging.getLogger("infinity.io")


def _fs_free(fd: int) -> int:
    """Bytes free to this user on the filesystem of the directory open as ``fd``."""
    st = os.fstatvfs(fd)
    return st.f_bavail * st.f_frsize


def _names(files) -> str:
    return ", ".join(f"'{f[0]}' ({f[1]} bytes{', ' + f[2] if len(f) > 2 else ''})" for f in files)


class SwapPath:
    """One swap directory: its lock, its data file, its allocator."""

    def __init__(self, directory: str, index: int, root: Optional[str] = None):
        self.dir = os.path.abspath(directory)
        self.root = root  # the configured swap path above dir: nothing below it is followed
        self.index = index
        self.dir_fd = -1
        self.parent_fd = -1  # set when this store made the directory: it removes it at close
        self.lock_fd = -1
        self.lock_path = os.path.join(self.dir, LOCK_NAME)
        self.file_name = ""
        self.file_path = ""
        self.fd = -1
        self.file_id = -1
        self.direct = False
        self.unreclaimed: Left = []  # files of dead runs that could not be removed
        self.alloc = ExtentAllocator(0, ALIGN)

    # Directory and lock -----------------------------------------------------------

    def lock(self) -> None:
        """Makes (0700) or checks the directory, takes its lock and removes
        the files of dead runs ([Note: ownership of swap files])."""
        self.dir_fd, self.parent_fd = open_dir(self.dir, self.root)
        self.lock_fd, replaced, proof = acquire_lock(self.dir_fd, self.dir)
        reclaimed, self.unreclaimed = reclaim(self.dir_fd, proof)
        reclaimed = replaced + reclaimed
        if reclaimed:
            log.warning("infinity.io.SwapStore: reclaimed %d file(s), %d bytes, in '%s' left by runs that are "
                        "gone (their flocks were free): %s", len(reclaimed), sum(f[1] for f in reclaimed),
                        self.dir, _names(reclaimed))
        if self.unreclaimed:
            log.warning("infinity.io.SwapStore: %s", self.unreclaimed_note())

    def unreclaimed_note(self) -> str:
        """What the files of other runs that could not be reclaimed hold ("" if none)."""
        if not self.unreclaimed:
            return ""
        return (f"{len(self.unreclaimed)} file(s) of other runs in '{self.dir}' could not be reclaimed, "
                f"{sum(f[1] for f in self.unreclaimed)} bytes: {_names(self.unreclaimed)}")

    # Data file ------------------------------------------------------------------------

    def open_file(self, engine, probe_buf, want_direct: bool) -> None:
        """Creates this store's data file (0600, O_EXCL: never another's),
        probes O_DIRECT with ``probe_buf`` and registers it with ``engine``."""
        n = 0
        while True:
            name = f"swap-{os.getpid()}-{n}.bin"
            try:
                fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=self.dir_fd)
                break
            except FileExistsError:  # another's (a live run's flock kept it from being reclaimed)
                n += 1
            except OSError as exc:
                raise path_error(exc, os.path.join(self.dir, name), "create swap file") from None
        self.file_name, self.file_path, self.fd = name, os.path.join(self.dir, name), fd
        # Recorded at once: the proof that lets the next run remove it should we die ([Note: a run's record]).
        record.append(self.lock_fd, record.entry(name, os.fstat(fd)))
        if want_direct and hasattr(os, "O_DIRECT"):
            reason = self._try_direct(probe_buf)
            if reason:
                warn_once("odirect:" + self.dir,
                           f"infinity.io.SwapStore: O_DIRECT refused for '{self.file_path}' ({reason}); "
                           "using buffered I/O for this path, so the page cache holds a copy of swapped data")
        # Held for the store's life: a free flock marks a dead run's file ([Note: ownership of swap files]).
        fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.file_id = engine.register(self.fd, self.file_path)

    def _try_direct(self, probe_buf) -> str:
        try:
            dfd = os.open(self.file_name, os.O_RDWR | os.O_DIRECT | os.O_NOFOLLOW | os.O_CLOEXEC,
                          dir_fd=self.dir_fd)
        except OSError as exc:
            return f"open with O_DIRECT: {exc.strerror}"
        # Some filesystems accept the flag at open and refuse the transfer (or
        # the reverse): probe one aligned 4 KiB write and read.
        try:
            view = memoryview((ctypes.c_char * ALIGN).from_address(probe_buf.ptr)).cast("B")
            os.pwrite(dfd, view, 0)
            os.preadv(dfd, [view], 0)
        except OSError as exc:
            os.close(dfd)
            return f"4 KiB O_DIRECT probe: {exc.strerror}"
        os.close(self.fd)
        self.fd = dfd
        self.direct = True
        return ""

    def grow(self, nbytes: int, what: str) -> None:
        """Preallocate ``nbytes`` more bytes at the end of the file (fallocate)."""
        old = self.alloc.capacity
        free = _fs_free(self.dir_fd)
        left = self.unreclaimed_note()
        left = f"; {left}" if left else ""
        if free < nbytes:
            raise SwapFullError(_errno.ENOSPC,
                                f"swap path '{self.dir}' is too small: {what} needs {nbytes} more bytes in "
                                f"'{self.file_path}', the filesystem has {free} bytes free{left}")
        try:
            os.posix_fallocate(self.fd, old, nbytes)
        except OSError as exc:
            raise SwapFullError(exc.errno,
                                f"cannot preallocate {nbytes} bytes at offset {old} of '{self.file_path}' "
                                f"for {what}: {exc.strerror} (errno {exc.errno}); the filesystem has "
                                f"{_fs_free(self.dir_fd)} bytes free{left}") from None
        self.alloc.grow(old + nbytes)

    # Teardown -------------------------------------------------------------------------

    def close(self, engine) -> List[str]:
        """Releases the data file, the lock and the directory, in that order,
        each even if an earlier step failed; removes those this store made
        and that still are what it made ([Note: ownership of swap files]).
        Idempotent. Returns what went wrong (it raises no OSError)."""
        problems: List[str] = []

        def attempt(what: str, step) -> None:
            try:
                step()
            except OSError as exc:
                problems.append(f"{what}: {exc.strerror} (errno {exc.errno})")

        if self.file_id >= 0:
            attempt(f"unregister '{self.file_path}'", lambda: engine.unregister(self.file_id))
            self.file_id = -1
        if self.fd >= 0:
            attempt(f"remove '{self.file_path}'", lambda: remove_own(self.dir_fd, self.file_name, self.fd))
            attempt(f"close '{self.file_path}'", lambda: os.close(self.fd))
            self.fd = -1
        if self.lock_fd >= 0:
            # Unlinked before it is unlocked: a store that opened it meanwhile
            # then finds the name gone or another inode and retries.
            attempt(f"remove '{self.lock_path}'", lambda: remove_own(self.dir_fd, LOCK_NAME, self.lock_fd))
            attempt(f"close '{self.lock_path}'", lambda: os.close(self.lock_fd))
            self.lock_fd = -1
        if self.parent_fd >= 0:
            attempt(f"remove '{self.dir}'",
                    lambda: remove_own_dir(self.parent_fd, os.path.basename(self.dir), self.dir_fd))
            attempt(f"close the parent of '{self.dir}'", lambda: os.close(self.parent_fd))
            self.parent_fd = -1
        if self.dir_fd >= 0:
            attempt(f"close '{self.dir}'", lambda: os.close(self.dir_fd))
            self.dir_fd = -1
        return problems
