"""Giving way under memory pressure instead of being OOM-killed.

[Note: memory pressure]
The host budget is fixed at ``initialize``, but the RAM left to the process
is not: data loaders, other jobs and the page cache come and go. After every
optimizer step the monitor reads what the process may still use
(``sysinfo.available_ram``: MemAvailable, or the cgroup's headroom). Below
``margin`` it gives way one level. With parameters homed on the host and an
NVMe tier for the optimizer state (placement.spillable), the later half of
the units still homed on the host spill: their compute copies are written to
the swap files (room for them is reserved there at start-up), their home
buffers go back to the pool, and they are NVMe homes from then on, cached
under a cap of the host's permanent use plus a fetch pipeline's room.
Otherwise, with NVMe homes, the cache of compute copies is capped at half
its use (never below what the placement needs) and the copies above the cap
are evicted (written back first when dirty). Either way the freed pool
pages are returned to the OS and the prefetch depth drops by one. When the
RAM left stays above twice the margin for ``CALM_STEPS`` steps it grows back
a level, and the units spilled at that level go home again. Below
``critical`` with nothing left to give (the optimizer's host homes cannot
shrink; the cache is at its floor), the next ``step()`` raises
:class:`MemoryPressureError` between steps, with the training state whole:
save a checkpoint and stop, before the kernel's OOM killer ends the process.
Every action is an event in ``infinity.stats(model)["pressure_events"]``.
On several ranks each rank decides for itself and only its cache gives way
(the prefetch depth orders collectives, so it stays); the rank that runs out
raises, and the others then fail at their next collective.
Policy only: evicting and releasing pages are the host cache's and the
pool's mechanisms.
"""

from __future__ import annotations

import time
from typing import Callable, List, Tuple

from ...system import sysinfo
from ...config.runtime import format_bytes
from ..plan.placement import NVME_CACHE_SPARE, round_pool
from ..mechanism.tiers import host_fixes  # the fixes the placement still allows, as BudgetError says them

__all__ = ["MemoryPressureError", "PressureMonitor"]

MIN_MARGIN = 256 << 20     # bytes of RAM to keep free at least
MARGIN_SHARE = 0.05        # ... or this share of the host budget, if more
CRITICAL = 64 << 20        # below this with nothing left to give: MemoryPressureError
CALM_STEPS = 3             # steps above twice the margin before growing back a level
MAX_LEVEL = 4


class MemoryPressureError(RuntimeError):
    """The RAM left to the process fell below what the run needs and infinity
    had nothing left to give back. Raised between steps: the state is whole."""


class PressureMonitor:
    """The [Note: memory pressure] policy of one engine: handed its parts
    (parts.py: this uses ``units``, ``modes``, ``residency``, ``room``,
    ``host_cache``, ``stats``, ``sharding``, ``fence``) and the host budget (bytes)."""

    def __init__(self, parts, host_budget: int, available: Callable[[], int] = sysinfo.available_ram):
        self.parts, self.host_budget = parts, host_budget
        self.available = available  # injectable: tests simulate pressure
        self.margin = max(MIN_MARGIN, int(MARGIN_SHARE * self.host_budget))
        self.critical = CRITICAL
        self.level = 0
        self._calm = 0
        self.events: List[dict] = []
        self._spilled: List[Tuple[int, list]] = []  # (level, units) spilled to NVMe at that level
        self._floor = self._cache_floor()
        # Residency is built before this monitor: its events join ours through this one hook.
        parts.residency.note = self.record

    def record(self, action: str, **kw) -> None:
        """An event of another owner (a fetch that met a full device) among the pressure events."""
        self._event(action, None, **kw)

    def _cache_floor(self) -> int:
        """The least the host pool may be capped at: what the placement needs."""
        from ..plan.placement import host_need
        return host_need([u.place for u in self.parts.units], self.parts.modes).minimum

    def _event(self, action: str, avail: int, **kw) -> None:
        self.events.append(dict(time=time.time(), step=self.parts.stats.steps, action=action, available=avail, **kw))

    def after_step(self) -> None:
        """Called at the end of every optimizer step; may give way or grow back a level."""
        avail = self.available()
        if avail < self.margin:
            self._calm = 0
            if self.level < MAX_LEVEL and self._give_way(avail):
                return
            if avail < self.critical:
                self._event("out of memory", avail)
                raise self._error(avail)
        elif avail > 2 * self.margin and (self.level or self._spilled):
            self._calm += 1
            if self._calm >= CALM_STEPS:
                self._calm = 0
                self._grow_back(avail)

    def _give_way(self, avail: int) -> bool:
        """One level down; False when nothing could be given."""
        p = self.parts
        room, res = p.room, p.residency
        gave = self._spill(avail)
        if not gave and p.modes.params_nvme:
            used = room.used_bytes
            cap = max(self._floor, used // 2)
            if cap < used:
                room.cap_bytes = cap
                evicted = room.evict_to(cap)
                released = room.tier.release_free_pages()
                self._event("cap host cache", avail, cap=cap, evicted=evicted, released=released)
                gave = True
        depth = res.depth_limit if res.depth_limit is not None else p.modes.depth
        # On several ranks the prefetch order issues collectives (ZeRO-3 gathers): all ranks keep one depth.
        if depth > 0 and p.sharding.world == 1:
            res.depth_limit = depth - 1
            self._event("lower prefetch depth", avail, depth=depth - 1)
            gave = True
        if gave:
            self.level += 1
        return gave

    def _spill(self, avail: int) -> bool:
        """Moves the later half of the units still homed on the host (the
        ones the next forward needs last) to the swap files, and caps the
        cache of their copies at the host's permanent use plus a fetch
        pipeline's room. False when there is none to move."""
        p, cache, room = self.parts, self.parts.host_cache, self.parts.room
        homes = [u for u in p.units if cache.can_spill(u)]
        if not homes:
            return False
        group = homes[len(homes) // 2:]
        for u in group:
            p.fence.wait_unit(u)  # a background save may still read the home
        freed = sum(cache.spill(u) for u in group)
        spilled = [u for g in self._spilled for u in g[1]] + group
        room.evict_to(0)  # the copies of spilled units cached so far: the cap below starts from the homes
        pipeline = (p.modes.depth + NVME_CACHE_SPARE) * max(round_pool(u.place.compute_bytes) for u in spilled)
        room.cap_bytes = room.used_bytes + pipeline
        self._spilled.append((self.level + 1, group))
        self._event("spill to NVMe", avail, units=len(group), bytes=freed, cap=room.cap_bytes,
                    released=room.tier.release_free_pages())
        return True

    def _grow_back(self, avail: int) -> None:
        p = self.parts
        self.level = max(0, self.level - 1)
        res = p.residency
        if res.depth_limit is not None:
            res.depth_limit = None if res.depth_limit + 1 >= p.modes.depth else res.depth_limit + 1
        if self.level == 0:
            p.room.cap_bytes = None
        elif p.room.cap_bytes is not None:
            p.room.cap_bytes = min(self.host_budget, 2 * p.room.cap_bytes)
        home = self._take_home()
        self._event("grow back", avail, cap=p.room.cap_bytes, depth=res.depth_limit, **home)

    def _take_home(self) -> dict:
        """Units spilled at the levels grown back over go home again (those
        the pool has no room for yet stay spilled and are tried again)."""
        back = 0
        for lvl, group in self._spilled:
            if lvl > self.level:
                back += sum(self.parts.host_cache.take_home(u) for u in group)
                group[:] = [u for u in group if u.host.spilled]
        self._spilled = [g for g in self._spilled if g[1]]
        return {"taken_home": back} if back else {}

    def _error(self, avail: int) -> MemoryPressureError:
        p = self.parts
        return MemoryPressureError(
            f"memory pressure: {avail} bytes ({format_bytes(avail)}) of RAM left to this process "
            f"({sysinfo.describe()}), below {self.critical} bytes, and infinity has given back all it can "
            f"(host pool in use {format_bytes(p.room.used_bytes)}, of which the placement needs "
            f"{format_bytes(self._floor)}). The training state is whole: save a checkpoint now "
            f"(infinity.save_checkpoint) and restart with less host_memory, {host_fixes(p.modes)}, or free RAM")
