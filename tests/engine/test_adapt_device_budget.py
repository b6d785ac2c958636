"""adapt/device_budget.py built without an Engine (issue 32): the budget's
minimum and first tier from the placement alone, and the default budget's
growth after the first step handed only the owners it replaces the tier of.

The growth must never hold two arenas at once (issue 36, C1): on a GPU the
old and the grown arena together exceed the device for any model whose
compute copies pass half of it. The saved-tensor router held views of the
old arena until after the new one was allocated."""

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import infinity
from infinity.engine.adapt import device_budget
from infinity.engine.adapt.device_budget import DeviceBudget
from infinity.engine.mechanism.tiers import BudgetError, DeviceTier
from infinity.engine.plan.placement import modes_of, place_unit
from infinity.engine.plan.state import DeviceState
from infinity.engine.plan.units import build_units


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))


def placed(**cfg):
    config = infinity.Config(device="cpu", dtype="fp32", offload_params="host", offload_optimizer="host",
                             prefetch_depth=1, **cfg)
    model = Net()
    modes = modes_of(config, 1, torch.device("cpu"))
    units = build_units(model, config.unit_classes, {id(p): 0 for p in model.parameters()}, 1)
    for u in units:
        u.place = place_unit(u.layout, modes)
    return units, modes, config


def test_minimum_and_first_tier_from_the_placement():
    units, modes, config = placed()
    b = DeviceBudget(units, modes, torch.device("cpu"), None)
    need = b.need()
    block = units[1].place.compute_bytes
    # root + (depth + 1) blocks of the largest size, plus the gradient reserve and 512 B a range.
    assert need.arena_min >= units[0].place.compute_bytes + 2 * block
    assert b.minimum() == need.minimum
    tier = b.first_tier()  # the CPU device with no budget: everything resident
    assert b.budget == need.everything and tier.budget_bytes == need.everything
    with pytest.raises(BudgetError, match=rf"device_memory={need.minimum - 1} bytes .* is too small"):
        DeviceBudget(units, modes, torch.device("cpu"), need.minimum - 1).first_tier()


class Owner:
    """Stands in for residency or the gradient owner: holds the device tier it is handed."""

    def __init__(self, tier=None):
        self.tier = tier

    def set_tier(self, tier):
        self.tier = tier

    set_device = set_tier


class Router:
    """Stands in for the saved-tensor router: holds the arena (as the real one
    does, for its views) until told to drop it."""

    def __init__(self, tier):
        self.arena = tier.arena
        self.events = []

    def drop_buffers(self):
        self.arena = None
        self.events.append("drop")

    def rebind(self, tier=None):
        self.events.append("rebind")


def test_growth_lets_go_of_the_old_arena_before_allocating_the_new(monkeypatch):
    units, modes, _ = placed()
    b = DeviceBudget(units, modes, torch.device("cpu"), None)
    need = b.need()
    capacity = device_budget.MARGIN_BYTES + need.everything * 2
    monkeypatch.setattr(DeviceBudget, "default",
                        lambda self, minimum: (device_budget.initial_budget(minimum, self.need().everything,
                                                                            minimum), capacity))
    old = b.first_tier()
    assert b.budget == need.minimum
    own = old.arena_bytes + old.fixed_bytes
    monkeypatch.setattr(DeviceBudget, "memory_peak", lambda self: own)  # nothing but the arena
    residency, grads, saved = Owner(old), Owner(old), Router(old)
    for u in units:
        u.dev = SimpleNamespace(state=DeviceState.ABSENT, permanent=False, external=False)
    old_ref = weakref.ref(old.arena)
    alive_at_alloc = []
    real_init = DeviceTier.__init__

    def spy(self, *a, **kw):
        gc.collect()
        alive_at_alloc.append(old_ref() is not None)
        real_init(self, *a, **kw)

    monkeypatch.setattr(DeviceTier, "__init__", spy)
    del old
    b.after_step(residency, grads, saved)
    assert alive_at_alloc == [False], "the old arena was still referenced when the grown one was allocated"
    assert residency.tier is grads.tier and residency.tier.budget_bytes == b.budget > need.minimum
    assert b.budget == need.everything  # room for everything once the pass showed nothing else needs it
    assert saved.events == ["drop", "rebind"]
    # Grows once: the next step keeps it.
    grown = residency.tier
    b.after_step(residency, grads, saved)
    assert residency.tier is grown


def test_growth_out_of_device_memory_keeps_the_old_size(monkeypatch):
    # The grown arena's allocation fails as CUDA's would (torch.OutOfMemoryError):
    # the budget stays at the size that ran, every owner gets a tier of that
    # size, and a warning names what happened and the fix.
    units, modes, _ = placed()
    b = DeviceBudget(units, modes, torch.device("cpu"), None)
    need = b.need()
    capacity = device_budget.MARGIN_BYTES + need.everything * 2
    monkeypatch.setattr(DeviceBudget, "default",
                        lambda self, minimum: (device_budget.initial_budget(minimum, self.need().everything,
                                                                            minimum), capacity))
    old = b.first_tier()
    first = b.budget
    own = old.arena_bytes + old.fixed_bytes
    monkeypatch.setattr(DeviceBudget, "memory_peak", lambda self: own)
    residency, grads, saved = Owner(old), Owner(old), Router(old)
    for u in units:
        u.dev = SimpleNamespace(state=DeviceState.ABSENT, permanent=False, external=False)
    real_init = DeviceTier.__init__
    asked = []

    def oom_above_first(self, device, budget, *a, **kw):
        asked.append(budget)
        if budget > first:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        real_init(self, device, budget, *a, **kw)

    monkeypatch.setattr(DeviceTier, "__init__", oom_above_first)
    del old
    with pytest.warns(RuntimeWarning, match=rf"could not grow from {first} to {need.everything} bytes .*"
                                            r"stays at .* Config.device_memory"):
        b.after_step(residency, grads, saved)
    assert asked == [need.everything, first]
    assert b.budget == first
    assert residency.tier is grads.tier and residency.tier.budget_bytes == first
    assert saved.events == ["drop", "rebind"]
