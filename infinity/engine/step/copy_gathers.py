"""Stages 1-2 of ZeRO: the updated compute copies all-gathered in ``step()``
(:class:`CopyGathers`, used by the step schedule in schedule.py)."""

from __future__ import annotations

__all__ = ["CopyGathers"]


class CopyGathers:
    """Stages 1-2: every rank gets the new compute copies of every shard, by
    an all-gather of each trainable unit's host copy, in program order on
    every rank, after the updates of ``todo`` (the units ``step()`` updates).

    [Note: the copies' all-gather in step()]
    With the copies in host memory (not NVMe homes, whose cache the open
    gathers would pin) each unit's gather is issued, asynchronously, as soon
    as no update of it or of a unit before it is still to come, so it runs
    while the optimizer updates the next units (the order stays program
    order, the same on every rank); :meth:`finish` issues the rest and waits
    for all before ``step()`` returns."""

    def __init__(self, p, todo):
        self.p, self.pending, self.next = p, [], 0
        self.on = p.modes.zero in (1, 2)
        self.early = self.on and not p.modes.params_nvme
        self.left = {u.index for u in todo}  # updates still to come

    def ready(self, u) -> None:
        """``u`` was updated: issues the gathers now due (with ``early``)."""
        self.left.discard(u.index)
        units = self.p.units
        while self.early and self.next < len(units) and units[self.next].index not in self.left:
            self._issue(units[self.next])
            self.next += 1

    def _issue(self, u) -> None:
        if not u.place.trainable:
            return
        p = self.p
        comp = p.host_cache.open_for_update(u)  # NVMe home: the cached copy, read back if evicted
        t = p.sharding.all_gather_(comp[:u.place.trainable_numel], async_op=self.early)
        self.pending.append((u, t))
        if not self.early:
            self._close(u, t)

    def _close(self, u, t) -> None:
        if t is not None:
            t.wait()
        self.p.host_cache.close_update(u)
        self.p.values_changed(u)

    def finish(self) -> None:
        """Issues the gathers not issued yet and waits for every one."""
        if not self.on:
            return
        for u in self.p.units[self.next:]:
            self._issue(u)
        self.next = len(self.p.units)
        if self.early:
            for u, t in self.pending:
                self._close(u, t)
        self.pending = []
