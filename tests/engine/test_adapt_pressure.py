"""adapt/pressure.py built without an Engine (issue 32): the give-way ladder
of [Note: memory pressure] on fakes of the parts it is handed, driven by a
simulated reading of the RAM left. The monitor is policy only, so the fakes
record what it asked of the mechanism."""

from types import SimpleNamespace

import pytest
import torch

import infinity
from infinity.engine.adapt import pressure as pr
from infinity.engine.adapt.pressure import MemoryPressureError, PressureMonitor
from infinity.engine.plan.placement import modes_of, place_unit, round_pool
from infinity.engine.plan.units import build_units

MiB = 1 << 20


class Room:
    """What the monitor uses of the host room: used_bytes, cap_bytes, evict_to, tier.release_free_pages."""

    def __init__(self, used):
        self.used_bytes, self.cap_bytes, self.evicted_to = used, None, []
        self.tier = SimpleNamespace(release_free_pages=lambda: 4096)

    def evict_to(self, cap, protect=None):
        self.evicted_to.append(cap)
        return 0


class HostCache:
    """What the monitor uses of the host cache: can_spill, spill, take_home (u.host.spilled)."""

    def __init__(self, room):
        self.room = room

    def can_spill(self, u):
        return not u.host.spilled

    def spill(self, u):
        u.host.spilled = True
        self.room.used_bytes -= MiB
        return MiB

    def take_home(self, u):
        u.host.spilled = False
        return True


def monitor(params="host", opt="nvme", n_blocks=4, depth=2):
    config = infinity.Config(device="cpu", dtype="fp32", offload_params=params, offload_optimizer=opt,
                             prefetch_depth=depth, swap_paths=["/nonexistent"])
    model = torch.nn.Sequential(torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(n_blocks)))
    modes = modes_of(config, 1, torch.device("cpu"))
    units = build_units(model, config.unit_classes, {id(p): 0 for p in model.parameters()}, 1)
    for u in units:
        u.place = place_unit(u.layout, modes)
        u.host = SimpleNamespace(spilled=False)
    room = Room(used=64 * MiB)
    fenced = []
    parts = SimpleNamespace(units=units, modes=modes, room=room, host_cache=HostCache(room),
                            residency=SimpleNamespace(depth_limit=None, note=None), stats=SimpleNamespace(steps=7),
                            sharding=SimpleNamespace(world=1), fence=SimpleNamespace(wait_unit=fenced.append))
    avail = [1 << 40]
    mon = PressureMonitor(parts, host_budget=128 * MiB, available=lambda: avail[0])
    return mon, parts, avail, fenced


def test_spills_the_later_half_then_lowers_depth_then_stops_with_a_named_error():
    mon, parts, avail, fenced = monitor()
    assert parts.residency.note == mon.record  # residency's events join the monitor's
    blocks = [u for u in parts.units[1:]]
    avail[0] = mon.margin - 1
    mon.after_step()  # level 1: the later half of the host homes spill, the cache is capped, depth 2 -> 1
    spilled = [u for u in parts.units if u.host.spilled]
    assert spilled and spilled == parts.units[len(parts.units) - len(spilled):]  # the later half
    assert fenced == spilled  # a background save may still read each home first
    biggest = max(round_pool(u.place.compute_bytes) for u in spilled)
    assert parts.room.cap_bytes == parts.room.used_bytes + (2 + pr.NVME_CACHE_SPARE) * biggest
    assert parts.residency.depth_limit == 1 and mon.level == 1
    assert [e["action"] for e in mon.events] == ["spill to NVMe", "lower prefetch depth"]
    assert all(e["step"] == 7 for e in mon.events)
    while mon.level < pr.MAX_LEVEL and any(not u.host.spilled for u in parts.units) or \
            parts.residency.depth_limit:
        mon.after_step()
    assert parts.residency.depth_limit == 0 and all(u.host.spilled for u in blocks)
    avail[0] = pr.CRITICAL - 1  # nothing left to give: the next step raises, naming what to do
    with pytest.raises(MemoryPressureError, match=r"below .* save a checkpoint now"):
        mon.after_step()
    assert mon.events[-1]["action"] == "out of memory"


def test_grows_back_after_calm_steps_and_takes_homes_back():
    mon, parts, avail, _ = monitor()
    avail[0] = mon.margin - 1
    mon.after_step()
    assert any(u.host.spilled for u in parts.units) and parts.room.cap_bytes is not None
    avail[0] = 2 * mon.margin + 1
    for _ in range(pr.CALM_STEPS - 1):
        mon.after_step()
    assert mon.level == 1  # not yet: calm for CALM_STEPS steps first
    mon.after_step()
    assert mon.level == 0 and parts.room.cap_bytes is None and parts.residency.depth_limit is None
    assert not any(u.host.spilled for u in parts.units)
    assert mon.events[-1]["action"] == "grow back" and mon.events[-1]["taken_home"] > 0


def test_nvme_homes_cap_the_cache_at_half_never_below_the_floor():
    mon, parts, avail, _ = monitor(params="nvme", opt="nvme")
    parts.host_cache.can_spill = lambda u: False  # NVMe homes: nothing to spill
    avail[0] = mon.margin - 1
    mon.after_step()
    used = 64 * MiB
    assert parts.room.cap_bytes == max(mon._floor, used // 2) and parts.room.evicted_to == [parts.room.cap_bytes]
    assert [e["action"] for e in mon.events] == ["cap host cache", "lower prefetch depth"]


def test_several_ranks_keep_the_prefetch_depth():
    mon, parts, avail, _ = monitor()
    parts.sharding.world = 2  # the prefetch order issues collectives: every rank keeps one depth
    avail[0] = mon.margin - 1
    mon.after_step()
    assert parts.residency.depth_limit is None and mon.level == 1


@pytest.mark.parametrize("params,opt,said,not_said", [
    ("nvme", "nvme", "lower prefetch_depth (now 2) or make the largest unit smaller (unit_classes)", "offload"),
    ("host", "nvme", "offload_params='nvme' (now 'host') or make the largest unit smaller (unit_classes)",
     "offload_optimizer"),
    ("host", "host", "offload_params='nvme' (now 'host') or offload_optimizer='nvme' (now 'host')", "prefetch"),
])
def test_the_error_advises_what_the_placement_still_allows(params, opt, said, not_said):
    """The pressure error advised "offload to 'nvme'" with both homes already on NVMe."""
    mon, parts, avail, _ = monitor(params=params, opt=opt)
    avail[0] = pr.CRITICAL - 1
    with pytest.raises(MemoryPressureError) as e:
        for _ in range(2 * pr.MAX_LEVEL + 4):
            mon.after_step()
    msg = str(e.value)
    assert f"restart with less host_memory, {said}, or free RAM" in msg and not_said not in msg, msg
