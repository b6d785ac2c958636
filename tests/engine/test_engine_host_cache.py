"""host_cache.py and the shared host pool (mechanism/host_room.py) on their
own: the reclaim ladder a transient host buffer climbs when the pool is full,
in policy.HOST_ROOM_LADDER's order, the write-back of dirty copies, and the
error when nothing is left."""

import types

import pytest
import torch
import torch.nn as nn

from infinity.engine.plan import placement as pl
from infinity.engine.owners.host_cache import HostCache
from infinity.engine.plan.state import HostState
from infinity.engine.stats import Stats
from infinity.engine.mechanism.host_room import HostRoom
from infinity.engine.mechanism.tiers import BudgetError, HostTier
from infinity.engine.plan.trace import Trace
from infinity.engine.plan.units import Layout, Unit

PAGE = 4096


class Handle:
    def __init__(self, done=True):
        self._done, self.waited = done, False

    def done(self):
        return self._done

    def wait(self):
        self._done = self.waited = True


class FakeNvme:
    """Records writes; reads complete at once. ``pending`` writes stay in flight until waited."""

    def __init__(self):
        self.writes, self.pending = [], False

    def write(self, key, t, crcs=None):
        h = Handle(done=not self.pending)
        self.writes.append((key, t.clone(), crcs, h))
        return h

    def read(self, key, out):
        return Handle()


def make_cache(n_units=3, pages=4):
    modes = pl.Modes(torch.device("cpu"), torch.float32, torch.float32, "nvme", "host", 0, 1, False, 1, 1)
    units = []
    for i in range(n_units):
        u = Unit(i, f"u{i}", [], Layout([(f"p{i}", nn.Parameter(torch.zeros(PAGE // 4)))], {}))
        u.place = pl.place_unit(u.layout, modes)
        u.dev = types.SimpleNamespace(last_used=i)
        units.append(u)
    nvme = FakeNvme()
    room = HostRoom(HostTier(pages * PAGE, pages * PAGE, pin=False))
    cache = HostCache(units, modes, room, nvme, Trace(), Stats())
    room.set_rungs(cache.evict_one, lambda protect: False)
    return cache, units, nvme


def fill(cache, units):
    """Caches every unit's compute copy (one page each)."""
    for u in units:
        cache.load(u)


def test_ladder_evicts_the_copy_needed_furthest_then_writes_back_dirty_ones():
    cache, units, nvme = make_cache(n_units=3, pages=3)
    fill(cache, units)
    assert cache.room.free_bytes == 0
    out = cache.open_for_update(units[0], whole=True)  # make unit 0 dirty
    out.fill_(7.0)
    cache.close_update(units[0], sums="s0")
    assert units[0].host.state is HostState.DIRTY
    # Without a trace, LRU: unit 0 (last_used 0) goes first, written back with its sums.
    t, buf = cache.room.acquire(PAGE // 4, torch.float32)
    assert units[0].host.state is HostState.NONE and units[0].host.compute is None
    key, data, crcs, _ = nvme.writes[-1]
    assert key == (0, "compute") and crcs == "s0" and torch.all(data == 7.0)
    cache.room.release(buf)


def test_ladder_order_then_a_named_error():
    cache, units, nvme = make_cache(n_units=2, pages=3)
    fill(cache, units)
    for u in units:  # every cached copy is being read by a transfer: none can go
        cache.reading(u, Handle(done=False))
    calls = []
    cache.room.set_wait_update(lambda: calls.append("wait_running_update") or len(calls) == 1
                               and not cache.room.release(held))
    cache.room.set_rungs(cache.evict_one, lambda protect: calls.append("drop_state_read_ahead") or False)
    held_t, held = cache.room.acquire(PAGE // 4, torch.float32)  # the last free page
    # A full pool: nothing finished, nothing evictable; the running update frees the held page.
    t, buf = cache.room.acquire(PAGE // 4, torch.float32)
    assert calls == ["wait_running_update"]
    with pytest.raises(BudgetError, match=rf"host tier: {PAGE} bytes needed, 0 of {3 * PAGE} free"):
        cache.room.acquire(PAGE // 4, torch.float32)
    assert calls == ["wait_running_update", "wait_running_update", "drop_state_read_ahead"]
    assert [r for r in policy_ladder()] == ["release_finished_writes", "evict_cached_copy", "wait_oldest_write",
                                            "wait_running_update", "drop_state_read_ahead"]


def policy_ladder():
    from infinity.engine.plan.policy import HOST_ROOM_LADDER
    return HOST_ROOM_LADDER


def test_a_write_back_in_flight_is_waited_for_before_its_buffer_is_reused():
    cache, units, nvme = make_cache(n_units=2, pages=2)
    fill(cache, units)
    cache.open_for_update(units[1], whole=True)
    cache.close_update(units[1])
    nvme.pending = True  # write-backs stay in flight
    assert cache.evict_one(None, wait=False) > 0  # unit 0 (clean) is the LRU choice: freed at once
    assert cache.evict_one(None, wait=False) > 0  # unit 1 (dirty): written back, buffer deferred
    assert units[1].host.state is HostState.WRITING_BACK
    handle = nvme.writes[-1][3]
    t, buf = cache.room.acquire(PAGE // 4, torch.float32)  # page of unit 0
    t2, buf2 = cache.room.acquire(PAGE // 4, torch.float32)  # needs the deferred page: waits for the write
    assert handle.waited
    # A new read of unit 1 sees the written-back bytes: the write is settled first.
    cache.room.release(buf)
    assert cache.load(units[1]) is not None and units[1].host.state is HostState.CLEAN


def test_the_optimizers_own_job_never_waits_for_an_update():
    """On the host job's thread (whatever its name) the ladder skips the
    wait for an update in flight: that update may be the job itself."""
    from infinity.engine.mechanism.mover import make_mover, on_host_job
    cache, units, nvme = make_cache(n_units=1, pages=1)
    calls = []
    cache.room.set_wait_update(lambda: calls.append("wait") or False)
    held = cache.room.acquire(PAGE // 4, torch.float32)[1]  # the only page
    mover = make_mover(torch.device("cpu"))
    try:
        seen = []

        def job():
            seen.append(on_host_job())
            with pytest.raises(BudgetError):
                cache.room.acquire(PAGE // 4, torch.float32)

        mover.host_job(job).wait()
        assert seen == [True] and calls == [] and not on_host_job()
        with pytest.raises(BudgetError):
            cache.room.acquire(PAGE // 4, torch.float32)  # any other thread may wait for one
        assert calls == ["wait"]
    finally:
        mover.close()
        cache.room.release(held)
