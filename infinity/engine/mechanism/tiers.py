"""Byte budgets of the device and host tiers, and the memory behind them.

Mechanism only: these classes hand out and take back bytes under a hard
budget and count peaks; which unit lives where is decided by the engine.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from ...config.runtime import format_bytes
from ...io.extent_allocator import ExtentAllocator
from ...system import sysinfo
from ..plan.limits import DEVICE_ALIGN  # See [Note: limits that must agree]

__all__ = ["DeviceTier", "HostTier", "BudgetError", "host_budget"]


class BudgetError(MemoryError):
    """A tier's budget cannot hold what is asked; the message names the bytes."""


class DeviceTier:
    """The device tier: one preallocated arena for compute copies plus counted
    fixed bytes (device-resident optimizer state) and transient bytes
    (gradients between autograd and their copy to the host).

    ``budget_bytes`` bounds arena + fixed + transient at every moment. A
    preallocated arena means no allocator calls (and, on the CPU, no page
    faults) on the hot path, and the budget is exact.
    """

    def __init__(self, device: torch.device, budget_bytes: int, arena_bytes: int, transient_reserve: int,
                 fixed_bytes: int = 0):
        if arena_bytes + transient_reserve + fixed_bytes > budget_bytes:
            raise BudgetError(f"device tier: arena {arena_bytes} + transient {transient_reserve} + fixed "
                              f"{fixed_bytes} bytes exceed the budget of {budget_bytes} bytes")
        self.device = device
        self.budget_bytes = budget_bytes
        arena_bytes = arena_bytes // DEVICE_ALIGN * DEVICE_ALIGN  # down: the budget is a hard bound
        self.arena = torch.empty(arena_bytes, dtype=torch.uint8, device=device)
        self._alloc = ExtentAllocator(arena_bytes, DEVICE_ALIGN)
        self.transient_reserve = transient_reserve
        self.fixed_bytes = fixed_bytes
        self._transient = 0
        self._lock = threading.Lock()
        self.peak_bytes = fixed_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of model state on the device now (arena ranges + fixed + transient)."""
        return self._alloc.used_bytes + self.fixed_bytes + self._transient

    @property
    def arena_bytes(self) -> int:
        return self._alloc.capacity

    @property
    def arena_free_bytes(self) -> int:
        return self._alloc.free_bytes

    def round(self, nbytes: int) -> int:
        return self._alloc.round(nbytes)

    def _note_peak(self) -> None:
        used = self.used_bytes
        if used > self.peak_bytes:
            self.peak_bytes = used

    @property
    def largest_free_bytes(self) -> int:
        return self._alloc.largest_free()

    def try_alloc(self, nbytes: int, high: bool = False) -> Optional[int]:
        """Offset (bytes) of a new arena range, or None if no free range fits;
        ``high``: the top of the highest free range that fits."""
        off = self._alloc.alloc_high(nbytes) if high else self._alloc.alloc(nbytes)
        if off is not None:
            self._note_peak()
        return off

    def free(self, offset: int) -> None:
        self._alloc.free(offset)

    def view(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The arena range at ``offset`` as a 1-D tensor of ``numel`` elements of ``dtype``."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return self.arena[offset:offset + nbytes].view(dtype)

    def add_fixed(self, nbytes: int) -> None:
        self.fixed_bytes += nbytes
        self._note_peak()

    def add_transient(self, nbytes: int) -> None:
        with self._lock:
            self._transient += nbytes
            self._note_peak()

    def sub_transient(self, nbytes: int) -> None:
        with self._lock:
            self._transient -= nbytes

    @property
    def transient_bytes(self) -> int:
        return self._transient


class HostTier:
    """The host tier: every host buffer of the model state, carved from one
    :class:`~infinity.io.HostPool` of ``capacity_bytes``, which must fit
    ``budget_bytes``. Page-locked when the device is CUDA.

    Buffers are permanent (:meth:`alloc`: homes of host-resident state) or
    transient (:meth:`acquire`/:meth:`release`: the NVMe tier's cache and
    optimizer pipeline). ``need_bytes`` is what the placement needs at least;
    more than the budget is refused with the bytes named. ``device``: the
    engine's device; a CUDA one is the device whose context pins the pool
    (default: the current device).
    """

    def __init__(self, capacity_bytes: int, budget_bytes: int, pin: bool, need_bytes: Optional[int] = None,
                 device: Optional[torch.device] = None, modes=None):
        need = capacity_bytes if need_bytes is None else need_bytes
        if need > budget_bytes:
            raise BudgetError(f"host tier: the model state placed on the host needs {need} bytes "
                              f"({format_bytes(need)}), more than host_memory={budget_bytes} bytes "
                              f"({format_bytes(budget_bytes)}); raise host_memory to at least {need} bytes, or "
                              f"{host_fixes(modes)}")
        self.budget_bytes = budget_bytes
        self.pool = None
        self._buffers = {}  # data_ptr -> pool handle of the buffers kept for good
        self._final_peak = 0  # the pool's peak, kept past close() for stats
        self._closed = False
        if capacity_bytes > 0:
            from ...io.host_pool import HostPool
            # The pool rounds its size up to 4 KiB; round the budget down first so it is never exceeded.
            size = min(capacity_bytes, budget_bytes // HostPool.ALIGN * HostPool.ALIGN or HostPool.ALIGN)
            cuda = device if device is not None and torch.device(device).type == "cuda" else None
            self.pool = HostPool(size, pin="auto" if pin else "none", device=cuda)

    @staticmethod
    def _nbytes(numel: int, dtype: torch.dtype) -> int:
        return numel * torch.empty((), dtype=dtype).element_size()

    def alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed 1-D host tensor of ``numel`` elements of ``dtype``, kept for good."""
        t, buf = self.acquire(numel, dtype, zero=True)
        self._buffers[t.data_ptr()] = buf
        return t

    def free(self, t: torch.Tensor) -> None:
        """Gives back a buffer of :meth:`alloc` (a home spilled to NVMe under memory pressure)."""
        self._buffers.pop(t.data_ptr()).release()

    def acquire(self, numel: int, dtype: torch.dtype, zero: bool = False, high: bool = False):
        """(tensor, handle) of a transient buffer; raises PoolExhausted when the
        budget has no room (the caller evicts and retries). Give the handle to
        :meth:`release`. ``high``: from the top of the pool (compute copies go
        there, fp32 state at the bottom, so each class's holes fit its own
        later requests instead of fragmenting the pool)."""
        if self.pool is None:
            raise RuntimeError(f"host tier: {numel} elements of {dtype} asked for, but the tier "
                               + ("is closed" if self._closed else "has no pool (capacity 0)"))
        nbytes = self._nbytes(numel, dtype)
        buf = self.pool.acquire(max(nbytes, 1), block=False, high=high)
        t = buf.view(torch.uint8)[:nbytes].view(dtype)
        if zero:
            t.zero_()
        return t, buf

    @staticmethod
    def release(buf) -> None:
        buf.release()

    def release_free_pages(self) -> int:
        """The pool's free pages back to the OS (bytes; see HostPool.release_free_pages)."""
        return self.pool.release_free_pages() if self.pool is not None else 0

    @property
    def free_bytes(self) -> int:
        return self.pool.free_bytes if self.pool is not None else 0

    @property
    def used_bytes(self) -> int:
        return self.pool.used_bytes if self.pool is not None else 0

    @property
    def peak_bytes(self) -> int:
        return self.pool.peak_bytes if self.pool is not None else self._final_peak

    @property
    def pinned(self) -> bool:
        return bool(self.pool is not None and self.pool.pinned)

    def close(self) -> None:
        """Unlocks the pool, then unmaps it once no tensor views it (idempotent).
        No copy may still read or write it: synchronize the mover first (see
        [Note: releasing the pool] in infinity/io/host_pool.py)."""
        self._closed = True
        buffers, self._buffers = self._buffers, {}
        for b in buffers.values():
            b.release()
        pool, self.pool = self.pool, None
        if pool is not None:
            self._final_peak = pool.peak_bytes
            pool.close()


def host_fixes(modes) -> str:
    """The changes besides a larger host budget that lower the host tier's
    need under ``modes`` (placement.Modes; None: not known), for errors: only
    those the configuration still allows, so both homes already on 'nvme' are
    not told to offload to 'nvme'."""
    if modes is None:
        return "offload to 'nvme'"
    fixes = [f"offload_{what}='nvme' (now 'host')" for what, home in (("params", modes.params),
                                                                        ("optimizer", modes.optimizer))
             if home == "host"]
    if modes.params_nvme:  # the host caches prefetch_depth + 2 compute copies of the largest unit
        fixes.append(f"lower prefetch_depth (now {modes.depth})")
    if modes.nvme_used:  # the cache and the optimizer's buffers are sized by the largest unit
        fixes.append("make the largest unit smaller (unit_classes)")
    if not fixes:
        return "keep less state on the host"
    return ", ".join(fixes[:-1]) + (" or " if len(fixes) > 1 else "") + fixes[-1]


def host_budget(given: Optional[int], need, modes=None) -> int:
    """The host budget (bytes): ``given`` (``Config.host_memory``), or 80% of
    the memory this process may use (the machine's, or its cgroup's if
    smaller); refused if the pool ``need`` (placement.HostNeed) asks for would
    not fit what the process may use (the OOM killer would end it).
    ``modes`` (placement.Modes) names the other fixes in the error."""
    room = sysinfo.available_ram()
    budget = given if given is not None else int(room * 0.8)
    if given is None and need.minimum > budget:
        raise BudgetError(
            f"host tier: the model state placed on the host needs {need.minimum} bytes "
            f"({format_bytes(need.minimum)}), more than the default host_memory of {budget} bytes: 80% of "
            f"what this process may use ({sysinfo.describe()}). Raise the memory limit, or "
            f"{host_fixes(modes) if modes is not None else 'offload to nvme or lower prefetch_depth'}")
    pool = min(need.capacity, budget)
    if pool > room:
        raise BudgetError(
            f"host tier: a pool of {pool} bytes ({format_bytes(pool)}) for host_memory={given} is more than "
            f"this process may still use, {room} bytes ({sysinfo.describe()}): it would be killed by the "
            f"OOM killer. Give host_memory at most {int(room * 0.9)} bytes, or raise the memory limit")
    return budget
