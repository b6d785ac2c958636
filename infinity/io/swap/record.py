"""A run's record in its swap directory's lock file: the proof that a file
there is infinity's, which dead-run clean-up requires before it deletes one.

[Note: a run's record]
A file in a swap directory is removed as a dead run's only if that run's
record proves it was made by infinity. A name like ``swap-<pid>-<n>.bin`` is
no proof: the directory may have been reached through a symbolic link (now
refused) or hold another program's files of that form. The record is the
lock file itself, which outlives its run (a SIGKILL leaves it): its first
line is the run's pid, then one line per data file the run created,
``<name> <st_dev> <st_ino>``, appended as soon as the file exists (O_EXCL,
so it is a file the run made, not one it found). A new store taking a dead
run's lock reads its record, copies the entries into its own lock before
reclaiming anything (so a store killed mid-reclaim hands the proof on), and
removes a data file only if its name is recorded with the inode the name
leads to now. A file without a record (another program's, or a run killed
between creating the file and recording it, a window of one write) is left
and named in the log and in any SwapFullError, never deleted.
"""

from __future__ import annotations

import errno as _errno
import os
import re
from typing import Optional, Set, Tuple

MAX_RECORD = 16384  # bytes: a pid and some hundred entries; a larger "lock" is not one of ours
_PID_RE = re.compile(rb"\d+\n")
_ENTRY_RE = re.compile(rb"(swap-\d+-\d+\.bin) (\d+) (\d+)\n")
_PARTIAL_RE = re.compile(rb"[\w.\- ]*")  # a last line cut short by a kill mid-write

Proof = Set[Tuple[str, int, int]]  # (name, st_dev, st_ino) of files a run recorded as its own


def parse(content: bytes) -> Optional[Proof]:
    """The entries of the record ``content`` (empty: a run that died before
    writing its pid), or None when it is not a record of infinity."""
    if len(content) > MAX_RECORD:
        return None
    if not content:
        return set()
    first = _PID_RE.match(content)
    if first is None:
        return None
    proof: Proof = set()
    pos = first.end()
    while pos < len(content):
        m = _ENTRY_RE.match(content, pos)
        if m is None:
            return proof if _PARTIAL_RE.fullmatch(content, pos) else None
        proof.add((m.group(1).decode(), int(m.group(2)), int(m.group(3))))
        pos = m.end()
    return proof


def append(lock_fd: int, entries: Proof) -> None:
    """Appends ``entries`` to our record, the lock open as ``lock_fd``. A full
    disk leaves them unrecorded: those files are then kept, not deleted, if
    we die (the flock on them is what protects a live run)."""
    if not entries:
        return
    data = b"".join(f"{n} {dev} {ino}\n".encode() for n, dev, ino in sorted(entries))
    try:
        os.pwrite(lock_fd, data, os.fstat(lock_fd).st_size)
    except OSError as exc:
        if exc.errno != _errno.ENOSPC:
            raise


def entry(name: str, st: os.stat_result) -> Proof:
    """The record entry of the file ``name`` whose stat is ``st``."""
    return {(name, st.st_dev, st.st_ino)}


def proven(proof: Proof, name: str, st: os.stat_result) -> bool:
    """True when ``proof`` records ``name`` with the inode ``st`` is."""
    return (name, st.st_dev, st.st_ino) in proof
