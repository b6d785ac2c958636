"""The delayed schedule (``overlap="delayed"``): step t's update runs during
step t+1's forward and backward and is applied at step t+1; split from
schedule.py, whose StepSchedule it builds on (see [Note: when the optimizer
runs] there)."""

from __future__ import annotations

import time

from .schedule import StepSchedule

__all__ = ["DelayedSchedule"]


class DelayedSchedule(StepSchedule):
    """The update of step t's gradients runs during step t+1's forward and
    backward and is applied at step t+1 (see [Note: when the optimizer runs]).

    [Note: the delayed pair]
    A unit has two compute buffers: the live one forward reads, and the one
    the queued update writes; applying the update swaps them. The update
    writes only the slots that got gradients, so the slots it leaves are
    copied from the live buffer into the other one before the swap (else
    they would go back to their value of two updates ago), and a unit with
    no gradient at all in the step queues nothing and is not swapped.
    """

    def __init__(self, parts, updater, accum_steps: int, early_ok: bool, speculation=None):
        super().__init__(parts, updater, accum_steps, early_ok)
        self._pending: list = []        # updates in flight
        self._pending_units: list = []

    def wait_one(self) -> bool:
        for t in self._pending:
            if not t.done():
                t.wait()
                return True
        return False

    def step(self, scaling) -> None:
        p = self.p
        t0 = time.perf_counter()
        for t in self._pending:
            t.wait()
        p.stats.optimizer_wait_seconds += time.perf_counter() - t0
        if self._pending:
            self._apply_pending()
        p.grads.drain()
        work = []
        for u in p.units:
            if u.place.trainable:
                p.grads.fill_kept_zeros(u)  # See [Note: zero_grad(set_to_none=False)] in grad_kept.py
                written = list(u.grads.written)
                work.append((u, p.grads.swap_delayed(u), written))  # the next backward fills the other buffer
        skip, scale = scaling.global_scale(work)
        scaling.after_overflow_check(skip)
        for u in p.units:
            p.grads.consume(u)
        if skip:
            return
        p.stats.steps += 1
        # The hyper-parameters of this step(): the updates run after it, when
        # an LR scheduler may already have moved the groups' lr.
        hyper = self.groups_now()
        for u, grad, written in work:
            if not any(written):
                continue  # no gradient: the unit keeps its buffers (see [Note: the delayed pair])

            def job(u=u, grad=grad, written=written) -> None:
                self.p.fence.wait_unit(u)
                self.updater.run(u, grad, written, u.host.next_compute, scale, live=False, hyper=hyper)
                self.updater.carry_unwritten(u, written, u.host.compute, u.host.next_compute)

            self._pending.append(p.mover.host_job(job))
            self._pending_units.append(u)

    def flush(self) -> None:
        if not self._pending:
            return
        for t in self._pending:
            t.wait()
        self._apply_pending()

    def _apply_pending(self) -> None:
        """The queued updates finished: their compute copies become the
        homes; device copies are refreshed."""
        p = self.p
        self._pending = []
        for u in self._pending_units:
            p.host_cache.swap_next(u)
            p.values_changed(u)
        self._pending_units = []
        p.residency.invalidate()
