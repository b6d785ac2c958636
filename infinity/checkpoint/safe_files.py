"""The one way a checkpoint's files are named, sized and opened for reading.

[Note: a checkpoint is input from someone else]
A checkpoint folder may come from another machine, another user or a
download, so every name its manifest gives is a claim to check, never a path
to follow. A file named by a manifest must be a plain name inside the
checkpoint folder: no separator (so no ``..``, no absolute path, no
subfolder), never a symbolic link (opened with O_NOFOLLOW, relative to the
folder's fd), and a regular file (fstat S_ISREG after the open; O_NONBLOCK,
so a FIFO planted under the name is refused at once instead of blocking
open(2) until a writer comes). Sizes are checked against the file before
anything is read, JSON and safetensors headers are bounded, and a nesting
too deep for the JSON parser is a corrupt file, not a RecursionError.
Errors name the file, the field, offsets and expected-vs-actual lengths;
they never echo bytes or values read from the file (a CRC of what was read
tells something about its content). Every reader of a checkpoint (load,
verify, consolidate) goes through this module.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from typing import Tuple

__all__ = ["CorruptCheckpointError", "member_path", "member_size", "open_member", "read_member", "parse_json",
           "read_error", "MAX_MANIFEST_BYTES", "MAX_HEADER_BYTES"]

# A manifest holds ~300 bytes a tensor (~100k tensors for the largest
# models here) and one CRC a 4 MiB chunk: far below this bound.
MAX_MANIFEST_BYTES = 256 << 20
# The safetensors package refuses headers over 100 MB; so do we.
MAX_HEADER_BYTES = 100_000_000

_OPEN = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


class CorruptCheckpointError(ValueError):
    """A checkpoint file does not hold what its manifest says, or the
    manifest itself is malformed (names file, field, tensor, offset)."""


def member_path(ckpt: str, name, what: str = "file") -> str:
    """``ckpt/name`` once ``name`` is checked to be a plain file name (no
    separator, not ``.`` or ``..``, no NUL); CorruptCheckpointError naming
    the field ``what`` otherwise."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\0" in name \
            or (os.sep != "/" and os.sep in name):
        shown = repr(name[:200]) if isinstance(name, str) else f"a {type(name).__name__}"
        raise CorruptCheckpointError(f"{os.path.join(ckpt, 'manifest.json')}: {what} {shown} is not a plain file "
                                     "name inside the checkpoint folder (absolute, '..', a subfolder or not a "
                                     "string); infinity reads nothing outside the checkpoint: the manifest is "
                                     "corrupt or was made to read other files")
    return os.path.join(ckpt, name)


def _refusal(path: str, exc: OSError) -> Exception:
    if exc.errno == errno.ENOENT:
        named = "" if os.path.basename(path) == "manifest.json" else " (the manifest names it)"
        return CorruptCheckpointError(f"{path}: missing{named}")
    if exc.errno == errno.ELOOP:
        return CorruptCheckpointError(f"{path}: a symbolic link; infinity never follows links in a checkpoint "
                                      "folder (copy the file in instead of linking it)")
    return OSError(exc.errno, f"cannot read checkpoint file {path}: {exc.strerror}")


def read_error(path: str, exc: OSError, pos: int) -> OSError:
    """The OSError for a read of the checkpoint file ``path`` that failed at
    byte ``pos`` (EIO from a failing disk, ...): same errno, the file and
    offset named, so a dead disk is never taken for a corrupt checkpoint."""
    return OSError(exc.errno, f"cannot read checkpoint file {path} at byte {pos}: {exc.strerror}; the disk or "
                              "filesystem failed the read (check dmesg), the checkpoint may be whole")


def _not_regular(path: str, st: os.stat_result) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: not a regular file (mode {st.st_mode:06o}: a FIFO, device, folder "
                                  "or link); a checkpoint holds only regular files")


def member_size(ckpt: str, name) -> int:
    """The size in bytes of the checkpoint's file ``name`` (checked as in
    :func:`member_path`, a regular file, not followed), without opening it."""
    path = member_path(ckpt, name)
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError as exc:
        raise _refusal(path, exc) from None
    if stat.S_ISLNK(st.st_mode):
        raise _refusal(path, OSError(errno.ELOOP, "link"))
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, st)
    return st.st_size


def open_member(ckpt: str, name) -> Tuple[int, int]:
    """An fd (blocking, read-only) on the checkpoint's regular file
    ``name`` and its size: opened relative to the folder's fd, O_NOFOLLOW
    and O_NONBLOCK, and refused unless fstat says a regular file (see
    [Note: a checkpoint is input from someone else]). The caller closes it."""
    path = member_path(ckpt, name)
    try:
        dfd = os.open(ckpt, _DIR)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot open checkpoint folder {ckpt}: {exc.strerror}") from None
    try:
        fd = os.open(name, _OPEN, dir_fd=dfd)
    except OSError as exc:
        raise _refusal(path, exc) from None
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st)
        os.set_blocking(fd, True)  # a regular file: reads are as usual from here on
        return fd, st.st_size
    except BaseException:
        os.close(fd)
        raise


def read_member(ckpt: str, name, limit: int) -> bytes:
    """All bytes of the checkpoint's file ``name``, refused (naming both
    sizes) when it is over ``limit`` bytes."""
    fd, size = open_member(ckpt, name)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1) if size <= limit else b""  # (it may grow after the fstat: read no more)
    except OSError as exc:
        raise read_error(os.path.join(ckpt, name), exc, 0) from None
    finally:
        os.close(fd)
    if size > limit or len(data) > limit:
        raise CorruptCheckpointError(f"{os.path.join(ckpt, name)}: {max(size, len(data))} bytes, over the {limit} a "
                                     f"checkpoint's {name} may have")
    return data


def parse_json(path: str, raw: bytes):
    """``raw`` parsed as JSON; malformed or nested too deep for the parser:
    CorruptCheckpointError naming ``path`` (not the bytes)."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise CorruptCheckpointError(f"{path}: JSON nested too deep to be a checkpoint's") from None
    except ValueError as e:
        where = f" (line {e.lineno}, column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
        raise CorruptCheckpointError(f"{path}: not valid JSON{where}") from None
