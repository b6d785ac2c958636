"""Config.master_dtype="bf16" in the engine ([Note: a bf16 master in the
engine] in engine/step/update.py): the master is a bf16 buffer in its host
or NVMe home, updated by the native bf16-master kernel with stochastic
rounding. The reference is ``infinity.CPUAdamW(master_dtype="bf16", seed=)``
on a plain bf16 copy of the model driven by plain PyTorch gradients (the same
kernel, tested against tests/master_reference.py in
tests/optim/test_adam_master*.py); losses and final parameters are compared
bit for bit, and so are checkpoint resumes against the uninterrupted run."""

import copy
import json
import os
import warnings

import pytest
import torch

import infinity
from engine_utils import batches, small_gpt, step_with_reference

LR, WD, SEED = 1e-3, 0.1, 1234


def make():
    return small_gpt(n_layer=2)


def config(tmp_path, tag="swap", **kw) -> infinity.Config:
    base = dict(device="cpu", dtype="bf16", master_dtype="bf16", seed=SEED, host_memory="256MiB",
                swap_paths=[str(tmp_path / tag)])
    base.update(kw)
    return infinity.Config(**base)


def train(model, opt, data) -> list:
    losses = []
    for x, y in data:
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def test_config_refuses_what_cannot_work():
    with pytest.raises(ValueError, match=r"Config.master_dtype='fp16'.*'fp32', 'bf16'"):
        infinity.Config(master_dtype="fp16")
    with pytest.raises(ValueError, match=r"master_dtype='bf16' needs .*dtype='bf16'.*got .*dtype='fp32'"):
        infinity.Config(master_dtype="bf16", dtype="fp32")
    with pytest.raises(ValueError, match=r"master_dtype='bf16' needs offload_optimizer 'host' or 'nvme'"):
        infinity.Config(master_dtype="bf16", offload_optimizer="none", offload_params="none")
    assert infinity.Config().master_dtype == "fp32"


@pytest.mark.parametrize("opt_home,md,overlap,chunk", [
    ("host", "fp32", "step", None),
    ("nvme", "int8", "backward", None),
    ("nvme", "bf16", "step", "256KiB"),   # the root unit's state streamed in chunks
])
def test_engine_is_cpu_adamw_bf16_master_bit_for_bit(tmp_path, opt_home, md, overlap, chunk):
    """Losses and final parameters equal CPUAdamW(master_dtype='bf16') on a
    bf16 model with the same data, in host and NVMe homes."""
    ref = small_gpt(n_layer=2, n_embd=128) if chunk else make()  # units of 70 K and 197 K elements: 2 and 4 chunks
    model = copy.deepcopy(ref)
    ref = ref.to(torch.bfloat16)
    ref_opt = infinity.CPUAdamW(ref.parameters(), lr=LR, weight_decay=WD, master_dtype="bf16", seed=SEED,
                                moment_dtype=md)
    kw = dict(state_chunk_bytes=chunk) if chunk else {}
    cfg = config(tmp_path, offload_optimizer=opt_home, moment_dtype=md, overlap=overlap, **kw)
    model, opt = infinity.initialize(model, cfg, lr=LR, weight_decay=WD)
    try:
        step_with_reference(model, opt, ref, ref_opt, batches(4))
        got, want = infinity.full_state_dict(model), ref.state_dict()
        assert all(torch.equal(got[k].to(torch.bfloat16), want[k]) for k in want)
        assert all(torch.equal(got[k], got[k].bfloat16().float()) for k in got)  # the master's bits
    finally:
        infinity.close(model)


@pytest.mark.parametrize("opt_home", ["host", "nvme"])
def test_master_is_two_bytes_a_parameter_in_its_home(tmp_path, opt_home):
    """The tiers hold a 2-byte master: fp32 moments make 10 bytes a parameter, not 12."""
    per = {}
    for master in ("fp32", "bf16"):
        model, opt = infinity.initialize(make(), config(tmp_path, master, master_dtype=master,
                                                        offload_optimizer=opt_home), lr=LR)
        train(model, opt, batches(1))
        st = infinity.stats(model)
        n = sum(p.numel() for p in model.parameters())
        held = st["state_bytes"] if opt_home == "host" else st["nvme_state_bytes"]
        assert held["master"] == (2 if master == "bf16" else 4) * n
        assert st["master_dtype"] == master
        per[master] = st["state_bytes_per_parameter"]
        infinity.close(model)
    assert per == {"fp32": 12.0, "bf16": 10.0}


@pytest.mark.parametrize("moments", ["fp32", "int8"])
def test_estimate_counts_the_bytes_the_tiers_hold(tmp_path, moments):
    """`infinity estimate`'s optimizer-state bytes are what a run's host tier
    holds, and a bf16 master is 2 bytes a parameter less than an fp32 one."""
    from infinity.cli.estimate import estimate
    per = {}
    for master in ("fp32", "bf16"):
        cfg = config(tmp_path, master, master_dtype=master, moment_dtype=moments)
        o = estimate(make(), cfg)["optimizer_state"]
        assert o["master_dtype"] == master
        model, opt = infinity.initialize(make(), cfg, lr=LR)
        held = infinity.stats(model)["state_bytes"]
        infinity.close(model)
        assert o["bytes"] == sum(v for k, v in held.items() if k != "grad")
        per[master] = o["bytes_per_parameter"]
    if moments == "fp32":
        assert per == {"fp32": 12.0, "bf16": 10.0}
    else:  # int8 slots start on a block: padding adds the same elements to master and moments
        assert per["fp32"] - per["bf16"] == pytest.approx(2 * per["bf16"] / (4 + 8 / 256))


@pytest.mark.parametrize("saved,resumed", [(("host", "host"), ("host", "nvme")), (("nvme", "nvme"), ("host", "host"))])
def test_resume_is_bit_exact_and_keeps_the_rounding_seed(tmp_path, saved, resumed):
    """Saved after 3 steps and resumed in a run of another Config.seed (and
    placement), 3 more steps give the uninterrupted run's losses and bytes:
    the checkpoint holds the bf16 master and its rounding seed."""
    data = batches(6)
    model, opt = infinity.initialize(make(), config(tmp_path, "ref"), lr=LR, weight_decay=WD)
    want_losses = train(model, opt, data)
    want = infinity.full_state_dict(model)
    infinity.close(model)
    model, opt = infinity.initialize(make(), config(tmp_path, "a", offload_params=saved[0],
                                                    offload_optimizer=saved[1]), lr=LR, weight_decay=WD)
    train(model, opt, data[:3])
    path = infinity.save_checkpoint(tmp_path / "ckpt", model, opt)
    infinity.close(model)
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    assert (manifest["master_dtype"], manifest["master_seed"]) == ("bf16", SEED)
    assert manifest["tensors"]["blocks.0.fc.weight"]["dtype"] == "bfloat16"
    model, opt = infinity.initialize(make(), config(tmp_path, "b", seed=99, offload_params=resumed[0],
                                                    offload_optimizer=resumed[1]), lr=LR, weight_decay=WD)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # same master_dtype: nothing converted
        infinity.load_checkpoint(tmp_path / "ckpt", model, opt)
    assert train(model, opt, data[3:]) == want_losses[3:]
    got = infinity.full_state_dict(model)
    infinity.close(model)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_another_master_dtype_converts_with_one_warning(tmp_path):
    """fp32 -> bf16 rounds to nearest even, bf16 -> fp32 is exact; each warns naming Config.master_dtype."""
    for src, dst in (("fp32", "bf16"), ("bf16", "fp32")):
        model, opt = infinity.initialize(make(), config(tmp_path, src, master_dtype=src), lr=LR)
        train(model, opt, batches(2))
        saved = infinity.full_state_dict(model)
        infinity.save_checkpoint(tmp_path / src, model, opt)
        infinity.close(model)
        model, opt = infinity.initialize(make(), config(tmp_path, dst + "x", master_dtype=dst), lr=LR)
        with pytest.warns(RuntimeWarning, match=rf"master_dtype='{src}'.*Config.master_dtype='{dst}'") as rec:
            infinity.load_checkpoint(tmp_path / src, model, opt)
        assert len([w for w in rec if "master_dtype" in str(w.message)]) == 1
        got = infinity.full_state_dict(model)
        infinity.close(model)
        assert all(torch.equal(got[k], saved[k].bfloat16().float()) for k in saved)


def test_zero_stages_on_two_ranks_give_the_same_bf16_master(tmp_path):
    """ZeRO 1-3 cut the master into shards; each shard's stochastic rounding
    is keyed by the element's index in its parameter (not in the shard), so
    on 2 gloo ranks (whose reductions are a + b at every stage) every stage
    ends with the bits of stage 0, where each rank updates every element."""
    import torch.multiprocessing as mp

    import zero_worker
    from test_zero import rendezvous
    # small_gpt: its shards start inside parameters (unequal_net's fall on their edges).
    cases = [dict(stage=st, steps=3, layers=2, dtype="bf16", master_dtype="bf16", seed=SEED,
                  opt=opt, params="host")
             for st, opt in ((0, "host"), (1, "host"), (2, "nvme"), (3, "host"))]
    mp.spawn(zero_worker.run, args=(2, rendezvous(tmp_path), cases, str(tmp_path)), nprocs=2, join=True)
    res = [torch.load(tmp_path / f"case{i}.pt") for i in range(len(cases))]
    for case, r in zip(cases[1:], res[1:]):
        assert r["stats"]["master_dtype"] == "bf16" and r["stats"]["world_size"] == 2
        assert r["losses"] == res[0]["losses"], (case, r["losses"], res[0]["losses"])
        for k, v in res[0]["state"].items():
            assert torch.equal(r["state"][k], v), (case, k)
