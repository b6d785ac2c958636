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
and read back by ``step()``.

Where the code is: the cache, its write-back and the reclaim ladder in
host_cache.py; the optimizer state's check-out, read-ahead and check-in in
optstate.py; the pipeline and the updates during backward in schedule.py;
gradient spills in grads.py. This file only names the swap keys and counts
the bytes.
"""

from __future__ import annotations

import os
from typing import Hashable, Sequence

import torch

from ..io.swap_store import IOHandle, SwapStore
from .stats import Stats

__all__ = ["NvmeTier", "key"]


def key(unit_index: int, kind: str) -> tuple:
    """Swap key of one unit's buffer: kind is "compute", "master", "exp_avg", "exp_avg_sq" or "grad"."""
    return (unit_index, kind)


class NvmeTier:
    """One :class:`~infinity.io.SwapStore` over ``paths``/rank{rank}, preallocated
    to ``capacity_bytes`` so a disk too small fails at start-up (path, bytes
    needed and free named by the store)."""

    def __init__(self, paths: Sequence[str], capacity_bytes: int, stats: Stats, rank: int = 0,
                 block_size: int = 8 << 20, queue_depth: int = 16, backend: str = "auto", checksum: bool = True):
        dirs = [os.path.join(os.path.abspath(p), f"rank{rank}") for p in paths]
        for p in paths:
            os.makedirs(os.path.abspath(p), mode=0o700, exist_ok=True)
        self.store = SwapStore(dirs, capacity_bytes=capacity_bytes, block_size=block_size,
                               queue_depth=queue_depth, staging_bytes=2 * len(dirs) * block_size,
                               backend=backend, checksum=checksum)
        self.stats = stats
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.peak_bytes = 0
        self._sizes: dict = {}

    @property
    def sum_chunk_bytes(self):
        """Chunk of the sums a producer may pass to :meth:`write` (None: none taken)."""
        return self.store.sum_chunk_bytes

    def write(self, k: Hashable, t: torch.Tensor, crcs=None) -> IOHandle:
        """Starts writing ``t`` (a contiguous CPU tensor, unchanged until the handle completes);
        ``crcs``: its sums, from the producer (:meth:`SwapStore.write <infinity.io.SwapStore.write>`)."""
        n = t.numel() * t.element_size()
        if k not in self._sizes:
            self._sizes[k] = n
            self.used_bytes += n
            self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        self.stats.moved("nvme_write", n)
        return self.store.write(k, t, crcs)

    def read(self, k: Hashable, out: torch.Tensor) -> IOHandle:
        """Starts reading key ``k`` into ``out`` (exactly its byte size)."""
        self.stats.moved("nvme_read", out.numel() * out.element_size())
        return self.store.read(k, out)

    def __contains__(self, k: Hashable) -> bool:
        return k in self.store

    def close(self) -> None:
        self.store.close()
