"""Who owns a checkpoint folder, and the lock that keeps one saver in it.

[Note: a checkpoint folder is owned like a swap folder]
A checkpoint folder decides what a run resumes from, so whoever may write
into it may choose the run's weights: it is treated as a swap folder is
(docs/io.md, infinity/io/swap/dir.py). A save makes it mode 0700; an
existing one is used by ``save_checkpoint`` and ``load_checkpoint`` only
when it is owned by this process's uid and not writable by group or others
(a UsageError names the path and the chmod/chown that fixes it). Reading it
only (``verify_checkpoint``, ``consolidate``) asks neither: those read
nothing outside the checkpoint and refuse what is malformed (safe_files.py).
While resolving the newest checkpoint, a ``step-<N>`` folder that is not
ours is ignored with a warning naming it.

A saver holds a flock (LOCK_EX) on ``.infinity-checkpoint.lock`` in the
folder from before it touches the folder until its checkpoint is committed
and pruned (a background save: until it ends). A second saver, in this
process or another, is refused with :class:`CheckpointLockedError` naming
the folder and the holder's pid. The kernel drops a flock when its holder
dies, even by SIGKILL, so a saver that holds the lock knows every
``.step-<N>.partial`` folder in it was left by a saver that is gone, and
only then removes them. The lock file is opened without following links,
must be a regular file of ours, and is never removed (no race between a
removal and another saver's open).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat

from ..engine.faults import UsageError

__all__ = ["LOCK_NAME", "CheckpointLockedError", "owned_by_us", "check_root", "make_root", "SaveLock"]

LOCK_NAME = ".infinity-checkpoint.lock"
_LOCK_OPEN = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class CheckpointLockedError(UsageError):
    """Another saver (this process or another) is writing into the checkpoint folder."""


def owned_by_us(st: os.stat_result) -> bool:
    """Whether the file or folder of ``st`` belongs to this process's uid."""
    return st.st_uid == os.geteuid()


def check_root(path: str, who: str) -> None:
    """Raises UsageError unless the existing checkpoint folder ``path`` is a
    folder owned by us and not writable by group or others."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise OSError(exc.errno, f"{who}: cannot reach checkpoint folder {path!r}: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{who}: checkpoint folder {path!r} is not a folder; remove it or choose another path")
    if not owned_by_us(st):
        raise UsageError(f"{who}: checkpoint folder {path!r} is owned by uid {st.st_uid}, not by this process's uid "
                         f"{os.geteuid()}: its owner could choose what this run resumes from. Use a folder of your "
                         f"own (or chown {os.geteuid()} '{path}' if you trust its files)")
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise UsageError(f"{who}: checkpoint folder {path!r} has mode {mode:04o}: group or others may write into "
                         f"it and choose what this run resumes from. Make it private (chmod 700 '{path}') or "
                         "choose another folder")


def make_root(path: str, who: str) -> None:
    """Makes the checkpoint folder ``path`` (0700; missing parents with the
    umask's mode) or checks the existing one (:func:`check_root`)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        check_root(path, who)
        return
    except FileNotFoundError:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return make_root(path, who)
    os.chmod(path, 0o700)  # the umask may have narrowed mkdir's mode; never widened it


class SaveLock:
    """The flock of one checkpoint folder's saver ([Note: a checkpoint
    folder is owned like a swap folder]): taken by the constructor,
    dropped by :meth:`release` (idempotent)."""

    def __init__(self, root: str):
        self.path = os.path.join(root, LOCK_NAME)
        try:
            self._fd = os.open(self.path, _LOCK_OPEN, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UsageError(f"save_checkpoint: {self.path!r} is a symbolic link, not infinity's lock file; "
                                 "infinity never follows it: remove it") from None
            raise
        try:
            self._take()
        except BaseException:
            os.close(self._fd)
            raise

    def _take(self) -> None:
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode) or not owned_by_us(st):
            raise UsageError(f"save_checkpoint: {self.path!r} is not a lock file of this user (mode "
                             f"{st.st_mode:06o}, uid {st.st_uid}); remove it or choose another checkpoint folder")
        os.set_blocking(self._fd, True)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip()
            pid = holder if holder.isdigit() else "unknown"
            raise CheckpointLockedError(
                f"save_checkpoint: checkpoint folder {os.path.dirname(self.path)!r} is being written by another "
                f"save (pid {pid}; lock file {self.path!r}). Wait for it, give this run its own folder, or stop "
                "the other run") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        """Drops the lock (closing its fd drops the flock)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
