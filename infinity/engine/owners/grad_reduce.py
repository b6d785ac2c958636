"""Gradients summed over the ranks: the gradient owner's part for data
parallelism and ZeRO (:class:`GradReductions`, a base of
:class:`~infinity.engine.owners.grads.Gradients`; its methods use that
class's buffers, tickets and helpers). Where a unit's gradients are
reduced, on the device or on the host group, is decided in plan/paths.py
([Note: where gradients are reduced]); the device side is grad_device.py's.
"""

from __future__ import annotations

from . import grad_written
from ..plan.limits import MAX_REDUCING  # See [Note: limits that must agree]
from ..plan.state import GradHome
from .grad_device import issue_reduction

__all__ = ["GradReductions"]


class GradReductions:
    """``reduce`` each unit's gradients over the ranks as backward finishes
    them, and ``finish_reductions`` at the step."""

    def reduce(self, u) -> None:
        """ZeRO and data parallelism: starts summing ``u``'s gradients over the
        ranks (into its own shard under ZeRO; see [Note: ZeRO shards in
        infinity]), asynchronously, so backward goes on. The ticket joins the
        unit's tickets: whatever reads or frees the gradients waits for it;
        stages 2-3 free the full buffer once it is done."""
        rec = u.grads
        if self.modes.reduce_on_device:
            t = self._reduce_on_device(u)
        else:
            t = self._reduce_on_host(u)
        # After the zeros of the slots not written here went into the sum: see grad_written.py.
        rec.tickets += [t, grad_written.start(rec, self.sharding)]
        rec.reduced = True
        if self.modes.zero >= 2:
            self._reducing.append(u)
            while len(self._reducing) > MAX_REDUCING:
                self._release_reduced(self._reducing.pop(0))

    def _reduce_on_device(self, u):
        """See [Note: a unit's gradients on the device] in grad_device.py: the ticket."""
        rec = u.grads
        self._open_device(u)  # if no gradient came on this rank: zeros
        out = rec.shard if self.modes.zero else rec.grad  # stage 0: every rank keeps the whole sum
        t, nb = issue_reduction(rec.device, u.layout, rec.written, self.sharding, out, self.mover)
        self.stats.moved("d2h", out.numel() * out.element_size())
        self._outstanding.append((t, nb))  # device bytes count until the shard is on the host
        return t

    def _reduce_on_host(self, u):
        """The host buffers reduced over the host group; the ticket."""
        rec = u.grads
        self.wait(u)
        if rec.grad is None:
            # Spilled to NVMe (read back), or no gradient on this rank (contribute zeros).
            spilled = rec.home is GradHome.SPILLED
            self.acquire(u)
            if not spilled:
                rec.grad.zero_()
                return self._reduce_host_buffer(rec)
        self._zero_unwritten(u, rec.grad)  # their pool bytes are stale: the sum must see zeros
        return self._reduce_host_buffer(rec)

    def _reduce_host_buffer(self, rec):
        if not self.modes.zero:  # plain data parallelism: every rank keeps the sum
            return self.sharding.all_reduce_(rec.grad, async_op=True)
        return self.sharding.reduce_scatter(rec.shard, rec.grad, async_op=True)

    def _release_reduced(self, u) -> None:
        if u.grads.home is GradHome.CLAIMED:
            return  # the update job frees them
        self.release(u)

    def finish_reductions(self) -> None:
        """Waits for every reduction; stages 2-3 free the full gradients."""
        self.drain()
        for u in self._reducing:
            self._release_reduced(u)
        self._reducing = []
