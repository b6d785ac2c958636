"""Where checkpoints live under a checkpoint folder, and how one becomes
complete.

[Note: a checkpoint is complete or invisible]
``save_checkpoint(root, ...)`` writes ``root/.step-<N>.partial`` (files
created new, fsynced as they close), then ``manifest.json`` into it (written
under a temporary name, fsynced, renamed), fsyncs the folder, renames it to
``root/step-<N>`` and fsyncs ``root``. A folder is a checkpoint only when it
is named ``step-<N>`` and holds a manifest that parses, so a kill at any
point leaves the previous checkpoints as they were and never makes a partial
one the newest. Old checkpoints (``keep_last``) and partial folders of dead
savers (dead: the saver's lock is ours now, see [Note: a checkpoint folder
is owned like a swap folder] in owner.py) are removed only after the new
one is complete, and only folders of ours (no link, no file): each is renamed to a
hidden ``.removing-*`` name (no longer a checkpoint, at once) and deleted on
a thread, because unlinking a checkpoint's files took 0.23-0.27 s a GB on
the development machine's ext4 (a fifth of a save), time the training need
not wait for. The next save into the folder waits for those deletions
first (their space counts); a kill in the middle leaves a hidden folder the
next prune removes.

Finding the newest checkpoint reads only what it must: a ``step-<N>`` entry
that is a link, a file, a folder of another uid, or whose manifest is
missing, unreadable or malformed is skipped with a RuntimeWarning naming it
and why; an I/O error other than those (EIO) is raised naming the path, so
a failing disk never reads as "no complete checkpoint".
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import threading
import uuid
import warnings
from typing import Dict, List, Optional, Tuple

from . import owner
from .safe_files import MAX_MANIFEST_BYTES, CorruptCheckpointError, parse_json, read_member

__all__ = ["MANIFEST", "FORMAT_VERSION", "step_dir_name", "partial_dir", "commit", "complete_checkpoints",
           "resolve", "prune", "fsync_dir", "write_json_atomic", "wait_removals", "is_checkpoint", "no_checkpoint"]

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_STEP = re.compile(r"step-(\d+)$")
_REMOVING = ".removing-"
_removals: Dict[str, List[threading.Thread]] = {}  # checkpoint folder -> its deletions under way
_removals_lock = threading.Lock()


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def partial_dir(root: str, step: int) -> str:
    """The folder a checkpoint of ``step`` is written into before it is complete."""
    return os.path.join(root, f".{step_dir_name(step)}.partial")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: str, obj: object) -> None:
    """Writes ``obj`` as JSON at ``path`` through a fsynced temporary file renamed into place."""
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def commit(root: str, partial: str, step: int) -> str:
    """Renames the written ``partial`` folder to ``root/step-<N>`` (replacing
    an older checkpoint of the same step only once the new one is in place)
    and makes both renames durable; returns the checkpoint's path."""
    fsync_dir(partial)
    final = os.path.join(root, step_dir_name(step))
    old = None
    if os.path.lexists(final):
        old = os.path.join(root, f".{step_dir_name(step)}.replaced")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(partial, final)
    fsync_dir(root)
    if old is not None:
        remove_later(root, old)
    return final


# Errnos that make one step folder unreadable (reported by name, skipped);
# any other (EIO, ...) while scanning is raised, naming the path: a failing
# disk is never "no complete checkpoint".
_SKIP_ERRNOS = (errno.ENOENT, errno.EACCES, errno.EPERM, errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.ENXIO)


def _scan_error(path: str, exc: OSError) -> OSError:
    why = os.strerror(exc.errno) if exc.errno else exc.strerror  # (not a reader's message naming the path again)
    return OSError(exc.errno, f"cannot read {path} while looking for the newest checkpoint: {why}; "
                              "check the disk (dmesg) or pass the step-<N> folder to load explicitly")


def _manifest_problem(path: str) -> Optional[str]:
    """Why ``path`` (a step-<N> folder) is not a complete checkpoint, or None."""
    try:
        m = parse_json(os.path.join(path, MANIFEST), read_member(path, MANIFEST, MAX_MANIFEST_BYTES))
    except CorruptCheckpointError as e:
        return str(e)
    except OSError as e:
        if e.errno not in _SKIP_ERRNOS:
            raise _scan_error(os.path.join(path, MANIFEST), e) from None
        return f"{os.path.join(path, MANIFEST)}: unreadable ({e.strerror})"
    if not isinstance(m, dict) or m.get("format") != "infinity-checkpoint":
        return f"{os.path.join(path, MANIFEST)}: not an infinity checkpoint manifest"
    return None


def _step_problem(path: str) -> Optional[str]:
    """Why the step-<N> entry ``path`` is not one of our complete checkpoints, or None."""
    try:
        st = os.lstat(path)
    except OSError as e:
        if e.errno not in _SKIP_ERRNOS:
            raise _scan_error(path, e) from None
        return f"{path}: unreadable ({e.strerror})"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path}: not a folder (a link or a file); infinity follows no link out of a checkpoint folder"
    if not owner.owned_by_us(st):
        return (f"{path}: owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}, so not trusted "
                f"(chown {os.geteuid()} '{path}' if you trust it)")
    return _manifest_problem(path)


def complete_checkpoints(root: str) -> List[Tuple[int, str]]:
    """(step, path) of the complete checkpoints under ``root``, oldest first.
    A ``step-<N>`` entry that is not a folder of ours holding a manifest
    that parses is skipped with a RuntimeWarning naming it and why; an I/O
    error other than a missing or unreadable entry is raised naming the path."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    except OSError as e:
        raise _scan_error(root, e) from None
    out = []
    for name in names:
        m = _STEP.fullmatch(name)
        if not m:
            continue
        path = os.path.join(root, name)
        why = _step_problem(path)
        if why is None:
            out.append((int(m.group(1)), path))
        else:
            warnings.warn(f"infinity checkpoints: {path} is skipped: {why}", RuntimeWarning, stacklevel=3)
    return sorted(out)


def is_checkpoint(path: str) -> bool:
    """Whether ``path`` itself is meant as one checkpoint (it has a manifest
    entry, whatever it is: reading it then says what is wrong)."""
    return os.path.lexists(os.path.join(path, MANIFEST))


def resolve(path: str) -> str:
    """``path`` itself if it is a checkpoint, else the newest complete one
    under it; FileNotFoundError naming what was looked for otherwise."""
    path = os.fspath(path)
    if is_checkpoint(path):
        return path
    found = complete_checkpoints(path)
    if found:
        return found[-1][1]
    raise no_checkpoint(path)


def no_checkpoint(path: str) -> FileNotFoundError:
    """The error for a folder with no complete checkpoint (the partial ones named)."""
    if not os.path.isdir(path):
        return FileNotFoundError(f"load_checkpoint: {path!r} does not exist")
    partial = [n for n in os.listdir(path) if n.endswith(".partial")]
    hint = f" ({len(partial)} incomplete: {sorted(partial)}; a save was interrupted)" if partial else ""
    return FileNotFoundError(f"load_checkpoint: no complete checkpoint in {path!r}: neither a {MANIFEST} there "
                             f"nor a step-<N> folder holding one{hint}")


def prune(root: str, keep_last: Optional[int], keep: str) -> List[str]:
    """Removes complete checkpoints beyond the newest ``keep_last`` (never
    ``keep``) and partial folders left by earlier saves; returns what went
    (gone from the folder at once, deleted in the background: see the note)."""
    gone = []
    for name in os.listdir(root):
        if name.startswith(_REMOVING) or (name.startswith(".step-") and name.endswith((".partial", ".replaced"))):
            if _own_folder(os.path.join(root, name)):
                remove_later(root, os.path.join(root, name))
                gone.append(name)
    if keep_last is not None:
        done = complete_checkpoints(root)
        for _, path in done[:max(0, len(done) - keep_last)]:
            if os.path.abspath(path) != os.path.abspath(keep):
                remove_later(root, path)
                gone.append(os.path.basename(path))
    return gone


def _own_folder(path: str) -> bool:
    """``path`` is a folder of ours (not a link, not a file): one a save of ours may have left."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and owner.owned_by_us(st)


def remove_later(root: str, path: str) -> None:
    """Renames ``path`` (a folder in ``root``) to a hidden name of its own
    and deletes it on a thread (:func:`wait_removals` waits for it)."""
    hidden = os.path.join(root, f"{_REMOVING}{uuid.uuid4().hex}")
    try:
        os.rename(path, hidden)
    except FileNotFoundError:
        return
    t = threading.Thread(target=shutil.rmtree, args=(hidden,), kwargs={"ignore_errors": True},
                         name="infinity-ckpt-prune")  # not a daemon: an exiting process finishes it
    with _removals_lock:
        _removals.setdefault(os.path.abspath(root), []).append(t)
    t.start()


def wait_removals(root: str) -> None:
    """Waits until the deletions :func:`prune` started in ``root`` are done."""
    with _removals_lock:
        threads = _removals.pop(os.path.abspath(root), [])
    for t in threads:
        t.join()
