"""The offload engine: builds the parts of a model's state once, hands each
what it uses by name (a :class:`~infinity.engine.parts.Parts` record), and
tells the four flows of a step in a few lines each. Which folder owns what is
in engine/__init__.py.
"""

from __future__ import annotations

import dataclasses
import datetime
import warnings
import weakref
from typing import Dict, List

import torch
import torch.nn as nn

from ..io.errors import SwapFullError
from ..system import sysinfo
from ..config.runtime import Config
from .adapt.device_budget import DeviceBudget
from .faults import FaultState, UsageError
from .fence import Fence
from .owners.grads import Gradients
from .owners.host_cache import HostCache
from .mechanism.grad_staging import StagingRing
from .mechanism.mover import DeferredTicket, make_mover
from .mechanism.nvme import NvmeTier
from .owners.optstate import OptimizerState
from .adapt.floor import check_memory_floor
from .plan.limits import STAGING_PER_PATH
from .plan.placement import HostNeed, grad_staging, host_need, modes_of, nvme_capacity, place_unit
from .adapt.pressure import PressureMonitor
from .owners.residency import Residency
from .owners.saved import SavedTensorRouter
from .parts import Parts
from .plan.state import DeviceState, Quiet
from .stats import Stats
from .mechanism.host_room import HostRoom
from .mechanism.tiers import HostTier, host_budget
from .plan.trace import Trace
from .plan.units import build_units
from .plan.opt_kinds import slot_align
from .values import Values
from .mechanism.zero import Sharding

__all__ = ["Engine"]


class Engine:
    """Owns the units of one model and, through its parts, every byte of their state."""

    def __init__(self, model: nn.Module, config: Config, group_of: Dict[int, int], process_group=None):
        self.model, self.config = model, config
        self.stats, self.trace, self.quiet = Stats(), Trace(), Quiet()
        self.faults = FaultState(self.describe_steps)  # See [Note: a run is consistent or it says so]
        self.device = config.resolve_device()
        self.mover = make_mover(self.device)
        weakref.finalize(self, self.mover.close, False)  # worker threads end with the engine
        self.sharding = Sharding(config.zero_stage, self.stats, group=process_group, device=self.device)
        if self.sharding.world > 1:
            desc = {f"config.{k}": v for k, v in config.to_dict().items() if k != "swap_paths"}
            desc.update({f"param {n}": (tuple(p.shape), p.requires_grad)
                         for n, p in model.named_parameters(remove_duplicate=False)})
            self.sharding.check_same(desc)
        self.modes = modes_of(config, self.sharding.world, self.device)
        self.units = build_units(model, config.unit_classes, group_of, self.sharding.shards,
                                 slot_align(config.moment_dtype))
        for u in self.units:
            u.place = place_unit(u.layout, self.modes)
        self.param_slot = {id(s.param): (u, i) for u in self.units for i, s in enumerate(u.layout.slots)}
        self.fence = Fence()  # See [Note: the engine's fence]
        self._make_parts()
        self.parts = Parts(self.units, self.modes, self.trace, self.stats, self.mover, self.sharding, self.nvme,
                           self.faults, self.fence, self.room, self.host_cache, self.grads, self.optstate,
                           self.residency, self.values_changed)
        self.pressure = PressureMonitor(self.parts, self.host_budget)
        self.values = Values(self.parts)  # a unit's values into and out of every tier, for code outside the step
        self.values.initialize(model)
        # See [Note: saved tensors follow their unit]; units that never move need no hooks.
        self.saved = None if self.modes.params_on_device else \
            SavedTensorRouter(self.residency, self.param_slot, self.faults)
        self.schedule = self.optimizer = self.hooks = self.guard = None  # see attach()
        self.values_version = 0  # bumped whenever parameter values change (values_changed, after_step)
        self._pass_pins: list = []
        self._in_pass = self.pass_grad = self._relayout = self._closed = False
        self.stats.end_step_window()  # the first step's counters start after initialisation

    def _make_parts(self) -> None:
        """The tiers under their budgets, and the owners that work on them."""
        cfg, modes = self.config, self.modes
        self.budget = DeviceBudget(self.units, modes, self.device, cfg.device_memory)
        need = host_need([u.place for u in self.units], modes)
        # Before any tier is allocated: a cgroup limit below the run's floor is
        # a named refusal, not a silent SIGKILL in step 1 ([Note: the memory floor]).
        check_memory_floor(self.model, need.minimum, self.budget.minimum(), self.device.type == "cpu",
                           STAGING_PER_PATH * cfg.swap_block_size * len(cfg.swap_paths) if modes.nvme_used else 0)
        dev_tier = self.budget.first_tier()
        self.host_budget = host_budget(cfg.host_memory, need, modes)
        host_tier = HostTier(need.capacity, self.host_budget, pin=self.device.type == "cuda",
                             need_bytes=need.minimum, device=self.device, modes=modes)
        self.nvme = None
        if modes.nvme_used:
            # The global rank names the folder: ranks of different groups on one node never share it.
            self.nvme = _open_nvme(cfg, need, len(self.units), self.stats, self.sharding.global_rank)
            weakref.finalize(self, self.nvme.close)
        self.room = HostRoom(host_tier)  # See [Note: the host room]
        blocks, block = grad_staging([u.place for u in self.units], modes)
        if blocks:  # the pinned ring in the host pool (its bytes are in need.minimum)
            self.mover.staging = StagingRing(blocks, block, lambda n: host_tier.alloc(n, torch.uint8))
        self.host_cache = HostCache(self.units, modes, self.room, self.nvme, self.trace, self.stats)
        self.grads = Gradients(self.units, modes, dev_tier, self.room, self.nvme, self.mover, self.stats,
                               self.sharding, cfg.grad_accumulation_steps, cfg.overlap)
        self.optstate = OptimizerState(self.units, modes, self.room, self.host_cache, self.nvme, self.sharding)
        self.room.set_rungs(self.host_cache.evict_one, self.optstate.drop_read_ahead)
        self.residency = Residency(self.units, modes, dev_tier, self.mover, self.trace, self.stats, self.sharding,
                                   self.host_cache, self.budget.minimum, self.quiet)

    def after_step(self) -> None:
        """Called at the end of every optimizer step (see [Note: the default
        device budget] and [Note: memory pressure])."""
        self.values_version += 1
        self.budget.after_step(self.residency, self.grads, self.saved)
        self.pressure.after_step()
        self.fence.after_step()
        self.residency.prefetch_next_pass()  # See [Note: the trace wraps around the step] in residency.py

    # -- wiring ------------------------------------------------------------------------------

    def attach(self, optimizer, hooks, guard) -> None:
        """The optimizer (its schedule runs the updates), the installed hooks
        and the parameters' guard (armed from now on between passes)."""
        self.optimizer, self.hooks, self.schedule = optimizer, hooks, optimizer.schedule
        self.room.set_wait_update(self.schedule.wait_one)  # the ladder's fourth rung
        self.guard = guard
        guard.arm()

    # -- passes ------------------------------------------------------------------------------

    def begin_pass(self, grad: bool) -> None:
        """Root forward starts: a new pass (a forward and, with grad, its backward)."""
        if self._in_pass:
            self.end_pass()
        if self.schedule is not None and self.schedule.updates_in_flight():
            raise self.grads.forward_error()
        if grad and self.optimizer is not None:
            self.optimizer.check_groups()  # before its backward may start updates
        self._in_pass, self.pass_grad = True, grad
        self.trace.begin_pass("train" if grad else "infer")
        if self._relayout or self.units[0].dev.state is DeviceState.ABSENT:
            # The pass units go to the top of an empty arena, next to each
            # other: nothing they leave between them splits the room the others page through.
            self._relayout = False
            self.residency.evict_unpinned()
        self._pin_for_pass(self.units[0])
        for u in self.units[1:]:
            if u.dev.external:
                self._pin_for_pass(u)
        if grad:
            self.grads.begin_backward()

    def _pin_for_pass(self, u) -> None:
        self.residency.fetch(u)
        self._pass_pins.append(u)

    def end_pass(self) -> None:
        """The pass is over (end of backward, or of a no-grad forward): its pins go."""
        if not self._in_pass:
            return
        for u in self._pass_pins:
            self.residency.unpin(u)
        self._pass_pins = []
        self.residency.end_pass()
        self._in_pass = False
        self.trace.end_pass()
        self.stats.trace_invalidations = self.trace.invalidations

    def backward_done(self) -> None:
        """The whole backward of the pass is done."""
        self.end_pass()
        self.schedule.backward_done()

    def note_external_use(self, u) -> None:
        """A parameter of ``u`` is used outside ``u``'s forward (found by the
        recording pass's watcher): from now on ``u`` is resident for whole
        passes, like the root unit."""
        if self.residency.mark_external(u):
            self._relayout = True
            warnings.warn(f"infinity: parameters of unit {u.name!r} are used outside its forward; the unit "
                          "will stay on the device for whole forward/backward passes", RuntimeWarning,
                          stacklevel=4)
        if u not in self._pass_pins:
            self._pin_for_pass(u)

    @property
    def in_pass(self) -> bool:
        return self._in_pass

    @property
    def closed(self) -> bool:
        return self._closed

    # -- gradients out -------------------------------------------------------------------------

    def on_grad(self, u, ti: int, p: nn.Parameter) -> None:
        """A parameter's gradient is complete: it leaves the device; on ``u``'s
        last one, the schedule may start on ``u`` (reduction, update)."""
        self.residency.settle()
        if self.grads.take(u, ti, p):
            self.schedule.unit_ready(u)

    # -- values ---------------------------------------------------------------------------------

    def forward_wrote(self, u, slots) -> None:
        """torch wrote ``u``'s parameters ``slots`` (slot indices) in place
        during forward (see [Note: writes in forward] in hooks.py): written
        through to every tier, or refused where that cannot give torch's
        result; the refusal fails the engine, since the device copy already
        holds the write."""
        names = ", ".join(repr(u.layout.slots[i].name) for i in slots)
        why = None
        if self.sharding.world > 1:
            why = (f"on {self.sharding.world} ranks each rank writes its own values into its copy of a parameter "
                   "the ranks share, so the ranks' parameters would part")
        elif self.config.overlap == "delayed":
            why = ("with overlap='delayed' the previous step's update is being computed from the values before "
                   "this write, and would overwrite it")
        if why is not None:
            msg = (f"parameter(s) {names} of unit {u.name!r} written in place during forward "
                   f"(e.g. nn.Embedding(max_norm=...), a no_grad weight update in forward): {why}. Use "
                   "overlap='step' or 'backward' on one rank, or move the write out of forward (between "
                   "steps a write goes through to every tier)")
            self.faults.record(RuntimeError(msg), "forward (a parameter written in place)")
            raise UsageError(msg)
        self.values.write_through(u, list(slots))

    def values_changed(self, u, slots=None, bump: bool = True) -> None:
        """The values of ``u``'s parameters (``slots``, default its trainable
        ones) changed in their home: bumps their autograd versions, so a
        tensor saved before and needed after raises torch's in-place error
        (see [Note: saved tensors follow their unit]). ``bump=False``: the
        write was torch's own in-place call on the parameter, which moved
        the version already."""
        self.values_version += 1  # readers that cache values (state_dict.py) read again
        params = [s.param for s in (u.layout.trainable_slots if slots is None else slots)]
        if params and bump:
            torch.autograd.graph.increment_version(params)

    def describe_steps(self) -> str:
        """Each unit's optimizer step counts, for error messages (equal counts shown once)."""
        parts = []
        for u in self.units:
            steps = sorted({s.step for s in u.layout.trainable_slots})
            if steps:
                parts.append(f"{u.name}: {steps[0] if len(steps) == 1 else steps}")
        return ", ".join(parts) or "none trainable"

    def state_bytes(self) -> Dict[str, int]:
        """Bytes kept for good per kind of optimizer state (the ZeRO 1/N shares)."""
        out = self.optstate.kept_bytes()
        out["grad"] = self.grads.kept_bytes()
        return out

    def __reduce_ex__(self, protocol):
        # Reached through the model's hooks by copy.deepcopy(model) and torch.save(model).
        raise UsageError(
            "copy.deepcopy / pickling (torch.save(model)) of a model managed by infinity: its state lives in "
            "infinity's tiers and swap files, which cannot be copied with it. Save it with "
            "infinity.save_checkpoint (or torch.save(model.state_dict())), or call infinity.close(model) first: "
            "the model is an ordinary one after that")

    # -- teardown --------------------------------------------------------------------------------

    def close(self) -> None:
        """Stops the worker threads and removes the swap files (the model is unusable after)."""
        if self._closed:
            return
        self._closed = True
        # Every step runs whatever the one before met: a fault must not keep
        # the lock, the files or the threads (see [Note: a run is consistent or it says so]).
        problems = []
        for name, step in (("collectives", self._settle_collectives), ("clock", self.sharding.clock.close),
                           ("copies", self.mover.synchronize),
                           ("threads", self.mover.close), ("writes", self.room.close),
                           ("swap files", self.nvme.close if self.nvme is not None else None),
                           ("host pool", self.room.close_pool)):  # last: NVMe transfers use its buffers
            if step is None:
                continue
            try:
                step()
            except Exception as e:  # noqa: BLE001 - reported below, the teardown goes on
                problems.append(f"{name}: {type(e).__name__}: {e}")
        if problems and not self.faults.failed:
            warnings.warn("infinity.close: teardown met errors (the swap files are scratch, nothing saved was "
                          "lost): " + "; ".join(problems), RuntimeWarning, stacklevel=3)
        self._drop_buffers()

    def _drop_buffers(self) -> None:
        """Forgets every tensor of the tiers, so memory goes back at close even
        while the caller keeps the optimizer (which references the engine):
        a run that closes and initializes again in one process needs room for one."""
        for owner in (self.host_cache, self.residency, self.optstate, self.grads, self.saved):
            if owner is not None:
                owner.drop_buffers()
        sysinfo.trim_heap()

    def _settle_collectives(self, timeout_s: float = 30.0) -> None:
        """Waits (at most ``timeout_s`` seconds each) for collectives still in
        flight (stage-3 gathers nobody used, reductions). Every rank issued the
        same ones, so they complete; left pending, gloo finishes them on its
        own thread while the interpreter shuts down and the process aborts. A
        gather not issued yet (NVMe, deferred) stays unissued on every rank alike."""
        works: List = []
        for u in self.units:
            t = u.dev.ticket
            works += getattr(t.inner if isinstance(t, DeferredTicket) else t, "works", ())
            for ft in u.grads.tickets:
                works += getattr(ft, "works", ())
        for w in works:
            try:
                w.wait(datetime.timedelta(seconds=timeout_s))
            except Exception:  # a failed peer: nothing left to protect
                pass
        # Drop the Work objects now: held by a closed engine (freed only by the
        # final garbage collection) they outlive the process group's
        # destruction and are released on gloo's thread during shutdown.
        self.residency.drop_in_flight()
        self.host_cache.forget_transfers()


def _open_nvme(cfg: Config, need: HostNeed, units: int, stats: Stats, rank: int) -> NvmeTier:
    """The NVMe tier, its swap files sized for ``need``. The room for a second
    copy of the optimizer state (``need.cow_bytes``: speculative updates
    write it while the old one stays, [Note: speculation with NVMe optimizer
    state] in step/speculate.py) is taken only where the disk has it: without
    it the run starts all the same and the units without room wait for
    ``step()`` (said once, ``stats()["speculation"]["units_without_disk"]``)."""
    def make(n: HostNeed) -> NvmeTier:
        return NvmeTier(cfg.swap_paths, nvme_capacity(n, units, len(cfg.swap_paths)), stats, rank=rank,
                        block_size=cfg.swap_block_size, queue_depth=cfg.swap_queue_depth, backend=cfg.swap_backend,
                        checksum=cfg.swap_checksum)
    if not need.cow_bytes:
        return make(need)
    try:
        return make(need)
    except SwapFullError:
        return make(dataclasses.replace(need, cow_bytes=0))
