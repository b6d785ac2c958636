"""step/scaling.py built without an Engine (issue 32): fp16 dynamic loss
scaling and the step's gradient scale, against torch's clipping on the same
gradients. Handed a config, a one-rank sharding, a gradient owner whose norm
sums the given tensors, and stats."""

import math
from types import SimpleNamespace

import pytest
import torch

import infinity
from infinity.engine.step.scaling import Scaling


class OneRank:
    """What Scaling uses of the sharding: ``world`` and ``sum_shards``."""
    world = 1

    @staticmethod
    def sum_shards(x: float) -> float:
        return x


class Grads:
    """What Scaling uses of the gradient owner: ``sum_of_squares(units_grads, runs)``,
    here over the whole tensors handed in (every run counts)."""

    def sum_of_squares(self, units_grads, runs):
        total = 0.0
        for u, g, written in units_grads:
            for a, b in runs(u, written, g):
                total += float(g[a:b].double().square().sum())
        return total


def scaling(**cfg):
    config = infinity.Config(device="cpu", **cfg)
    return Scaling(config, OneRank(), Grads(), lambda u, w, g: [(0, g.numel())], SimpleNamespace(skipped_steps=0))


def test_clip_coefficient_matches_torch():
    torch.manual_seed(0)
    grads = [torch.randn(100) * 3, torch.randn(37)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    total = torch.nn.utils.clip_grad_norm_(params, 1.0)
    s = scaling(dtype="fp32", max_grad_norm=1.0)
    skip, scale = s.global_scale([(None, g, None) for g in grads])
    assert not skip and s.last_grad_norm == pytest.approx(float(total), rel=1e-6)  # torch sums in fp32
    # torch multiplies by max_norm / (norm + 1e-6), clamped to 1: the same coefficient.
    assert scale == pytest.approx(1.0 / (float(total) + 1e-6), rel=1e-6)
    for p, g in zip(params, grads):
        torch.testing.assert_close(p.grad, g * scale, rtol=1e-6, atol=0)
    # Under the threshold nothing is clipped.
    s = scaling(dtype="fp32", max_grad_norm=1e9)
    assert s.global_scale([(None, g, None) for g in grads]) == (False, 1.0)


def test_no_clip_no_fp16_needs_no_norm():
    s = scaling(dtype="fp32")
    assert not s.waits_for_step
    assert s.global_scale([(None, torch.tensor([float("inf")]), None)]) == (False, 1.0)
    assert s.last_grad_norm is None


def test_fp16_dynamic_scale_backs_off_skips_and_grows():
    s = scaling(dtype="fp16", initial_loss_scale=1024.0, loss_scale_growth_interval=3, min_loss_scale=256.0)
    assert s.waits_for_step and s.loss_scale == 1024.0
    good = [(None, torch.full((4,), 1024.0), None)]  # scaled gradients: norm 2048 / 1024 = 2
    skip, scale = s.global_scale(good)
    assert not skip and s.last_grad_norm == pytest.approx(2.0) and scale == 1 / 1024
    s.after_overflow_check(skip)
    bad = [(None, torch.tensor([float("inf"), 1.0]), None)]
    for expect in (512.0, 256.0, 256.0):  # halves on each overflow, never below min_loss_scale
        skip, _ = s.global_scale(bad)
        assert skip and math.isinf(s.last_grad_norm)
        s.after_overflow_check(skip)
        assert s.loss_scale == expect and s.good_steps == 0
    assert s.stats.skipped_steps == 3
    for i in range(1, 7):  # doubles after every 3 good steps
        s.after_overflow_check(False)
        assert s.loss_scale == 256.0 * 2 ** (i // 3)


def test_fp16_static_scale_never_moves():
    s = scaling(dtype="fp16", loss_scale=128.0)
    s.after_overflow_check(True)
    s.after_overflow_check(False)
    assert s.loss_scale == 128.0 and not s.dynamic
    _, scale = s.global_scale([(None, torch.ones(3), None)])
    assert scale == 1 / 128


def test_data_parallel_sums_are_averaged():
    s = scaling(dtype="fp32", max_grad_norm=10.0)
    s.sharding = SimpleNamespace(world=4, sum_shards=lambda x: x)  # gradients summed over four ranks
    skip, scale = s.global_scale([(None, torch.full((1,), 8.0), None)])
    assert not skip and s.last_grad_norm == 2.0 and scale == 0.25
