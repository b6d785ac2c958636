"""Exceptions of :mod:`infinity.io`, and the fault-injection spec shared by both engines."""

from __future__ import annotations

import errno as _errno
import os
from typing import Optional, Tuple

__all__ = ["SwapIOError", "ChecksumError", "SwapFullError", "StoreLockedError", "PoolExhausted",
           "SwapPathError", "SwapPathNotDirectoryError", "SwapPathReadOnlyError", "SwapPathPermissionError",
           "SwapPathUnsafeError", "parse_fault_spec"]


class SwapIOError(OSError):
    """A read or write of swap data failed.

    ``errno`` is the operating system's error number (``ENOSPC``, ``EIO``, ...);
    the message names the path, the file offset, the byte count and the errno
    text (and the key, when raised by :class:`~infinity.io.SwapStore`).
    """


class ChecksumError(SwapIOError):
    """Data read back differs from what was written (CRC mismatch); the message
    names the key, the path and the offset of the failing chunk."""


class SwapFullError(SwapIOError):
    """A swap path lacks the space asked for (bytes needed and free are named)."""


class StoreLockedError(RuntimeError):
    """Another :class:`~infinity.io.SwapStore` (this process or another) holds the directory."""


class SwapPathError(OSError):
    """A swap directory cannot be used. ``errno`` is set; the message names the
    path, what is wrong with it and the fix. Subclasses say which case."""


class SwapPathNotDirectoryError(SwapPathError, NotADirectoryError):
    """The swap path (or a component of it) is not a directory, e.g. a regular file."""


class SwapPathReadOnlyError(SwapPathError):
    """The swap path is on a read-only filesystem (EROFS)."""


class SwapPathPermissionError(SwapPathError, PermissionError):
    """The swap path, or a file in it, cannot be created or opened (EACCES, EPERM)."""


class SwapPathUnsafeError(SwapPathError):
    """Using the swap path would expose or overwrite what is not the store's: a
    directory accessible to group or others or owned by another user, or a lock
    file that is a symbolic link, not a regular file, someone else's, or not a
    lock file of infinity."""


class PoolExhausted(MemoryError):
    """A :class:`~infinity.io.HostPool` cannot supply the bytes asked for within its budget."""


# The environment variable that injects a fault into every engine created after it is set.
FAULT_ENV = "INFINITY_IO_FAULT"

_OPS = {"read": 0, "write": 1, "any": -1, "ring": 2}  # "ring": INF_IO_FAULT_RING (infinity_io.h)


def parse_fault_spec(spec: Optional[str] = None) -> Optional[Tuple[int, int, int]]:
    """Parse ``INFINITY_IO_FAULT`` (or ``spec``): ``OP:NTH:ERR``.

    OP is ``read``, ``write`` or ``any``; NTH the 1-based block number (counted
    per engine) that fails; ERR an errno name (``ENOSPC``, ``EIO``), a number,
    or ``short`` for a transfer cut in half (then completed by the retry path).
    OP ``ring`` kills the io_uring rings from the NTH block on: every
    ``io_uring_enter`` fails with ERR, and so does every block from then on
    (io_uring backend only; the other engines ignore it).
    Returns ``(op, nth, err)`` with err 0 for ``short``, or None when unset.
    """
    spec = os.environ.get(FAULT_ENV) if spec is None else spec
    if not spec:
        return None
    try:
        op_s, nth_s, err_s = spec.split(":")
        op = _OPS[op_s.strip().lower()]
        nth = int(nth_s)
        err_s = err_s.strip()
        if err_s.lower() == "short":
            err = 0
        elif err_s.isdigit():
            err = int(err_s)
        else:
            err = getattr(_errno, err_s.upper())
    except (ValueError, KeyError, AttributeError):
        raise ValueError(f"{FAULT_ENV}={spec!r}: expected OP:NTH:ERR, e.g. write:3:ENOSPC, "
                         "read:1:EIO, any:2:short or ring:1:EIO") from None
    if op == _OPS["ring"] and err == 0:
        raise ValueError(f"{FAULT_ENV}={spec!r}: a ring fault needs an errno (e.g. ring:1:EIO), not 'short'")
    return op, nth, err
