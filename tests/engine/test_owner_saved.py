"""owners/saved.py built without an Engine (issue 32): the saved-tensor
router follows a unit to another range of the arena, lets other tensors
through, redoes autograd's version check, and fails the engine through the
faults object it is handed when bringing a unit back fails."""

import contextlib
from types import SimpleNamespace

import pytest
import torch

from infinity.engine.faults import UsageError
from infinity.engine.owners.saved import SavedTensorRouter

N = 64  # floats per unit range


class Residency:
    """What the router uses of residency: ``tier.arena``, ``unit_at(byte
    offset)``, ``ensure_for_unpack(u)``. Moving a unit copies its bytes to
    the other half of the arena, as a refetch into another range would."""

    def __init__(self):
        self.tier = SimpleNamespace(arena=torch.zeros(2 * N * 4, dtype=torch.uint8))
        self.floats = self.tier.arena.view(torch.float32)
        self.units, self.fail = [], False

    def unit_at(self, offset):
        return next((u for u in self.units if u.dev.range <= offset < u.dev.range + N * 4), None)

    def ensure_for_unpack(self, u):
        if self.fail:
            raise OSError("injected: the refetch failed")
        if u.moved:
            old, new = u.dev.range // 4, (u.dev.range + N * 4) % (2 * N * 4) // 4
            self.floats[new:new + N].copy_(self.floats[old:old + N])
            self.floats[old:old + N].fill_(float("nan"))  # another unit's bytes now
            u.dev.range, u.moved = new * 4, False


class Faults:
    """What the router uses of the failure state: ``guard(where)``."""

    def __init__(self):
        self.where = []

    @contextlib.contextmanager
    def guard(self, where):
        self.where.append(where)
        yield


def setup():
    res = Residency()
    u = SimpleNamespace(dev=SimpleNamespace(range=0), moved=False, name="blocks.0",
                        layout=SimpleNamespace(slots=[SimpleNamespace(name="blocks.0.weight")]))
    res.units.append(u)
    w = res.floats[:N].view(8, 8)
    w.copy_(torch.arange(N, dtype=torch.float32).view(8, 8))
    param = torch.nn.Parameter(torch.empty(0))
    param.data = w  # as residency points a parameter into the arena: its own version counter
    faults = Faults()
    return SavedTensorRouter(res, {id(param): (u, 0)}, faults), res, u, param, faults


def linear_saved(router, param):
    """(x, y = x @ param.T) with the router's hooks on: the weight is saved as an arena view, x as itself."""
    x = torch.randn(3, 8, requires_grad=True)
    assert router.push()
    try:
        return x, torch.nn.functional.linear(x, param)
    finally:
        router.pop()


def test_a_saved_view_follows_its_unit_to_another_range():
    router, res, u, param, faults = setup()
    x, y = linear_saved(router, param)
    u.moved = True  # evicted and fetched into the other half before backward
    y.sum().backward()
    expected = torch.ones(3, 8) @ torch.arange(N, dtype=torch.float32).view(8, 8)  # dy/dx = 1 @ W
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)
    assert u.dev.range == N * 4 and faults.where == ["backward (a saved tensor)"]


def test_a_parameter_changed_after_saving_raises_torchs_error():
    router, res, u, param, _ = setup()
    x, y = linear_saved(router, param)
    with torch.no_grad():
        param.mul_(2)  # a version bump, as an update does
    with pytest.raises(UsageError, match=r"parameter 'blocks.0.weight' \(unit 'blocks.0'\) is at version"):
        y.sum().backward()


def test_a_failed_refetch_goes_through_the_faults_guard():
    router, res, u, param, faults = setup()
    x, y = linear_saved(router, param)
    res.fail = True
    with pytest.raises(OSError, match="injected"):
        y.sum().backward()
    assert faults.where == ["backward (a saved tensor)"]


def test_drop_and_rebind_follow_a_new_arena():
    router, res, u, param, _ = setup()
    router.drop_buffers()
    res.tier = SimpleNamespace(arena=torch.zeros(2 * N * 4, dtype=torch.uint8))
    router.rebind()
    inside = res.tier.arena.view(torch.float32)[:4]
    outside = torch.zeros(4)
    assert router._pack_arena(outside) is None and router._pack_arena(inside) is not None
