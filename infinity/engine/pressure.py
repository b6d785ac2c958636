"""Giving way under memory pressure instead of being OOM-killed.

[Note: memory pressure]
The host budget is fixed at ``initialize``, but the RAM left to the process
is not: data loaders, other jobs and the page cache come and go. After every
optimizer step the monitor reads what the process may still use
(``sysinfo.available_ram``: MemAvailable, or the cgroup's headroom). Below
``margin`` it gives way one level: the host cache of NVMe compute copies is
capped at half its use (never below what the placement needs), the copies
above the cap are evicted (written back first when dirty), the freed pool
pages are returned to the OS, and the prefetch depth drops by one. When the
RAM left stays above twice the margin for ``CALM_STEPS`` steps it grows back
a level. Below ``critical`` with nothing left to give (host homes cannot
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
from typing import Callable, List

from .. import sysinfo
from ..config import format_bytes

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
    """The [Note: memory pressure] policy of one engine (``eng``)."""

    def __init__(self, eng, available: Callable[[], int] = sysinfo.available_ram):
        self.eng = eng
        self.available = available  # injectable: tests simulate pressure
        self.margin = max(MIN_MARGIN, int(MARGIN_SHARE * eng.host_budget))
        self.critical = CRITICAL
        self.level = 0
        self._calm = 0
        self.events: List[dict] = []
        self._floor = self._cache_floor()

    def _cache_floor(self) -> int:
        """The least the host pool may be capped at: what the placement needs."""
        from .placement import host_need
        return host_need([u.place for u in self.eng.units], self.eng.modes).minimum

    def _event(self, action: str, avail: int, **kw) -> None:
        self.events.append(dict(time=time.time(), step=self.eng.stats.steps, action=action, available=avail, **kw))

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
        elif avail > 2 * self.margin and self.level:
            self._calm += 1
            if self._calm >= CALM_STEPS:
                self._calm = 0
                self._grow_back(avail)

    def _give_way(self, avail: int) -> bool:
        """One level down; False when nothing could be given."""
        eng = self.eng
        cache, res = eng.cache, eng.residency
        gave = False
        if eng.modes.nvme_used:
            used = cache.tier.used_bytes
            cap = max(self._floor, used // 2)
            if cap < used:
                cache.cap_bytes = cap
                evicted = cache.evict_to(cap)
                released = cache.tier.release_free_pages()
                self._event("cap host cache", avail, cap=cap, evicted=evicted, released=released)
                gave = True
        depth = res.depth_limit if res.depth_limit is not None else eng.modes.depth
        # On several ranks the prefetch order issues collectives (ZeRO-3 gathers): all ranks keep one depth.
        if depth > 0 and eng.sharding.world == 1:
            res.depth_limit = depth - 1
            self._event("lower prefetch depth", avail, depth=depth - 1)
            gave = True
        if gave:
            self.level += 1
        return gave

    def _grow_back(self, avail: int) -> None:
        eng = self.eng
        self.level -= 1
        res = eng.residency
        if res.depth_limit is not None:
            res.depth_limit = None if res.depth_limit + 1 >= eng.modes.depth else res.depth_limit + 1
        if self.level == 0:
            eng.cache.cap_bytes = None
        elif eng.cache.cap_bytes is not None:
            eng.cache.cap_bytes = min(eng.host_budget, 2 * eng.cache.cap_bytes)
        self._event("grow back", avail, cap=eng.cache.cap_bytes, depth=res.depth_limit)

    def _error(self, avail: int) -> MemoryPressureError:
        eng = self.eng
        return MemoryPressureError(
            f"memory pressure: {avail} bytes ({format_bytes(avail)}) of RAM left to this process "
            f"({sysinfo.describe()}), below {self.critical} bytes, and infinity has given back all it can "
            f"(host pool in use {format_bytes(eng.cache.tier.used_bytes)}, of which the placement needs "
            f"{format_bytes(self._floor)}). The training state is whole: save a checkpoint now "
            "(infinity.save_checkpoint) and restart with less host_memory, offload to 'nvme', or free RAM")
