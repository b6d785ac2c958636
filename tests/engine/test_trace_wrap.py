"""The trace wraps around the step ([Note: the trace wraps around the step],
issue 36): after step() the next training pass's first units are already
coming up, the bytes trained are the same, and a write between step() and
the next forward is not lost to a copy fetched before it."""

import torch
from cuda_emulator import emulated_cuda_ordering
from engine_utils import batches, small_gpt

import infinity
from infinity.engine.owners.residency import Residency
from infinity.engine.plan.state import DeviceState


def cfg(**kw):
    return infinity.Config(**dict(dict(device="cpu", dtype="fp32", offload_params="host", offload_optimizer="host",
                                       device_memory=1 << 20, host_memory="64MiB", prefetch_depth=2), **kw))


def run(steps=3, write=False):
    model, opt = infinity.initialize(small_gpt(n_layer=4), cfg(), lr=1e-2)
    eng = opt.engine
    coming = []
    for x, y in batches(steps, seed=2):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
        coming.append([u.index for u in eng.units if u.dev.state is not DeviceState.ABSENT])
        if write:
            with torch.no_grad():
                model.blocks[0].qkv.weight.mul_(0.5)
    state = {k: v.clone() for k, v in infinity.full_state_dict(model).items()}
    loss = model(*batches(1, seed=9)[0]).item()
    infinity.close(model)
    return coming, state, loss


def test_after_step_the_next_passes_first_units_are_coming_up(monkeypatch):
    coming, state, loss = run()
    head = coming[1:]  # the first step() has the trace the first pass recorded
    assert all(0 in c and len(c) >= 2 for c in head), coming
    monkeypatch.setattr(Residency, "prefetch_next_pass", lambda self: None)
    coming_off, state_off, loss_off = run()
    assert all(c == [] for c in coming_off), coming_off
    assert loss == loss_off and all(torch.equal(state[k], v) for k, v in state_off.items())


def test_a_write_after_step_reaches_the_next_forward_under_cuda_ordering(monkeypatch):
    with emulated_cuda_ordering():
        _, state, loss = run(write=True)
    monkeypatch.setattr(Residency, "prefetch_next_pass", lambda self: None)
    _, state_off, loss_off = run(write=True)
    assert loss == loss_off and all(torch.equal(state[k], v) for k, v in state_off.items())
