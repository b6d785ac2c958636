"""NVMe optimizer state streamed in chunks ([Note: state streamed in chunks]
in engine/owners/optstate.py): a unit larger than ``Config.state_chunk_bytes``
is updated chunk by chunk, with the same bytes as a whole-unit update, and
the host minimum counts chunk buffers instead of buffers of the largest unit."""

import pytest
import torch
import torch.multiprocessing as mp

import infinity
from infinity.engine.mechanism.tiers import BudgetError
from infinity.engine.plan import placement as pl
from infinity.engine.plan.estimator import estimate_peaks, placed
from infinity.engine.plan.limits import PIPELINE_BUFFERS
from engine_utils import UnequalNet, batches, train_states
import zero_worker

CHUNK = 256 << 10  # the smallest chunk: 64 Ki fp32 elements
# Units (elements, d=16: 33h + 16): 264016 (five chunks), 1336 (less than
# one), 99016 (two); the root (embedding and head) 8192.
HIDDEN = (8000, 40, 3000)
LR, WD = 1e-3, 0.1


def make():
    torch.manual_seed(7)
    return UnequalNet(hidden=HIDDEN)


def config(tmp_path, chunked: bool, **kw) -> infinity.Config:
    base = dict(device="cpu", dtype="fp32", offload_params="host", offload_optimizer="nvme", host_memory="256MiB",
                swap_paths=[str(tmp_path / ("chunked" if chunked else "whole"))])
    if chunked:
        base["state_chunk_bytes"] = CHUNK
    base.update(kw)
    return infinity.Config(**base)


def run(cfg, steps=3, accum=1):
    """(fp32 parameters, optimizer.state_dict(), stats, chunks a unit) after ``steps`` steps."""
    chunks = [len(p.windows) for p in placed(make(), cfg)[2]]  # the engine's placement, as the estimator makes it
    return train_states(make(), cfg, steps, accum, LR, WD) + (chunks,)


def assert_same(a, b):
    for k in a[0]:
        assert torch.equal(a[0][k], b[0][k]), k
    assert set(a[1]["state"]) == set(b[1]["state"])
    for i, st in a[1]["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[k], b[1]["state"][i][k]), (i, k)


def chunked_and_whole(tmp_path, **kw):
    whole, chunked = run(config(tmp_path, False, **kw)), run(config(tmp_path, True, **kw))
    assert max(whole[3]) == 1
    assert max(chunked[3]) >= 5 and 1 in chunked[3]  # one unit of five chunks or more, one smaller than a chunk
    assert_same(chunked, whole)
    return chunked, whole


@pytest.mark.parametrize("md", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("overlap", ["step", "backward"])
def test_chunked_update_is_the_whole_update(tmp_path, md, overlap):
    chunked, whole = chunked_and_whole(tmp_path, moment_dtype=md, overlap=overlap)
    assert chunked[2]["nvme_state_bytes"] == whole[2]["nvme_state_bytes"]


@pytest.mark.parametrize("params", ["nvme", "none"])
def test_chunked_update_with_an_aliased_master_and_bf16_gradients(tmp_path, params):
    """Parameters on NVMe with fp32 compute: the master is the cached compute
    copy ([Note: fp32 master aliasing]), locked whole while the moments stream;
    bf16 compute: bf16 gradients into the kernel."""
    chunked_and_whole(tmp_path, offload_params=params, dtype="fp32" if params == "nvme" else "bf16")


@pytest.mark.parametrize("overlap", ["step", "backward"])
def test_chunked_update_with_clipping_and_accumulation(tmp_path, overlap):
    chunked_and_whole(tmp_path, moment_dtype="int8", overlap=overlap, max_grad_norm=0.5,
                      grad_accumulation_steps=2 if overlap == "backward" else 1)


def test_chunked_state_round_trips_through_the_state_dict(tmp_path):
    """The chunks' extents are read and rewritten whole (read_home / write_home)."""
    cfg = config(tmp_path, True, moment_dtype="int8")
    model, opt = infinity.initialize(make(), cfg, lr=LR, weight_decay=WD)
    for x, y in batches(2):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    opt.load_state_dict(sd)
    again = opt.state_dict()
    for i, st in sd["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[k], again["state"][i][k]), (i, k)
    infinity.close(model)


def host_minimum(cfg) -> int:
    """The host placement's minimum for ``make()`` under ``cfg`` (as initialize computes it)."""
    _, modes, places = placed(make(), cfg)
    return pl.host_need(places, modes).minimum


def test_host_budget_below_the_whole_unit_minimum_runs_chunked(tmp_path):
    """A budget below the old minimum (nine fp32 buffers of the largest unit)
    is refused without chunks and runs with them, within its peak, with the
    bytes of the whole-unit run; the estimator gives the chunked minimum."""
    largest = pl.round_pool(4 * 264016)
    whole_min, chunked_min = host_minimum(config(tmp_path, False)), host_minimum(config(tmp_path, True))
    # The gradients of chunked units stream too ([Note: gradients streamed in chunks]): only the root's stay whole.
    _, modes, places = placed(make(), config(tmp_path, True))
    streamed = max(pl.streamed_grad_bytes(p, modes) for p in places)
    kept = max(pl.round_pool(4 * p.trainable_numel) for p in places if not p.grad_chunked)
    assert streamed == (4 + 2) * CHUNK and kept == pl.round_pool(4 * 8192)  # four parameters, two stream chunks
    assert whole_min - chunked_min == PIPELINE_BUFFERS * largest - (3 * kept + streamed + 6 * CHUNK) > 5 * largest
    assert estimate_peaks(make(), config(tmp_path, True))["host"]["minimum"] == chunked_min  # infinity estimate's
    budget = chunked_min + CHUNK
    assert budget < whole_min
    with pytest.raises(BudgetError, match="host_memory"):
        infinity.initialize(make(), config(tmp_path, False, host_memory=budget))
    reference = run(config(tmp_path, False))
    tight = run(config(tmp_path, True, host_memory=budget, overlap="backward"))
    assert tight[2]["peak_bytes"]["host"] <= budget
    assert_same(tight, reference)


ZERO_CASES = [dict(stage=s, steps=2, model="chunky", moment_dtype="int8", opt="nvme", state_chunk=chunk, **kw)
              for s, kw in ((1, {}), (3, dict(params="nvme"))) for chunk in ("64MiB", CHUNK)]


@pytest.mark.slow  # two processes
def test_zero_shards_stream_in_chunks_at_world_2(tmp_path):
    """ZeRO 1 and 3 on 2 gloo ranks with int8 moments on NVMe: each rank's
    shard (132008 elements of the largest unit) streams in three chunks,
    with the bytes of the whole-shard update."""
    mp.spawn(zero_worker.run, args=(2, str(tmp_path / "rendezvous"), ZERO_CASES, str(tmp_path)), nprocs=2, join=True)
    res = [torch.load(tmp_path / f"case{i}.pt") for i in range(len(ZERO_CASES))]
    for whole, chunked in zip(res[0::2], res[1::2]):
        assert max(whole["stats"]["state_chunks"]) == 1 and max(chunked["stats"]["state_chunks"]) == 3
        assert all(torch.equal(whole["state"][k], chunked["state"][k]) for k in whole["state"])
        for i, st in whole["optimizer"]["state"].items():
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(st[k], chunked["optimizer"]["state"][i][k]), (i, k)


def test_config_checks_state_chunk_bytes():
    assert infinity.Config().state_chunk_bytes == 64 << 20
    assert infinity.Config(state_chunk_bytes="1MiB").state_chunk_bytes == 1 << 20
    for bad in (1000, 0, "300KiB"):
        with pytest.raises(ValueError, match=r"Config.state_chunk_bytes=.*multiple of 262144"):
            infinity.Config(state_chunk_bytes=bad)
    with pytest.raises(ValueError, match=r"Config.state_chunk_bytes"):
        infinity.Config(state_chunk_bytes="2GiB")
