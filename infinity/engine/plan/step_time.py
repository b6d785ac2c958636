"""The time of one training step, predicted before the run: the engine's own
schedule laid out as tasks on resources (simulate.py), priced by a hardware
profile (profile.py), from the meta forward's op costs (costs.py).

[Note: the step as tasks]
One steady-state step, as the engine runs it (``grad_accumulation_steps``
forward and backward passes, each like the first; the optimizer's work
follows the last backward):

- the head of the trace was prefetched at the end of the last ``step()``
  ([Note: the trace wraps around the step] in residency.py): those copies
  start at time 0;
- forward, unit by unit (the root first): a unit absent from the arena is
  fetched on demand (compute waits), then the next ``prefetch_depth``
  absent units of the trace within ``prefetch_bytes`` are copied up while it
  computes; a unit is evicted by Belady's rule (furthest next use), and a
  prefetch never evicts a unit needed sooner. The arena is the budget less
  the gradient reserve (placement.DeviceNeed);
- backward, in reverse: the same fetches for the units evicted since their
  forward; each unit's gradients go to the host (``d2h``) after its
  backward;
- the optimizer on the host thread: overlap="step" after backward, unit by
  unit; "backward" each unit as soon as its gradients are on the host (the
  root last), with NVMe state at most ``MAX_QUEUED`` queued (backward waits);
  "delayed" the previous step's updates from time 0, beside forward and
  backward; ``step()`` ends when all are done;
- NVMe optimizer state: each unit's master and moments (8 bytes a parameter
  when the master is the compute copy) are read before and written after its
  update; with overlap="step" the gradients are spilled in backward and read
  back, the next unit's read running while one updates;
- NVMe parameters: when the host cache cannot hold every compute copy, each
  fetch reads the copy from disk first and each updated copy is written back.

Each unit's forward and backward also pays the engine's own time per
parameter tensor ([Note: the engine's time per parameter]
Beside the ops it runs, the engine spends Python time on the compute thread
for each parameter tensor of a unit (in forward the guard on each
parameter's use, param_guard.py; in backward each gradient's hand-off to
the host, grads.take, and the hooks) and for each op the unit runs (the
saved-tensor hooks, saved.py). Measured here (tiny units through infinity
against plain PyTorch, one torch thread) the parameter part is about 0.13 ms
a tensor and pass, with no measurable part per unit (units of 4, 12 and 24
tensors: 0.47, 1.5 and 2.8 ms a pass) nor per byte (the bench's GPT at
widths 32 and 256: 15 and 20 ms a step over its 52 tensors). So a unit's
pass pays ``param_overhead_s[phase]`` times its parameter tensors in forward
(its trainable ones in backward) plus ``engine_op_overhead_s[phase]`` times
the ops counted for it, both measured by ``infinity doctor --profile``
(cli/engine_probe.py). A per-unit figure measured on small units (the
earlier model) missed most of it: a GPT block has 12 tensors and ~40 ops.

[Note: the step boundary]
``step()`` and ``zero_grad()`` do more than the updates: the gradients'
drain and scale, each unit's device copy dropped for the new values and
its parameters' stand-ins set (``invalidate``), the memory-pressure check,
the head of the next pass's trace issued ([Note: the trace wraps around the
step] in residency.py), each gradient forgotten. It runs on the calling
thread after the last update, before the next forward can start: one
serial task on compute after every update and the last backward, of
``step_overhead_s["fixed"]`` plus ``step_overhead_s["per_tensor"]`` times
the model's parameter tensors, both measured by ``infinity doctor
--profile`` (cli/engine_probe.py: tiny units' ``step()`` + ``zero_grad()``
less their updates, at 48 and 144 tensors). Measured here (one torch
thread, the machine loaded by other jobs): 2-5 ms a step and 40-50 us a
tensor, 3-11 ms of the bench's 0.14 s GPT step, which the model had left
out (its step() ended with the last update).

Left out: activation memory and the
allocator, the data loader, checksums, host-pool back-pressure other than the
update queue's, and (with gradient accumulation) the reading back of
gradients spilled to NVMe between backward passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn

from .collectives import LINK, NET_LINKS, grad_reduction, wire_bytes
from .costs import ROOT_TAIL, OpCost, PassCosts, count_pass
from .limits import MAX_QUEUED
from .opt_kinds import state_bytes
from .placement import Modes, device_need, host_need, nbytes, round_pool
from .profile import Profile
from .simulate import COMPUTE, Simulation, SimResult

__all__ = ["StepPrediction", "predict_step", "unit_seconds", "op_seconds"]

_DTYPE_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass
class StepPrediction:
    """A predicted step: ``seconds``, the ``bound`` part, ``exposed`` seconds
    per part, ``busy`` seconds per resource and ``bytes`` per link."""

    seconds: float
    bound: str
    exposed: Dict[str, float]
    busy: Dict[str, float]
    bytes: Dict[str, int]
    sim: SimResult


def op_seconds(o: OpCost, profile: Profile, dtype: str) -> float:
    """Seconds of op ``o`` in ``dtype`` on the profiled device ([Note: an op's time] in costs.py)."""
    if o.name in ("attention", "attention_backward"):
        rate = profile.attention_rate(dtype, o.name == "attention_backward", o.shape[1])
        work = o.flops / (rate or profile.gemm_rate(dtype, o.flops))
    elif o.flops:
        work = o.flops / profile.gemm_rate(dtype, o.flops, o.shape or None)
    else:
        rate = profile.op_rate(dtype, o.name)
        work = o.numel / rate if rate else 0.0
    return max(work, o.nbytes / profile.mem_bw) + profile.op_overhead_s


def unit_seconds(costs: PassCosts, phase: str, unit: int, profile: Profile, dtype: str,
                 prices: Optional[Dict[OpCost, float]] = None) -> float:
    """Seconds of ``unit``'s ops in ``phase`` on the profiled device; ``prices``:
    a memo of op -> seconds for this profile and dtype (a model repeats its ops)."""
    prices = {} if prices is None else prices
    t = 0.0
    for o in getattr(costs, phase).get(unit, []):
        s = prices.get(o)
        if s is None:
            s = prices[o] = op_seconds(o, profile, dtype)
        t += s
    return t


class _Arena:
    """The device arena's contents along the trace (Belady eviction), to
    tell which uses fetch; pure bookkeeping, no time."""

    def __init__(self, sizes: List[int], room: int, trace: List[int]):
        self.sizes, self.room, self.trace = sizes, room, trace
        self.resident: Dict[int, int] = {}

    def next_use(self, idx: int, pos: int) -> int:
        for j in range(pos + 1, len(self.trace)):
            if self.trace[j] == idx:
                return j
        return len(self.trace) + 1

    def alloc(self, idx: int, pos: int, pinned: int, protect_before: Optional[int] = None) -> bool:
        """Makes room for ``idx`` (evicting furthest next use first); False if it cannot."""
        while sum(self.sizes[i] for i in self.resident) + self.sizes[idx] > self.room:
            cand = [(self.next_use(i, pos), i) for i in self.resident if i not in (pinned, 0)]
            if protect_before is not None:
                cand = [c for c in cand if c[0] > protect_before]
            if not cand:
                return False
            del self.resident[max(cand)[1]]
        self.resident[idx] = 1
        return True


def predict_step(model: nn.Module, config, run: Callable[[nn.Module], torch.Tensor], profile: Profile,
                 placed_units, costs: Optional[PassCosts] = None) -> StepPrediction:
    """The predicted step of ``model`` (on the meta device) under ``config``:
    ``placed_units`` is estimator.placed's ``(units, modes, places)``; ``run``
    one forward on meta inputs returning the loss; ``costs`` the op costs if
    counted already (count_pass). See [Note: the step as tasks]."""
    units, modes, places = placed_units
    if modes.world > 1:
        profile.net(NET_LINKS[0])  # raises naming the fix when the profile has no network figures
    if costs is None:
        costs = count_pass(model, run, {u.index: u.modules for u in units[1:]}, modes.dtype)
    tensors = [(len(u.layout.slots), len(u.layout.trainable_slots)) for u in units]
    b = _Builder(modes, places, profile, costs, config, tensors)
    b.lay_out()
    res = b.sim.run()
    return StepPrediction(res.makespan, res.bound, res.exposed, res.busy, b.moved, res)


class _Builder:
    """Lays one step out as tasks; see [Note: the step as tasks]."""

    def __init__(self, modes: Modes, places, profile: Profile, costs: PassCosts, config, tensors):
        self.m, self.places, self.prof, self.costs = modes, places, profile, costs
        self.tensors = tensors  # per unit: (parameter tensors, trainable ones)
        self.sim = Simulation(profile.slow_pairs())
        self.dt = _DTYPE_NAME[modes.dtype]
        self.prices: Dict[OpCost, float] = {}  # op -> seconds on this profile
        self.moved = {"h2d": 0, "d2h": 0, "nvme_read": 0, "nvme_write": 0}
        if modes.world > 1:
            self.moved.update({k: 0 for k in NET_LINKS})
        self.fetch: Dict[int, Optional[int]] = {}   # unit -> its latest h2d task
        self.n = len(places)
        need = device_need(places, [False] * self.n, modes)
        budget = config.device_memory if config.device_memory is not None else need.everything
        self.room = need.arena_bytes(budget)
        self.host_budget = config.host_memory
        # Clipping and fp16's overflow check need every gradient: early updates wait for step().
        early = config.max_grad_norm is None and modes.dtype != torch.float16
        self.overlap = "step" if config.overlap == "backward" and not early else config.overlap
        self.params_from_disk = modes.params_nvme and not self._cache_holds_all()
        self.accum, self.last_backward = config.grad_accumulation_steps, True

    def _cache_holds_all(self) -> bool:
        h = host_need(self.places, self.m)
        if self.host_budget is None:
            return True
        need = h.permanent + sum(round_pool(nbytes(p.home_numel, self.m.dtype)) for p in self.places)
        return need <= self.host_budget

    # -- pieces ---------------------------------------------------------------------------

    def _copy(self, name: str, link: str, nb: int, deps) -> int:
        self.moved[link] += nb
        bw = self.prof.h2d_bw if link == "h2d" else self.prof.d2h_bw
        return self.sim.add(name, link, nb / bw, link, deps)

    def _net(self, name: str, link: str, sent: int, deps) -> int:
        """A collective on ``link`` sending ``sent`` bytes ([Note: collectives in the step model])."""
        self.moved[link] += sent
        bw, latency = self.prof.net(link)
        return self.sim.add(name, link, latency + sent / bw, link, deps)

    def _disk(self, name: str, write: bool, nb: int, deps) -> int:
        self.moved["nvme_write" if write else "nvme_read"] += nb
        bw = self.prof.disk_write_bw if write else self.prof.disk_read_bw
        res = "disk_write" if write else "disk_read"
        return self.sim.add(name, res, nb / bw, res, deps)

    def _h2d(self, i: int, issue) -> int:
        """Brings unit ``i`` up (from disk first when the host cache misses)."""
        nb = self.places[i].compute_bytes
        deps = [issue]
        if self.params_from_disk:
            deps.append(self._disk(f"read compute {i}", False, nbytes(self.places[i].home_numel, self.m.dtype),
                                   [issue]))
        if self.m.zero == 3 and self.m.world > 1:  # the own shard up, the unit all-gathered on the device
            up = self._copy(f"h2d {i} (shard)", "h2d", nb // self.m.world, deps)
            t = self._net(f"gather {i}", LINK[("param_gather", True)], wire_bytes(nb, self.m.world), [up])
        else:
            t = self._copy(f"h2d {i}", "h2d", nb, deps)
        self.fetch[i] = t
        return t

    # -- the pass -------------------------------------------------------------------------

    def lay_out(self) -> None:
        m = self.m
        order = list(range(1, self.n))
        fwd = [0] + order
        bwd = order[::-1] + [0]
        trace = fwd + bwd
        self.updates: Dict[int, int] = {}
        pre = self._delayed_updates() if m.delayed else []
        compute_end = None
        for mb in range(self.accum):  # each backward's gradients go to the host; the updates follow the last
            self.last_backward = mb == self.accum - 1
            compute_end = self._pass(trace, len(fwd), compute_end)
        self._optimizer(compute_end)
        if pre:
            self.sim.add("step() waits", "optimizer", 0.0, "optimizer", pre)
        self._step_boundary(compute_end, pre)

    def _step_boundary(self, compute_end: Optional[int], pre: list) -> None:
        """The engine's own time after the updates ([Note: the step boundary])."""
        so = self.prof.step_overhead_s
        secs = so.get("fixed", 0.0) + so.get("per_tensor", 0.0) * sum(n for n, _ in self.tensors)
        self.sim.add("step() boundary", "compute", secs, "step()", [compute_end, *self.updates.values(), *pre])

    def _pass(self, trace: List[int], n_fwd: int, start: Optional[int]) -> Optional[int]:
        """Forward and backward over ``trace`` after task ``start`` (the last
        micro-batch's backward, or None); returns the last compute task."""
        m, p = self.m, self.places
        on_device = m.params_on_device
        if start is None:  # the step's first pass: every compute copy was refreshed by the last update
            self.arena = _Arena([pl.compute_bytes for pl in p], self.room, trace)
            if not on_device:
                # The root stays resident for the pass; the head of the trace came up at the last step's end.
                self.arena.resident[0] = 1
                self._h2d(0, None)
        arena = self.arena
        if not on_device:  # a later pass finds the units the last one left resident
            self._prefetch(arena, trace, -1, start)
        prev = start
        self.grad_out: Dict[int, int] = {}
        for pos, i in enumerate(trace):
            backward = pos >= n_fwd
            if not on_device and i not in arena.resident:
                if not arena.alloc(i, pos, pinned=i):
                    raise ValueError(f"unit {i} does not fit the arena of {self.room} bytes")
                self._h2d(i, prev)
            if not on_device:
                self._prefetch(arena, trace, pos, prev)
            phase = "backward" if backward else "forward"
            deps = [prev, self.fetch.get(i)]
            if backward and m.opt_nvme and self.overlap == "backward" and self.last_backward:
                deps += self._queue_bound(i)
            secs = unit_seconds(self.costs, phase, i, self.prof, self.dt, self.prices) + self._engine_seconds(i, backward)
            if backward and i == 0:
                secs += unit_seconds(self.costs, "backward", ROOT_TAIL, self.prof, self.dt, self.prices)
            prev = self.sim.add(f"{phase} {i}", "compute", secs, COMPUTE, deps)
            if backward and m.host_optimizer and p[i].trainable:
                self.grad_out[i] = self._grads_out(i, prev)
                self._after_grads(i)
        return prev

    def _engine_seconds(self, i: int, backward: bool) -> float:
        """The engine's own time in unit ``i``'s pass ([Note: the engine's time per parameter])."""
        phase = "backward" if backward else "forward"
        ops = len(getattr(self.costs, phase).get(i, [])) + (len(self.costs.backward.get(ROOT_TAIL, []))
                                                            if backward and i == 0 else 0)
        return (self.prof.param_overhead_s.get(phase, 0.0) * self.tensors[i][1 if backward else 0]
                + self.prof.engine_op_overhead_s.get(phase, 0.0) * ops)

    def _grads_out(self, i: int, after: int) -> int:
        """Unit ``i``'s gradients to the host, reduced over the ranks after the
        last backward ([Note: collectives in the step model]); returns the task the update waits for."""
        m, gb = self.m, nbytes(self.places[i].trainable_numel, self.m.grad_dtype)
        if m.world == 1 or not self.last_backward:
            return self._copy(f"grads {i}", "d2h", gb, [after])
        link, sent, down = grad_reduction(m.zero, m.world, m.reduce_on_device, gb)
        if m.reduce_on_device:
            red = self._net(f"reduce grads {i}", link, sent, [after])
            return self._copy(f"grads {i} (shard)", "d2h", down, [red])
        out = self._copy(f"grads {i}", "d2h", down, [after])
        return self._net(f"reduce grads {i}", link, sent, [out])

    def _prefetch(self, arena: _Arena, trace: List[int], pos: int, issue) -> None:
        """policy.prefetch_plan: the next ``depth`` distinct units, absent ones within the byte cap."""
        seen, ahead = set(), 0
        for j in range(pos + 1, len(trace)):
            idx = trace[j]
            if len(seen) >= self.m.depth:
                break
            if idx in seen:
                continue
            seen.add(idx)
            if idx in arena.resident:
                continue
            nb = arena.sizes[idx]
            if self.m.prefetch_bytes is not None and ahead + nb > self.m.prefetch_bytes:
                break
            if not arena.alloc(idx, max(pos, 0), pinned=trace[pos] if pos >= 0 else 0, protect_before=j):
                break
            ahead += nb
            self._h2d(idx, issue)

    def _after_grads(self, i: int) -> None:
        """Backward mode: the unit's update queued now; step mode with NVMe state: its gradients spilled."""
        m, p = self.m, self.places
        if self.overlap == "backward":
            if self.last_backward:
                self._update(i, [self.grad_out[i]])
        elif m.opt_nvme and self.overlap == "step":
            self._disk(f"spill grads {i}", True, nbytes(p[i].trainable_numel, m.grad_dtype),
                       [self.grad_out[i]])

    def _queue_bound(self, i: int) -> list:
        """Backward with NVMe state: at most MAX_QUEUED updates queued: the
        backward after unit j's waits for the update of the unit MAX_QUEUED later."""
        j = i + 1 + MAX_QUEUED  # the unit whose update must end before i's backward (reverse order)
        return [self.updates.get(j)] if j < self.n else []

    def _state_bytes(self, i: int) -> int:
        pl = self.places[i]
        return state_bytes(pl.state_numel, self.m.moment_dtype, master=not pl.aliased, master_dtype=self.m.master_dtype)

    def _update(self, i: int, deps: list, read_deps: Optional[list] = None) -> int:
        """Unit ``i``'s AdamW on the host thread (with its NVMe state read before and written after)."""
        m, pl = self.m, self.places[i]
        deps = list(deps)
        if m.opt_nvme:
            deps.append(self._disk(f"read state {i}", False, self._state_bytes(i), read_deps or []))
        secs = pl.state_numel / self.prof.adamw_rate(_DTYPE_NAME[m.grad_dtype])
        t = self.sim.add(f"update {i}", "optimizer", secs, "optimizer", deps)
        self.updates[i] = t
        if m.opt_nvme:
            self._disk(f"write state {i}", True, self._state_bytes(i), [t])
        if self.params_from_disk:
            self._disk(f"write back compute {i}", True, nbytes(pl.home_numel, m.dtype), [t])
        after, tb = t, nbytes(pl.trainable_numel, m.dtype)
        if m.gather_on_device:  # the own shard up, gathered on the device (host_gather_reason)
            up = self._copy(f"refresh {i} (shard)", "h2d", tb // m.world, [t])
            self._net(f"gather copy {i}", LINK[("copy_gather", True)], wire_bytes(tb, m.world), [up])
            return t
        if m.world > 1 and m.zero in (1, 2):  # the updated compute copies all-gathered on the host
            after = self._net(f"gather copy {i}", LINK[("copy_gather", False)], wire_bytes(tb, m.world), [t])
        if m.params_on_device:
            self._copy(f"refresh {i}", "h2d", pl.compute_bytes, [after])
        return t

    def _delayed_updates(self) -> list:
        """Delayed mode: last step's updates run from time 0."""
        return [self.sim.add(f"update {i} (previous step)", "optimizer",
                             pl.state_numel / self.prof.adamw_rate(_DTYPE_NAME[self.m.grad_dtype]), "optimizer")
                for i, pl in enumerate(self.places) if pl.trainable]

    def _optimizer(self, compute_end: Optional[int]) -> None:
        m = self.m
        if not m.host_optimizer or m.delayed:
            return
        grads = list(self.grad_out.values())
        if self.overlap == "backward":
            return  # queued during backward; step() waits for them
        prev_read = prev_update = before = None
        for i in sorted(self.grad_out):
            deps = [compute_end] + grads
            rd = []
            if m.opt_nvme:  # unit i's reads start once unit i-1's are in and unit i-2's update is done
                gb = nbytes(self.places[i].trainable_numel, m.grad_dtype)
                rd = [self._disk(f"read grads {i}", False, gb, [compute_end, prev_read, before])]
                prev_read = rd[0]
            before, prev_update = prev_update, self._update(i, deps + rd, rd)
