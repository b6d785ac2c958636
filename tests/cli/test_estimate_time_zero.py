"""`infinity estimate --time` on several ranks ([Note: collectives in the
step model] in infinity/engine/plan/collectives.py): the predicted bytes per
link of each ZeRO stage equal what the engine's stats() counted on 2 gloo
ranks, and the collectives are tasks on the network links."""

import dataclasses

import pytest
import torch
import torch.multiprocessing as mp

import infinity
from infinity.cli.estimate_time import predict
from infinity.engine.plan.profile import load_profile

import zero_worker
from engine_utils import T, small_gpt, unit_bytes
from test_estimate_time import profile

WORLD = 2
CASES = [dict(stage=0, steps=2), dict(stage=1, steps=2), dict(stage=2, steps=2),
         dict(stage=3, steps=2), dict(stage=3, steps=2, opt="nvme", overlap="backward"),
         dict(stage=1, steps=2, params="none")]
NET = dict(net_bw={"net_device": 1e9, "net_host": 5e8}, net_latency_s={"net_device": 1e-5, "net_host": 5e-5})


def _config(case, swap) -> infinity.Config:
    # As zero_worker.run configures each case.
    dev = 64 << 20 if case.get("params") == "none" else 8 * unit_bytes(small_gpt())
    return infinity.Config(device="cpu", dtype="fp32", device_memory=dev, host_memory="256MiB",
                           zero_stage=case["stage"], offload_params=case.get("params", "host"),
                           overlap=case.get("overlap", "step"), offload_optimizer=case.get("opt", "host"),
                           swap_paths=[str(swap)])


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("zero_time")
    mp.spawn(zero_worker.run, args=(WORLD, str(tmp / "rendezvous"), CASES, str(tmp)), nprocs=WORLD, join=True)
    return [torch.load(tmp / f"case{i}.pt")["stats"]["step_bytes_moved"] for i in range(len(CASES))], tmp


@pytest.mark.parametrize("ci", range(len(CASES)))
def test_bytes_per_link_are_the_engines_on_two_ranks(measured, ci):
    moved, tmp = measured
    with torch.device("meta"):
        m = small_gpt()
    x = torch.zeros(2, T, dtype=torch.long, device="meta")
    pr = predict(m, _config(CASES[ci], tmp), lambda mm: mm(x, x), profile(**NET), world=WORLD)
    got = moved[ci]
    for link in ("h2d", "d2h", "net_device", "net_host", "nvme_read", "nvme_write"):
        assert pr.bytes[link] == got.get(link, 0), (CASES[ci], link, pr.bytes, got)
    assert sum(pr.exposed.values()) == pytest.approx(pr.seconds)


def test_a_slow_network_bounds_the_step(tmp_path):
    with torch.device("meta"):
        m = small_gpt()
    x = torch.zeros(2, T, dtype=torch.long, device="meta")
    cfg = _config(dict(stage=3), tmp_path)
    fast = predict(m, cfg, lambda mm: mm(x, x), profile(**NET), world=WORLD)
    slow = predict(m, cfg, lambda mm: mm(x, x), profile(net_bw={"net_device": 1e5, "net_host": 1e5},
                                                         net_latency_s={}), world=WORLD)
    assert slow.bound == "net_device" and slow.seconds > fast.seconds
    assert slow.busy["net_device"] >= slow.bytes["net_device"] / 1e5


def test_several_ranks_need_the_networks_figures(tmp_path):
    with torch.device("meta"):
        m = small_gpt()
    x = torch.zeros(2, T, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match="net_bw"):
        predict(m, _config(dict(stage=2), tmp_path), lambda mm: mm(x, x), profile(), world=WORLD)
    for name in ("h200-pcie5-nvme", "rtx4090-pcie4-nvme"):
        p = load_profile(name)
        assert p.net("net_device")[0] > 0 and p.net("net_host")[0] > 0
    assert dataclasses.asdict(profile(**NET))["net_bw"] == NET["net_bw"]
