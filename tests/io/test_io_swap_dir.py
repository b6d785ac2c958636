"""Swap directories: who owns what in them ([Note: ownership of swap files],
infinity/io/swap/dir.py), what close() removes, dead runs' files reclaimed, and
the named errors for paths that cannot be used.

Filesystem cases run on a real loop-mounted ext4 when root allows (read-only
remount, ``umount -l``, a small disk); they skip, saying why, otherwise. The
Python engine is enough here: none of this depends on the engine.
"""

import errno
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import time

import pytest
import torch

from infinity.io import (StoreLockedError, SwapFullError, SwapPathNotDirectoryError, SwapPathPermissionError,
                         SwapPathReadOnlyError, SwapPathUnsafeError, SwapStore)

MiB = 1 << 20
LOCK = ".infinity-swap.lock"


def store(path, **kw):
    kw.setdefault("capacity_bytes", 1 * MiB)
    return SwapStore(path, backend="python", block_size=65536, staging_bytes=256 * 1024, **kw)


def private_dir(path):
    path.mkdir()
    path.chmod(0o700)
    return path


def fs_free(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


# -- row 5: the lock file is never followed, and never written once in place -----------

def test_planted_lock_file_is_never_followed_or_overwritten(tmp_path):
    d = private_dir(tmp_path / "swap")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    os.symlink(victim, d / LOCK)
    lock = re.escape(str(d / LOCK))
    with pytest.raises(SwapPathUnsafeError, match=rf"'{lock}' is a symbolic link .*rm '{lock}'"):
        store(d)
    assert victim.read_text() == "precious\n" and os.path.islink(d / LOCK)
    os.unlink(d / LOCK)
    (d / LOCK).write_text("my notes\n")  # a regular file of that name that is no lock of ours
    with pytest.raises(SwapPathUnsafeError, match="is not a lock file of infinity.*neither overwrites nor deletes"):
        store(d)
    assert (d / LOCK).read_text() == "my notes\n"
    assert sorted(os.listdir(d)) == [LOCK]  # no data file, no temporary lock left


def test_lock_without_hard_links(tmp_path, monkeypatch):
    """Where linkat is refused (FAT, some FUSE) the lock is made in place."""
    def no_link(*a, **kw):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)
    d = tmp_path / "swap"
    with store(d):
        assert (d / LOCK).read_text().split("\n")[0] == str(os.getpid())
        with pytest.raises(StoreLockedError):
            store(d)
    assert not d.exists()


# -- row 8: close() removes only what still is its own -------------------------------

def test_close_leaves_the_next_store_its_files_after_rm_rf(tmp_path):
    d = tmp_path / "swap"
    a = store(d)
    a.write("k", torch.arange(1000.)).wait()
    shutil.rmtree(d)  # under a live store
    b = store(d)      # takes the new directory
    b_files = sorted(os.listdir(d))
    a.close()
    assert sorted(os.listdir(d)) == b_files  # b's lock and data file are still there
    with pytest.raises(StoreLockedError):
        store(d)  # so a third run is refused
    x = torch.arange(500.)
    b.write("x", x).wait()
    y = torch.empty_like(x)
    b.read("x", y).wait()
    assert torch.equal(x, y)
    b.close()
    assert not d.exists()


def test_close_after_lazy_umount_removes_its_own_files(ext4):
    root = os.open(ext4, os.O_RDONLY | os.O_DIRECTORY)  # keeps the detached filesystem reachable
    try:
        s = store(ext4 / "swap")
        s.write("k", torch.arange(1000.)).wait()
        assert subprocess.run(["umount", "-l", str(ext4)]).returncode == 0
        s.close()
        assert sorted(os.listdir(root)) == ["lost+found"]  # its files and the directory it made are gone
    finally:
        os.close(root)


# -- row 9: dead runs' files are reclaimed ----------------------------------------------

def _killed_run(path, capacity):
    """A child process that opens a store on ``path``, then is killed by SIGKILL."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(rfd)
            store(path, capacity_bytes=capacity)
            os.write(wfd, b"open\n")
            time.sleep(60)
        except BaseException as exc:
            os.write(wfd, f"{type(exc).__name__}: {exc}\n".encode())
        finally:
            os._exit(code)
    os.close(wfd)
    with os.fdopen(rfd) as r:
        said = r.readline().strip()
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert said == "open", said


def test_files_of_killed_runs_are_reclaimed(ext4, caplog):
    d = ext4 / "swap"
    cap = int(fs_free(ext4) * 0.4) // MiB * MiB  # two such runs fit, three do not
    for _ in range(3):
        _killed_run(d, cap)
    with caplog.at_level(logging.WARNING, logger="infinity.io"):
        s = store(d, capacity_bytes=cap)
    s.close()
    msg = [r.getMessage() for r in caplog.records if "reclaimed" in r.getMessage()]
    assert len(msg) == 1 and "reclaimed 2 file(s)" in msg[0] and str(d) in msg[0], msg
    assert int(msg[0].split(" bytes")[0].split()[-1]) >= cap  # the dead run's data file
    # A dead run's file it may not remove (another uid's) stays, and a store
    # that then lacks the space names it.
    other = d / "swap-4999999-0.bin"  # beyond pid_max: no live process
    with open(other, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 2 * cap)
    os.chown(other, 65534, 65534)
    with pytest.raises(SwapFullError, match=r"swap-4999999-0\.bin' \(\d+ bytes, owned by uid 65534\)"):
        store(d, capacity_bytes=cap)
    assert other.exists()


# -- row 12: close after a failure, directories checked, named errors -----------------

def test_close_tears_down_after_a_failed_unlink(tmp_path, monkeypatch, caplog):
    d = tmp_path / "swap"
    s = store(d)

    def eio(*a, **kw):
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger="infinity.io"):
        m.setattr(os, "unlink", eio)
        s.close()
    closing = [r.getMessage() for r in caplog.records]
    s.close()  # twice: fine
    # The lock's fd was closed (its flock released): a new store in this
    # process takes the directory, reclaiming what the failed unlinks left.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="infinity.io"), store(d) as s2:
        s2.write("k", torch.ones(10)).wait()
    assert any("reclaimed 2 file(s)" in r.getMessage() for r in caplog.records)
    assert os.listdir(d) == []
    # And the failure was said, naming the files.
    assert any("Input/output error" in m and LOCK in m and "swap-" in m for m in closing), closing


def test_existing_directory_open_to_others_is_refused(tmp_path):
    d = tmp_path / "swap"
    d.mkdir()
    d.chmod(0o755)
    with pytest.raises(SwapPathUnsafeError, match=rf"has mode 0755.*chmod 700 '{re.escape(str(d))}'"):
        store(d)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o755 and os.listdir(d) == []


def test_swap_path_that_is_a_regular_file(tmp_path):
    f = tmp_path / "swapfile"
    f.write_text("data\n")
    p = re.escape(str(f))
    with pytest.raises(SwapPathNotDirectoryError, match=rf"'{p}' is not a directory; remove it or choose"):
        store(f)
    with pytest.raises(SwapPathNotDirectoryError, match=rf"'{p}' is not a directory"):
        store(f / "sub")  # a component of the path is the file
    assert f.read_text() == "data\n"


def test_read_only_filesystem_is_named(ext4):
    private_dir(ext4 / "swap")
    r = subprocess.run(["mount", "-o", "remount,ro", str(ext4)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")
    p = re.escape(str(ext4 / "swap"))
    with pytest.raises(SwapPathReadOnlyError, match=rf"'{p}' is on a read-only filesystem.*remount"):
        store(ext4 / "swap")
    with pytest.raises(SwapPathReadOnlyError, match=rf"'{re.escape(str(ext4 / 'new'))}'.*read-only.*remount"):
        store(ext4 / "new")


def _in_child_as(uid, fn):
    """``fn()``'s exception as (type name, message), run in a child process as ``uid``."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(rfd)
            os.setgid(uid)
            os.setuid(uid)
            fn()
            os.write(wfd, b"none\tno error\n")
        except BaseException as exc:
            os.write(wfd, f"{type(exc).__name__}\t{exc}\n".encode())
        finally:
            os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd) as r:
        out = r.read().strip().split("\t", 1)
    os.waitpid(pid, 0)
    return out


def test_path_that_cannot_be_created_is_named(tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    if os.geteuid() == 0:  # root may write anywhere: try as nobody
        tmp_path.chmod(0o755)
        parent.chmod(0o755)
        name, msg = _in_child_as(65534, lambda: store(parent / "swap"))
        assert name == "SwapPathPermissionError", (name, msg)
        assert f"'{parent / 'swap'}'" in msg and "uid 65534" in msg and "mkdir -m 700" in msg, msg
    else:
        parent.chmod(0o500)
        try:
            with pytest.raises(SwapPathPermissionError, match=rf"'{re.escape(str(parent / 'swap'))}'.*mode 0500"):
                store(parent / "swap")
        finally:
            parent.chmod(0o700)


def test_dead_runs_lock_and_temporary_lock_are_reclaimed(tmp_path, caplog):
    """What a run killed while taking the lock leaves: a lock holding a dead
    pid (or nothing) and a temporary lock, all unflocked."""
    d = private_dir(tmp_path / "swap")
    (d / LOCK).write_text("4999999\n")
    (d / f"{LOCK}.4999999.00ff").write_text("4999999\n")
    (d / "unrelated.bin").write_text("keep")
    with caplog.at_level(logging.WARNING, logger="infinity.io"), store(d):
        assert (d / LOCK).read_text().split("\n")[0] == str(os.getpid())  # a new lock, ours
        with pytest.raises(StoreLockedError, match=f"pid {os.getpid()}"):
            store(d)
    assert any("reclaimed 2 file(s)" in r.getMessage() for r in caplog.records)
    assert sorted(os.listdir(d)) == ["unrelated.bin"]
