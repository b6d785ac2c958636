"""step/schedule.py built without an Engine (issue 32): the schedules of
overlap="step" and overlap="backward" on a Parts record of small real parts
(units and placement of a tiny model, host pool, host cache, gradient owner,
CPU mover, one-rank sharding, fence, faults, trace, stats) and real Scaling,
with a fake updater: when updates run, the ready queue's order, wait_one,
update_order, and the accumulation window."""

import threading

import pytest
import torch
from torch import nn

import infinity
from infinity.engine.faults import FaultState, UsageError
from infinity.engine.fence import Fence
from infinity.engine.mechanism.host_room import HostRoom
from infinity.engine.mechanism.mover import make_mover
from infinity.engine.mechanism.tiers import DeviceTier, HostTier
from infinity.engine.mechanism.zero import Sharding
from infinity.engine.owners.grads import Gradients
from infinity.engine.owners.host_cache import HostCache
from infinity.engine.parts import Parts
from infinity.engine.plan.placement import modes_of, place_unit
from infinity.engine.plan.state import GradState
from infinity.engine.plan.trace import Trace
from infinity.engine.plan.units import build_units
from infinity.engine.stats import Stats
from infinity.engine.step.scaling import Scaling
from infinity.engine.step.schedule import make_schedule


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 16)  # the root unit (index 0)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))  # units 1..3


class Updater:
    """Stands in for step/update.py's updater. The schedules use only
    ``run(u, grad, written, out, scale, live, hyper=None, undo=None)`` and
    ``param_groups`` (the hyper-parameters the delayed mode and the early
    updates take). An SGD step with lr 1 into ``out`` (the host compute
    copy); a held unit's update waits for its gate, then is recorded."""

    def __init__(self):
        self.calls, self.gates = [], {}
        self.param_groups = [dict(lr=1.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, params=[])]

    def run(self, u, grad, written, out, scale, live, hyper=None, undo=None):
        assert undo is None  # these schedules run no speculative update
        gate = self.gates.get(u.index)
        if gate is not None:
            assert gate.wait(300), "gate never opened"
        out[:u.place.trainable_numel].sub_(grad * scale)
        self.calls.append((u.index, scale, threading.current_thread().name.startswith("infinity-host")))

    def hold(self, units):
        for u in units:
            self.gates[u.index] = threading.Event()

    def open(self, u=None):
        for i, g in self.gates.items():
            if u is None or i == u.index:
                g.set()


class Residency:
    """Stands in for the residency owner: the schedules (overlap "step" and
    "backward", host optimizer) call only ``invalidate(done)`` after a step
    (``done``: the units the copies' gathers refreshed already)."""

    def __init__(self):
        self.invalidations = 0

    def invalidate(self, done=frozenset()):
        self.invalidations += 1


class NoOptState:
    """Stands in for the optimizer-state owner: used only with NVMe state and
    after a failed update (``discard(u)``), neither of which happens here."""

    def discard(self, u):
        raise AssertionError("unexpected")


@pytest.fixture
def build():
    made = []

    def make(overlap, **cfg):
        torch.manual_seed(0)
        config = infinity.Config(device="cpu", dtype="fp32", offload_params="host", offload_optimizer="host",
                                 grad_accumulation_steps=2, overlap=overlap, **cfg)
        model, stats = Net(), Stats()
        modes = modes_of(config, 1, torch.device("cpu"))
        units = build_units(model, config.unit_classes, {}, 1)
        for u in units:
            u.place = place_unit(u.layout, modes)
        room = HostRoom(HostTier(1 << 16, 1 << 16, pin=False))
        mover = make_mover(torch.device("cpu"))
        sharding, trace = Sharding(0, stats), Trace()
        host_cache = HostCache(units, modes, room, None, trace, stats)
        dev = DeviceTier(torch.device("cpu"), 1 << 16, 4096, transient_reserve=1 << 12)
        grads = Gradients(units, modes, dev, room, None, mover, stats, sharding, 2, overlap)
        for u in units:
            host_cache.set_home(u, room.alloc(u.place.compute_numel, torch.float32).normal_())
            grads.set_permanent(u, room.alloc(u.place.trainable_numel, modes.grad_dtype))
        fence, fenced, changed = Fence(), [], []
        fence.install(object(), fenced.append, lambda: None, lambda: None)
        parts = Parts(units, modes, trace, stats, mover, sharding, None, FaultState(lambda: ""), fence, room,
                      host_cache, grads, NoOptState(), Residency(), lambda u, slots=None: changed.append(u))
        updater = Updater()
        scaling = Scaling(config, sharding, grads, lambda u, w, g: [(0, g.numel())], stats)
        sched = make_schedule(parts, updater, overlap, 2, early_ok=not scaling.waits_for_step)
        made.append((mover, room, updater))
        homes = [u.host.compute.clone() for u in units]
        return sched, parts, updater, scaling, homes, (fenced, changed)

    yield make
    for mover, room, updater in made:
        updater.open()  # a failed test may leave updates held
        mover.synchronize()
        mover.close()
        room.close()
        room.close_pool()


def backward(sched, p):
    """One backward: each unit's gradients leave the device in reverse program
    order and it is reported ready on its last one. Returns the gradients per unit."""
    p.grads.begin_backward()
    given = {}
    for u in reversed(p.units):
        flat = torch.zeros(u.place.trainable_numel)
        for ti, s in enumerate(u.layout.trainable_slots):
            s.param.grad = torch.randn_like(s.param)
            flat[s.offset:s.offset + s.numel] = s.param.grad.reshape(-1)
            if p.grads.take(u, ti, s.param):
                sched.unit_ready(u)
        given[u.index] = flat
    sched.backward_done()
    return given


def assert_stepped(p, homes, *grad_sets, scale=1.0):
    for u, h0 in zip(p.units, homes):
        total = sum(g[u.index] for g in grad_sets)
        torch.testing.assert_close(u.host.compute, h0 - total * scale)
        assert u.grads.state is GradState.CLEAN and not any(u.grads.written)


def test_backward_overlap_queues_updates_in_backward_order(build):
    sched, p, updater, scaling, homes, (fenced, changed) = build("backward")
    assert [u.index for u in sched.update_order()] == [3, 2, 1, 0]  # before any step: reverse program order
    g1 = backward(sched, p)  # not the window's last backward: nothing starts
    assert updater.calls == [] and not sched.updates_in_flight() and not sched.wait_one()
    updater.hold(p.units)
    g2 = backward(sched, p)  # the last one: each unit's update is queued as it becomes ready
    assert sched.updates_in_flight() and list(sched._running) == [3, 2, 1, 0]
    assert p.grads.window_closed and p.grads.micro_batches == 2
    updater.open(p.units[3])
    assert sched.wait_one()  # the oldest in flight: unit 3's
    assert [c[0] for c in updater.calls] == [3]
    assert sched.updates_in_flight()
    with pytest.raises(UsageError, match="zero_grad\\(\\) before optimizer.step\\(\\)"):
        sched.zero_grad()
    with pytest.raises(UsageError, match="backward\\(\\) number 3 before optimizer.step\\(\\)"):
        backward(sched, p)  # the window closed: its first gradient raises
    updater.open()
    sched.step(scaling)
    # Every unit updated once, on the host thread, in the order queued; none again in step().
    assert updater.calls == [(3, 1.0, True), (2, 1.0, True), (1, 1.0, True), (0, 1.0, True)]
    assert [u.index for u in sched.update_order()] == [3, 2, 1, 0]
    assert p.stats.steps == 1 and p.residency.invalidations == 1 and not sched.updates_in_flight()
    assert not sched.wait_one() and [u.index for u in fenced] == [3, 2, 1, 0] and changed == []
    assert_stepped(p, homes, g1, g2)


def test_step_overlap_runs_nothing_until_step(build):
    sched, p, updater, scaling, homes, (fenced, changed) = build("step")
    assert [u.index for u in sched.update_order()] == [0, 1, 2, 3]  # program order
    g1 = backward(sched, p)
    g2 = backward(sched, p)
    assert updater.calls == [] and not sched.updates_in_flight() and not sched.wait_one()
    assert not p.grads.window_closed  # nothing ran during backward: one more backward would still count
    sched.step(scaling)
    assert updater.calls == [(0, 1.0, False), (1, 1.0, False), (2, 1.0, False), (3, 1.0, False)]
    assert [u.index for u in sched.update_order()] == [0, 1, 2, 3]
    assert p.stats.steps == 1 and p.residency.invalidations == 1 and len(fenced) == 4 and changed == []
    assert_stepped(p, homes, g1, g2)


def test_backward_overlap_with_clipping_waits_for_step(build):
    """Clipping needs every gradient: the backward schedule runs its updates in step(), scaled."""
    sched, p, updater, scaling, homes, _ = build("backward", max_grad_norm=1e-3)
    assert [u.index for u in sched.update_order()] == [0, 1, 2, 3]  # no early updates: program order
    g1 = backward(sched, p)
    g2 = backward(sched, p)
    assert updater.calls == [] and not sched.updates_in_flight() and not p.grads.window_closed
    sched.step(scaling)
    total = torch.cat([g1[u.index] + g2[u.index] for u in p.units])
    norm = float(torch.linalg.vector_norm(total.double()))
    assert scaling.last_grad_norm == pytest.approx(norm, rel=1e-6)
    scale = updater.calls[0][1]
    assert scale == pytest.approx(1e-3 / (norm + 1e-6), rel=1e-6)
    assert [c[0] for c in updater.calls] == [0, 1, 2, 3] and {c[1] for c in updater.calls} == {scale}
    assert_stepped(p, homes, g1, g2, scale=scale)


def test_zero_grad_opens_a_new_window(build):
    sched, p, updater, scaling, homes, _ = build("backward")
    backward(sched, p)
    sched.zero_grad()  # the first micro-batch's gradients are forgotten
    assert p.grads.micro_batches == 0 and not any(p.units[1].grads.written)
    g1 = backward(sched, p)
    assert updater.calls == []  # a new window: this is its first backward again
    g2 = backward(sched, p)
    sched.step(scaling)
    assert [c[0] for c in updater.calls] == [3, 2, 1, 0]
    assert_stepped(p, homes, g1, g2)
