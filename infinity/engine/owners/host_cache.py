"""Every unit's host compute copy: permanent homes, the cache of NVMe-homed
compute copies, write-back of dirty copies with the producer's checksums,
spilling homes under memory pressure and taking them back.

Owns ``unit.host`` (a :class:`HostRecord`); nothing else writes it. Its
buffers come from the shared host pool (see [Note: the host room] in
host_room.py), whose ladder it gives a rung: :meth:`HostCache.evict_one`. Which cached copy to drop is policy.py's choice. See [Note: NVMe
homes and the host cache] in nvme.py and [Note: host copy states] in state.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..plan import policy
from ..mechanism.nvme import key as swap_key
from ..plan.placement import round_pool, spillable
from ..plan.state import HostState, transition
from ..mechanism.tiers import BudgetError
from ..plan.trace import NEVER

__all__ = ["HostRecord", "HostCache"]


@dataclass
class HostRecord:
    """A unit's host compute copy (written by host_cache.py only)."""

    state: HostState = HostState.NONE
    compute: Optional[torch.Tensor] = None  # the home, or the cached copy of an NVMe home
    buf: object = None        # pool handle of a cached copy (None: a permanent home, or none)
    busy: object = None       # the transfer reading ``compute`` (a fetch ticket)
    sums: object = None       # CRC32C of ``compute`` from the update that made it dirty
    write: object = None      # the write-back of an evicted copy, in flight
    locks: int = 0            # updates writing ``compute`` now
    next_compute: Optional[torch.Tensor] = None  # delayed mode: the buffer the queued update writes
    spilled: bool = False     # a host home moved to the swap files under memory pressure (see spill)


class HostCache:
    """Every unit's host compute copy (see the module docstring), in buffers
    of the shared host pool ``room`` (mechanism/host_room.py), under its lock."""

    def __init__(self, units, modes, room, nvme, trace, stats):
        self.units, self.modes, self.room, self.nvme, self.trace, self.stats = units, modes, room, nvme, trace, stats
        for u in units:
            u.host = HostRecord()

    # -- the compute-copy cache -------------------------------------------------------

    def evict_one(self, protect, done_only: bool = False, wait: bool = True) -> int:
        """Drops policy's choice among the cached compute copies (never one a
        transfer reads or an update writes). ``done_only``: only copies this
        pass does not use again. A dirty copy is written back first; without
        ``wait`` its buffer is freed when that write is done. Returns the
        bytes freed or to be freed (0: none)."""
        with self.room.lock:
            cands = [u for u in self.units
                     if u is not protect and u.host.buf is not None and not u.host.locks
                     and not (done_only and self.trace.next_use(u.index) != NEVER)
                     and (u.host.busy is None or u.host.busy.done())]
            v = policy.victim(cands, self.trace, lambda x: x.index, lambda x: x.dev.last_used)
            if v is None:
                return 0
            h = v.host
            freed = round_pool(h.compute.numel() * h.compute.element_size())
            if h.state is HostState.DIRTY:
                # Write-back: a copy updated while cached reaches NVMe only now, so
                # a unit that stays cached costs no swap writes step after step.
                handle = self.nvme.write(swap_key(v.index, "compute"), h.compute, h.sums)
                h.sums = None
                if not wait:
                    h.state = transition(v.name, "host", h.state, HostState.WRITING_BACK)
                    h.write = handle  # a read of this copy waits for it (_settle_write_back)
                    self.room.defer_release(handle, h.buf)
                    h.compute = h.buf = h.busy = None
                    return freed
                handle.wait()
                h.state = transition(v.name, "host", h.state, HostState.CLEAN)
            self.room.release(h.buf)
            h.state = transition(v.name, "host", h.state, HostState.NONE)
            h.compute = h.buf = h.busy = None
            return freed

    def settle_write_back(self, u) -> None:
        """Waits for a write-back of ``u``'s evicted copy still in flight (before its NVMe copy is rewritten)."""
        with self.room.lock:
            self._settle_write_back(u)

    def _settle_write_back(self, u) -> None:
        """Waits for a write-back of ``u``'s evicted copy still in flight, so a
        read of the NVMe copy sees the new bytes."""
        h = u.host
        if h.write is not None:
            h.write.wait()
            h.write = None
        if h.state is HostState.WRITING_BACK:
            h.state = transition(u.name, "host", h.state, HostState.NONE)

    def load(self, u):
        """Makes sure ``u``'s compute copy has a host buffer; returns the NVMe
        read filling it, or None if it was cached."""
        with self.room.lock:
            h = u.host
            if h.compute is not None:
                return None
            comp, buf = self.room.acquire(u.place.home_numel, self.modes.dtype, protect=u, compute=True)
            self._settle_write_back(u)
            h.compute, h.buf = comp, buf
            h.state = transition(u.name, "host", h.state, HostState.CLEAN)
            # Busy until the read is done: no eviction may free the buffer it
            # fills (a fetch replaces this by its own transfer, which waits for it).
            h.busy = self.nvme.read(swap_key(u.index, "compute"), comp)
            return h.busy

    def nvme_home(self, u) -> bool:
        """``u``'s compute copy lives in the swap files (``offload_params="nvme"``, or spilled)."""
        return self.modes.params_nvme or u.host.spilled

    def for_fetch(self, u):
        """(host copy, NVMe read filling it or None): the source of a fetch."""
        read = self.load(u) if self.nvme_home(u) else None
        return u.host.compute, read

    def reading(self, u, ticket) -> None:
        """A transfer (``ticket``) now reads ``u``'s host copy."""
        u.host.busy = ticket

    def home(self, u) -> Optional[torch.Tensor]:
        """``u``'s host compute copy, or None."""
        return u.host.compute

    # -- homes and updates ---------------------------------------------------------------

    def set_home(self, u, compute: torch.Tensor, next_compute: Optional[torch.Tensor] = None) -> None:
        """``u``'s permanent host compute copy (and the delayed mode's second one)."""
        h = u.host
        h.compute, h.next_compute = compute, next_compute
        h.state = transition(u.name, "host", h.state, HostState.HOME)

    def keep_cached(self, u, compute: torch.Tensor, buf) -> None:
        """A copy just written to NVMe stays cached, clean, while the budget has room."""
        with self.room.lock:
            u.host.compute, u.host.buf = compute, buf
            u.host.state = transition(u.name, "host", u.host.state, HostState.CLEAN)

    def swap_next(self, u) -> None:
        """Delayed mode: the queued update's buffer becomes the home."""
        h = u.host
        h.compute, h.next_compute = h.next_compute, h.compute

    def open_for_update(self, u, whole: bool = False) -> Optional[torch.Tensor]:
        """The host buffer an update writes ``u``'s new compute copy into, once
        no transfer to the device reads it (None: the master is the compute
        copy). ``whole``: the update writes every trainable parameter (else
        the old copy is read first). Pair with :meth:`close_update`."""
        h = u.host
        if not self.nvme_home(u):
            if h.busy is not None:
                h.busy.wait()  # a host barrier: a fetch may still read the old copy
            return h.compute
        if u.place.aliased:
            return None
        with self.room.lock:
            if h.compute is None and whole and len(u.layout.trainable_slots) == len(u.layout.slots) \
                    and self.modes.zero == 0:
                # Every parameter gets written: no need to read the old copy,
                # only to zero the padding between them.
                from ..plan.units import Layout
                comp, buf = self.room.acquire(u.place.compute_numel, self.modes.dtype, protect=u, compute=True)
                Layout.zero_padding(comp, u.layout.slots)
                self._settle_write_back(u)
                h.compute, h.buf = comp, buf
                h.state = transition(u.name, "host", h.state, HostState.CLEAN)
            elif h.compute is None:
                self.load(u).wait()  # frozen parameters must be there too
            elif h.busy is not None and not h.busy.done():
                if getattr(h.busy, "inner", True) is None:
                    raise RuntimeError(f"internal: unit {u.name!r} updated while its fetch is pending")
                h.busy.wait()
            h.locks += 1
            return h.compute

    def close_update(self, u, sums=None) -> None:
        """Ends an update's write into ``u``'s compute copy (begun by
        :meth:`open_for_update` or :meth:`lock_master`): the copy is dirty,
        written back with ``sums`` (the update's checksums of the whole copy,
        or None) when evicted."""
        if not self.nvme_home(u):
            return
        with self.room.lock:
            h = u.host
            if h.state is not HostState.DIRTY:
                h.state = transition(u.name, "host", h.state, HostState.DIRTY)
            h.sums = sums
            h.locks -= 1

    def lock_master(self, u):
        """[Note: fp32 master aliasing]: the cached compute copy is the master;
        holds it for an update (see :meth:`close_update`). Returns the copy and
        the transfer to wait for before reading it (an NVMe read or a fetch
        still copying it up), or None."""
        with self.room.lock:
            read = self.load(u)
            h = u.host
            if read is None and h.busy is not None and not h.busy.done():
                read = h.busy
            h.locks += 1
            h.sums = None  # updated in place from here on
            return h.compute, read

    def copy_home(self, u, dst: torch.Tensor, lo: int = 0) -> None:
        """Copies ``u``'s compute copy [lo, lo + dst.numel()) into ``dst``;
        an NVMe home is read into the cache first (and stays there, clean or
        dirty as it was, for the update that follows)."""
        if not self.nvme_home(u):
            dst.copy_(u.host.compute[lo:lo + dst.numel()])
            return
        comp, read = self.lock_master(u)
        try:
            if read is not None:
                read.wait()
            dst.copy_(comp[lo:lo + dst.numel()])
        finally:
            self.unlock_master(u)

    def unlock_master(self, u) -> None:
        """Lets go of :meth:`lock_master` without an update (nothing changed)."""
        with self.room.lock:
            u.host.locks -= 1

    def read_compute(self, u) -> Optional[torch.Tensor]:
        """``u``'s home compute copy (this rank's shard under ZeRO-3) as a CPU
        tensor: the buffer itself, or a temporary read from NVMe; None if
        there is no host copy (device-resident parameters)."""
        h = u.host
        if h.compute is not None:
            return h.compute
        if not self.nvme_home(u):
            return None
        self._settle_write_back(u)
        return self.read_nvme_home(u)

    def read_nvme_home(self, u) -> torch.Tensor:
        """A temporary copy of ``u``'s NVMe compute copy (no write of it in flight)."""
        out = torch.empty(u.place.home_numel, dtype=self.modes.dtype)
        self.nvme.read(swap_key(u.index, "compute"), out).wait()
        return out

    def store_compute(self, u, home: torch.Tensor) -> None:
        """Writes ``home`` as ``u``'s NVMe compute copy now (values loaded
        from outside); a cached copy is then clean."""
        with self.room.lock:
            h = u.host
            if h.busy is not None:
                h.busy.wait()
            self.nvme.write(swap_key(u.index, "compute"), home).wait()
            h.sums = None
            if h.state is HostState.DIRTY:
                h.state = transition(u.name, "host", h.state, HostState.CLEAN)

    # -- spilling homes under memory pressure (pressure.py) -------------------------------

    def can_spill(self, u) -> bool:
        """``u``'s permanent host home may move to the swap files: the NVMe
        tier reserved room for it (placement.spillable), no update
        holds it, and it is not the delayed mode's pair of buffers."""
        h = u.host
        return spillable(self.modes) and h.state is HostState.HOME and not h.locks

    def spill(self, u) -> int:
        """Writes ``u``'s host home to the swap files and gives its buffer
        back: from now on it is an NVMe home, cached like any. Returns the bytes freed."""
        with self.room.lock:
            h = u.host
            if not self.can_spill(u):
                return 0
            if h.busy is not None:
                h.busy.wait()  # a fetch may still copy from the buffer
            self.nvme.write(swap_key(u.index, "compute"), h.compute).wait()
            freed = round_pool(h.compute.numel() * h.compute.element_size())
            self.room.free(h.compute)
            h.compute = h.busy = None
            h.spilled = True
            h.state = transition(u.name, "host", h.state, HostState.NONE)
            return freed

    def take_home(self, u) -> bool:
        """Undoes :meth:`spill`: ``u`` gets a permanent host home again, filled
        from its cached copy or the swap file. False (still spilled) when the
        pool has no room for it now."""
        with self.room.lock:
            h = u.host
            if not h.spilled or h.locks:
                return False
            try:
                home = self.room.alloc(u.place.home_numel, self.modes.dtype)
            except BudgetError:
                return False
            if h.compute is not None:  # cached (clean or dirty): the newest bytes
                if h.busy is not None:
                    h.busy.wait()
                home.copy_(h.compute)
                self.room.release(h.buf)
            else:
                self._settle_write_back(u)
                self.nvme.read(swap_key(u.index, "compute"), home).wait()
            h.compute, h.buf, h.busy, h.sums, h.spilled = home, None, None, None, False
            h.state = transition(u.name, "host", h.state, HostState.HOME)
            return True

    # -- teardown --------------------------------------------------------------------

    def forget_transfers(self) -> None:
        for u in self.units:
            u.host.busy = None

    def drop_buffers(self) -> None:
        """After teardown: forgets every unit's host buffers (see Engine._drop_buffers)."""
        for u in self.units:
            u.host = HostRecord()
