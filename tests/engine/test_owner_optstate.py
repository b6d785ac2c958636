"""owners/optstate.py built without an Engine: master and moments resident
in memory, or homed on a real small NvmeTier in tmp_path and checked out to
host buffers, checked in, read ahead and discarded. Bytes round-trip exactly
(compared as int32, so any bit pattern counts) and every state is the one
plan/state.py allows.

Faked: the host pool (the buffers the checked-out state lives in)."""

import threading

import pytest
import torch
import torch.nn as nn

import infinity
from infinity.engine.mechanism.nvme import NvmeTier
from infinity.engine.mechanism.zero import Sharding
from infinity.engine.owners.optstate import KINDS, OptimizerState
from infinity.engine.plan.placement import modes_of, place_unit
from infinity.engine.plan.state import IllegalTransition, OptState
from infinity.engine.plan.units import build_units
from infinity.engine.stats import Stats
from infinity.engine.step.update import Updater


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))


class Room:
    """Stands in for the shared host pool (mechanism/host_room.py). For units
    whose master is not aliased to the compute copy, OptimizerState uses
    exactly: ``lock``; ``acquire(numel, dtype, zero=, protect=)`` -> (tensor,
    buffer handle); ``defer_release(write handle, buffer)``;
    ``release(buffer)``, ``free_bytes``; ``release_finished(block=)``,
    ``wait_deferred()``. Buffers not zeroed start NaN, so a read that did not
    happen shows. (The host cache itself is used only for aliased masters.)"""

    def __init__(self):
        self.lock = threading.RLock()
        self.free_bytes = 1 << 30
        self.live, self.next = {}, 0

    def acquire(self, numel, dtype, zero=False, protect=None):
        self.next += 1
        t = torch.zeros(numel, dtype=dtype) if zero else torch.full((numel,), float("nan"), dtype=dtype)
        self.live[self.next] = t
        return t, self.next

    def defer_release(self, handle, buf):
        handle.wait()
        self.release(buf)

    def release(self, buf):
        del self.live[buf]  # a buffer given back twice raises

    def release_finished(self, block=True):
        pass

    def wait_deferred(self):
        pass


def placed(optimizer):
    torch.manual_seed(0)
    config = infinity.Config(device="cpu", dtype="bf16", offload_params="host", offload_optimizer=optimizer)
    modes = modes_of(config, 1, torch.device("cpu"))
    units = build_units(Net(), None, {}, 1)
    for u in units:
        u.place = place_unit(u.layout, modes)
    return units, modes


def bits(n, gen):
    """``n`` fp32 values of arbitrary bits (NaNs and infinities included)."""
    return torch.randint(-2 ** 31, 2 ** 31, (n,), dtype=torch.int64, generator=gen).to(torch.int32).view(torch.float32)


def same(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_resident():
    units, modes = placed("host")
    opt = OptimizerState(units, modes, None, None, None, Sharding(0, Stats()))  # resident: no pool, no NVMe
    u = units[1]
    assert u.opt.state is OptState.NONE and opt.read(u, "master") is None
    tn = u.place.trainable_numel
    gen = torch.Generator().manual_seed(1)
    bufs = [bits(tn, gen) for _ in KINDS]
    opt.set_resident(u, *bufs)
    assert u.opt.state is OptState.RESIDENT
    for kind, t in zip(KINDS, bufs):
        assert opt.read(u, kind) is t  # the buffer itself, no copy
        assert opt.resident_view(u, kind).data_ptr() == t.data_ptr()
    assert opt.checkout(u) == [] and u.opt.state is OptState.RESIDENT
    opt.checkin(u, None)
    opt.discard(u)
    assert u.opt.state is OptState.RESIDENT and all(getattr(u.opt, k) is t for k, t in zip(KINDS, bufs))
    with pytest.raises(IllegalTransition, match="blocks.0.*resident -> home"):
        opt.set_home_nvme(u, None)
    ea, eas = bits(tn, gen), bits(tn, gen)
    opt.write_moments(u, ea, eas)  # in place
    assert u.opt.exp_avg is bufs[1] and same(bufs[1], ea) and same(bufs[2], eas)
    assert opt.kept_bytes() == {k: 4 * tn for k in KINDS}


@pytest.fixture
def nvme_parts(tmp_path):
    units, modes = placed("nvme")
    stats = Stats()
    nvme = NvmeTier([str(tmp_path)], 1 << 20, stats, block_size=65536, backend="python")
    cache = Room()
    opt = OptimizerState(units, modes, cache, None, nvme, Sharding(0, stats))
    yield units, opt, cache, nvme, stats
    nvme.close()


def test_nvme_checkout_checkin_round_trips_the_bytes(nvme_parts):
    units, opt, cache, nvme, stats = nvme_parts
    u = units[1]
    assert not u.place.aliased
    tn = u.place.state_numel
    gen = torch.Generator().manual_seed(2)
    master = bits(tn, gen)
    opt.set_home_nvme(u, master)
    assert u.opt.state is OptState.HOME and u.opt.fresh and u.opt.master is None
    assert stats.bytes_moved["nvme_write"] == 4 * tn
    # Read from the home without checking out: the master written, moments zero (never written).
    assert same(opt.read(u, "master"), master) and not opt.read(u, "exp_avg").any()
    handles = opt.checkout(u)
    assert u.opt.state is OptState.CHECKED_OUT and len(handles) == 1  # fresh moments are not read
    for h in handles:
        h.wait()
    assert same(u.opt.master, master) and not u.opt.exp_avg.any() and not u.opt.exp_avg_sq.any()
    assert len(cache.live) == 3
    new = {k: bits(tn, gen) for k in KINDS}  # what an update wrote
    for k in KINDS:
        getattr(u.opt, k).copy_(new[k])
    opt.checkin(u, None)
    assert u.opt.state is OptState.HOME and not u.opt.fresh and u.opt.master is None and u.opt.bufs == []
    assert cache.live == {}  # every buffer given back once its write was done
    for h in opt.checkout(u):
        h.wait()
    for k in KINDS:
        assert same(getattr(u.opt, k), new[k]), k
    # Discard: the buffers go back, the NVMe copies stand.
    opt.discard(u)
    assert u.opt.state is OptState.HOME and cache.live == {}
    for k in KINDS:
        assert same(opt.read(u, k), new[k]), k
    with pytest.raises(IllegalTransition):
        opt.set_resident(u, *new.values())


def test_nvme_read_ahead_then_checkout_or_drop(nvme_parts):
    units, opt, cache, nvme, _ = nvme_parts
    a, b = units[1], units[2]
    gen = torch.Generator().manual_seed(3)
    vals = {}
    for u in (a, b):
        vals[u.index] = {k: bits(u.place.state_numel, gen) for k in KINDS}
        opt.set_home_nvme(u, vals[u.index]["master"])
        opt.write_moments(u, vals[u.index]["exp_avg"], vals[u.index]["exp_avg_sq"])
        assert not u.opt.fresh
    assert opt.read_ahead(a) and a.opt.state is OptState.READING_AHEAD
    assert not opt.read_ahead(a)  # not at home any more
    pending = a.opt.pending
    handles = opt.checkout(a)  # claims the read-ahead: no second read
    assert handles is pending and a.opt.state is OptState.CHECKED_OUT and a.opt.pending is None
    for h in handles:
        h.wait()
    for k in KINDS:
        assert same(getattr(a.opt, k), vals[a.index][k]), k
    opt.discard(a)
    # A read-ahead not claimed is the last rung of the host ladder: given back, read again later.
    assert opt.read_ahead(b)
    assert not opt.drop_read_ahead(protect=b)  # the unit asking keeps its own
    assert opt.drop_read_ahead(protect=None) and b.opt.state is OptState.HOME and cache.live == {}
    assert not opt.drop_read_ahead(protect=None)
    # No room in the host budget: no read-ahead, nothing taken.
    cache.free_bytes = 0
    assert not opt.read_ahead(b) and b.opt.state is OptState.HOME and cache.live == {}


def test_nvme_update_sums_are_accepted_on_the_read_back(nvme_parts):
    """Checked out, updated by the Updater (which takes the checksums in the
    same pass, one kernel call over the whole buffers), checked in with those
    sums: the store reads the state back with no checksum mismatch."""
    units, opt, cache, nvme, stats = nvme_parts
    if nvme.sum_chunk_bytes is None:
        pytest.skip("this swap store takes no producer sums")
    u = units[1]
    tn = u.place.state_numel
    master = torch.randn(tn)
    for s in u.layout.trainable_slots[-1:]:
        master[s.offset + s.numel:] = 0  # padding is zero in every buffer
    master[u.layout.trainable_slots[0].numel:u.layout.trainable_slots[1].offset] = 0
    opt.set_home_nvme(u, master)
    for h in opt.checkout(u):
        h.wait()
    groups = [dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)]
    upd = Updater(opt.modes, opt.sharding, groups, stats, nvme.sum_chunk_bytes, 1, lambda *a: None)
    grad = torch.randn(tn)
    grad[master == 0] = 0
    sums = upd.run(u, grad, [True] * len(u.layout.trainable_slots), None, 1.0)
    assert set(sums) == set(KINDS)
    want = {k: getattr(u.opt, k).clone() for k in KINDS}
    opt.checkin(u, sums)
    assert nvme.retried == []
    for k in KINDS:
        assert same(opt.read(u, k), want[k]), k
    assert nvme.retried == []  # no read was retried for a checksum mismatch
