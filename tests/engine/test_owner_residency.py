"""owners/residency.py built without an Engine: the device copy of each unit
in a real DeviceTier on the CPU, moved by the real CPU mover, evicted by the
policy over a real Trace. Asserts the bytes in the arena, where the
parameters' ``.data`` point, the pins and the state transitions (plan/state.py).

Faked: the host cache (``source``) and, once, an NVMe read ticket."""

import threading

import pytest
import torch
import torch.nn as nn

import infinity
from infinity.engine.faults import UsageError
from infinity.engine.mechanism.mover import make_mover
from infinity.engine.mechanism.tiers import BudgetError, DeviceTier
from infinity.engine.mechanism.zero import Sharding
from infinity.engine.owners.residency import Residency
from infinity.engine.plan.placement import modes_of, place_unit
from infinity.engine.plan.state import DeviceState, IllegalTransition, Quiet
from infinity.engine.plan.trace import Trace
from infinity.engine.plan.units import build_units
from infinity.engine.stats import Stats

ABSENT, FETCHING, RESIDENT = DeviceState.ABSENT, DeviceState.FETCHING, DeviceState.RESIDENT


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))


class Source:
    """Stands in for the host cache. Residency uses exactly: ``for_fetch(u)``
    -> (host compute copy, NVMe read ticket or None), ``reading(u, ticket)``
    (records the unit's device state when the copy is issued) and ``home(u)``
    (the host copy, for units that live on the device)."""

    def __init__(self, homes):
        self.homes, self.reads, self.log = homes, {}, []

    def for_fetch(self, u):
        return self.homes[u.index], self.reads.pop(u.index, None)

    def reading(self, u, ticket):
        self.log.append((u.index, u.dev.state, ticket))

    def home(self, u):
        return self.homes[u.index]


class Read:
    """A fake NVMe read: fills the host copy only when waited on (the fetch must
    wait first), after ``gate`` is set if given (a slow disk)."""

    def __init__(self, dst, values, gate=None):
        self.dst, self.values, self.gate, self.waited = dst, values, gate, False

    def wait(self):
        if self.gate is not None:
            assert self.gate.wait(300)
        self.dst.copy_(self.values)
        self.waited = True


@pytest.fixture
def parts():
    """Units of Net in bf16 with host homes; an arena for exactly two blocks
    (ranges are rounded to 512 bytes); the mover closed after the test."""
    torch.manual_seed(0)
    model = Net()
    config = infinity.Config(device="cpu", dtype="bf16", offload_params="host", offload_optimizer="host",
                             prefetch_depth=1)
    modes = modes_of(config, 1, torch.device("cpu"))
    units = build_units(model, None, {}, 1)
    for u in units:
        u.place = place_unit(u.layout, modes)
    block = units[1].place.compute_bytes
    tier = DeviceTier(torch.device("cpu"), 4096, 2 * (-(-block // 512) * 512), 0)
    homes = {u.index: torch.randn(u.place.compute_numel).to(modes.dtype) for u in units}
    stats, trace, mover = Stats(), Trace(), make_mover(torch.device("cpu"))
    source = Source(homes)
    res = Residency(units, modes, tier, mover, trace, stats, Sharding(0, stats), source, lambda: 4096, Quiet())
    yield res, units, source, tier, stats, trace
    mover.close()


def states(units):
    return [u.dev.state for u in units[1:]]


def assert_resident_bytes(res, u, home):
    """The device copy holds the host bytes exactly, in the arena at its range,
    and every parameter's ``.data`` is its slot of it."""
    d, arena = u.dev, res.tier.arena
    assert d.state is RESIDENT and d.range is not None
    assert d.compute.data_ptr() == arena.data_ptr() + d.range
    assert torch.equal(d.compute.view(torch.int16), home.view(torch.int16))
    for s in u.layout.slots:
        p = s.param.data
        assert p.shape == s.shape and p.dtype == torch.bfloat16
        assert p.data_ptr() == arena.data_ptr() + d.range + 2 * s.offset, s.name
        assert torch.equal(p.reshape(-1).view(torch.int16), home[s.offset:s.offset + s.numel].view(torch.int16))


def test_fetch_points_params_into_the_arena_and_evict_detaches(parts):
    res, units, source, tier, stats, _ = parts
    u = units[1]
    assert u.dev.state is ABSENT and u.dev.pins == 0
    free = tier.arena_free_bytes
    res.fetch(u)
    assert [(i, s) for i, s, _ in source.log] == [(1, FETCHING)]  # the copy was issued while fetching
    assert_resident_bytes(res, u, source.homes[1])
    assert u.dev.pins == 1 and stats.fetches == 1 and stats.bytes_moved["h2d"] == u.place.compute_bytes
    assert tier.arena_free_bytes == free - tier.round(u.place.compute_bytes)
    res.unpin(u)
    assert u.dev.pins == 0 and u.dev.state is RESIDENT  # unpinned stays until evicted
    res.fetch(u)  # resident: no second copy
    res.unpin(u)
    assert stats.fetches == 1 and len(source.log) == 1
    res.evict(u)
    assert u.dev.state is ABSENT and u.dev.range is None and u.dev.compute is None
    assert tier.arena_free_bytes == free and stats.evictions == 1
    for s in u.layout.slots:  # the NaN stand-in, right shape, one element of storage
        assert s.param.shape == s.shape and s.param.data.isnan().all()
        assert s.param.data.untyped_storage().nbytes() == 2
    # The root (a pass unit) comes from the top of the arena, the others from the bottom.
    res.fetch(units[0])
    res.fetch(units[2])
    assert units[2].dev.range == 0 and units[0].dev.range + tier.round(units[0].place.compute_bytes) == \
        tier.arena_bytes
    assert_resident_bytes(res, units[0], source.homes[0])


def test_fetch_waits_for_the_nvme_read_before_copying(parts):
    res, units, source, *_ = parts
    u = units[2]
    values = torch.randn(u.place.compute_numel).to(torch.bfloat16)
    read = source.reads[2] = Read(source.homes[2], values)
    res.fetch(u)
    assert read.waited
    assert_resident_bytes(res, u, values)


def test_lru_without_a_trace_and_pins(parts):
    res, units, source, tier, stats, _ = parts
    b1, b2, b3, b4 = units[1:]
    for u in (b1, b2, b1):  # b1 used last: b2 is the least recently used
        res.fetch(u)
        res.unpin(u)
    res.fetch(b3)
    assert states(units) == [RESIDENT, ABSENT, RESIDENT, ABSENT] and stats.evictions == 1
    # A pinned unit is never evicted: b1 (now the LRU) pinned, b3 goes.
    res.fetch(b1)
    res.unpin(b3)
    res.fetch(b4)
    assert states(units) == [RESIDENT, ABSENT, ABSENT, RESIDENT]
    assert_resident_bytes(res, b1, source.homes[1])
    assert_resident_bytes(res, b4, source.homes[4])
    # Both pinned: no room, a named error; the failed fetch leaves no pin and no state behind.
    with pytest.raises(BudgetError, match="cannot fit unit 'blocks.1'"):
        res.fetch(b2)
    assert b2.dev.pins == 0 and b2.dev.state is ABSENT
    with pytest.raises(AssertionError):
        res.evict(b1)  # pinned
    with pytest.raises(UsageError):
        res.drop_copy(b1)
    res.unpin(b1)
    with pytest.raises(AssertionError):
        res.unpin(b1)  # below zero
    b1.dev.pins = 0
    res.fetch(b2)  # b1 is unpinned now: it goes, b4 stays pinned
    assert states(units) == [ABSENT, RESIDENT, ABSENT, RESIDENT]
    assert_resident_bytes(res, b2, source.homes[2])
    res.unpin(b2)
    res.unpin(b4)
    res.evict_unpinned()
    assert states(units) == [ABSENT] * 4 and tier.arena_free_bytes == tier.arena_bytes


def test_belady_with_a_replayed_trace(parts):
    res, units, source, tier, stats, trace = parts
    b = units
    res.depth_limit = 0  # no prefetch: only the evictions

    def run_pass(order):
        evicted = []
        trace.begin_pass("train")
        for i in order:
            before = {u.index for u in units if u.dev.state is not ABSENT}
            res.fetch(b[i])
            res.unpin(b[i])
            evicted += sorted(before - {u.index for u in units if u.dev.state is not ABSENT})
        trace.end_pass()
        return evicted

    order = [1, 2, 3, 1, 2]
    # Recording (no trace yet): least recently used.
    assert run_pass(order) == [1, 2, 3]
    res.evict_unpinned()
    # Replaying: at 3, 1 is needed next (trace index 3) and 2 after it (4): 2 goes, not the LRU 1.
    assert run_pass(order) == [2, 3] and trace.invalidations == 0
    for i in (1, 2):
        assert_resident_bytes(res, b[i], source.homes[i])


def test_prefetch_fetching_state_and_eviction_while_fetching(parts):
    res, units, source, tier, stats, trace = parts
    b1, b2, b3, _ = units[1:]
    for _ in range(2):  # record, then replay with prefetch_depth=1
        trace.begin_pass("train")
        for u in (b1, b2, b3):
            res.fetch(u)
            res.unpin(u)
        trace.end_pass()
        res.evict_unpinned()
    trace.begin_pass("train")
    fetches, prefetches = stats.fetches, stats.prefetches
    gate = threading.Event()  # b2's read is slow: its copy is still to come when it is evicted
    source.reads[2] = Read(source.homes[2], source.homes[2].clone(), gate)
    res.fetch(b1)
    assert b2.dev.state is FETCHING and b2.dev.pins == 0 and stats.prefetches == prefetches + 1  # not waited
    assert stats.fetches == fetches + 1
    ticket = source.log[-1][2]
    assert source.log[-1][:2] == (2, FETCHING) and not ticket.done()
    threading.Timer(0.2, gate.set).start()
    res.evict(b2)  # FETCHING -> ABSENT: waits for the copy still writing into the range
    assert ticket.done() and b2.dev.state is ABSENT and b2.dev.ticket is None
    res.fetch(b2)
    assert stats.fetches == fetches + 2
    assert_resident_bytes(res, b2, source.homes[2])
    res.unpin(b1)
    res.unpin(b2)
    res.fetch(b3)  # the pass as recorded: the trace stands
    res.unpin(b3)
    trace.end_pass()
    assert trace.invalidations == 0
    # A prefetched unit becomes resident when compute needs it, with no second copy.
    res.evict_unpinned()
    trace.begin_pass("train")
    res.fetch(b1)
    assert b2.dev.state is FETCHING
    n = len(source.log)
    res.fetch(b2)
    assert len(source.log) == n and b2.dev.state is RESIDENT
    assert_resident_bytes(res, b2, source.homes[2])


def test_invalidate_drops_unpinned_copies_and_refreshes_permanent_ones(parts):
    res, units, source, tier, stats, _ = parts
    b1, b2 = units[1:3]
    originals = [s.param.detach().reshape(-1).clone() for s in b1.layout.slots]  # flat, as values.py hands them
    res.place_permanent(b1, originals)
    assert b1.dev.permanent and b1.dev.state is RESIDENT
    for s, o in zip(b1.layout.slots, originals):
        assert torch.equal(s.param.data.reshape(-1), o.to(torch.bfloat16))
    res.fetch(b2)
    res.unpin(b2)
    res.invalidate()  # b2 dropped; b1 refreshed from its home
    assert b2.dev.state is ABSENT and b1.dev.state is RESIDENT
    assert_resident_bytes(res, b1, source.homes[1])
    with pytest.raises(AssertionError):
        res.evict(b1)  # lives on the device for good
    # An illegal transition (plan/state.py: RESIDENT -> FETCHING) raises, naming the unit; the state stands.
    with pytest.raises(IllegalTransition, match="unit 'blocks.0': illegal device transition resident -> fetching"):
        res.place_permanent(b1, originals)
    assert b1.dev.state is RESIDENT
    assert_resident_bytes(res, b1, source.homes[1])
