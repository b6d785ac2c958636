"""The named errors of a swap path that cannot be used: each says the path,
what was tried and the fix (see docs/io.md, "Swap directories")."""

from __future__ import annotations

import errno as _errno
import os
import stat
from typing import Optional, Tuple

from ..errors import (SwapPathError, SwapPathNotDirectoryError, SwapPathPermissionError, SwapPathReadOnlyError)


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


def no_dirs_here(path: str, parent: str) -> SwapPathError:
    """The error for ``path`` when its existing ``parent`` is on a filesystem
    that makes no directories (ENOENT on mkdir: /proc, /sys)."""
    from ...system.sysinfo import mount_of
    mnt, fstype, _ = mount_of(parent)
    where = f"a {fstype} filesystem (mounted at '{mnt}')"
    return SwapPathError(_errno.ENOENT, f"cannot create swap directory '{path}': '{parent}' exists but is on "
                                        f"{where} that makes no directories there (as /proc and /sys do); "
                                        "choose a swap path on a disk")
