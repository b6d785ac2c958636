"""When updates run: in ``step()`` (:class:`StepSchedule`), during backward
as each unit's gradients complete (:class:`BackwardSchedule`), or one step
late beside the next forward and backward (:class:`DelayedSchedule`), behind
one interface: ``unit_ready``, ``backward_done``, ``step``, ``flush``,
``wait_one``, ``zero_grad``.

[Note: when the optimizer runs]
- overlap="step": in ``step()``, unit by unit, after backward.
- overlap="backward": a unit's update is queued on the host worker thread as
  soon as its last gradient has left the device during the last backward of
  the accumulation window. It reads only host buffers and writes the master,
  the moments and the host compute copy; the device copy that backward still
  reads is untouched until ``step()`` invalidates it. Clipping and fp16
  overflow checks need every gradient first, so with either the updates run
  speculatively and are checked at ``step()`` ([Note: speculative updates]
  in speculate.py), or, where that is not available, wait for it. The queue of updates in flight, in the order they were
  queued, is the ready queue (``_running``); ``wait_one`` waits for its oldest.
- overlap="delayed": ``step()`` applies the update computed from the previous
  step's gradients (swapping in the second compute buffer) and queues the
  update of this step's gradients, which then runs during the next forward
  and backward. The update applied at step t uses the gradients of step t-1.

[Note: hyper-parameters of early updates]
With overlap="backward" a unit's update runs during backward, with the
groups' hyper-parameters of that moment. A change between backward and
``step()`` (a warm-up that sets lr by hand just before ``step()``) cannot
reach the updates that ran already, so the whole step keeps the values
its first early update saw (``_hyper``): every unit is updated alike, never
half with each value, and ``step()`` warns once that the change takes
effect one step later than in torch.

[Note: the accumulation window]
``Config.grad_accumulation_steps`` backward passes make one step. In the last
of them some work happens during backward: with overlap="backward" each
unit's update, and under data parallelism (stages 0, 2, 3; stage 1 with
overlap="backward") each unit's gradient reduction. Once that ran (``Gradients.window_closed``), another
backward before ``step()`` would add gradients nothing reads any more, so its
first gradient raises instead of being dropped; ``zero_grad()`` after an
early update raises too, since the update cannot be undone.
"""

from __future__ import annotations

import time
import warnings
from collections import OrderedDict
from typing import List


from .copy_gathers import CopyGathers
from ...optim.functional import group_hyper
from ..plan import policy
from ..faults import UsageError
from ..plan.state import OptState
from ..plan.limits import MAX_QUEUED  # See [Note: limits that must agree]

__all__ = ["make_schedule", "StepSchedule", "BackwardSchedule", "MAX_QUEUED"]


class StepSchedule:
    """Updates in ``step()``. ``parts`` is the engine's record of its parts
    (parts.py; this uses ``grads``, ``optstate``, ``host_cache``,
    ``residency``, ``mover``, ``sharding``, ``stats``, ``trace``, ``faults``,
    ``fence``, ``values_changed``, ``units``, ``modes``)."""

    def __init__(self, parts, updater, accum_steps: int, early_ok: bool, speculation=None):
        self.p, self.updater, self.accum_steps = parts, updater, accum_steps
        self.early_ok = early_ok        # no clipping and no fp16: updates may run before step()
        self.spec = speculation         # else updates during backward are speculative (speculate.py), if not None
        self._running: "OrderedDict[int, object]" = OrderedDict()  # unit index -> update in flight
        self._closing = False           # this backward ran last-window work
        self._root_read = None          # host job preparing the root's update (NVMe read, undo state saved)
        self._last_order: List[int] = []  # unit indices in the order the last step's updates were queued
        self._hyper = None              # the groups' hyper-parameters this step's early updates run with
        self._warned_hyper = False
        # Gradients go through a reduction under data parallelism, and under
        # any ZeRO stage even for one rank: it fills the shard the update reads.
        self.needs_reduce = parts.sharding.world > 1 or parts.modes.zero > 0

    # -- during backward ---------------------------------------------------------------

    def _last_backward(self) -> bool:
        return self.p.grads.micro_batches + 1 == self.accum_steps

    def unit_ready(self, u) -> None:
        """``u``'s last gradient of this backward has left the device."""
        p = self.p
        if self._reduces_in_backward() and self._last_backward() and u.place.trainable and not u.grads.reduced:
            self._closing = True  # See [Note: the accumulation window]
            p.grads.reduce(u)     # in program order on every rank
        if not self._start_early(u) and p.modes.opt_nvme and not p.modes.zero:
            p.grads.spill(u)      # bounded host memory until step()

    def _reduces_in_backward(self) -> bool:
        """Each unit's gradients are reduced in the window's last backward
        (stages 0, 2, 3, and stage 1 reduced on the device: [Note: where
        gradients are reduced] in plan/paths.py); stage 1 on the host
        reduce-scatters them in ``step()``, unless its updates may start
        during backward (BackwardSchedule)."""
        return self.needs_reduce and (self.p.modes.zero != 1 or self.p.modes.reduce_on_device)

    def _start_early(self, u) -> bool:
        return False

    def backward_done(self) -> None:
        """A whole backward is done."""
        p = self.p
        p.grads.backward_counted(self._closing)
        if p.modes.opt_nvme and not p.modes.zero:
            for u in p.units:  # units some of whose parameters got no gradient
                p.grads.spill(u)

    def _guarded(self, job, u):
        """``job`` for the host thread: a fault it raises fails the engine at
        once (so the next hook stops the pass) and gives back ``u``'s buffers;
        the error itself reaches the caller where the job is waited for."""
        p = self.p

        def run() -> None:
            try:
                job()
            except BaseException as e:
                p.faults.record(e, f"the update of unit {u.name!r} on the optimizer's thread")
                _quietly(p.optstate.discard, u)
                _quietly(p.grads.release, u)
                raise

        return run

    def updates_in_flight(self) -> bool:
        """True between a backward that started updates (overlap="backward") and ``step()``."""
        return bool(self._running)

    def wait_one(self) -> bool:
        """Waits for the oldest update in flight (which frees its buffers). True if one was waited for."""
        for t in self._running.values():
            if not t.done():
                t.wait()
                return True
        return False

    def update_order(self) -> list:
        """The trainable units in the order the next step is expected to
        update them: the order the last step's updates were queued (what a
        background checkpoint writes first: [Note: a background save]), or
        before any step :meth:`_first_order`."""
        units = self.p.units
        order = [units[i] for i in self._last_order if i < len(units)]
        want = [u for u in units if u.place.trainable]
        return order if len(order) == len(want) else self._first_order(want)

    def _first_order(self, trainable: list) -> list:
        """The update order before any step was seen: program order."""
        return trainable

    # -- the step -----------------------------------------------------------------------

    def step(self, scaling) -> None:
        """Updates every unit not updated yet; returns when each new compute
        copy is in its home tier. ``scaling`` gives the step's gradient scale
        (step/scaling.py: ``global_scale``, ``after_overflow_check``)."""
        p = self.p
        t0 = time.perf_counter()
        if self._root_read is not None:
            self._root_read.wait()
            self._root_read = None
        for t in self._running.values():
            t.wait()
        p.stats.optimizer_wait_seconds += time.perf_counter() - t0
        p.grads.drain()
        if self.needs_reduce:
            for u in p.units:  # same order on every rank
                if u.place.trainable and not u.grads.reduced and u.index not in self._running:
                    p.grads.reduce(u)
            p.grads.finish_reductions()
        hyper, self._hyper = self._hyper, None
        if hyper is not None:
            self._check_hyper(hyper)
        spec = self.spec.units if self.spec is not None else []
        # With speculative updates the norm is over every unit, as overlap="step" takes it.
        todo = [u for u in p.units if (u.index not in self._running or spec) and u.place.trainable]
        for u in todo:  # See [Note: zero_grad(set_to_none=False)] in grad_kept.py
            p.grads.fill_kept_zeros(u)
        skip, scale = scaling.global_scale([(u, p.grads.update_input(u), u.grads.written) for u in todo])
        if self.spec is not None:
            self.spec.observe(skip, scale)
        replay = bool(spec) and not self.spec.check(skip, scale)  # rolled back: every unit from here
        if spec and not replay:
            todo = [u for u in todo if u.index not in self._running]
        elif skip and self._running and not spec:
            raise RuntimeError("internal: overflow after early updates")  # early updates exclude fp16
        t0 = time.perf_counter()
        scaling.after_overflow_check(skip)
        refreshed = set()
        if not skip:
            refreshed = self._update_all(todo, scale, hyper)
            p.stats.steps += 1
            self._last_order = list(self._running) + [u.index for u in todo if u.index not in self._running]
        if replay:
            p.stats.spec_replay_seconds += time.perf_counter() - t0
        self._end_step()
        if not skip:
            self._refresh_compute_copies(refreshed)

    def _end_step(self) -> None:
        """The step's gradients are read: their buffers free, the queue empty."""
        for u in self.p.units:
            self.p.grads.consume(u)
        self._running = OrderedDict()
        self._closing = False
        if self.spec is not None:
            self.spec.end_step()

    def groups_now(self) -> list:
        """The param groups' hyper-parameters now (no params)."""
        return [{k: v for k, v in g.items() if k != "params"} for g in self.updater.param_groups]

    def _check_hyper(self, hyper: list) -> None:
        """See [Note: hyper-parameters of early updates]: warns (once) when
        the groups changed since this step's early updates started."""
        then = [group_hyper(g) for g in hyper]
        now = [group_hyper(g) for g in self.groups_now()]
        if then == now or self._warned_hyper:
            return
        self._warned_hyper = True
        what = "; ".join(f"param_groups[{gi}] {k} {getattr(a, k)} -> {getattr(b, k)}"
                         for gi, (a, b) in enumerate(zip(then, now)) for k in a._fields if getattr(a, k) != getattr(b, k))
        warnings.warn(
            "infinity: optimizer hyper-parameters changed between backward() and optimizer.step() with "
            f"overlap='backward' ({what}): the updates ran during backward with the values they had then, and "
            "this step() applies those values to every unit, so the change takes effect at the next step "
            "(torch applies it to this one). Set them before forward (an LR scheduler stepped after "
            "optimizer.step() does), or use overlap='step'. (Warned once.)", RuntimeWarning, stacklevel=4)

    def _update_all(self, todo, scale: float, hyper=None) -> set:
        """Updates ``todo``; returns the indices of the units whose device
        copies the copies' gathers refreshed (CopyGathers.finish)."""
        p, t0 = self.p, time.perf_counter()
        gathers = CopyGathers(p, todo)
        if p.modes.opt_nvme:
            self._pipeline(todo, scale, hyper)
        else:
            for u in todo:
                self.update_in_memory(u, p.grads.update_input(u), list(u.grads.written), scale, hyper)
                gathers.ready(u)
        p.stats.optimizer_wait_seconds += time.perf_counter() - t0  # updates in step() hide behind nothing
        return gathers.finish()

    def update_in_memory(self, u, grad, written: List[bool], scale: float, hyper=None, undo=None) -> None:
        """One unit's update with its optimizer state in memory (host or
        device). With NVMe homes of the parameters the new compute copy goes
        through the host cache, so it is marked dirty and written back when
        evicted, never lost. ``undo``: see ``Updater.run``."""
        p = self.p
        if not any(written):
            return  # no gradient this step: nothing changes
        p.fence.wait_unit(u)
        # A speculative update saving the copy's bytes in its pass needs the old copy read (NVMe homes).
        whole = all(written) and (undo is None or undo.compute is None)
        out = p.host_cache.open_for_update(u, whole) if p.modes.host_optimizer else None
        try:
            self.updater.run(u, grad, written, out, scale, live=True, hyper=hyper, undo=undo)
        finally:
            if p.modes.host_optimizer:
                p.host_cache.close_update(u)

    def update_from_nvme(self, u, grad, written: List[bool], scale: float, hyper=None, keep_old=False) -> None:
        """One unit's update with its state checked out from NVMe (the reads
        waited for), then checked back in with the kernel's checksums
        (``keep_old``: a speculative update's, copy-on-write: see
        ``OptimizerState.checkin``)."""
        p = self.p
        p.fence.wait_unit(u)
        # See [Note: state streamed in chunks] in owners/optstate.py.
        # Gradients streamed in chunks (a GradStream) come with the state's: [Note: gradients streamed in chunks].
        chunked_grad = grad if u.place.grad_chunked else None
        stream = (lambda fn: p.optstate.stream(u, fn, keep_old, chunked_grad)) if u.place.chunked else None
        sums = self.updater.run(u, grad, written, p.host_cache.open_for_update(u, all(written)), scale, live=True,
                                hyper=hyper, stream=stream)
        p.optstate.checkin(u, sums, keep_old)
        # [Note: fp32 master aliasing]: the master's sums over the whole copy
        # go with its write-back on eviction ([Note: sums from the producer]).
        whole = sums is not None and u.place.aliased and u.place.trainable_numel == u.place.compute_numel
        p.host_cache.close_update(u, sums.get("master") if whole else None)

    def _pipeline(self, todo, scale: float, hyper=None) -> None:
        """NVMe optimizer state: while unit i is updated, unit i+1's master,
        moments and gradients are being read and unit i-1's written (see
        [Note: NVMe homes and the host cache])."""
        p = self.p

        def load(u) -> list:
            hs = [] if p.modes.zero else [h for h in (p.grads.load(u, wait=False),) if h is not None]
            return hs + p.optstate.checkout(u)

        pending = load(todo[0]) if todo else []
        for i, u in enumerate(todo):
            for h in pending:
                h.wait()
            pending = load(todo[i + 1]) if i + 1 < len(todo) else []
            grad = p.grads.update_input(u)
            if grad is not None:
                self.update_from_nvme(u, grad, list(u.grads.written), scale, hyper)
            else:  # no gradient this step: the untouched state goes back
                p.optstate.discard(u)
            p.grads.release(u)

    def _refresh_compute_copies(self, refreshed=frozenset()) -> None:
        """The new values reach the device: ``refreshed`` (unit indices) did already."""
        p = self.p
        if not p.modes.host_optimizer:
            # The optimizer ran on the device: write the new compute copies.
            for u in p.units:
                tn = u.place.trainable_numel
                if not tn:
                    continue
                p.fence.wait_unit(u)
                if u.dev.permanent:
                    p.residency.write_permanent(u, u.opt.master)
                elif p.mover.is_cuda:
                    p.mover.d2h(p.host_cache.home(u)[:tn], u.opt.master.to(p.modes.dtype)).wait()
                else:
                    p.host_cache.home(u)[:tn].copy_(u.opt.master)
        p.residency.invalidate(refreshed)

    # -- other calls ---------------------------------------------------------------------

    def flush(self) -> None:
        """Delayed mode: applies the queued update now. No-op otherwise."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forgets accumulated gradients (overwritten, not zeroed, by the next
        backward); see [Note: zero_grad(set_to_none=False)] in grad_kept.py."""
        p = self.p
        if self._running:
            # See [Note: the accumulation window].
            raise UsageError(
                "optimizer.zero_grad() before optimizer.step(), after a backward whose updates already ran "
                "(overlap='backward' updates each unit during the last backward of the accumulation window): "
                "the gradients cannot be discarded any more. Call optimizer.step() first, or use "
                "overlap='step' to decide after backward whether to step")
        self._closing = False
        p.grads.open_window()
        p.grads.drain()
        for u in p.units:
            p.grads.consume(u)
        p.grads.forget(set_to_none)


class BackwardSchedule(StepSchedule):
    """Each unit's update runs on the host thread during the window's last
    backward, as soon as its gradients are complete (see [Note: when the
    optimizer runs])."""

    def _first_order(self, trainable: list) -> list:
        """Before any step was seen: the units complete their gradients
        roughly in reverse program order (in ``step()`` where updates may not
        run early: clipping or fp16 without speculation)."""
        return trainable[::-1] if self.early_ok or self.spec is not None else trainable

    def _reduces_in_backward(self) -> bool:
        """Stage 1 too when updates may start early: its update needs the
        reduce-scattered shard (see [Note: ZeRO shards in infinity])."""
        return super()._reduces_in_backward() or (self.needs_reduce and (self.early_ok or self.spec is not None))

    def _start_early(self, u) -> bool:
        p = self.p
        if not ((self.early_ok or self.spec is not None) and self._last_backward()
                and (p.modes.zero != 1 or u.grads.reduced) and u.index not in self._running
                and not p.grads.stale):  # stale: see [Note: a backward after step() without zero_grad()]
            return False
        spec = None if self.early_ok else self.spec
        if spec is not None and not spec.reserve(u):
            return False  # waits for step()
        self._closing = True
        grad, written = p.grads.update_input(u), p.grads.written_now(u)
        # Gradients are sums over the data-parallel ranks; see [Note: speculative updates] in speculate.py.
        scale = 1.0 / p.sharding.world if spec is None else spec.scale
        def norm_part() -> None:
            # step()'s norm needs every unit's gradients: a speculated unit's share is taken here, off the step's
            # critical path (stage 0; See [Note: speculative updates] in speculate.py).
            if spec is not None and not p.modes.zero:
                p.grads.take_norm_part(u, self.updater.counted_runs)

        if self._hyper is None:  # See [Note: hyper-parameters of early updates]
            self._hyper = self.groups_now()
        hyper = self._hyper
        if p.modes.opt_nvme:
            self._bound_queue()
            if not p.modes.zero:
                p.grads.claim(u)

            def job() -> None:
                p.grads.wait(u)
                norm_part()
                for h in p.optstate.checkout(u):
                    h.wait()
                if spec is not None:
                    spec.begin(u)
                self.update_from_nvme(u, grad, written, scale, hyper, keep_old=spec is not None)
                if spec is None or p.modes.zero:
                    p.grads.release(u)
                elif not spec.keep_grads:  # step()'s norm and a replay need them: on disk meanwhile
                    p.grads.spill(u, claimed=True)
        else:
            def job() -> None:
                p.grads.wait(u)
                norm_part()
                undo = spec.begin(u) if spec is not None else None
                self.update_in_memory(u, grad, written, scale, hyper, undo)

        self._running[u.index] = p.mover.host_job(self._guarded(job, u))
        if p.modes.opt_nvme:
            self._read_ahead_next()
        elif spec is not None and len(self._running) == 1 and u.index and spec.reserve(p.units[0]):
            # The root's update ends backward, on the step's critical path: its undo state is saved ahead.
            self._root_read = p.mover.host_job(self._guarded(lambda: spec.save(p.units[0]), p.units[0]))
        return True

    def _bound_queue(self) -> None:
        """Backpressure: with NVMe state every queued update holds its unit's
        gradients in a host buffer until it runs; when backward outruns the
        optimizer they would fill the pool, and the update running then finds
        no room for its own buffers (it cannot wait for itself). So at most
        ``MAX_QUEUED`` updates are queued or running: the host budget's
        pipeline (limits.PIPELINE_GRAD_BUFFERS, PIPELINE_STATE_BUFFERS) holds that many."""
        while sum(not t.done() for t in self._running.values()) >= MAX_QUEUED:
            t0 = time.perf_counter()
            self.wait_one()
            self.p.stats.optimizer_wait_seconds += time.perf_counter() - t0

    def _read_ahead_next(self) -> None:
        """Reads the optimizer state of the unit whose gradients complete next
        while the current one is updated. The root's update runs after
        backward ends, on the step's critical path: its state is read one
        unit earlier, on the host thread (queued behind the update just
        submitted, so it never takes that update's buffers), evicting compute
        copies this pass is done with if the host budget has no room."""
        p = self.p
        nxt = policy.state_read_ahead(p.trace.upcoming(16), lambda i: p.units[i].place.trainable,
                                      lambda i: i in self._running)
        if not nxt:
            return
        p.optstate.read_ahead(p.units[nxt[0]])
        root = p.units[0]
        if nxt[-1] == 0 and root.opt.state is OptState.HOME and self._root_read is None:
            self._root_read = p.mover.host_job(self._guarded(lambda: p.optstate.read_ahead(root, evict_done=True),
                                                             root))


def _quietly(fn, *args) -> None:
    """Cleanup after a fault: what fails here must not hide the fault."""
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - the first fault is what the user sees
        pass


def make_schedule(parts, updater, overlap: str, accum_steps: int, early_ok: bool,
                  speculation=None) -> StepSchedule:
    """The schedule of ``overlap`` ("step", "backward" or "delayed");
    ``speculation``: a speculate.Speculation for overlap="backward" where
    updates may not simply run early (clipping, fp16), else None."""
    from .delayed import DelayedSchedule  # it builds on StepSchedule: imported here, not at the top
    cls = {"step": StepSchedule, "backward": BackwardSchedule, "delayed": DelayedSchedule}[overlap]
    return cls(parts, updater, accum_steps, early_ok, speculation)
