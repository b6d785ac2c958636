"""The NVMe tier of the engine: a SwapStore per process, keyed by unit and
buffer kind, with byte counters.

[Note: NVMe homes and the host cache]
With ``offload_params="nvme"`` a unit's compute copy lives in the swap files;
the host tier keeps a *cache* of compute copies in pinned buffers under
``host_memory``. A fetch reads the copy into a cache buffer (if it is not
cached) and copies it up to the device; when the cache needs room it drops the
clean copy whose next use in the trace is furthest away (the device tier's rule),
never one a transfer still reads. With ``offload_optimizer="nvme"`` the fp32
master and the Adam moments live in the swap files and come to the host only
for the unit being updated: the optimizer is a pipeline that reads the next
unit's states while the current one is updated and the previous one's are
written back. A unit's fp32 gradients stay in a host buffer from its first
gradient to its update; with ``overlap="backward"`` they never touch the disk.
Otherwise they are written to the swap files when the unit's backward is done
and read back by ``step()``. A unit whose state is streamed in chunks sends
its gradients to the swap files chunk by chunk where nothing needs them
whole ([Note: gradients streamed in chunks] in owners/grad_chunks.py).

Where the code is: the cache, its write-back and the reclaim ladder in
host_cache.py; the optimizer state's check-out, read-ahead and check-in in
optstate.py; the pipeline and the updates during backward in schedule.py;
gradient spills in grads.py. This file only names the swap keys and counts
the bytes.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Hashable, List, Optional, Sequence, Tuple

import torch

from ...system import sysinfo
from ...io.swap.dir import make_dir, remove_own_dir
from ...io.swap.store import SwapStore
from ..faults import with_retries
from ..stats import Stats
from ..plan.limits import STAGING_PER_PATH  # See [Note: limits that must agree]

__all__ = ["NvmeTier", "RetryingHandle", "key"]


def key(unit_index: int, kind: str, chunk: Optional[int] = None) -> tuple:
    """Swap key of one unit's buffer: kind is "compute", "master", "exp_avg",
    "exp_avg_sq" (and int8 scales) or "grad"; ``chunk``: the index of one
    chunk of a unit's optimizer state streamed in chunks ([Note: state
    streamed in chunks] in owners/optstate.py), each its own extent."""
    return (unit_index, kind) if chunk is None else (unit_index, kind, chunk)


class NvmeTier:
    """One :class:`~infinity.io.SwapStore` over ``paths``/rank{rank}, preallocated
    to ``capacity_bytes`` so a disk too small fails at start-up (path, bytes
    needed and free named by the store). A missing ``paths`` entry is made
    (0700) and removed again at :meth:`close` if empty."""

    def __init__(self, paths: Sequence[str], capacity_bytes: int, stats: Stats, rank: int = 0,
                 block_size: int = 8 << 20, queue_depth: int = 16, backend: str = "auto", checksum: bool = True):
        dirs = [os.path.join(os.path.abspath(p), f"rank{rank}") for p in paths]
        # The swap roots this tier made (path, fd, fd on its parent): removed
        # at close when empty and still the ones it made. Another rank's
        # folder in one keeps it.
        self._made: List[Tuple[str, int, int]] = []
        try:
            for p in paths:
                fd, pfd = make_dir(os.path.abspath(p))
                if fd >= 0:
                    self._made.append((os.path.abspath(p), fd, pfd))
            self.store = SwapStore(dirs, capacity_bytes=capacity_bytes, block_size=block_size,
                                   queue_depth=queue_depth, staging_bytes=STAGING_PER_PATH * len(dirs) * block_size,
                                   backend=backend, checksum=checksum,
                                   roots=[os.path.abspath(p) for p in paths])  # rank folders: no link followed
        except BaseException:
            self._remove_made()
            raise
        _warn_if_ram_backed(paths)
        self.stats = stats
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.peak_bytes = 0
        self._sizes: dict = {}
        self.retried: list = []  # one line per transient error retried (see faults.with_retries)
        self._writes: dict = {}  # key -> its last write (see _settle)
        self._writes_lock = threading.Lock()

    @property
    def sum_chunk_bytes(self):
        """Chunk of the sums a producer may pass to :meth:`write` (None: none taken)."""
        return self.store.sum_chunk_bytes

    def write(self, k: Hashable, t: torch.Tensor, crcs=None, keep_old: bool = False) -> "RetryingHandle":
        """Starts writing ``t`` (a contiguous CPU tensor, unchanged until the handle completes);
        ``crcs``: its sums, from the producer (:meth:`SwapStore.write <infinity.io.SwapStore.write>`);
        ``keep_old``: to fresh extents, the old ones kept until :meth:`commit` or
        :meth:`rollback` ([Note: copy-on-write keys] in io/swap/store.py).
        Transient failures are retried when the handle is waited for."""
        n = t.numel() * t.element_size()
        if k not in self._sizes:
            self._sizes[k] = n
            self.used_bytes += n
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        self.stats.moved("nvme_write", n)
        self._settle(k)
        h = RetryingHandle(lambda: self.store.write(k, t, crcs, keep_old=keep_old), self.retried)
        with self._writes_lock:
            self._writes[k] = h
        return h

    def read(self, k: Hashable, out: torch.Tensor) -> "RetryingHandle":
        """Starts reading key ``k`` into ``out`` (exactly its byte size); a
        transient failure or checksum mismatch is read again when waited for."""
        self.stats.moved("nvme_read", out.numel() * out.element_size())
        self._settle(k)
        return RetryingHandle(lambda: self.store.read(k, out), self.retried)

    def _settle(self, k: Hashable) -> None:
        """Waits for the last write of ``k`` (retrying it if it failed) before
        another transfer of ``k``: a retry submitted after a later write would
        overwrite it, and a read after a failed write would return the old bytes."""
        with self._writes_lock:  # the compute and host threads both transfer
            w = self._writes.get(k)
        if w is not None:
            w.wait()
            with self._writes_lock:
                if self._writes.get(k) is w:
                    del self._writes[k]

    def reserve(self, k: Hashable, nbytes: int) -> bool:
        """Fresh extents for the next ``keep_old`` write of ``k``; False when the swap files have no room."""
        return self.store.reserve(k, nbytes)

    def unreserve(self, k: Hashable) -> None:
        """Gives back what :meth:`reserve` set aside for ``k`` and no write used."""
        self.store.unreserve(k)

    def commit(self, k: Hashable) -> None:
        """``k``'s ``keep_old`` write stands: the old extents are freed."""
        self.store.commit(k)

    def rollback(self, k: Hashable) -> None:
        """``k`` holds what it held before its ``keep_old`` write again (once that write ended)."""
        self._settle(k)
        self.store.rollback(k)

    def bytes_of(self, keys) -> int:
        """Bytes the swap files hold for ``keys`` (as first written; 0 for a key never written)."""
        return sum(self._sizes.get(k, 0) for k in keys)

    def __contains__(self, k: Hashable) -> bool:
        return k in self.store

    def close(self) -> None:
        """Closes the store (its files go), then removes the swap roots this
        tier made if they are empty. Idempotent."""
        try:
            self.store.close()
        finally:
            self._remove_made()

    def _remove_made(self) -> None:
        made, self._made = self._made, []
        for path, fd, pfd in made:
            try:
                remove_own_dir(pfd, os.path.basename(path), fd)
            except OSError:
                pass  # left in place; nothing of the run is in an empty folder
            finally:
                os.close(fd)
                os.close(pfd)


class RetryingHandle:
    """An I/O handle whose :meth:`wait` submits the transfer again after a
    transient failure (faults.with_retries); waited once, it keeps its outcome."""

    __slots__ = ("_submit", "_handle", "_log", "_error", "_waited", "_lock")

    def __init__(self, submit, log: list):
        self._submit, self._log = submit, log
        self._handle = submit()
        self._error: Optional[BaseException] = None
        self._waited = False
        self._lock = threading.Lock()  # the deferred frees and a later transfer of the key may both wait

    def done(self) -> bool:
        return self._waited or self._handle.done()

    def wait(self) -> None:
        """Blocks until the transfer is done; raises its error once retries are spent (and again on later waits)."""
        with self._lock:
            if not self._waited:
                try:
                    self._handle = with_retries(self._submit, self._handle, self._log)
                except BaseException as e:
                    self._error = e
                finally:
                    self._waited = True
                    self._submit = None  # it holds the transfer's tensor: not one byte longer than needed
        if self._error is not None:
            raise self._error


def _warn_if_ram_backed(paths: Sequence[str]) -> None:
    """A swap path on tmpfs or ramfs holds the "NVMe" tier in RAM: said once per path."""
    for p in paths:
        mp, fstype, _ = sysinfo.mount_of(p)
        if fstype in sysinfo.RAM_FILESYSTEMS:
            warnings.warn(f"infinity: swap path {p!r} is on {fstype} (mounted at {mp}), a RAM-backed filesystem: "
                          "the NVMe tier there takes RAM, not disk. Put Config.swap_paths on a local NVMe/SSD "
                          "filesystem (ext4, xfs); `infinity doctor` checks a path", RuntimeWarning, stacklevel=4)
