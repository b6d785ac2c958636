"""The engine under CUDA's latest legal copy schedule (tests/cuda_emulator.py,
issue 36): every placement, overlap mode, dtype and accumulation gives the
same bytes as under the default CPU mover, and a wait removed from the
engine shows up as a difference at once."""

import itertools

import pytest
import torch
from cuda_emulator import emulated_cuda_ordering
from engine_utils import batches, small_gpt, unequal_net

import infinity
from infinity.engine.owners.grads import Gradients

MODELS = {"gpt": lambda: small_gpt(n_layer=4), "unequal": unequal_net}


def train(model_name, cfg, steps=3, accum=1):
    """Losses and final fp32 state of ``steps`` steps (``accum`` backward passes each)."""
    model, opt = infinity.initialize(MODELS[model_name](), infinity.Config(**cfg), lr=1e-2, weight_decay=0.1)
    losses = []
    try:
        for i, (x, y) in enumerate(batches(steps * accum, seed=4)):
            loss = model(x, y) / accum
            loss.backward()
            losses.append(loss.item())
            if (i + 1) % accum == 0:
                opt.step()
                opt.zero_grad()
        opt.flush()
        state = {k: v.clone() for k, v in infinity.full_state_dict(model).items()}
    finally:
        infinity.close(model)
    return losses, state


def config(tmp_path, dtype, params, opt, overlap, accum):
    return dict(device="cpu", dtype=dtype, offload_params=params, offload_optimizer=opt, overlap=overlap,
                grad_accumulation_steps=accum, device_memory=1 << 20, host_memory="64MiB", prefetch_depth=2,
                swap_paths=[str(tmp_path)], swap_block_size=4096)


def valid(cfg) -> bool:
    try:
        infinity.Config(**cfg)
        return True
    except ValueError:
        return False


def same_bytes(model_name, cfg, accum):
    want = train(model_name, cfg, accum=accum)
    with emulated_cuda_ordering() as movers:
        got = train(model_name, cfg, accum=accum)
    assert movers and sum(s.ran for m in movers for s in m.streams) > 0, "no copy went through the emulator"
    assert got[0] == want[0], (got[0], want[0])
    for k, v in want[1].items():
        assert torch.equal(got[1][k], v), k


MATRIX = [c for c in itertools.product(MODELS, ("fp32", "bf16"), ("none", "host", "nvme"), ("host", "nvme"),
                                       ("step", "backward", "delayed"), (1, 2))]
CI_SUBSET = [("unequal", "fp32", "host", "host", "backward", 1), ("gpt", "bf16", "nvme", "nvme", "step", 2),
             ("unequal", "bf16", "none", "host", "delayed", 1), ("gpt", "fp32", "host", "nvme", "backward", 2),
             ("unequal", "fp32", "nvme", "host", "step", 1)]


@pytest.mark.parametrize("model_name,dtype,params,opt,overlap,accum", CI_SUBSET)
def test_same_bytes_under_emulated_cuda_ordering(tmp_path, model_name, dtype, params, opt, overlap, accum):
    cfg = config(tmp_path, dtype, params, opt, overlap, accum)
    assert valid(cfg)
    same_bytes(model_name, cfg, accum)


@pytest.mark.slow
@pytest.mark.parametrize("model_name,dtype,params,opt,overlap,accum", MATRIX)
def test_same_bytes_under_emulated_cuda_ordering_full_matrix(tmp_path, model_name, dtype, params, opt, overlap,
                                                             accum):
    cfg = config(tmp_path, dtype, params, opt, overlap, accum)
    if not valid(cfg):
        pytest.skip("a combination Config refuses")
    same_bytes(model_name, cfg, accum)


def _skip_fetch_wait(self, u) -> None:
    """Residency._wait without the wait: the unit is marked resident as soon as its copy is issued."""
    from infinity.engine.plan.state import DeviceState, transition
    d = u.dev
    if d.state is DeviceState.FETCHING:
        d.ticket = None
        d.state = transition(u.name, "device", d.state, DeviceState.RESIDENT)


def _skip_gradient_waits(monkeypatch):
    """Gradients.wait and the drain before the step read nothing in flight."""
    monkeypatch.setattr(Gradients, "wait", lambda self, u: None)
    monkeypatch.setattr(Gradients, "drain", lambda self: None)


@pytest.mark.parametrize("hole", ["fetch", "gradients"])
def test_a_removed_wait_is_caught(tmp_path, monkeypatch, hole):
    """A wait removed from the engine: compute reads a unit whose copy has
    not run, or the update reads gradients still in flight. Under the
    emulator the run differs from the right one at step 1 (under the default
    mover it may pass by luck, as it would on a GPU most of the time)."""
    cfg = config(tmp_path, "fp32", "host", "host", "step", 1)
    want = train("unequal", cfg, steps=1)
    if hole == "fetch":
        from infinity.engine.owners.residency import Residency
        monkeypatch.setattr(Residency, "_wait", _skip_fetch_wait)
    else:
        _skip_gradient_waits(monkeypatch)
    with emulated_cuda_ordering():
        try:
            got = train("unequal", cfg, steps=1)
        except Exception:  # noqa: BLE001 - a loud failure is caught too
            return
    assert got[0] != want[0] or any(not torch.equal(got[1][k], v) for k, v in want[1].items())


def _zero_same_bytes(tmp_path, world, cases):
    """ZeRO on ``world`` gloo ranks: each case trained with the default mover and under the emulator
    (tests/zero_worker.py writes rank 0's losses and full state), bit for bit equal."""
    import torch.multiprocessing as mp
    import zero_worker
    both = [dict(c, emulate=e) for c in cases for e in (False, True)]
    mp.spawn(zero_worker.run, args=(world, str(tmp_path / "rdzv"), both, str(tmp_path)), nprocs=world, join=True)
    for i, c in enumerate(cases):
        want, got = (torch.load(tmp_path / f"case{2 * i + k}.pt") for k in (0, 1))
        assert got["stats"]["emulated_copies"] > 0 and want["stats"]["emulated_copies"] == 0, c
        assert got["losses"] == want["losses"], c
        for k, v in want["state"].items():
            assert torch.equal(got["state"][k], v), (c, k)


ZERO_CASES = [{"stage": 1, "steps": 3, "layers": 2, "opt": "nvme", "overlap": "backward"},
              {"stage": 2, "steps": 3, "layers": 2, "overlap": "backward", "accum": 2},
              {"stage": 3, "steps": 3, "layers": 2, "params": "nvme", "opt": "nvme"},
              {"stage": 2, "steps": 3, "layers": 2, "params": "none"}]  # copies gathered on the device


def test_zero_on_two_ranks_same_bytes_under_emulated_cuda_ordering(tmp_path):
    _zero_same_bytes(tmp_path, 2, ZERO_CASES)


@pytest.mark.slow
def test_zero_on_one_rank_same_bytes_under_emulated_cuda_ordering(tmp_path):
    _zero_same_bytes(tmp_path, 1, ZERO_CASES + [{"stage": 3, "steps": 3, "layers": 2, "overlap": "backward"}])
