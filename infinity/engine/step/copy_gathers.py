"""Stages 1-2 of ZeRO: the updated compute copies all-gathered in ``step()``
(:class:`CopyGathers`, used by the step schedule in schedule.py).

[Note: where the updated copies are gathered]
At stages 1-2 every rank updates its own shard of each unit's master and
writes the new compute values of that shard into the unit's host compute
copy (the optimizer's copy-out target); the other ranks' shards must then
reach every rank. With the parameters on the device
(``offload_params="none"``) the device copy is the one compute reads and
lives there for good, so the gather happens there: the own shard goes up
H2D into its place in the device copy (1/N of the unit's trainable bytes,
the mover's copy stream, after the compute queued so far, since the range
is live: [Note: refreshing a live range] in mover.py), and the device
group all-gathers the trainable range in place, from a side stream that
waits for that copy ([Note: the stage-3 gather's copy-in] in
mechanism/zero.py, the same mechanism). No rank receives another rank's
shard over the host group, and the whole copy no longer goes up H2D
after the step. The host copy is then authoritative for the own shard
only (the others keep older values): it is what the next update reads
for slots without gradients and what the next refresh sends, while
every reader of the whole copy (``state_dict``, checkpoints, frozen
slots) reads the device copy (``Values.read_compute``), and a write from
outside (``Values.write``) writes both whole. Every refresh of a
device-resident unit from its host copy takes this path
(``Residency.refresh``: after a rolled-back speculative step too), so the
device copy never sees a stale shard.
With the parameters offloaded (host or NVMe homes) the host-group gather
stays: the host copy is the source of every page-in, so it must be whole;
gathering on the device at each page-in (stage 3's path) would make the
host copy a shard and every fetch a collective, which is what stage 3 is.

On CUDA the order is the stage-3 gather's: the own shard's copy waits on
the copy stream for the compute queued so far (backward's kernels, and
whatever the user queued since, may still read the range), the side stream
waits for the copy's event, then the collective is issued from it; the host
waits for the gathers (an event after them on the side stream) before
``step()`` returns, so the next forward, and the next update writing the
host shard the copy read, come after them. On the CPU device the host waits
for the copy and issues the gather on the gloo group.
"""

from __future__ import annotations

__all__ = ["CopyGathers"]


class CopyGathers:
    """Stages 1-2: every rank gets the new compute copies of every shard, by
    an all-gather of each trainable unit's copy, in program order on every
    rank, after the updates of ``todo`` (the units ``step()`` updates): of
    the host copy on the host group, or (``modes.gather_on_device``) of the
    device copy on the device group, see [Note: where the updated copies are
    gathered].

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
        self.refreshed = set()  # units whose device copies the gathers brought up to date

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
        if p.modes.gather_on_device:
            t = p.residency.refresh(u)
            self.refreshed.add(u.index)
        else:
            comp = p.host_cache.open_for_update(u)  # NVMe home: the cached copy, read back if evicted
            t = p.sharding.all_gather_(comp[:u.place.trainable_numel], async_op=self.early)
        self.pending.append((u, t))
        if not self.early:
            self._close(u, t)

    def _close(self, u, t) -> None:
        if t is not None:
            t.wait()
        if not self.p.modes.gather_on_device:
            self.p.host_cache.close_update(u)
        self.p.values_changed(u)

    def finish(self) -> set:
        """Issues the gathers not issued yet and waits for every one; returns
        the indices of the units whose device copies they refreshed."""
        if not self.on:
            return self.refreshed
        for u in self.p.units[self.next:]:
            self._issue(u)
        self.next = len(self.p.units)
        if self.early:
            for u, t in self.pending:
                self._close(u, t)
        self.pending = []
        return self.refreshed
