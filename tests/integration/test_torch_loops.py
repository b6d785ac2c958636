"""Users' training loops that differed from torch silently (issue 33), through
the parity harness: every placement and overlap mode at the engine's
minimum device budget, every loss and final tensor against plain torch."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from paging_zoo import D, Block, Chain
from parity import check_parity, parity_configs, run_pair

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


class ShrinkingBlock(Block):
    """A block that decays its first weight in place, under no_grad, in its
    own forward (as weight re-normalisation and EMA updates do)."""

    def forward(self, x):
        with torch.no_grad():
            self.a.weight.mul_(0.9)
        return super().forward(x)


class RenormNet(nn.Module):
    """``nn.Embedding(max_norm=)`` in the root (its lookup renormalises the
    rows it reads, in place) and in a block, around blocks of which one
    writes its weight in forward."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(40, D, max_norm=0.5)
        self.blocks = nn.ModuleList([Block(16), ShrinkingBlock(8), nn.Embedding(40, D, max_norm=0.3), Block(8)])
        self.out = nn.Linear(D, D)

    def forward(self, idx, y):
        x = self.emb(idx)
        for i, b in enumerate(self.blocks):
            x = x + b(idx) if isinstance(b, nn.Embedding) else b(x)
        return F.mse_loss(self.out(x), y)


def renorm_net():
    torch.manual_seed(5)
    return RenormNet()


def renorm_loop(m, o, step):
    g = torch.Generator().manual_seed(step)
    idx, y = torch.randint(0, 40, (6,), generator=g), torch.randn(6, D, generator=g)
    loss = m(idx, y)
    loss.backward()
    o.step()
    o.zero_grad()
    with torch.no_grad():  # an evaluation forward renormalises too
        m(idx.flip(0), y)
    return loss.item()


def test_in_place_writes_in_forward_reach_every_tier(tmp_path):
    """Item 2: the write reached the device copy only (emb.weight 3.06 off
    after 4 steps at 63c37da; a no_grad mul_ in forward: 0.17)."""
    assert check_parity(renorm_net, renorm_loop, tmp_path, steps=4, budgets=("min",),
                        overlaps=("step", "backward")) >= 6


def test_in_place_write_in_forward_with_delayed_overlap_is_refused():
    cfg = infinity.Config(device="cpu", dtype="fp32", host_memory="64MiB", offload_params="host",
                          offload_optimizer="host", overlap="delayed")
    m, o = infinity.initialize(renorm_net(), cfg, lr=1e-2)
    idx, y = torch.randint(0, 40, (6,)), torch.randn(6, D)
    with pytest.raises(UsageError, match=r"written in place during forward.*overlap='step'"):
        m(idx, y)
    with pytest.raises(infinity.EngineFailedError, match="written in place"):
        o.step()
    infinity.close(m)


def test_parameters_left_out_of_param_groups_are_not_trained(tmp_path):
    """torch leaves parameters outside its groups alone; infinity trained
    them in a default group, silently."""
    def groups(m):
        return [{"params": list(m.blocks[0].parameters()) + list(m.out.parameters())},
                {"params": list(m.blocks[2].parameters()), "weight_decay": 0.0, "lr": 3e-3}]

    make = skipping_chain({})
    cfgs = list(parity_configs(make, tmp_path, budgets=("min",)))
    for name, cfg in cfgs:
        ref = make()
        init = {k: v.clone() for k, v in ref.state_dict().items()}
        with pytest.warns(UserWarning, match=r"in none of param_groups .*'inp.weight'"):
            losses, ref_losses, got, want = run_pair(
                make, plain_loop, cfg, init_kw=lambda m: dict(lr=1e-2, weight_decay=0.1, param_groups=groups(m)),
                torch_opt=lambda m: torch.optim.AdamW(groups(m), lr=1e-2, weight_decay=0.1, foreach=False))
        assert losses == pytest.approx(ref_losses, rel=1e-5), name
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=f"{name}: {k}")
        assert torch.equal(got["inp.weight"], init["inp.weight"]) and torch.equal(got["blocks.1.a.weight"],
                                                                                   init["blocks.1.a.weight"])


@pytest.mark.parametrize("params,opt,overlap", [("none", "host", "step"), ("host", "host", "delayed"),
                                                ("nvme", "nvme", "backward"), ("none", "none", "step")])
def test_optimizer_state_answers_like_torch(tmp_path, params, opt, overlap):
    """``optimizer.state`` was empty (len 0, state[p] == {}): code reading
    moments (logging, LR finders) got nothing, silently."""
    make = skipping_chain({1: (2,)})
    ref = make()
    m = __import__("copy").deepcopy(ref)
    ref.blocks[1].requires_grad_(False)
    m.blocks[1].requires_grad_(False)
    ro = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, foreach=False)
    cfg = infinity.Config(device="cpu", dtype="fp32", host_memory="64MiB", offload_params=params,
                          offload_optimizer=opt, overlap=overlap, swap_paths=[str(tmp_path)], swap_block_size=4096)
    m, o = infinity.initialize(m, cfg, lr=1e-2)
    if overlap == "delayed":
        from parity import DelayedReference
        ro = DelayedReference(ro)
    assert len(o.state) == 0 and o.state[m.inp.weight] == {}
    for step in range(2):
        plain_loop(ref, ro, step)
        plain_loop(m, o, step)
    if overlap == "delayed":  # step 1's update is queued: its moments are what optimizer.state shows
        ro.flush()
        ro = ro.inner
    names = dict(m.named_parameters())
    stepped = [n for n, p in ref.named_parameters() if p in ro.state]
    assert sorted(names[n] is p for n, p in names.items() if p in o.state) == [True] * len(stepped)
    assert len(o.state) == len(stepped) and set(id(p) for p in o.state) == {id(names[n]) for n in stepped}
    assert o.state[m.blocks[1].a.weight] == {}  # frozen
    for n, rp in ref.named_parameters():
        if rp not in ro.state:
            continue
        got, want = o.state[names[n]], ro.state[rp]
        assert sorted(got) == ["exp_avg", "exp_avg_sq", "step"], n
        assert float(got["step"]) == float(want["step"]), n
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got[k].as_subclass(torch.Tensor), want[k], rtol=1e-5, atol=1e-7, msg=n)
    t = o.state[m.out.weight]["exp_avg"]
    assert float(t.norm()) > 0 and t.shape == m.out.weight.shape
    with pytest.raises(UsageError, match="load_state_dict"):
        t.mul_(0)
    with pytest.raises(UsageError, match="load_state_dict"):
        t[0].zero_()
    with pytest.raises(UsageError, match="load_state_dict"):
        o.state[m.out.weight]["exp_avg"] = torch.zeros_like(t)
    with pytest.raises(UsageError, match="load_state_dict"):
        o.state[m.out.weight] = {}
    infinity.close(m)


def test_param_groups_of_another_model_are_refused():
    a, b = skipping_chain({})(), skipping_chain({})()
    with pytest.raises(ValueError, match=r"param_groups\[0\] lists a tensor of shape .* not a parameter of the model"):
        infinity.initialize(a, infinity.Config(device="cpu"), param_groups=[{"params": list(b.parameters())}])


@pytest.mark.parametrize("overlap", ["step", "backward", "delayed"])
def test_dcgan_loop_generator_backward_reaches_the_stepped_discriminator(overlap):
    """The DCGAN tutorial's loop: the generator's backward runs through the
    discriminator after the discriminator's step() and before its next
    zero_grad(), which drops those gradients. infinity raised there, and
    with overlap="backward" had already updated the discriminator with the
    generator's gradients."""
    import copy

    def make_d():
        torch.manual_seed(7)
        return Chain([16, 8])

    torch.manual_seed(8)
    gen_ref = nn.Sequential(nn.Linear(D, D), nn.Tanh(), nn.Linear(D, D))
    gen = copy.deepcopy(gen_ref)
    d_ref, d = make_d(), make_d()
    cfg = infinity.Config(device="cpu", dtype="fp32", host_memory="64MiB", offload_params="host",
                          offload_optimizer="host", overlap=overlap, grad_accumulation_steps=2)  # two backward()s
    d, od = infinity.initialize(d, cfg, lr=1e-2)
    od_ref = torch.optim.AdamW(d_ref.parameters(), lr=1e-2, foreach=False)
    if overlap == "delayed":
        from parity import DelayedReference
        od_ref = DelayedReference(od_ref)
    og, og_ref = (torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False) for m in (gen, gen_ref))
    target = torch.zeros(6, D)
    for step in range(4):
        real, noise = batch(step)
        losses = []
        for G, Dn, oD, oG in ((gen_ref, d_ref, od_ref, og_ref), (gen, d, od, og)):
            oD.zero_grad()
            err_real = Dn(real, target)
            err_real.backward()
            fake = G(noise)
            err_fake = Dn(fake.detach(), target + 1)
            err_fake.backward()
            oD.step()
            oG.zero_grad()
            err_g = Dn(fake, target)  # reaches the discriminator's parameters
            err_g.backward()
            oG.step()
            losses.append((err_real.item(), err_fake.item(), err_g.item()))
        assert losses[1] == pytest.approx(losses[0], rel=1e-5), (step, losses)
    od.flush()
    if overlap == "delayed":
        od_ref.flush()
    got = infinity.full_state_dict(d)
    for k, v in d_ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)
    for a, b in zip(gen.parameters(), gen_ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    infinity.close(d)


def autograd_grad_loop(m, o, step):
    """``torch.autograd.grad`` w.r.t. the parameters (SAM, MAML, per-parameter
    logging) beside the usual backward; returns the gradients' summed norms."""
    x, y = batch(step)
    m.step = step
    params = [p for p in m.parameters() if p.requires_grad]
    grads = torch.autograd.grad(m(x, y), params)
    m(x, y).backward()
    o.step()
    o.zero_grad()
    return float(sum(g.norm() for g in grads))


def test_autograd_grad_of_managed_parameters(tmp_path):
    """It raised "One of the differentiated Tensors does not require grad"
    while p.requires_grad was True."""
    assert check_parity(skipping_chain({}), autograd_grad_loop, tmp_path, steps=3, budgets=("min",)) >= 8


class HalvingBlock(Block):
    """Halves its input in place before using it."""

    def forward(self, x):
        x.mul_(0.5)
        return super().forward(x)


class ReusesInput(nn.Module):
    """``x = x + block(x)`` where each block writes its input in place: the
    caller's ``x`` holds the written values and their autograd history."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList([HalvingBlock(16), Block(8), HalvingBlock(32)])
        self.step = 0

    def forward(self, x, y):
        x = self.inp(x)
        for b in self.blocks:
            x = x + b(x)
        return F.mse_loss(x, y)


def reuses_input():
    torch.manual_seed(11)
    return ReusesInput()


def test_a_unit_forward_writing_its_input_in_place(tmp_path):
    """It raised "Output 0 of _PostBackward is a view and is being modified
    inplace", naming an internal class; torch runs it."""
    assert check_parity(reuses_input, plain_loop, tmp_path, steps=3, budgets=("min",)) >= 8


def test_a_torch_state_over_all_parameters_with_some_frozen_loads():
    """A torch AdamW built over model.parameters() (frozen ones included,
    with no state) failed to load with only "sizes [8] ... sizes [7]"."""
    import copy
    ref = skipping_chain({})()
    ref.blocks[1].a.weight.requires_grad_(False)
    m = copy.deepcopy(ref)
    ro = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    for step in range(2):
        plain_loop(ref, ro, step)
    m, o = infinity.initialize(m, infinity.Config(device="cpu", dtype="fp32"), lr=1e-2)
    m.load_state_dict(ref.state_dict())
    o.load_state_dict(ro.state_dict())
    for step in range(2, 4):
        a, b = plain_loop(ref, ro, step), plain_loop(m, o, step)
        assert a == pytest.approx(b, rel=1e-5)
    got = infinity.full_state_dict(m)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)
    two = torch.optim.AdamW([{"params": list(ref.blocks.parameters())}, {"params": list(ref.inp.parameters())}])
    with pytest.raises(ValueError, match=r"only trainable parameters \(the model has 1 frozen\)"):
        o.load_state_dict(two.state_dict())
    infinity.close(m)


@pytest.mark.parametrize("params,opt", [("host", "host"), ("nvme", "nvme"), ("none", "none")])
def test_deleting_and_clearing_optimizer_state_restarts_it_as_torch(tmp_path, params, opt):
    import copy
    ref = skipping_chain({})()
    m = copy.deepcopy(ref)
    ro = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    cfg = infinity.Config(device="cpu", dtype="fp32", host_memory="64MiB", offload_params=params,
                          offload_optimizer=opt, swap_paths=[str(tmp_path)], swap_block_size=4096)
    m, o = infinity.initialize(m, cfg, lr=1e-2)
    for step in range(4):
        if step == 2:
            del ro.state[ref.blocks[1].a.weight]
            del o.state[m.blocks[1].a.weight]
            assert m.blocks[1].a.weight not in o.state and o.state[m.blocks[1].a.weight] == {}
        if step == 3:
            ro.state.clear()
            o.state.clear()
            assert len(o.state) == 0
        assert plain_loop(m, o, step) == pytest.approx(plain_loop(ref, ro, step), rel=1e-5)
    got = infinity.full_state_dict(m)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)
    with pytest.raises(KeyError):
        del o.state[torch.nn.Parameter(torch.zeros(1))]
    infinity.close(m)


def test_lr_set_between_backward_and_step_with_backward_overlap_warns_and_applies_to_every_unit_alike():
    """With overlap="backward" the updates run during backward: an lr set
    before step() took effect one step late, silently, and the updates that
    ran in step() (the root's) used the new one: a mix."""
    import copy
    ref = skipping_chain({})()
    m = copy.deepcopy(ref)
    ro = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    cfg = infinity.Config(device="cpu", dtype="fp32", offload_params="host", offload_optimizer="host",
                          overlap="backward")
    m, o = infinity.initialize(m, cfg, lr=1e-2)
    lrs = [1e-2, 3e-2, 5e-3, 2e-2]
    with pytest.warns(RuntimeWarning, match=r"changed between backward\(\) and optimizer.step\(\).*lr 0.01 -> 0.03"):
        for step in range(4):
            x, y = batch(step)
            m.step = ref.step = step
            for net, opt in ((m, o), (ref, ro)):
                net(x, y).backward()
                if opt is o:  # infinity: set just before step(), after the updates ran in backward
                    for g in opt.param_groups:
                        g["lr"] = lrs[step]
                opt.step()
                opt.zero_grad()
            for g in ro.param_groups:  # torch, as infinity applies it: from the next step on
                g["lr"] = lrs[step]
    got = infinity.full_state_dict(m)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)
    infinity.close(m)
