"""Swap directories (infinity/io/swap_dir.py): made 0700 or checked, and the
named errors for paths that cannot be used.

Filesystem cases run on a real loop-mounted ext4 when root allows (read-only
remount); they skip, saying why, otherwise. The
Python engine is enough here: none of this depends on the engine.
"""

import os
import re
import shutil
import stat
import subprocess

import pytest

from infinity.io import (SwapPathNotDirectoryError, SwapPathPermissionError, SwapPathReadOnlyError,
                         SwapPathUnsafeError, SwapStore)

MiB = 1 << 20


def store(path, **kw):
    kw.setdefault("capacity_bytes", 1 * MiB)
    return SwapStore(path, backend="python", block_size=65536, staging_bytes=256 * 1024, **kw)


def private_dir(path):
    path.mkdir()
    path.chmod(0o700)
    return path


@pytest.fixture
def ext4(tmp_path):
    """A fresh loop-mounted ext4 of 56 MiB, unmounted (lazily) afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root to loop-mount an ext4 image")
    if not shutil.which("mkfs.ext4"):
        pytest.skip("mkfs.ext4 is not installed")
    img, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    with open(img, "wb") as f:
        f.truncate(56 * MiB)
    r = subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"mkfs.ext4 failed: {r.stderr.strip()}")
    mnt.mkdir()
    r = subprocess.run(["mount", "-o", "loop", str(img), str(mnt)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot loop-mount an ext4 image here: {r.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


# -- row 12: directories checked, named errors ------------------------------------------

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
