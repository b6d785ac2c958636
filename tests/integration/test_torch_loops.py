"""Users' training loops that differed from torch silently (issue 33), through
the parity harness: every placement and overlap mode at the engine's
minimum device budget, every loss and final tensor against plain torch."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from paging_zoo import D, Block, Chain
from parity import check_parity

import infinity
from infinity.engine.faults import UsageError


def batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(6, D, generator=g), torch.randn(6, D, generator=g)


def skipping_chain(skips):
    """A Chain whose blocks in ``skips[step]`` do not run at that step."""
    def make():
        torch.manual_seed(0)
        m = Chain([32, 8, 16, 8])
        m.order = lambda s: [i for i in range(4) if i not in skips.get(s, ())]
        return m
    return make


def plain_loop(m, o, step):
    x, y = batch(step)
    m.step = step
    loss = m(x, y)
    loss.backward()
    o.step()
    o.zero_grad()
    return loss.item()


class TopOneMoE(nn.Module):
    """Each sample goes to the one expert its router scores highest (scaled
    by the gate, so the router learns): experts no sample chose get no
    gradient in that step."""

    def __init__(self, n: int = 6):
        super().__init__()
        self.router = nn.Linear(D, n)
        self.experts = nn.ModuleList(Block(h) for h in (8, 16, 8, 32, 16, 8)[:n])
        self.out = nn.Linear(D, D)

    def forward(self, x, y):
        gate = F.softmax(self.router(x), dim=-1)
        top, idx = gate.max(dim=-1)
        h = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            sel = idx == e
            if sel.any():
                h = h.index_put((sel.nonzero().squeeze(1),), expert(x[sel]) * top[sel, None])
        return F.mse_loss(self.out(h), y)


def moe():
    torch.manual_seed(3)
    return TopOneMoE()


def moe_loop(m, o, step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(3, D, generator=g), torch.randn(3, D, generator=g)
    loss = m(x, y)
    loss.backward()
    o.step()
    o.zero_grad()
    return loss.item()


@pytest.mark.parametrize("skips", [{1: (2,)}, {1: (2,), 2: (2,), 3: (1, 2)}], ids=["once", "often"])
def test_a_block_skipped_in_some_steps(tmp_path, skips):
    """Item 1: overlap="delayed" left a skipped unit's compute copy two
    updates behind (step 4's loss 0.370 vs torch's 0.711)."""
    assert check_parity(skipping_chain(skips), plain_loop, tmp_path, steps=5, budgets=("min",)) >= 8


def test_top_one_moe_experts_without_tokens(tmp_path):
    """Item 1: experts no sample was routed to in a step (84 of 100 tensors off at 63c37da)."""
    assert check_parity(moe, moe_loop, tmp_path, steps=6, budgets=("min",)) >= 8


def keep_zero_grads_loop(m, o, step):
    """``zero_grad(set_to_none=False)``: a block left out of later steps
    still moves (its moments decay, weight decay applies)."""
    x, y = batch(step)
    m.step = step
    loss = m(x, y)
    loss.backward()
    o.step()
    o.zero_grad(set_to_none=False)
    return loss.item()


def model_zero_grad_loop(m, o, step):
    """The same through ``model.zero_grad(set_to_none=False)``; every other
    step ends with the default (None), which stops the zero updates."""
    x, y = batch(step)
    m.step = step
    loss = m(x, y)
    loss.backward()
    o.step()
    m.zero_grad(set_to_none=step % 3 == 2)
    return loss.item()


@pytest.mark.parametrize("loop", [keep_zero_grads_loop, model_zero_grad_loop], ids=["optimizer", "model"])
def test_zero_grad_set_to_none_false_keeps_zero_gradients(tmp_path, loop):
    """Item 3: infinity ignored set_to_none=False (a parameter 0.17 off after 4 steps)."""
    make = skipping_chain({s: (2,) for s in range(1, 6)} | {3: (1, 2)})
    assert check_parity(make, loop, tmp_path, steps=6, budgets=("min",)) >= 8


def step_without_backward_loop(m, o, step):
    """A step() with no backward after zero_grad(set_to_none=False): torch
    updates every parameter that had a gradient, with zeros."""
    if step % 2 == 1:
        o.step()
        o.zero_grad(set_to_none=False)
        return 0.0
    return keep_zero_grads_loop(m, o, step)


def test_step_without_backward_after_zero_grads(tmp_path):
    make = skipping_chain({})
    assert check_parity(make, step_without_backward_loop, tmp_path, steps=5, budgets=("min",)) >= 8


@pytest.mark.parametrize("overlap", ["step", "backward", "delayed"])
def test_step_twice_after_one_backward_is_refused_before_anything_changes(overlap):
    """Item 5: torch applies the same gradients twice; infinity freed them at
    the first step() and applied them once, silently (loss 0.129 vs 2.115)."""
    torch.manual_seed(0)
    cfg = infinity.Config(device="cpu", dtype="fp32", host_memory="64MiB", offload_params="host",
                          offload_optimizer="host", overlap=overlap)
    m, o = infinity.initialize(Chain([8, 16]), cfg, lr=1e-2)
    x, y = batch(0)
    m(x, y).backward()
    o.step()
    o.flush()
    before = {k: v.clone() for k, v in infinity.full_state_dict(m).items()}
    state = {i: {k: v.clone() for k, v in s.items()} for i, s in o.state_dict()["state"].items()}
    with pytest.raises(UsageError, match=r"step\(\) again without backward"):
        o.step()
    o.flush()
    after = infinity.full_state_dict(m)
    assert all(torch.equal(before[k], after[k]) for k in before)
    for i, s in o.state_dict()["state"].items():
        assert all(torch.equal(s[k], state[i][k]) for k in s)
    o.zero_grad()
    m(x, y).backward()  # the run goes on as usual
    o.step()
    o.zero_grad()
    o.flush()
    before = {k: v.clone() for k, v in infinity.full_state_dict(m).items()}
    o.step()  # after zero_grad(set_to_none=True) torch has no gradients: a step() changes nothing
    o.flush()
    after = infinity.full_state_dict(m)
    assert all(torch.equal(before[k], after[k]) for k in before)
    infinity.close(m)
