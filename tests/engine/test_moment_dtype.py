"""Config.moment_dtype in the engine: bf16 and int8 Adam moments in their
host and NVMe homes ([Note: low-bit moments in the engine] in
engine/plan/opt_kinds.py). The reference is infinity.CPUAdamW with the same
moment_dtype on a plain model (the same kernel, tested against a plain
PyTorch reference in tests/optim/test_adam_moments_kernel.py); runs are
compared bit for bit across placements, overlap modes and ZeRO stages."""

import copy

import pytest
import torch
import torch.multiprocessing as mp

import infinity
from infinity.engine.plan.opt_kinds import QBLOCK
from engine_utils import batches, small_gpt, step_with_reference, train_states
import zero_worker

LR, WD = 1e-3, 0.1
# bf16 runs the same code paths as int8 less the scales: its longer runs are slow-marked
DTYPES = [pytest.param("bf16", marks=pytest.mark.slow), "int8"]


def make():
    return small_gpt(n_layer=2)


def config(tmp_path, md, **kw) -> infinity.Config:
    base = dict(device="cpu", dtype="bf16", moment_dtype=md, host_memory="256MiB",
                swap_paths=[str(tmp_path / "swap")])
    base.update(kw)
    return infinity.Config(**base)


def run(cfg, steps=3, accum=1, model=None):
    """Trains through infinity; (final fp32 parameters, optimizer.state_dict(), stats)."""
    return train_states(model or make(), cfg, steps, accum, LR, WD)


def assert_same(a, b):
    pa, sa, _ = a
    pb, sb, _ = b
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    assert set(sa["state"]) == set(sb["state"])
    for i, st in sa["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert st[k].dtype == torch.float32  # torch's format
            assert torch.equal(st[k], sb["state"][i][k]), (i, k)


def test_config_checks_moment_dtype():
    with pytest.raises(ValueError, match=r"Config.moment_dtype='int4'.*'fp32', 'bf16', 'int8'"):
        infinity.Config(moment_dtype="int4")
    with pytest.raises(ValueError, match=r"moment_dtype='int8' needs offload_optimizer 'host' or 'nvme'"):
        infinity.Config(moment_dtype="int8", offload_optimizer="none", offload_params="none")
    assert infinity.Config().moment_dtype == "fp32"


@pytest.mark.parametrize("md,overlap", [("bf16", "step"), ("int8", "backward")])
def test_engine_is_cpu_adamw_bit_for_bit(md, overlap):
    """fp32 compute: the engine's update over runs of slots in flat buffers
    gives CPUAdamW's bytes (per-parameter tensors), parameters and moments."""
    ref = make()
    model = copy.deepcopy(ref)
    ref_opt = infinity.CPUAdamW(ref.parameters(), lr=LR, weight_decay=WD, moment_dtype=md)
    cfg = infinity.Config(device="cpu", dtype="fp32", moment_dtype=md, host_memory="256MiB", overlap=overlap)
    model, opt = infinity.initialize(model, cfg, lr=LR, weight_decay=WD)
    step_with_reference(model, opt, ref, ref_opt, batches(3))
    got, want = infinity.full_state_dict(model), ref.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    for i, st in ref_sd["state"].items():
        assert torch.equal(sd["state"][i]["exp_avg"], st["exp_avg"]) and \
            torch.equal(sd["state"][i]["exp_avg_sq"], st["exp_avg_sq"])
    kept = infinity.stats(model)["state_bytes"]
    infinity.close(model)
    if md == "int8":
        assert kept["exp_avg"] * 4 == kept["master"] and kept["exp_avg_scale"] * QBLOCK == kept["master"]
    else:
        assert kept["exp_avg"] * 2 == kept["master"] and "exp_avg_scale" not in kept


@pytest.mark.parametrize("md", DTYPES)
def test_placements_give_the_same_bytes(tmp_path, md):
    """Optimizer state on the host or NVMe, compute copies on the device,
    host or NVMe: one set of bytes."""
    base = run(config(tmp_path / "a", md))
    for i, (params, opt) in enumerate((("none", "host"), ("nvme", "nvme"), ("host", "nvme"))):
        got = run(config(tmp_path / f"b{i}", md, offload_params=params, offload_optimizer=opt))
        assert_same(base, got)
        if opt == "nvme":
            assert got[2]["nvme_state_bytes"]["exp_avg"] > 0


@pytest.mark.parametrize("md", DTYPES)
def test_overlap_modes_clipping_and_accumulation_give_the_same_bytes(tmp_path, md):
    """overlap="backward" with clipping (speculative updates, rolled back
    and replayed: the undo state keeps the low-bit moments and scales) and
    "delayed" give overlap="step"'s bytes; so does accumulation."""
    kw = dict(max_grad_norm=0.05, grad_accumulation_steps=2)
    base = run(config(tmp_path / "a", md, **kw), accum=2)
    spec = run(config(tmp_path / "b", md, overlap="backward", **kw), accum=2)
    assert spec[2]["speculation"]["replayed"] > 0  # the clip hit: rolled back and redone
    assert_same(base, spec)
    # delayed: step t's update lands at t+1; it runs on the same low-bit buffers
    delayed = run(config(tmp_path / "c", md, overlap="delayed"), steps=3)
    kinds = [k for k in base[2]["state_bytes"] if k != "grad"]
    assert {k: delayed[2]["state_bytes"][k] for k in kinds} == {k: base[2]["state_bytes"][k] for k in kinds}
    assert not any(torch.equal(delayed[0][k], base[0][k]) for k in base[0] if k.endswith("c_fc.weight"))


def test_moment_dtypes_differ_and_fp32_is_default(tmp_path):
    """The field takes effect: three dtypes, three results (so a silently
    ignored moment_dtype would fail the placement tests' premise)."""
    res = {md: run(config(tmp_path / md, md))[0] for md in ("fp32", "bf16", "int8")}
    k = "blocks.0.mlp.c_fc.weight" if "blocks.0.mlp.c_fc.weight" in res["fp32"] else next(iter(res["fp32"]))
    assert not torch.equal(res["fp32"][k], res["bf16"][k]) and not torch.equal(res["bf16"][k], res["int8"][k])


class Wide(torch.nn.Module):
    """Units of whole 256-element blocks: the state bytes a parameter without padding."""

    def __init__(self, d=256, n=3):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.square().mean()


@pytest.mark.parametrize("opt", ["host", "nvme"])
def test_int8_state_is_six_bytes_a_parameter(tmp_path, opt):
    """fp32 master + int8 moments, counted by the tiers: <= 6.1 bytes a parameter (4 + 2 + 8/256)."""
    torch.manual_seed(0)
    model = Wide()
    n = sum(p.numel() for p in model.parameters())
    cfg = config(tmp_path, "int8", offload_optimizer=opt, dtype="fp32")
    model, o = infinity.initialize(model, cfg, lr=LR)
    model(torch.randn(4, 256)).backward()
    o.step()
    s = infinity.stats(model)
    infinity.close(model)
    kinds = ("master", "exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale")
    counted = s["nvme_state_bytes"] if opt == "nvme" else s["state_bytes"]
    total = sum(counted[k] for k in kinds)
    assert total == n * 4 + 2 * n + 2 * 4 * (n // QBLOCK), counted
    assert total / n <= 6.1
    if opt == "nvme":
        assert sum(s["state_bytes"][k] for k in kinds) == 0  # nothing of it kept in memory for good


@pytest.mark.parametrize("md", ["bf16", "int8"])
def test_load_state_dict_stores_the_moments_as_cpu_adamw_does(md):
    """A torch AdamW state (fp32 moments) loads quantised, as CPUAdamW's load_state_dict stores it."""
    ref = make()
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    for x, y in batches(2):
        ref(x, y).backward()
        torch_opt.step()
        torch_opt.zero_grad()
    sd = torch_opt.state_dict()
    model = copy.deepcopy(ref)
    cpu = infinity.CPUAdamW(copy.deepcopy(ref).parameters(), lr=LR, weight_decay=WD, moment_dtype=md)
    cpu.load_state_dict(sd)
    model, opt = infinity.initialize(model, infinity.Config(device="cpu", dtype="fp32", moment_dtype=md,
                                                            host_memory="256MiB"), lr=LR, weight_decay=WD)
    opt.load_state_dict(sd)
    got, want = opt.state_dict()["state"], cpu.state_dict()["state"]
    infinity.close(model)
    for i in want:
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got[i][k], want[i][k]), (i, k)
            assert not torch.equal(got[i][k], sd["state"][i][k])  # stored in fewer bits


ZERO_CASES = [dict(stage=s, steps=3, layers=2, moment_dtype="int8", **kw)
              for s, kw in ((0, {}), (1, {}), (2, dict(overlap="backward")), (3, dict(opt="nvme", params="nvme")))]


@pytest.mark.slow  # two processes: ~40 s on 2 cores
def test_zero_stages_give_the_same_bytes_at_world_2(tmp_path):
    """int8 moments under ZeRO 0-3 on 2 ranks: every stage gives the same
    bytes (shards start on blocks; a sum of two ranks' gradients is the same
    whichever collective takes it), parameters and moments; close to one
    process (its gradients are summed in another order)."""
    mp.spawn(zero_worker.run, args=(2, str(tmp_path / "rendezvous"), ZERO_CASES, str(tmp_path)), nprocs=2, join=True)
    res = [torch.load(tmp_path / f"case{i}.pt") for i in range(len(ZERO_CASES))]
    for r in res[1:]:
        assert all(torch.equal(res[0]["state"][k], r["state"][k]) for k in r["state"])
        for i, st in res[0]["optimizer"]["state"].items():
            assert torch.equal(st["exp_avg"], r["optimizer"]["state"][i]["exp_avg"])
            assert torch.equal(st["exp_avg_sq"], r["optimizer"]["state"][i]["exp_avg_sq"])
    kept = res[1]["stats"]["state_bytes"]  # stage 1: this rank's shard, whole blocks
    assert kept["exp_avg_scale"] // 4 * QBLOCK == kept["exp_avg"] == kept["master"] // 4
