"""A host budget too small for the placement is refused with the changes the
configuration still allows (issue 35, item 4): with parameters and optimizer
state both on 'nvme' it was told to "offload to 'nvme'"."""

import re

import pytest

import infinity
from engine_utils import small_gpt, unit_bytes

UB = unit_bytes(small_gpt())


def cfg(tmp_path, params, optimizer, **kw) -> infinity.Config:
    base = dict(device="cpu", dtype="fp32", device_memory=8 * UB, host_memory=UB // 2, prefetch_depth=2,
                offload_params=params, offload_optimizer=optimizer, swap_paths=[str(tmp_path / "swap")])
    base.update(kw)
    return infinity.Config(**base)


def refusal(tmp_path, params, optimizer) -> str:
    with pytest.raises(infinity.BudgetError) as info:
        infinity.initialize(small_gpt(), cfg(tmp_path, params, optimizer))
    return str(info.value)


def test_both_on_nvme_is_not_told_to_offload_to_nvme(tmp_path):
    msg = refusal(tmp_path, "nvme", "nvme")
    assert "offload" not in msg, msg
    assert "lower prefetch_depth (now 2)" in msg and "make the largest unit smaller (unit_classes)" in msg, msg
    # The named budget is enough: the advice is one a user can follow.
    need = int(re.search(r"raise host_memory to at least (\d+) bytes", msg).group(1))
    model, _ = infinity.initialize(small_gpt(), cfg(tmp_path, "nvme", "nvme", host_memory=need))
    infinity.close(model)


@pytest.mark.parametrize("params, optimizer, told, not_told", [
    ("host", "host", ["offload_params='nvme'", "offload_optimizer='nvme'"], ["prefetch_depth", "unit_classes"]),
    ("host", "nvme", ["offload_params='nvme'", "unit_classes"], ["offload_optimizer", "prefetch_depth"]),
    ("nvme", "host", ["offload_optimizer='nvme'", "prefetch_depth", "unit_classes"], ["offload_params"]),
])
def test_advice_names_only_what_is_still_on_the_host(tmp_path, params, optimizer, told, not_told):
    msg = refusal(tmp_path, params, optimizer)
    assert "raise host_memory to at least" in msg, msg
    for part in told:
        assert part in msg, (part, msg)
    for part in not_told:
        assert part not in msg, (part, msg)


def test_default_budget_refusal_names_the_same_fixes(monkeypatch):
    """host_memory=None on a machine with too little RAM: the same advice."""
    import torch
    from infinity.engine.mechanism import tiers
    from infinity.engine.plan.placement import HostNeed, Modes
    monkeypatch.setattr(tiers.sysinfo, "available_ram", lambda: 1000)
    modes = Modes(device=torch.device("cpu"), dtype=torch.float32, grad_dtype=torch.float32, params="nvme",
                  optimizer="nvme", zero=0, world=1, delayed=False, depth=3, accum_steps=1)
    with pytest.raises(infinity.BudgetError) as info:
        tiers.host_budget(None, HostNeed(permanent=0, minimum=10_000, capacity=20_000, nvme_bytes=0), modes)
    msg = str(info.value)
    assert "offload" not in msg and "Raise the memory limit, or lower prefetch_depth (now 3)" in msg, msg
