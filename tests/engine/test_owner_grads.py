"""owners/grads.py built without an Engine (issue 32): a unit's gradients
off the "device" (the CPU device tier) into a host buffer, their sum over
the micro-batches of an accumulation window, the spill to a real NVMe tier
and back, the claim by an update and the release, and the squared norm.

Real neighbours: units and placement of a tiny model, the shared host pool
(HostRoom over a HostTier), the CPU device tier, the CPU mover, a
world-of-one Sharding, Stats, and a python-backend NvmeTier in tmp_path."""

import pytest
import torch
from torch import nn

import infinity
from infinity.engine.faults import UsageError
from infinity.engine.mechanism.host_room import HostRoom
from infinity.engine.mechanism.mover import make_mover
from infinity.engine.mechanism.nvme import NvmeTier
from infinity.engine.mechanism.tiers import DeviceTier, HostTier
from infinity.engine.mechanism.zero import Sharding
from infinity.engine.owners.grads import Gradients
from infinity.engine.plan.placement import modes_of, place_unit
from infinity.engine.plan.state import GradHome, GradState
from infinity.engine.plan.units import build_units
from infinity.engine.stats import Stats

F32 = 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 16)  # the root unit: 128 + 16 elements, 160 with padding
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))  # 256 + 16, 288 with padding


@pytest.fixture
def made(tmp_path):
    """Gradients of Net with NVMe optimizer state (transient host buffers,
    spilled gradients) over two micro-batches."""
    torch.manual_seed(0)
    config = infinity.Config(device="cpu", dtype="fp32", offload_params="host", offload_optimizer="nvme",
                             grad_accumulation_steps=2)
    model = Net()
    stats = Stats()
    modes = modes_of(config, 1, torch.device("cpu"))
    units = build_units(model, config.unit_classes, {}, 1)
    for u in units:
        u.place = place_unit(u.layout, modes)
    room = HostRoom(HostTier(1 << 16, 1 << 16, pin=False))
    dev = DeviceTier(torch.device("cpu"), 1 << 16, 4096, transient_reserve=1 << 12)
    nvme = NvmeTier([str(tmp_path / "swap")], 1 << 20, stats, block_size=65536, backend="python")
    mover = make_mover(torch.device("cpu"))
    grads = Gradients(units, modes, dev, room, nvme, mover, stats, Sharding(0, stats), 2, "step")
    try:
        yield grads, units, model
    finally:
        mover.synchronize()
        room.close()
        nvme.close()
        mover.close()
        room.close_pool()


def backward(grads, u):
    """One backward's gradients of ``u``: every trainable slot's ``p.grad`` is
    taken in turn; returns the gradients given (flattened, in slot order)."""
    grads.begin_backward()
    given, last = [], []
    for ti, s in enumerate(u.layout.trainable_slots):
        s.param.grad = torch.randn_like(s.param)
        given.append(s.param.grad.detach().reshape(-1).clone())
        last.append(grads.take(u, ti, s.param))
        assert s.param.grad is None  # the "device" copy is gone
    assert last == [False] * (len(last) - 1) + [True]  # True on the unit's last slot only
    grads.wait(u)
    return given


def slots_of(u, buf):
    return [buf[s.offset:s.offset + s.numel] for s in u.layout.trainable_slots]


def test_take_moves_gradients_to_the_host_and_accumulates_the_window(made):
    grads, units, _ = made
    u = units[1]
    first = backward(grads, u)
    rec = u.grads
    assert rec.home is GradHome.HOST and rec.state is GradState.ACCUMULATING and rec.written == [True, True]
    assert grads.room.used_bytes >= u.place.trainable_numel * F32
    for got, want in zip(slots_of(u, rec.grad), first):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.all(rec.grad[272:] == 0)  # the padding after the bias is zero, not pool garbage
    assert grads.stats.bytes_moved["d2h"] == 272 * F32
    grads.backward_counted(window_closed=False)
    second = backward(grads, u)  # the second micro-batch adds into the same buffer
    for got, a, b in zip(slots_of(u, rec.grad), first, second):
        torch.testing.assert_close(got, a + b)
    grads.drain()
    assert grads.device_tier.transient_bytes == 0 and grads.stats.bytes_moved["d2h"] == 2 * 272 * F32
    assert units[2].grads.home is GradHome.NONE  # untouched units hold nothing
    # The window closed (the last backward ran its updates): a third backward's first gradient raises.
    grads.backward_counted(window_closed=True)
    p = u.layout.trainable_slots[0].param
    p.grad = torch.ones_like(p)
    with pytest.raises(UsageError, match="backward\\(\\) number 3 before optimizer.step\\(\\)"):
        grads.take(u, 0, p)
    # step() then consume: the state is clean and the written flags reset for the next window.
    grads.consume(u)
    assert rec.state is GradState.CLEAN and rec.written == [False, False] and rec.grad is None
    assert grads.room.used_bytes == 0


def test_spill_load_drop_round_trip_through_nvme(made):
    grads, units, _ = made
    u = units[2]
    first = backward(grads, u)
    saved = u.grads.grad.clone()
    grads.spill(u)
    rec = u.grads
    assert rec.home is GradHome.SPILLED and rec.grad is None and rec.buf is None
    assert grads.nvme.used_bytes == u.place.trainable_numel * F32
    assert grads.stats.bytes_moved["nvme_write"] == u.place.trainable_numel * F32
    grads.room.wait_deferred()
    grads.room.release_finished(block=False)
    assert grads.room.used_bytes == 0  # the host buffer went once the write was done
    grads.spill(u)  # not in a host buffer: nothing to write
    assert grads.stats.bytes_moved["nvme_write"] == u.place.trainable_numel * F32
    grads.load(u)
    assert rec.home is GradHome.LOADED
    torch.testing.assert_close(rec.grad, saved, rtol=0, atol=0)
    assert grads.stats.bytes_moved["nvme_read"] == u.place.trainable_numel * F32
    grads.drop_loaded(u)
    assert rec.home is GradHome.SPILLED and rec.grad is None and grads.room.used_bytes == 0
    # The next micro-batch reads the spilled sum back and adds to it.
    grads.backward_counted(window_closed=False)
    second = backward(grads, u)
    assert rec.home is GradHome.HOST
    for got, a, b in zip(slots_of(u, rec.grad), first, second):
        torch.testing.assert_close(got, a + b)
    grads.release(u)
    assert rec.home is GradHome.NONE and rec.grad is None and grads.room.used_bytes == 0


def test_claim_and_release_states(made):
    grads, units, _ = made
    u = units[1]
    grads.claim(u)  # no host buffer: nothing to claim
    assert u.grads.home is GradHome.NONE
    backward(grads, u)
    grads.claim(u)
    assert u.grads.home is GradHome.CLAIMED
    grads.spill(u)  # a claimed buffer belongs to the update: never spilled
    assert u.grads.home is GradHome.CLAIMED and grads.nvme.used_bytes == 0
    grads.release(u)
    assert u.grads.home is GradHome.NONE and u.grads.grad is None and grads.room.used_bytes == 0
    grads.release(u)  # twice is harmless
    assert u.grads.home is GradHome.NONE
    # A buffer kept for good is never given back nor moved.
    keep = torch.zeros(units[2].place.trainable_numel)
    grads.set_permanent(units[2], keep)
    grads.claim(units[2])
    grads.release(units[2])
    assert units[2].grads.home is GradHome.PERMANENT and units[2].grads.grad is keep


def test_sum_of_squares_matches_torch_norm(made):
    grads, units, _ = made
    held, spilled = units[1], units[2]
    backward(grads, held)
    backward(grads, spilled)
    want = torch.linalg.vector_norm(torch.cat([held.grads.grad, spilled.grads.grad]).double()) ** 2
    grads.spill(spilled)
    whole = lambda u, written, g: [(0, g.numel())]
    got = grads.sum_of_squares([(held, held.grads.grad, held.grads.written), (spilled, None, spilled.grads.written)],
                               whole)
    assert got == pytest.approx(float(want), rel=1e-6)
    # The spilled gradients were read back for it and dropped again.
    assert spilled.grads.home is GradHome.SPILLED and spilled.grads.grad is None
    assert grads.stats.bytes_moved["nvme_read"] == spilled.place.trainable_numel * F32
    # Only the runs given count: the weights of the held unit alone.
    w = held.layout.trainable_slots[0]
    only_w = grads.sum_of_squares([(held, held.grads.grad, held.grads.written)],
                                  lambda u, written, g: [(w.offset, w.offset + w.numel)])
    assert only_w == pytest.approx(float(torch.linalg.vector_norm(held.grads.grad[:w.numel].double()) ** 2), rel=1e-6)
    assert grads.sum_of_squares([], whole) == 0.0
