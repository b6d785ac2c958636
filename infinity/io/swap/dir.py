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
  infinity's names that are regular files of our uid with a free flock, and,
  for data files, recorded by the dead run's lock as made by it ([Note: a
  run's record] in record.py; a name is no proof). What it cannot reclaim
  (another uid's, flock held, no record, unlink failed) is logged and named
  by :class:`SwapFullError`.
- The directory is reached without following symbolic links below the
  configured swap path (``root``): a link there (``S/rank0 -> elsewhere``)
  would put the lock and the swap files elsewhere and reclaim files there.
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

from . import record
from ..errors import StoreLockedError, SwapPathError, SwapPathReadOnlyError, SwapPathUnsafeError
from .path_errors import no_dirs_here as _no_dirs_here, path_error

__all__ = ["LOCK_NAME", "path_error", "make_dir", "open_dir", "check_private", "acquire_lock", "reclaim",
           "remove_own", "remove_own_dir"]

LOCK_NAME = ".infinity-swap.lock"
_DATA_RE = re.compile(r"swap-\d+-\d+\.bin")
_TMP_RE = re.compile(re.escape(LOCK_NAME) + r"\.\d+\.[0-9a-f]+")
# Existing files are opened to be flocked and read, never written. O_NONBLOCK:
# a FIFO planted under the name must not block the open.
_OPEN_EXISTING = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC

# (name, bytes on disk) of a reclaimed file; (name, bytes, why) of one left.
Reclaimed = List[Tuple[str, int]]
Left = List[Tuple[str, int, str]]


# -- the directory ----------------------------------------------------------------------

def _make(path: str) -> bool:
    """Makes ``path`` (mode 0700, missing parents with the umask's mode); False if it exists."""
    parent = os.path.dirname(path)
    for attempt in range(2):
        try:
            os.mkdir(path, 0o700)
            return True
        except FileExistsError:
            return False
        except FileNotFoundError:
            # Once the parents exist, ENOENT again means the filesystem makes
            # no directories there (/proc, /sys): said, not retried forever.
            if attempt:
                raise _no_dirs_here(path, parent) from None
            try:
                os.makedirs(parent, exist_ok=True)
            except OSError as exc:
                raise path_error(exc, parent, "create the parent directories of swap path") from None
        except OSError as exc:
            raise path_error(exc, path, "create swap directory") from None
    raise AssertionError("unreachable")


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


def open_dir(path: str, root: Optional[str] = None) -> Tuple[int, int]:
    """Makes the swap directory ``path`` (0700) or checks the existing one
    (:func:`check_private`). Returns an fd on it and, when this call made
    it, an fd on its parent (see :func:`make_dir`), else -1. ``root``: the
    configured swap path ``path`` lies below; no component below it is
    followed if a symbolic link (:class:`SwapPathUnsafeError`, naming it)."""
    if root is not None and os.path.abspath(root) != os.path.abspath(path):
        fd, pfd = _walk_below(os.path.abspath(root), os.path.abspath(path))
    else:
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


def _walk_below(root: str, path: str) -> Tuple[int, int]:
    """Opens ``path`` from ``root`` one component at a time, never following
    a symbolic link, making missing components (0700). Returns (fd, parent fd
    if the last component was made here, else -1)."""
    rel = os.path.relpath(path, root)
    if rel.startswith(os.pardir):
        raise ValueError(f"swap directory '{path}' is not below its swap path '{root}'")
    _make(root)
    try:
        fd = os.open(root, _DIR_FLAGS)
    except OSError as exc:
        raise path_error(exc, root, "open swap path") from None
    made, here = False, root
    try:
        for name in rel.split(os.sep):
            here = os.path.join(here, name)
            try:
                os.mkdir(name, 0o700, dir_fd=fd)
                made = True
            except FileExistsError:
                made = False
            except FileNotFoundError:  # the folder open as fd exists: its filesystem makes none there
                raise _no_dirs_here(here, os.path.dirname(here)) from None
            except OSError as exc:
                raise path_error(exc, here, "create swap directory") from None
            try:
                nfd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                _refuse_link(fd, name, here, root)
                raise path_error(exc, here, "open swap directory") from None
            if made:
                os.fchmod(nfd, 0o700)  # the umask may have narrowed mkdir's mode
            fd, old = nfd, fd
            if made and here == path:
                return fd, old  # the parent's fd: remove_own_dir removes what this call made
            os.close(old)
        return fd, -1
    except BaseException:
        os.close(fd)
        raise


def _refuse_link(dfd: int, name: str, here: str, root: str) -> None:
    """Raises SwapPathUnsafeError if ``name`` in ``dfd`` is a symbolic link."""
    try:
        if not stat.S_ISLNK(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode):
            return
        target = os.readlink(name, dir_fd=dfd)
    except OSError:
        return
    raise SwapPathUnsafeError(_errno.ELOOP, f"swap directory '{here}' is a symbolic link (to '{target}') below the "
                                            f"swap path '{root}': infinity does not follow it, so no lock, swap "
                                            "file or clean-up reaches the folder it leads to; remove the link "
                                            f"(rm '{here}') or give that folder as the swap path")


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


def _take_dead_lock(fd: int, dfd: int, lock_path: str) -> Tuple[int, record.Proof]:
    """The existing lock open as ``fd``: raises StoreLockedError if a live
    store holds it, SwapPathUnsafeError if it is not a lock of infinity;
    else (a dead run's) unlinks it and returns its bytes on disk and the
    files its record proves the dead run's ([Note: a run's record])."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        # The record's first line is the pid; the files it created follow ([Note: a run's record]).
        owner = os.pread(fd, 64, 0).decode(errors="replace").split("\n", 1)[0].strip() or "unknown"
        raise StoreLockedError(
            f"swap directory '{os.path.dirname(lock_path)}' is in use by another SwapStore (pid {owner}; lock "
            f"file '{lock_path}'). Give this run its own directory, or stop the other one.") from None
    st = os.fstat(fd)
    content = os.pread(fd, record.MAX_RECORD + 1, 0)
    proof = record.parse(content)
    if proof is None or st.st_size > record.MAX_RECORD:
        raise SwapPathUnsafeError(_errno.EEXIST, f"'{lock_path}' is not a lock file of infinity ({st.st_size} "
                                                 f"bytes: {content[:32]!r}); infinity neither overwrites nor "
                                                 "deletes it: remove it if nothing needs it, or choose another "
                                                 "swap path")
    try:
        remove_own(dfd, LOCK_NAME, fd)
    except OSError as exc:
        raise path_error(exc, lock_path, "remove the dead run's lock file") from None
    return st.st_blocks * 512, proof


def acquire_lock(dfd: int, path: str) -> Tuple[int, Reclaimed, record.Proof]:
    """Takes the lock of the swap directory ``path`` open as ``dfd`` ([Note:
    ownership of swap files]). Returns the lock's fd (flocked), the dead
    run's lock it replaced, if any, and the files that lock's record proves
    the dead run's; those entries are copied into our record first ([Note:
    a run's record]). Raises :class:`StoreLockedError` when a live store
    holds it, :class:`SwapPathUnsafeError` when the name holds what is not
    a lock of ours."""
    lock_path = os.path.join(path, LOCK_NAME)
    replaced: Reclaimed = []
    proof: record.Proof = set()
    for _ in range(100):
        fd = _place_new_lock(dfd, path)
        if fd >= 0:
            try:
                record.append(fd, proof)  # handed on before anything is reclaimed
            except BaseException:
                os.close(fd)
                raise
            return fd, replaced, proof
        old = _open_existing_lock(dfd, lock_path)
        if old < 0:
            continue
        try:
            nbytes, theirs = _take_dead_lock(old, dfd, lock_path)
            replaced.append((LOCK_NAME, nbytes))
            proof |= theirs
        finally:
            os.close(old)
    raise SwapPathError(_errno.EAGAIN, f"cannot take the lock '{lock_path}': it changed under every one of 100 "
                                       "tries (other runs starting on this directory?); retry, or give each run "
                                       "its own swap path")


# -- files of dead runs, and our own ----------------------------------------------------

def _reclaim_one(dfd: int, name: str, st: os.stat_result, proof: record.Proof) -> str:
    """Unlinks the dead run's file ``name`` if ``proof`` shows it infinity's;
    returns why it is left, or ""."""
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}"
    if _DATA_RE.fullmatch(name) and not record.proven(proof, name, st):
        return "no dead run's record names it, so it is not proven a file of infinity's (remove it if it is)"
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
        if _TMP_RE.fullmatch(name) and record.parse(os.pread(fd, record.MAX_RECORD + 1, 0)) is None:
            return "not a lock record of infinity's (it holds more than a pid)"
        remove_own(dfd, name, fd)
        return ""
    except OSError as exc:
        return f"cannot remove it: {exc.strerror} (errno {exc.errno})"
    finally:
        os.close(fd)


def reclaim(dfd: int, proof: record.Proof) -> Tuple[Reclaimed, Left]:
    """With the directory's lock held: unlinks the files dead runs left in it
    whose ``proof`` (from :func:`acquire_lock`) shows them infinity's ([Note:
    ownership of swap files]). Returns those reclaimed and those left (with
    why), each with its bytes on disk."""
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
        why = _reclaim_one(dfd, name, st, proof)
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
