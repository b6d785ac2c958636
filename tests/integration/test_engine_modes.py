"""Delayed update, budgets, mixed precision, configuration errors."""

import copy

import pytest
import torch

import infinity
from infinity.engine.mechanism.tiers import BudgetError
from engine_utils import assert_params_close, batches, small_gpt, train_steps, unit_bytes

UB = unit_bytes(small_gpt())


def cfg(**kw) -> infinity.Config:
    base = dict(device="cpu", dtype="fp32", device_memory=8 * UB, host_memory="256MiB", prefetch_depth=2)
    base.update(kw)
    return infinity.Config(**base)


def test_delayed_update_matches_its_definition():
    """overlap="delayed": the update applied at step t uses the gradients of step t-1."""
    ref = small_gpt()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    model, opt = infinity.initialize(model, cfg(overlap="delayed"), lr=1e-3, weight_decay=0.1)
    pending = None
    for i, (x, y) in enumerate(batches(12)):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        rl = ref(x, y)
        rl.backward()
        grads = [p.grad.clone() for p in ref.parameters()]
        ref_opt.zero_grad()
        if pending is not None:
            for p, g in zip(ref.parameters(), pending):
                p.grad = g
            ref_opt.step()
            ref_opt.zero_grad()
        pending = grads
        assert abs(loss.item() - rl.item()) <= 1e-5 * abs(rl.item()), (i, loss.item(), rl.item())
    for p, g in zip(ref.parameters(), pending):  # full_state_dict applies the queued update
        p.grad = g
    ref_opt.step()
    assert_params_close(infinity.full_state_dict(model), ref.state_dict())
    s = infinity.stats(model)
    assert s["overlap"] > 0.5, s


def test_delayed_differs_from_immediate():
    a, b = small_gpt(), small_gpt()
    ma, oa = infinity.initialize(a, cfg(overlap="delayed"))
    mb, ob = infinity.initialize(b, cfg(overlap="step"))
    train_steps(ma, oa, 3)
    train_steps(mb, ob, 3)
    la = ma(*batches(1, seed=5)[0]).item()
    lb = mb(*batches(1, seed=5)[0]).item()
    assert la != lb


@pytest.mark.parametrize("depth", [1, 3])
def test_budgets_held_and_analytic_bound(depth):
    model = small_gpt()
    m, opt = infinity.initialize(model, cfg(prefetch_depth=depth, device_memory=None))
    eng = infinity.api.engine_of(m)
    need = eng.budget.need()
    slack = 512 * (len(eng.units) + 1)  # per-range alignment, and the arena rounded down
    minimum = need.arena_min + need.grad_reserve + slack
    assert minimum == eng.budget.minimum()
    # Now at the smallest budget the engine accepts.
    model2 = small_gpt()
    m2, opt2 = infinity.initialize(model2, cfg(prefetch_depth=depth, device_memory=minimum))
    train_steps(m2, opt2, 6)
    s = infinity.stats(m2)
    assert s["peak_bytes"]["device"] <= minimum == s["budget_bytes"]["device"]
    assert s["peak_bytes"]["device"] >= need.arena_min - 2 * UB  # the budget was used, not idle
    from infinity.engine.plan.placement import host_need
    e2 = infinity.api.engine_of(m2)
    permanent = host_need([u.place for u in e2.units], e2.modes).permanent
    assert s["peak_bytes"]["host"] == permanent <= s["budget_bytes"]["host"]


def test_bytes_moved_fall_as_budget_grows():
    moved = []
    for units in (4, 7, 12):
        model = small_gpt()
        m, opt = infinity.initialize(model, cfg(device_memory=units * UB, prefetch_depth=1))
        train_steps(m, opt, 4)
        s = infinity.stats(m)
        assert s["peak_bytes"]["device"] <= units * UB
        moved.append(s["step_bytes_moved"]["h2d"])
    assert moved[0] > moved[1] > moved[2], moved
    # With room for everything each unit moves once per step (after its update).
    eng = infinity.api.engine_of(m)
    assert moved[2] == sum(u.compute_numel * 4 for u in eng.units)


def test_device_budget_too_small_names_unit_and_bytes():
    with pytest.raises(BudgetError, match=r"device_memory=\d+ bytes .* too small.*'blocks.0' \(\d+ bytes\)"):
        infinity.initialize(small_gpt(), cfg(device_memory=2 * UB))


def test_host_budget_too_small_names_bytes():
    with pytest.raises(BudgetError, match=r"needs \d+ bytes .* more than host_memory=100000 bytes"):
        infinity.initialize(small_gpt(), cfg(host_memory=100_000))


def test_bf16_trains_and_loss_falls():
    model = small_gpt()
    m, opt = infinity.initialize(model, cfg(dtype="bf16"), lr=3e-3, weight_decay=0.0)
    x, y = batches(1)[0]
    losses = []
    for _ in range(25):
        loss = m(x, y)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses[-1] < losses[0] - 0.5, losses
    eng = infinity.api.engine_of(m)
    assert eng.units[1].host.compute.dtype == torch.bfloat16
    # The bf16 compute copy is the rounded fp32 master.
    u = eng.units[1]
    n = u.trainable_numel
    assert torch.equal(u.host.compute[:n], u.opt.master.to(torch.bfloat16))


def test_fp16_dynamic_loss_scale_skips_overflow():
    model = small_gpt()
    m, opt = infinity.initialize(model, cfg(dtype="fp16", initial_loss_scale=2.0**40,
                                            loss_scale_growth_interval=3), lr=3e-3, weight_decay=0.0)
    before = infinity.full_state_dict(m)
    x, y = batches(1)[0]
    scales, losses = [], []
    for _ in range(40):
        loss = m(x, y)
        losses.append(loss.item())
        opt.scale_loss(loss).backward()
        opt.step()
        opt.zero_grad()
        scales.append(opt.loss_scale)
    s = infinity.stats(m)
    assert s["skipped_steps"] >= 1 and s["steps"] + s["skipped_steps"] == 40
    assert min(scales) < 2.0**40  # lowered on overflow
    assert any(b > a for a, b in zip(scales, scales[1:]))  # and grown again after clean steps
    assert all(torch.isfinite(v).all() for v in infinity.full_state_dict(m).values())
    assert losses[-1] < losses[0]
    assert not torch.equal(before["blocks.0.fc.weight"], infinity.full_state_dict(m)["blocks.0.fc.weight"])


def test_full_state_dict_keys_and_values():
    ref = small_gpt()
    m, opt = infinity.initialize(copy.deepcopy(ref), cfg())
    sd = infinity.full_state_dict(m)
    assert list(sd) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k], v), k
    # Parameters keep their shapes for user code, even while paged out.
    assert [p.shape for p in m.parameters()] == [p.shape for p in ref.parameters()]


def test_optimizer_state_dict_matches_torch_format():
    ref = small_gpt()
    m, opt = infinity.initialize(copy.deepcopy(ref), cfg())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    train_steps(m, opt, 1)  # one step: same gradients, so moments agree to rounding
    train_steps(ref, ref_opt, 1)
    sd, rsd = opt.state_dict(), ref_opt.state_dict()
    assert set(sd["state"]) == set(rsd["state"])
    assert [g["params"] for g in sd["param_groups"]] == [g["params"] for g in rsd["param_groups"]]
    for i, st in rsd["state"].items():
        assert sd["state"][i]["step"].item() == st["step"].item() == 1
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = sd["state"][i][key], st[key]
            assert a.shape == b.shape
            assert (a - b).abs().max().item() <= 1e-6 * b.abs().max().item() + 1e-12, (i, key)


@pytest.mark.parametrize("kw,match", [
    (dict(foo=1), "unknown field"),
    (dict(dtype="int8"), "Config.dtype"),
    (dict(device="tpu"), "Config.device"),
    (dict(device_memory="lots"), "Config.device_memory"),
    (dict(offload_params="disk"), "Config.offload_params"),
    (dict(overlap="sometimes"), "Config.overlap"),
    (dict(prefetch_depth=-1), "Config.prefetch_depth"),
    (dict(max_grad_norm=0), "Config.max_grad_norm"),
    (dict(zero_stage=5), "Config.zero_stage"),
    (dict(swap_paths="/tmp/x"), "Config.swap_paths"),
    (dict(overlap="delayed", offload_optimizer="none"), "delayed"),
    (dict(swap_block_size=1000), "Config.swap_block_size"),
    (dict(swap_backend="aio"), "Config.swap_backend"),
    (dict(swap_checksum="yes"), "Config.swap_checksum"),
    (dict(offload_params="nvme", offload_optimizer="none"), "offload_params='nvme'"),
])
def test_config_errors_name_the_field(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        infinity.Config(**kw)


def test_initialize_errors():
    with pytest.raises(ValueError, match="unknown optimizer argument"):
        infinity.initialize(small_gpt(), cfg(), learning_rate=1e-3)
    with pytest.raises(ValueError, match="lr"):
        infinity.initialize(small_gpt(), cfg(), lr=-1.0)
    with pytest.raises(TypeError, match="float64"):
        infinity.initialize(small_gpt().double(), cfg())
    m = small_gpt()
    infinity.initialize(m, cfg())
    with pytest.raises(ValueError, match="already managed"):
        infinity.initialize(m, cfg())
    with pytest.raises(ValueError, match="not managed"):
        infinity.stats(small_gpt())


def test_parse_bytes():
    from infinity.config.runtime import parse_bytes
    assert parse_bytes("8GiB") == 8 << 30
    assert parse_bytes("512 MiB") == 512 << 20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes(1234) == 1234
    assert parse_bytes("1e9") == parse_bytes(1e9) == 1_000_000_000  # a string as its number
    with pytest.raises(ValueError, match="x"):
        parse_bytes("12 parsecs", "x")
    # A bare "8G" was taken as 10**9 silently; tools disagree on it.
    with pytest.raises(ValueError, match=r"device_memory='8G'.*'8GB'.*'8GiB'"):
        parse_bytes("8G", "device_memory")
    with pytest.raises(ValueError, match="ambiguous"):
        infinity.Config(host_memory="512m")


def test_default_device_budget_grows_after_the_first_step(monkeypatch):
    """device_memory=None on CUDA: half the free memory for the first pass,
    then what the measured pass leaves free (see [Note: the default device
    budget]). Simulated on the CPU through the engine's two memory probes."""
    from infinity.engine.adapt import device_budget
    budget_cls = device_budget.DeviceBudget
    capacity = device_budget.MARGIN_BYTES + (3 << 20)
    need_other = 1 << 20  # activations and the rest, as the allocator's peak shows them

    def default_budget(self, minimum):
        # As if half the free memory were below the minimum: the first pass runs at the minimum.
        return device_budget.initial_budget(minimum, self.need().everything, minimum), capacity

    engines = []  # the engine, once built: the peak counts its arena as the allocator would
    monkeypatch.setattr(budget_cls, "default", default_budget)
    monkeypatch.setattr(budget_cls, "memory_peak", lambda self: engines[0].residency.tier.arena_bytes
                        + engines[0].residency.tier.fixed_bytes + need_other)
    import copy
    ref = small_gpt()
    m, opt = infinity.initialize(copy.deepcopy(ref), cfg(device_memory=None), lr=1e-3, weight_decay=0.1)
    eng = infinity.api.engine_of(m)
    engines.append(eng)
    first = eng.budget.budget
    assert first == eng.budget.minimum() < eng.budget.need().everything
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    for x, y in batches(4):
        loss, rl = m(x, y), ref(x, y)
        loss.backward()
        rl.backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert abs(loss.item() - rl.item()) <= 1e-5 * abs(rl.item())
    grown = min(eng.budget.need().everything, capacity - int(device_budget.HEADROOM * need_other) - device_budget.MARGIN_BYTES)
    assert first < grown == eng.budget.budget == infinity.stats(m)["budget_bytes"]["device"]
    assert infinity.stats(m)["peak_bytes"]["device"] <= grown
    assert_params_close(infinity.full_state_dict(m), ref.state_dict())
