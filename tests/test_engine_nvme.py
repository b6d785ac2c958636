"""The NVMe tier under the engine: parity with plain PyTorch, host budget as
a cache, swap files owned and removed."""

import os

import pytest
import torch

import infinity
from infinity.engine.tiers import BudgetError
from engine_utils import batches, small_gpt, train_pair, unit_bytes

UB = unit_bytes(small_gpt())


def cfg(tmp_path, paths=1, **kw) -> infinity.Config:
    base = dict(device="cpu", dtype="fp32", device_memory=8 * UB, host_memory=30 * UB, prefetch_depth=2,
                offload_params="nvme", offload_optimizer="nvme",
                swap_paths=[str(tmp_path / f"swap{i}") for i in range(paths)])
    base.update(kw)
    return infinity.Config(**base)


@pytest.mark.parametrize("paths", [1, 2])
@pytest.mark.parametrize("depth", [1, 4])
@pytest.mark.parametrize("overlap", ["step", "backward"])
def test_nvme_parity(tmp_path, paths, depth, overlap):
    kw = dict(prefetch_depth=depth, overlap=overlap)
    if depth == 4:
        kw["device_memory"] = 10 * UB
    model, opt, _, _ = train_pair(small_gpt, cfg(tmp_path, paths, **kw), steps=20)
    s = infinity.stats(model)
    assert s["bytes_moved"]["nvme_write"] > 0 and s["peak_bytes"]["nvme"] > 0
    assert s["peak_bytes"]["host"] <= s["budget_bytes"]["host"]
    assert s["peak_bytes"]["device"] <= s["budget_bytes"]["device"]
    if overlap == "backward":
        # Gradients go straight from their host buffer into the update: only
        # master, moments and the compute copy are written each step.
        eng = infinity.api.engine_of(model)
        state = sum(4 * 3 * u.trainable_numel + 4 * u.compute_numel for u in eng.units)
        assert s["step_bytes_moved"]["nvme_write"] == state
    infinity.api.close(model)


@pytest.mark.parametrize("params,optimizer", [("host", "nvme"), ("nvme", "host"), ("none", "nvme")])
def test_nvme_mixed_homes(tmp_path, params, optimizer):
    kw = dict(offload_params=params, offload_optimizer=optimizer, host_memory=60 * UB)
    if params == "none":
        kw["device_memory"] = 64 << 20
    model, _, _, _ = train_pair(small_gpt, cfg(tmp_path, 2, **kw), steps=10, accum=2)
    infinity.api.close(model)


def test_nvme_clipping_and_accumulation(tmp_path):
    model, opt, _, _ = train_pair(small_gpt, cfg(tmp_path, max_grad_norm=0.05, grad_accumulation_steps=2),
                                  steps=8, accum=2, clip=0.05)
    assert opt.last_grad_norm > 0.05
    infinity.api.close(model)


def test_nvme_traffic_falls_as_host_budget_grows(tmp_path):
    reads = []
    for i, units in enumerate((16, 19, 40)):
        c = cfg(tmp_path / str(i), host_memory=units * UB, prefetch_depth=1)
        model = small_gpt()
        m, opt = infinity.initialize(model, c)
        for x, y in batches(3):
            m(x, y).backward()
            opt.step()
            opt.zero_grad()
        s = infinity.stats(m)
        assert s["peak_bytes"]["host"] <= units * UB
        reads.append(s["step_bytes_moved"]["nvme_read"])
        # master, moments and the gradients spilled during backward (overlap="step")
        state_bytes = sum(4 * 4 * u.trainable_numel for u in infinity.api.engine_of(m).units)
        infinity.api.close(m)
    # (The middle budget is reported, not ordered: first-fit packing of the
    # pool can cost it a cached copy or two.)
    assert reads[0] > reads[2] and reads[1] >= reads[2], reads
    # With every compute copy cached, only the optimizer state is read.
    assert reads[2] == state_bytes


def test_swap_files_are_owned_and_removed(tmp_path):
    c = cfg(tmp_path, 2)
    m, opt = infinity.initialize(small_gpt(), c)
    x, y = batches(1)[0]
    m(x, y).backward()
    opt.step()
    dirs = [os.path.join(p, "rank0") for p in c.swap_paths]
    for d in dirs:
        assert oct(os.stat(d).st_mode & 0o777) == "0o700"
        files = [f for f in os.listdir(d)]
        assert files, d
        for f in files:
            assert oct(os.stat(os.path.join(d, f)).st_mode & 0o777) == "0o600"
    # A second run on the same directories is refused, naming the path.
    with pytest.raises(Exception, match="rank0"):
        infinity.initialize(small_gpt(), c)
    infinity.api.close(m)
    for d in dirs:
        assert not os.path.exists(d) or os.listdir(d) == []


def test_host_budget_below_pipeline_minimum_is_refused(tmp_path):
    with pytest.raises(BudgetError, match="host_memory"):
        infinity.initialize(small_gpt(), cfg(tmp_path, host_memory=3 * UB))


def test_nvme_full_state_dict_and_optimizer_state(tmp_path):
    import copy
    ref = small_gpt()
    m, opt = infinity.initialize(copy.deepcopy(ref), cfg(tmp_path), lr=1e-3, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    x, y = batches(1)[0]
    m(x, y).backward()
    ref(x, y).backward()
    opt.step()
    ref_opt.step()
    sd, rsd = opt.state_dict(), ref_opt.state_dict()
    for i, st in rsd["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert (sd["state"][i][k] - st[k]).abs().max() <= 1e-6 * st[k].abs().max() + 1e-12
    full = infinity.full_state_dict(m)
    for k, v in ref.state_dict().items():
        assert (full[k] - v).abs().max() <= 1e-5 * v.abs().max() + 1e-7, k
    infinity.api.close(m)


@pytest.mark.parametrize("backend", ["threads", "python"])
def test_nvme_other_backends_without_checksum(tmp_path, backend):
    model, _, _, _ = train_pair(small_gpt, cfg(tmp_path, swap_backend=backend, swap_checksum=False,
                                               swap_block_size="1MiB"), steps=6)
    assert infinity.api.engine_of(model).nvme.store.backend == backend
    infinity.api.close(model)
