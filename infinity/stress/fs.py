"""Real small filesystems for the stress test's disk faults (root only):
a loop-mounted ext4 image that fills, and one whose device goes away.

Every image and mount point lives under the stress run's own swap root;
nothing outside it is touched.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import struct
import subprocess
from typing import Optional

__all__ = ["loop_ext4", "unmount", "shut_down"]

EXT4_IOC_SHUTDOWN = 0x8004587D   # _IOR('X', 125, __u32): the filesystem fails every I/O from now on
EXT4_GOING_FLAGS_NOLOGFLUSH = 2  # as if the device were pulled: no flush of the journal


def loop_ext4(root: str, name: str, size: int) -> Optional[str]:
    """Mounts a fresh ext4 image of ``size`` bytes at ``root/name`` (the
    image beside it); returns the mount point, or None where this process
    cannot (not root, no mkfs.ext4, no loop devices)."""
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4"):
        return None
    mnt, img = os.path.join(root, name), os.path.join(root, name + ".img")
    os.makedirs(mnt, exist_ok=True)
    with open(img, "wb") as f:
        f.truncate(max(size, 4 << 20))  # ext4 needs a few MiB of its own
    ok = subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", img], capture_output=True).returncode == 0 and \
        subprocess.run(["mount", "-o", "loop", img, mnt], capture_output=True).returncode == 0
    if not ok:
        os.unlink(img)
        return None
    return mnt


def unmount(mnt: str, lazy: bool = False) -> None:
    """Unmounts ``mnt`` (``lazy``: detached now, released when the last open file closes) and removes its image."""
    subprocess.run(["umount"] + (["-l"] if lazy else []) + [mnt], capture_output=True)
    try:
        os.unlink(mnt + ".img")
    except OSError:
        pass


def shut_down(mnt: str) -> None:
    """Makes the ext4 at ``mnt`` fail every read, write and open with EIO,
    as a pulled or dead device does (the kernel's EXT4_IOC_SHUTDOWN)."""
    fd = os.open(mnt, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_NOLOGFLUSH))
    finally:
        os.close(fd)
