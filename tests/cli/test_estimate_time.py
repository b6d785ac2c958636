"""`infinity estimate --time`: the step model's structure on small
configurations (timing decides nothing here): its bytes per link against what
the engine really moved, its exposed times, and its bound following the
profile (a slower disk, a shallower prefetch)."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch

import infinity
from infinity.cli.estimate_time import predict, run_time, variants
from infinity.cli.common import UsageError
from infinity.engine.plan.profile import Profile, load_profile, shipped_profiles
from infinity.models import GPT, GPTConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
import bench_predict  # noqa: E402

GCFG = GPTConfig(vocab_size=128, block_size=32, n_layer=3, n_head=2, n_embd=64)


def profile(**kw) -> Profile:
    base = dict(name="test", source="made up", device="cpu", gemm_flops={"fp32": [[64, 1e10], [1024, 2e10]]},
                mem_bw=1e10, op_overhead_s=1e-5, h2d_bw=1e9, d2h_bw=1e9, adamw_params_per_s={"fp32": 1e8},
                disk_read_bw=1e9, disk_write_bw=1e9, slow={"disk_read<disk_write": 1.0, "disk_write<disk_read": 1.0})
    base.update(kw)
    return Profile(**base)


def meta_model(batch=2, **kw):
    with torch.device("meta"):
        m = GPT(dataclasses.replace(GCFG, **kw))
    x = torch.zeros(batch, GCFG.block_size, dtype=torch.long, device="meta")
    return m, (lambda mm: mm(x, x))


def config(tmp_path, **kw):
    return infinity.Config(device="cpu", dtype="fp32", swap_paths=[str(tmp_path)], **kw)


def measured_bytes(cfg) -> dict:
    torch.manual_seed(0)
    model, opt = infinity.initialize(GPT(GCFG), cfg, lr=1e-3)
    x = torch.randint(0, GCFG.vocab_size, (2, GCFG.block_size))
    for _ in range(3):
        for _ in range(cfg.grad_accumulation_steps):
            model(x, x).backward()
        opt.step()
        opt.zero_grad()
    moved = dict(infinity.stats(model)["step_bytes_moved"])
    infinity.close(model)
    return moved


@pytest.mark.parametrize("kw", [{}, {"prefetch_depth": 0, "device_memory": "min"},
                                {"offload_optimizer": "nvme", "overlap": "backward"},
                                {"grad_accumulation_steps": 2, "prefetch_depth": 0, "device_memory": "min"}],
                         ids=["resident", "min-budget-depth0", "nvme-backward", "accumulation-min-budget"])
def test_bytes_per_link_are_the_engines(tmp_path, kw):
    kw = dict(kw)
    cfg = config(tmp_path)
    if kw.pop("device_memory", None) == "min":
        from infinity.cli.estimate import estimate
        cfg = dataclasses.replace(cfg, device_memory=estimate(meta_model()[0], cfg)["device"]["minimum"])
    cfg = dataclasses.replace(cfg, **kw)
    m, fwd = meta_model()
    pr = predict(m, cfg, fwd, profile())
    got = measured_bytes(cfg)
    assert pr.bytes["h2d"] == got["h2d"] and pr.bytes["d2h"] == got["d2h"]
    assert pr.bytes["nvme_read"] == got.get("nvme_read", 0) and pr.bytes["nvme_write"] == got.get("nvme_write", 0)
    assert sum(pr.exposed.values()) == pytest.approx(pr.seconds)
    assert pr.bound == max(pr.exposed, key=pr.exposed.get)


def test_bound_follows_the_disk(tmp_path):
    cfg = config(tmp_path, offload_optimizer="nvme", overlap="step")
    m, fwd = meta_model()
    fast = predict(m, cfg, fwd, profile(disk_read_bw=1e11, disk_write_bw=1e11))
    assert fast.bound == "compute"
    slow = predict(m, cfg, fwd, profile(disk_read_bw=1e6, disk_write_bw=1e6))
    assert slow.bound.startswith("disk_")
    half = predict(m, cfg, fwd, profile(disk_read_bw=5e5, disk_write_bw=5e5))
    disk = lambda p: p.exposed.get("disk_read", 0) + p.exposed.get("disk_write", 0)  # noqa: E731
    assert disk(half) > 1.9 * disk(slow) and half.seconds > slow.seconds


def test_prefetch_hides_slow_copies(tmp_path):
    from infinity.cli.estimate import estimate
    m, fwd = meta_model()
    cfg = config(tmp_path)
    cfg = dataclasses.replace(cfg, device_memory=estimate(m, cfg)["device"]["minimum"] * 2)
    prof = profile(h2d_bw=3e7)
    shallow = predict(m, dataclasses.replace(cfg, prefetch_depth=0), fwd, prof)
    deep = predict(m, dataclasses.replace(cfg, prefetch_depth=1), fwd, prof)
    assert deep.exposed["h2d"] < shallow.exposed["h2d"]
    assert deep.seconds < shallow.seconds


def test_overlap_modes_hide_the_optimizer(tmp_path):
    m, fwd = meta_model()
    prof = profile(adamw_params_per_s={"fp32": 3e6})
    step = predict(m, config(tmp_path, overlap="step"), fwd, prof)
    back = predict(m, config(tmp_path, overlap="backward"), fwd, prof)
    assert step.bound == "optimizer"
    assert back.exposed.get("optimizer", 0) < step.exposed["optimizer"]
    # Clipping needs every gradient: the updates wait for step() as with overlap="step".
    clipped = predict(m, config(tmp_path, overlap="backward", max_grad_norm=1.0), fwd, prof)
    assert clipped.seconds == pytest.approx(step.seconds)


def test_checkpointing_adds_the_recompute():
    from infinity.engine.plan.costs import count_pass
    got = {}
    for ck in (False, True):
        m, fwd = meta_model(checkpoint=ck)
        units = {i + 1: [b] for i, b in enumerate(m.blocks)}
        c = count_pass(m, fwd, units, torch.float32)
        # products only: attention is one call each way, or its math path under checkpointing
        got[ck] = [sum(o.flops for o in getattr(c, ph)[1] if o.shape and "attention" not in o.name)
                   for ph in ("forward", "backward")]
        names = [o.name for o in c.forward[1]]
        assert names.count("attention") == (0 if ck else 1) and ("bmm" in names) == ck
    (f0, b0), (f1, b1) = got[False], got[True]
    assert b0 == 2 * f0  # a backward's products are twice the forward's
    # The recompute runs in the unit's backward; torch stops it once the saved
    # tensors are back (the block's last linear is not recomputed).
    assert f1 > f0 and 0.5 * f1 < b1 - 2 * f1 < f1


def test_ci_rows_of_the_bench_predict(tmp_path):
    """Three rows of scripts/bench/bench_predict.py (the minimum budget at depth
    0, NVMe optimizer state, gradient accumulation): the prediction's
    structure and bytes, from the placement's own arithmetic."""
    prof = profile()
    got = {i: bench_predict.predict_row(i, prof) for i in bench_predict.CI_ROWS}
    for i, pr in got.items():
        config, gcfg, _ = bench_predict.row_config(i)
        assert pr.bound == max(pr.exposed, key=pr.exposed.get)
        assert sum(pr.exposed.values()) == pytest.approx(pr.seconds) and pr.seconds >= max(pr.busy.values())
        n = sum(t.name.startswith("backward ") for t in pr.sim.tasks)
        assert n == (gcfg.n_layer + 1) * config.grad_accumulation_steps  # the blocks and the root, each pass
    d0, nvme, accum = (got[i] for i in bench_predict.CI_ROWS)
    assert d0.bytes["h2d"] > accum.bytes["h2d"]  # the minimum budget fetches units twice a pass
    assert accum.bytes["d2h"] == 2 * nvme.bytes["d2h"]  # each backward's gradients go to the host
    # NVMe state, overlap step: fp32 master and moments read and written, the gradients spilled and read back.
    grads = nvme.bytes["d2h"]
    assert nvme.bytes["nvme_read"] - grads == nvme.bytes["nvme_write"] - grads > 0
    assert accum.bytes["nvme_read"] == accum.bytes["nvme_write"] == 0


def test_variants_and_cli_section(tmp_path):
    m, fwd = meta_model()
    cfg = config(tmp_path)
    vs = variants(cfg)
    assert vs[0] is cfg and len(vs) == 10
    assert not any(v.overlap == "delayed" and v.offload_optimizer == "nvme" for v in vs)
    p = tmp_path / "p.json"
    p.write_text(profile().to_json())
    out = run_time(m, cfg, fwd, 1, False, str(p))
    assert "fastest placement that fits" in out and out.count("overlap=") == 11
    with pytest.raises(UsageError, match="--profile"):
        run_time(m, cfg, fwd, 1, False, None)
    with pytest.raises(UsageError, match="net_bw"):  # several ranks need the network's figures
        run_time(m, cfg, fwd, 2, False, str(p))
    p.write_text(profile(net_bw={"net_device": 1e9, "net_host": 1e9}).to_json())
    two = run_time(m, dataclasses.replace(cfg, zero_stage=3), fwd, 2, False, str(p))
    assert "fastest placement that fits" in two


def test_profiles_load_and_bad_ones_are_named(tmp_path):
    assert {"h200-pcie5-nvme", "rtx4090-pcie4-nvme"} <= set(shipped_profiles())
    h200 = load_profile("h200-pcie5-nvme")
    assert h200.device == "cuda" and "PM1743" in h200.source
    bad = json.loads(profile().to_json())
    bad["disk_read_bw"] = 0
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="disk_read_bw=0"):
        load_profile(str(tmp_path / "bad.json"))
    bad["disk_read_bw"], bad["slow"] = 1e9, {"gpu<h2d": 1.0}
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="slow\\['gpu<h2d'\\]"):
        load_profile(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="no such file"):
        load_profile(str(tmp_path / "none.json"))


def test_gpu_profile_predicts_a_cuda_config(tmp_path):
    m, fwd = meta_model(batch=64, n_embd=1024, n_head=8)
    cfg = infinity.Config(device="cuda", dtype="bf16", swap_paths=[str(tmp_path)], offload_optimizer="nvme")
    h200, rtx = load_profile("h200-pcie5-nvme"), load_profile("rtx4090-pcie4-nvme")
    a, b = predict(m, cfg, fwd, h200), predict(m, cfg, fwd, rtx)
    assert 0 < a.seconds < b.seconds


@pytest.mark.slow
def test_doctor_writes_a_profile_that_loads(tmp_path):
    from infinity.cli import main
    out = tmp_path / "prof.json"
    assert main(["doctor", "--profile", str(out), "--dtype", "fp32", "--swap-path", str(tmp_path / "swap")]) == 0
    prof = load_profile(str(out))
    assert prof.device == "cpu" and prof.extra["seconds_to_measure"] > 0  # recorded; how long is the machine's
    assert {"compute<h2d", "h2d<compute", "compute<optimizer"} <= set(prof.slow)
    assert prof.net("net_host") == prof.net("net_device") and prof.net("net_host")[0] > 0  # one gloo group on the CPU


def test_what_if_names_the_second_swap_path(tmp_path):
    from infinity.cli.estimate_time import what_if
    from infinity.engine.plan.costs import count_pass
    from infinity.engine.plan.estimator import placed
    m, fwd = meta_model()
    cfg = config(tmp_path, offload_optimizer="nvme")
    costs = count_pass(m, fwd, {u.index: u.modules for u in placed(m, cfg)[0][1:]}, torch.float32)
    lines = what_if(m, cfg, fwd, profile(disk_read_bw=1e6, disk_write_bw=1e6), costs)
    assert any(x.startswith("a second swap path of the same speed would cut the step") for x in lines)
    assert what_if(m, cfg, fwd, profile(disk_read_bw=1e12, disk_write_bw=1e12), costs) == []


def test_engine_overhead_measures_in_a_low_precision_dtype():
    """The engine's time per parameter tensor and op is measured with fp32
    models handed to initialize (the engine casts the compute copy), whatever the run's dtype."""
    from infinity.cli.engine_probe import engine_overhead
    got = engine_overhead(torch.device("cpu"), "bf16", reps=1)
    assert set(got) == {"param_overhead_s", "engine_op_overhead_s", "step_overhead_s"}
    assert set(got["step_overhead_s"]) == {"fixed", "per_tensor"}
    assert all(min(v.values()) >= 0.0 for v in got.values())
    assert all(set(got[k]) == {"forward", "backward"} for k in ("param_overhead_s", "engine_op_overhead_s"))


@pytest.mark.parametrize("overlap", ["step", "backward", "delayed"])
def test_step_boundary_is_one_serial_task_after_the_updates(tmp_path, overlap):
    """[Note: the step boundary]: the step ends with the engine's own time,
    fixed plus per parameter tensor of the model, after the last backward and
    every update, exactly; none when the profile has no figure."""
    from infinity.engine.plan.costs import count_pass
    from infinity.engine.plan.estimator import placed
    from infinity.engine.plan.step_time import predict_step
    m, fwd = meta_model()
    cfg = config(tmp_path, overlap=overlap)
    units = placed(m, cfg)
    costs = count_pass(m, fwd, {u.index: u.modules for u in units[0][1:]}, torch.float32)
    slow = profile(adamw_params_per_s={"fp32": 1e5})  # updates outlast backward: the boundary waits for them
    base = predict_step(m, cfg, fwd, slow, units, costs)
    more = predict_step(m, cfg, fwd, dataclasses.replace(slow, step_overhead_s={"fixed": 0.25, "per_tensor": 0.01}),
                        units, costs)
    tensors = sum(len(u.layout.slots) for u in units[0])
    assert tensors == sum(1 for _ in m.parameters())
    assert more.seconds == pytest.approx(base.seconds + 0.25 + 0.01 * tensors)
    (b,) = [t for t in more.sim.tasks if t.name == "step() boundary"]
    assert b.resource == "compute" and b.end == pytest.approx(more.seconds)
    assert b.start == pytest.approx(max(t.end for t in more.sim.tasks if t.resource in ("compute", "optimizer")
                                        and t is not b))
    assert more.exposed["step()"] == pytest.approx(0.25 + 0.01 * tensors)
    assert "step()" not in base.exposed or base.exposed["step()"] == 0.0
    with pytest.raises(ValueError, match="step_overhead_s takes the keys 'fixed' and 'per_tensor'"):
        profile(step_overhead_s={"forward": 1e-3})


def test_engine_time_is_priced_per_parameter_tensor_and_op(tmp_path):
    """[Note: the engine's time per parameter]: each unit's pass pays the
    profile's figures times its parameter tensors (forward) or trainable ones
    (backward) and its ops, exactly; an old profile's per-unit figure is refused by name."""
    from infinity.engine.plan.costs import ROOT_TAIL, count_pass
    from infinity.engine.plan.estimator import placed
    from infinity.engine.plan.step_time import predict_step
    m, fwd = meta_model()
    cfg = config(tmp_path)
    units = placed(m, cfg)
    costs = count_pass(m, fwd, {u.index: u.modules for u in units[0][1:]}, torch.float32)
    base = predict_step(m, cfg, fwd, profile(), units, costs)
    per = {"param_overhead_s": {"forward": 1e-3, "backward": 2e-3},
           "engine_op_overhead_s": {"forward": 1e-5, "backward": 3e-5}}
    more = predict_step(m, cfg, fwd, profile(**per), units, costs)
    tasks = {t.name: t.end - t.start for t in base.sim.tasks}
    checked = 0
    for t in more.sim.tasks:
        if t.name.split()[0] in ("forward", "backward"):
            phase, i = t.name.split()[0], int(t.name.split()[1])
            lay = units[0][i].layout
            n = len(lay.trainable_slots if phase == "backward" else lay.slots)
            ops = len(getattr(costs, phase).get(i, [])) + (len(costs.backward[ROOT_TAIL]) * (phase == "backward")
                                                           if i == 0 else 0)
            extra = n * per["param_overhead_s"][phase] + ops * per["engine_op_overhead_s"][phase]
            assert t.end - t.start == pytest.approx(tasks[t.name] + extra)
            checked += 1
    assert checked == 2 * len(units[0])
    bad = tmp_path / "old.json"
    bad.write_text(json.dumps({**dataclasses.asdict(profile()), "unit_overhead_s": 1e-3}))
    with pytest.raises(ValueError, match="param_overhead_s"):
        load_profile(str(bad))
