"""The directory of one swap path: made (0700) or checked, and the named
errors (:class:`~infinity.io.SwapPathError` subclasses) for paths that
cannot be used."""

from __future__ import annotations

import errno as _errno
import os
import stat
from typing import Optional, Tuple

from .errors import (SwapPathError, SwapPathNotDirectoryError, SwapPathPermissionError, SwapPathReadOnlyError,
                     SwapPathUnsafeError)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


# -- errors -----------------------------------------------------------------------------

def _nearest(path: str) -> Tuple[str, Optional[os.stat_result]]:
    """The path itself or its nearest ancestor that exists, and its stat."""
    p = path
    while True:
        try:
            return p, os.stat(p)
        except OSError:
            if os.path.dirname(p) == p:
                return p, None
            p = os.path.dirname(p)


def path_error(exc: OSError, path: str, doing: str) -> OSError:
    """``exc``, raised while trying to ``doing`` ``path``, as the named
    :class:`SwapPathError` that says the fix (a generic one for other errnos)."""
    e = exc.errno
    if e == _errno.EROFS:
        return SwapPathReadOnlyError(e, f"cannot {doing} '{path}': the filesystem is read-only; remount it "
                                        "read-write (mount -o remount,rw MOUNTPOINT) or choose another swap path")
    if e in (_errno.EACCES, _errno.EPERM):
        where, st = _nearest(os.path.dirname(path) if doing.startswith("create") else path)
        how = f"'{where}' is mode {stat.S_IMODE(st.st_mode):04o} owned by uid {st.st_uid}" if st else "no access"
        return SwapPathPermissionError(e, f"cannot {doing} '{path}': {exc.strerror} ({how}; this process runs "
                                          f"as uid {os.geteuid()}); choose a swap path this user may write, or "
                                          f"have its owner make it (mkdir -m 700 PATH; chown {os.geteuid()} PATH)")
    if e in (_errno.ENOTDIR, _errno.EEXIST):
        where, st = _nearest(path)
        what = f"'{where}' is not a directory" if st and not stat.S_ISDIR(st.st_mode) else "not a directory"
        return SwapPathNotDirectoryError(e, f"cannot {doing} '{path}': {what}; remove it or choose another "
                                            "swap path")
    return SwapPathError(e, f"cannot {doing} '{path}': {exc.strerror} (errno {e})")


# -- the directory ----------------------------------------------------------------------

def _make(path: str) -> bool:
    """Makes ``path`` (mode 0700, missing parents with the umask's mode); False if it exists."""
    try:
        os.mkdir(path, 0o700)
        return True
    except FileExistsError:
        return False
    except FileNotFoundError:
        parent = os.path.dirname(path)
        try:
            os.makedirs(parent, exist_ok=True)
        except OSError as exc:
            raise path_error(exc, parent, "create the parent directories of swap path") from None
        return _make(path)
    except OSError as exc:
        raise path_error(exc, path, "create swap directory") from None


def check_private(fd: int, path: str) -> None:
    """Raises unless the directory open as ``fd`` is ours (our uid), private
    (no access for group or others) and on a writable filesystem."""
    st = os.fstat(fd)
    uid = os.geteuid()
    if st.st_uid != uid:
        raise SwapPathUnsafeError(_errno.EPERM, f"swap directory '{path}' is owned by uid {st.st_uid}, not by "
                                                f"this process's uid {uid}: its owner could replace swap data; use "
                                                f"a directory of your own (or chown {uid} '{path}')")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise SwapPathUnsafeError(_errno.EPERM, f"swap directory '{path}' has mode {mode:04o}: group or others "
                                                f"may reach swap data; make it private (chmod 700 '{path}') or "
                                                "choose another swap path")
    if os.fstatvfs(fd).f_flag & os.ST_RDONLY:
        raise SwapPathReadOnlyError(_errno.EROFS, f"swap directory '{path}' is on a read-only filesystem: "
                                                  "remount it read-write (mount -o remount,rw MOUNTPOINT) or "
                                                  "choose another swap path")


def make_dir(path: str) -> Tuple[int, int]:
    """Makes the directory ``path`` (mode 0700; missing parents with the
    umask's mode) unless it exists. Returns fds on it and on its parent when
    this call made it, so that :func:`remove_own_dir` removes that one and no
    other later; (-1, -1) when it existed. Errors: :func:`path_error`."""
    if not _make(path):
        return -1, -1
    try:
        fd = os.open(path, _DIR_FLAGS)
    except OSError as exc:
        raise path_error(exc, path, "open swap directory") from None
    try:
        os.fchmod(fd, 0o700)  # the umask may have narrowed mkdir's mode
        return fd, os.open(os.path.dirname(path), _DIR_FLAGS)
    except BaseException:
        os.close(fd)
        raise


def open_dir(path: str) -> Tuple[int, int]:
    """Makes the swap directory ``path`` (0700) or checks the existing one
    (:func:`check_private`). Returns an fd on it and, when this call made
    it, an fd on its parent (see :func:`make_dir`), else -1."""
    fd, pfd = make_dir(path)
    if fd < 0:
        try:
            fd = os.open(path, _DIR_FLAGS)
        except OSError as exc:
            raise path_error(exc, path, "open swap directory") from None
    try:
        check_private(fd, path)
    except BaseException:
        os.close(fd)
        if pfd >= 0:
            os.close(pfd)
        raise
    return fd, pfd


# -- removal ---------------------------------------------------------------------------

def remove_own_dir(pfd: int, name: str, fd: int) -> None:
    """Removes the directory ``name`` of the directory open as ``pfd`` if it
    still is the one open as ``fd`` and is empty (another store's files keep
    it). Raises OSError for failures other than ENOENT, ENOTEMPTY or EEXIST."""
    try:
        remove = os.stat(name, dir_fd=pfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    mine = os.fstat(fd)
    if (remove.st_dev, remove.st_ino) != (mine.st_dev, mine.st_ino):
        return
    try:
        os.rmdir(name, dir_fd=pfd)
    except OSError as exc:
        if exc.errno not in (_errno.ENOENT, _errno.ENOTEMPTY, _errno.EEXIST):
            raise
