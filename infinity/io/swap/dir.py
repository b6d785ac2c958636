"""The directory of one swap path and who owns what in it: the directory made
(0700) or checked, its lock file, the files of dead runs reclaimed, and only
the store's own files removed at close.

[Note: ownership of swap files]
A swap directory holds one lock file, ``.infinity-swap.lock``, and the data
files ``swap-<pid>-<n>.bin`` of the store that holds the lock. A store holds a
flock (LOCK_EX) on each of them for its whole life, and the kernel drops a
flock when its holder dies, even by SIGKILL: so a file whose flock is free
belongs to no live store. The flock decides, not the pid: pids are reused (a
restarted container's run often has the dead run's pid, even our own).

- A new lock appears in the directory already flocked and holding its pid: it
  is made under a temporary name (``.infinity-swap.lock.<pid>.<hex>``) and
  hard-linked into place, which fails if the name exists. So a lock whose
  flock is free is a dead run's, never a starting one's.
- An existing lock is opened with O_NOFOLLOW and used only if it is a regular
  file of our uid holding a pid (or nothing: a run that died before writing
  it); else the store refuses, naming it. A file in place is never written or
  truncated: a dead run's lock is unlinked and replaced.
- Holding the lock, the store unlinks the files of dead runs: those with
  infinity's names that are regular files of our uid with a free flock. What
  it cannot reclaim (another uid's, flock held, unlink failed) is logged and
  named by :class:`SwapFullError`.
- Files are removed by the directory's fd, once the name is checked to lead
  to the inode the store holds open. A directory removed and made again under
  a live store (``rm -rf``) keeps the new store's files, and after
  ``umount -l`` the store still removes its own (its fds reach the detached
  filesystem; its path does not).
"""

from __future__ import annotations

import errno as _errno
import fcntl
import os
import re
import secrets
import stat
from typing import List, Optional, Tuple

from ..errors import (StoreLockedError, SwapPathError, SwapPathNotDirectoryError, SwapPathPermissionError,
                      SwapPathReadOnlyError, SwapPathUnsafeError)

LOCK_NAME = ".infinity-swap.lock"
_DATA_RE = re.compile(r"swap-\d+-\d+\.bin")
_TMP_RE = re.compile(re.escape(LOCK_NAME) + r"\.\d+\.[0-9a-f]+")
_PID_RE = re.compile(rb"\d+\n")
# Existing files are opened to be flocked and read, never written. O_NONBLOCK:
# a FIFO planted under the name must not block the open.
_OPEN_EXISTING = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC

# (name, bytes on disk) of a reclaimed file; (name, bytes, why) of one left.
Reclaimed = List[Tuple[str, int]]
Left = List[Tuple[str, int, str]]


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


# -- the lock ---------------------------------------------------------------------------

_CREATE = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# linkat's errnos on filesystems without hard links (FAT, some FUSE).
_NO_LINK = (_errno.EPERM, _errno.EOPNOTSUPP, _errno.EMLINK)


def _flock_and_sign(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
    except OSError as exc:
        if exc.errno != _errno.ENOSPC:  # a full disk (dead runs' files?): the flock is what counts
            raise


def _place_new_lock(dfd: int, path: str) -> int:
    """Our lock, in place under LOCK_NAME, flocked and holding our pid; -1 if
    the name is taken (or a reclaiming store took our temporary file)."""
    tmp = f"{LOCK_NAME}.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        fd = os.open(tmp, _CREATE, 0o600, dir_fd=dfd)
    except FileExistsError:
        return -1  # that random name is taken: draw another
    except OSError as exc:
        raise path_error(exc, os.path.join(path, LOCK_NAME), "create lock file") from None
    placed = no_link = False
    try:
        _flock_and_sign(fd)
        os.link(tmp, LOCK_NAME, src_dir_fd=dfd, dst_dir_fd=dfd, follow_symlinks=False)
        placed = True
    except (FileExistsError, FileNotFoundError, BlockingIOError):
        pass
    except OSError as exc:
        no_link = exc.errno in _NO_LINK
        if not no_link:
            raise path_error(exc, os.path.join(path, LOCK_NAME), "create lock file") from None
    finally:
        try:
            remove_own(dfd, tmp, fd)
        except OSError:
            pass  # left flocked by us (if placed): the next store reclaims it once we are gone
        if not placed:
            os.close(fd)
    return _place_lock_in_place(dfd, path) if no_link else (fd if placed else -1)


def _place_lock_in_place(dfd: int, path: str) -> int:
    """:func:`_place_new_lock` without hard links: made under LOCK_NAME, so for
    a moment it is there unflocked and empty; a store that takes it for a dead
    run's then and unlinks it is caught by the inode check, and we retry."""
    try:
        fd = os.open(LOCK_NAME, _CREATE, 0o600, dir_fd=dfd)
    except FileExistsError:
        return -1
    except OSError as exc:
        raise path_error(exc, os.path.join(path, LOCK_NAME), "create lock file") from None
    try:
        _flock_and_sign(fd)
        st = os.stat(LOCK_NAME, dir_fd=dfd, follow_symlinks=False)
        mine = os.fstat(fd)
        if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
            return fd
    except (FileNotFoundError, BlockingIOError):
        pass
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return -1


def _open_existing_lock(dfd: int, lock_path: str) -> int:
    """The existing lock file, opened (not followed, not written) once checked
    to be a regular file of our uid; -1 if it went away meanwhile."""
    try:
        st = os.stat(LOCK_NAME, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return -1
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(LOCK_NAME, dir_fd=dfd)
        except OSError:
            target = "?"
        raise SwapPathUnsafeError(_errno.ELOOP, f"lock file '{lock_path}' is a symbolic link (to '{target}'): "
                                                "infinity never follows it, so no file elsewhere is written; "
                                                f"remove the link (rm '{lock_path}') if no run of yours made it")
    if not stat.S_ISREG(st.st_mode):
        raise SwapPathUnsafeError(_errno.EEXIST, f"'{lock_path}' is not a regular file (mode "
                                                 f"{st.st_mode:06o}), so not a lock file of infinity: remove it or "
                                                 "choose another swap path")
    if st.st_uid != os.geteuid():
        raise SwapPathUnsafeError(_errno.EPERM, f"lock file '{lock_path}' is owned by uid {st.st_uid}, not by "
                                                f"this process's uid {os.geteuid()}: stop that user's run, or "
                                                "remove the file, or choose another swap path")
    try:
        fd = os.open(LOCK_NAME, _OPEN_EXISTING, dir_fd=dfd)
    except (FileNotFoundError, IsADirectoryError):
        return -1
    except OSError as exc:
        if exc.errno == _errno.ELOOP:
            return -1  # replaced by a link since the stat: the next try names it
        raise path_error(exc, lock_path, "open lock file") from None
    fst = os.fstat(fd)
    if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        return -1
    return fd


def _take_dead_lock(fd: int, dfd: int, lock_path: str) -> int:
    """The existing lock open as ``fd``: raises StoreLockedError if a live
    store holds it, SwapPathUnsafeError if it is not a lock of infinity;
    else (a dead run's) unlinks it and returns its bytes on disk."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
        raise StoreLockedError(
            f"swap directory '{os.path.dirname(lock_path)}' is in use by another SwapStore (pid {owner}; lock "
            f"file '{lock_path}'). Give this run its own directory, or stop the other one.") from None
    st = os.fstat(fd)
    content = os.pread(fd, 64, 0)
    if st.st_size > 32 or (content and not _PID_RE.fullmatch(content)):
        raise SwapPathUnsafeError(_errno.EEXIST, f"'{lock_path}' is not a lock file of infinity ({st.st_size} "
                                                 f"bytes: {content[:32]!r}); infinity neither overwrites nor "
                                                 "deletes it: remove it if nothing needs it, or choose another "
                                                 "swap path")
    try:
        remove_own(dfd, LOCK_NAME, fd)
    except OSError as exc:
        raise path_error(exc, lock_path, "remove the dead run's lock file") from None
    return st.st_blocks * 512


def acquire_lock(dfd: int, path: str) -> Tuple[int, Reclaimed]:
    """Takes the lock of the swap directory ``path`` open as ``dfd`` ([Note:
    ownership of swap files]). Returns the lock's fd (flocked) and the dead
    run's lock it replaced, if any. Raises :class:`StoreLockedError` when a
    live store holds it, :class:`SwapPathUnsafeError` when the name holds
    what is not a lock of ours."""
    lock_path = os.path.join(path, LOCK_NAME)
    replaced: Reclaimed = []
    for _ in range(100):
        fd = _place_new_lock(dfd, path)
        if fd >= 0:
            return fd, replaced
        old = _open_existing_lock(dfd, lock_path)
        if old < 0:
            continue
        try:
            replaced.append((LOCK_NAME, _take_dead_lock(old, dfd, lock_path)))
        finally:
            os.close(old)
    raise SwapPathError(_errno.EAGAIN, f"cannot take the lock '{lock_path}': it changed under every one of 100 "
                                       "tries (other runs starting on this directory?); retry, or give each run "
                                       "its own swap path")


# -- files of dead runs, and our own ----------------------------------------------------

def _reclaim_one(dfd: int, name: str, st: os.stat_result) -> str:
    """Unlinks the dead run's file ``name``; returns why it is left, or ""."""
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}"
    try:
        fd = os.open(name, _OPEN_EXISTING, dir_fd=dfd)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        return f"cannot open it: {exc.strerror} (errno {exc.errno})"
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return "in use: a live process holds its flock"
        remove_own(dfd, name, fd)
        return ""
    except OSError as exc:
        return f"cannot remove it: {exc.strerror} (errno {exc.errno})"
    finally:
        os.close(fd)


def reclaim(dfd: int) -> Tuple[Reclaimed, Left]:
    """With the directory's lock held: unlinks the files dead runs left in it
    ([Note: ownership of swap files]). Returns those reclaimed and those left
    (with why), each with its bytes on disk."""
    done: Reclaimed = []
    left: Left = []
    for name in sorted(os.listdir(dfd)):
        if not (_DATA_RE.fullmatch(name) or _TMP_RE.fullmatch(name)):
            continue
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(st.st_mode):
            continue  # no file of ours, and it holds no space
        why = _reclaim_one(dfd, name, st)
        if why:
            left.append((name, st.st_blocks * 512, why))
        else:
            done.append((name, st.st_blocks * 512))
    return done, left


def remove_own(dfd: int, name: str, fd: int) -> None:
    """Unlinks ``name`` in the directory open as ``dfd`` if it still is the
    file open as ``fd``; a file of that name that is not is left alone.
    Raises the unlink's OSError (except ENOENT)."""
    try:
        st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return
    mine = os.fstat(fd)
    if (st.st_dev, st.st_ino) != (mine.st_dev, mine.st_ino):
        return
    try:
        os.unlink(name, dir_fd=dfd)
    except FileNotFoundError:
        pass


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
