"""One swap directory of a :class:`~infinity.io.SwapStore`: its lock file, its
data file (O_DIRECT when the filesystem allows it) and the allocator of the
extents in that file."""

from __future__ import annotations

import ctypes
import errno as _errno
import fcntl
import os

from .engine import ALIGN
from .errors import StoreLockedError, SwapFullError
from .extent_allocator import ExtentAllocator
from .host_pool import _warn_once
from .swap_dir import open_dir, path_error

LOCK_NAME = ".infinity-swap.lock"


def _fs_free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


class _SwapPath:
    """One swap directory: its lock, its data file, its allocator."""

    def __init__(self, directory: str, index: int):
        self.dir = os.path.abspath(directory)
        self.index = index
        self.created_dir = False
        self.lock_fd = -1
        self.lock_path = os.path.join(self.dir, LOCK_NAME)
        self.created_lock = False
        self.file_path = ""
        self.fd = -1
        self.file_id = -1
        self.direct = False
        self.alloc = ExtentAllocator(0, ALIGN)

    # Directory and lock -----------------------------------------------------------

    def lock(self) -> None:
        """Makes (0700) or checks the directory (named errors: ``swap_dir``) and takes its lock."""
        fd, pfd = open_dir(self.dir)
        os.close(fd)
        if pfd >= 0:
            os.close(pfd)
            self.created_dir = True
        while True:
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                created = True
            except FileExistsError:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CLOEXEC)
                created = False
            except OSError as exc:
                raise path_error(exc, self.lock_path, "create lock file") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                finally:
                    os.close(fd)
                raise StoreLockedError(
                    f"swap directory '{self.dir}' is in use by another SwapStore (pid {owner}; lock file "
                    f"'{self.lock_path}'). Give this run its own directory, or stop the other one.") from None
            # The previous owner may have unlinked the file between our open and
            # our flock: then we hold a lock on a deleted inode. Check, retry.
            try:
                same = os.stat(self.lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.lock_fd, self.created_lock = fd, created
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    # Data file ------------------------------------------------------------------------

    def open_file(self, engine, probe_buf, want_direct: bool) -> None:
        n = 0
        while True:
            name = os.path.join(self.dir, f"swap-{os.getpid()}-{n}.bin")
            try:
                fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                break
            except FileExistsError:  # a crashed run's file, or another store's: not ours to touch
                n += 1
            except OSError as exc:
                raise path_error(exc, name, "create swap file") from None
        self.file_path, self.fd = name, fd
        if want_direct and hasattr(os, "O_DIRECT"):
            reason = self._try_direct(probe_buf)
            if reason:
                _warn_once("odirect:" + self.dir,
                           f"infinity.io.SwapStore: O_DIRECT refused for '{self.file_path}' ({reason}); "
                           "using buffered I/O for this path, so the page cache holds a copy of swapped data")
        self.file_id = engine.register(self.fd, self.file_path)

    def _try_direct(self, probe_buf) -> str:
        try:
            dfd = os.open(self.file_path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
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
        free = _fs_free(self.dir)
        if free < nbytes:
            raise SwapFullError(_errno.ENOSPC,
                                f"swap path '{self.dir}' is too small: {what} needs {nbytes} more bytes in "
                                f"'{self.file_path}', the filesystem has {free} bytes free")
        try:
            os.posix_fallocate(self.fd, old, nbytes)
        except OSError as exc:
            raise SwapFullError(exc.errno,
                                f"cannot preallocate {nbytes} bytes at offset {old} of '{self.file_path}' "
                                f"for {what}: {exc.strerror} (errno {exc.errno}); the filesystem has "
                                f"{_fs_free(self.dir)} bytes free") from None
        self.alloc.grow(old + nbytes)

    def close(self, engine) -> None:
        if self.file_id >= 0:
            engine.unregister(self.file_id)
            self.file_id = -1
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.file_path:
            try:
                os.unlink(self.file_path)
            except FileNotFoundError:
                pass
            self.file_path = ""
        if self.lock_fd >= 0:
            if self.created_lock:
                try:
                    os.unlink(self.lock_path)  # before unlocking: see the inode check in lock()
                except FileNotFoundError:
                    pass
            os.close(self.lock_fd)
            self.lock_fd = -1
        if self.created_dir:
            try:
                os.rmdir(self.dir)  # only if empty: files of others stay
            except OSError:
                pass
            self.created_dir = False
