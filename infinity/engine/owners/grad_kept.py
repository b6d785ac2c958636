"""The zero gradients torch would keep: the gradient owner's part for
``zero_grad(set_to_none=False)`` (:class:`KeptZeros`, a base of
:class:`~infinity.engine.owners.grads.Gradients`; its methods use that
class's buffers).

[Note: zero_grad(set_to_none=False)]
torch keeps a zero ``.grad`` for every parameter that had one, so the next
step updates it even when its next backward leaves it out (its moments
decay, weight decay applies). ``had`` marks those slots; ``zero_grad()``
with ``set_to_none=True`` (torch's default) clears it. At ``step()`` the
slots that had a gradient and got none in this window are zeroed in the
buffer the update reads and count as written (``fill_kept_zeros``), so the
norm, the overflow check and the update see what torch's would.
"""

from __future__ import annotations

from typing import List

import torch

from ..mechanism.nvme import key as swap_key
from ..plan.state import GradHome, GradState, transition

__all__ = ["KeptZeros"]


class KeptZeros:
    """``had`` bookkeeping and the zeros written at ``step()``. See [Note: zero_grad(set_to_none=False)]."""

    def forget(self, set_to_none: bool) -> None:
        """``zero_grad(set_to_none)``: the window's gradients are forgotten;
        with ``set_to_none`` torch's ``.grad`` of every parameter is None
        again, else the slots that had one hold zeros from now on."""
        if set_to_none:
            for u in self.units:
                u.grads.had = [False] * len(u.grads.had)

    def any_kept(self) -> bool:
        """True when some parameter would have a ``.grad`` (torch's view) now."""
        return any(any(u.grads.had) for u in self.units)

    def fill_kept_zeros(self, u) -> None:
        """Before the step reads ``u``'s gradients: the slots torch would hold
        a zero ``.grad`` for (``had``, not written in this window) get zeros in
        the buffer the update reads and count as written."""
        rec = u.grads
        kept = [ti for ti, (h, w) in enumerate(zip(rec.had, rec.written)) if h and not w]
        if not kept:
            return
        if u.place.grad_chunked:
            return self._fill_streamed(u, kept)
        buf = self.update_input(u)
        if buf is None:  # NVMe optimizer state: a transient buffer, maybe spilled
            return self._fill_spilled(u, kept)
        self._zero_slots(u, buf, kept)

    def _zero_unwritten(self, u, buf: torch.Tensor) -> None:
        slots = u.layout.trainable_slots
        for ti, w in enumerate(u.grads.written):
            if not w:
                buf[slots[ti].offset:slots[ti].offset + slots[ti].numel].zero_()

    def _zero_slots(self, u, buf: torch.Tensor, kept: List[int]) -> None:
        self.wait(u)
        slots, lo = u.layout.trainable_slots, 0
        if buf.numel() != u.place.trainable_numel:  # ZeRO: the own shard
            lo = self.sharding.shard(u.place.trainable_numel)[0]
        for ti in kept:
            s = slots[ti]
            a, b = max(s.offset - lo, 0), min(s.offset + s.numel - lo, buf.numel())
            if a < b:
                buf[a:b].zero_()
            u.grads.written[ti] = True

    def _fill_streamed(self, u, kept: List[int]) -> None:
        """Gradients streamed in chunks: the zeros land in the chunks as a
        gradient would, which then go to NVMe ([Note: gradients streamed in
        chunks] in grad_chunks.py)."""
        rec = u.grads
        if rec.home in (GradHome.NONE, GradHome.SPILLED):
            rec.home = transition(u.name, "grad home", rec.home, GradHome.HOST)
        for ti in kept:
            self.chunked.land_zeros(u, ti)
            rec.written[ti] = True
        if rec.state is GradState.CLEAN:
            rec.state = transition(u.name, "grad", rec.state, GradState.ACCUMULATING)
        self.spill(u)

    def _fill_spilled(self, u, kept: List[int]) -> None:
        """NVMe optimizer state: zeros written into the spilled gradients (or
        a fresh zero buffer), spilled again, so host memory stays bounded."""
        rec = u.grads
        if rec.home is GradHome.SPILLED:
            self.load(u)
            self._zero_slots(u, rec.grad, kept)
            self.nvme.write(swap_key(u.index, "grad"), rec.grad).wait()
            self.drop_loaded(u)
            return
        self.acquire(u)
        rec.grad.zero_()
        self._zero_slots(u, rec.grad, kept)
        if rec.state is GradState.CLEAN:
            rec.state = transition(u.name, "grad", rec.state, GradState.ACCUMULATING)
        self.spill(u)
