"""The shared host pool of one engine: the host tier under one lock, the
reclaim ladder that makes room when a buffer does not fit, frees deferred
until a write from the buffer is done, and the soft cap memory pressure sets.

[Note: the host room]
Every owner with host buffers (the host cache, the gradients, the optimizer
state, values at ``initialize``) takes and gives them back here, under this
lock; none reaches into another owner's buffers. When the pool is full,
:meth:`HostRoom.acquire` climbs policy.HOST_ROOM_LADDER: writes already done
free their buffers, the owners' rungs give back what they can (a cached
compute copy, an update in flight, state read ahead), a write still in
flight is waited for. The rungs are the owners': they are registered once,
where the engine builds its parts (core.py), the schedule's when it first
exists (``Engine.attach``). The lock is re-entrant and can be let go of
entirely while a rung waits for an update that needs it.
"""

from __future__ import annotations

import threading
from typing import Callable, List, Optional, Tuple

import torch

from ...io.errors import PoolExhausted
from ..plan.placement import nbytes, round_pool
from .mover import on_host_job
from .tiers import BudgetError, HostTier

__all__ = ["HostRoom", "OwnedLock"]


class OwnedLock:
    """A re-entrant lock that can be let go of entirely for a wait and taken
    back to the same depth (an update the waiter waits for needs it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: Optional[int] = None
        self._depth = 0

    def __enter__(self) -> "OwnedLock":
        me = threading.get_ident()
        if self._owner != me:
            self._lock.acquire()
            self._owner = me
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
            self._lock.release()

    def wait_unlocked(self, fn: Callable[[], object]) -> object:
        """Runs ``fn`` with the lock let go of (if this thread holds it)."""
        if self._owner != threading.get_ident():
            return fn()
        depth, self._depth, self._owner = self._depth, 0, None
        self._lock.release()
        try:
            return fn()
        finally:
            self._lock.acquire()
            self._owner, self._depth = threading.get_ident(), depth


def _no(*_args, **_kw) -> bool:
    return False


class HostRoom:
    """The host tier ``tier`` shared by an engine's owners (see [Note: the host room]).

    ``cap_bytes``: while memory is tight (pressure.py), compute copies are
    taken only while the pool uses less than this; None: no cap."""

    def __init__(self, tier: HostTier):
        self.tier = tier
        self.lock = OwnedLock()
        self.cap_bytes: Optional[int] = None
        self._deferred: List[Tuple[object, object]] = []  # (I/O handle, buffer) freed when the write is done
        self._evict: Callable[..., int] = _no             # evict_one(protect): bytes freed (the host cache)
        self._wait_update: Callable[[], bool] = _no       # wait for one update in flight (the schedule)
        self._drop_read_ahead: Callable[[object], bool] = _no  # give back state read ahead (optimizer state)

    def set_rungs(self, evict_one: Callable[..., int], drop_read_ahead: Callable[[object], bool]) -> None:
        """The owners' rungs of the ladder (see policy.HOST_ROOM_LADDER)."""
        self._evict, self._drop_read_ahead = evict_one, drop_read_ahead

    def set_wait_update(self, wait_one: Callable[[], bool]) -> None:
        """The schedule's rung: waits for the oldest update in flight (True if one was)."""
        self._wait_update = wait_one

    @property
    def free_bytes(self) -> int:
        return self.tier.free_bytes

    @property
    def used_bytes(self) -> int:
        return self.tier.used_bytes

    # -- buffers ----------------------------------------------------------------------

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed host buffer kept for good (a home); evicts cached compute
        copies to make room."""
        with self.lock:
            while True:
                try:
                    return self.tier.alloc(numel, dtype)
                except PoolExhausted:
                    if self._make_room(None):
                        continue
                    raise BudgetError(f"host tier: {nbytes(numel, dtype)} bytes needed for a permanent buffer, "
                                      f"{self.tier.free_bytes} of {self.tier.pool.capacity_bytes} free; "
                                      "raise host_memory") from None

    def free(self, t: torch.Tensor) -> None:
        """Gives back a buffer of :meth:`alloc` (a home spilled to NVMe)."""
        with self.lock:
            self.tier.free(t)

    def acquire(self, numel: int, dtype: torch.dtype, zero: bool = False, protect=None, compute: bool = False):
        """(tensor, handle) of a transient host buffer, climbing the reclaim
        ladder (policy.HOST_ROOM_LADDER) until it fits; ``protect``: the unit
        the buffer is for (never evicted for it). ``compute``: a compute copy,
        taken from the top of the pool (fp32 state and gradients from the
        bottom), so neither class fragments the other's free space."""
        with self.lock:
            if compute and self.cap_bytes is not None:
                # Under memory pressure the compute-copy cache keeps below its cap (see pressure.py).
                self.evict_to(self.cap_bytes - round_pool(nbytes(numel, dtype)), protect)
            while True:
                try:
                    return self.tier.acquire(numel, dtype, zero, high=compute)
                except PoolExhausted:
                    if self._make_room(protect):
                        continue
                    # Any thread but the optimizer's own may wait for its work
                    # (on CUDA backward hooks run on autograd's device thread).
                    if not on_host_job() and self.lock.wait_unlocked(self._wait_update):
                        continue
                    if self._drop_read_ahead(protect):
                        continue
                    raise BudgetError(f"host tier: {nbytes(numel, dtype)} bytes needed, {self.tier.free_bytes} of "
                                      f"{self.tier.pool.capacity_bytes} free and nothing left to evict; "
                                      "raise host_memory or lower prefetch_depth") from None

    def try_acquire(self, numel: int, dtype: torch.dtype):
        """(tensor, handle) of a transient host buffer if the pool has room
        now, else None: nothing is evicted or waited for (a buffer that is
        only worth having when free: a speculative update's undo state)."""
        with self.lock:
            self.release_finished(block=False)
            try:
                return self.tier.acquire(numel, dtype)
            except PoolExhausted:
                return None

    def release(self, buf) -> None:
        with self.lock:
            self.tier.release(buf)

    def _make_room(self, protect) -> bool:
        """The ladder's first three rungs (call with the lock)."""
        return bool(self.release_finished(block=False) or self._evict(protect)
                    or self.release_finished(block=True))

    def evict_to(self, used_bytes: int, protect=None) -> int:
        """Evicts cached compute copies until the pool uses at most ``used_bytes``
        (or nothing is left to evict); returns the bytes freed."""
        freed = 0
        with self.lock:
            while self.tier.used_bytes > used_bytes:
                got = self._evict(protect)
                if not got:
                    break
                freed += got
        return freed

    # -- deferred frees -----------------------------------------------------------------

    def defer_release(self, handle, buf) -> None:
        """Frees ``buf`` once ``handle`` (a write from it) completes."""
        with self.lock:
            self._deferred.append((handle, buf))

    def release_finished(self, block: bool) -> bool:
        """Frees buffers whose writes finished; with ``block`` waits for the
        oldest if none has. True if anything was freed."""
        with self.lock:
            freed, keep = False, []
            for h, buf in self._deferred:
                if h.done():
                    h.wait()  # raises the write's error, if any
                    self.tier.release(buf)
                    freed = True
                else:
                    keep.append((h, buf))
            if not freed and block and keep:
                h, buf = keep.pop(0)
                h.wait()
                self.tier.release(buf)
                freed = True
            self._deferred = keep
            return freed

    def wait_deferred(self) -> None:
        """Waits (without the lock) for the writes of deferred frees queued so far."""
        with self.lock:
            handles = [h for h, _ in self._deferred]
        for h in handles:
            h.wait()

    # -- teardown --------------------------------------------------------------------

    def close(self) -> None:
        """Waits for every deferred write (none may still read a buffer when
        the pool goes); raises the first error met, after waiting for all.
        The caller closes the NVMe tier, then :meth:`close_pool`."""
        first = None
        with self.lock:
            for h, _ in self._deferred:
                try:
                    h.wait()
                except Exception as e:  # noqa: BLE001 - the others are still waited for
                    first = first or e
            self._deferred = []
        if first is not None:
            raise first

    def close_pool(self) -> None:
        self.tier.close()
