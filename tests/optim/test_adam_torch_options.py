"""torch's AdamW options as param-group keys (issue 33, item 4): each is
honoured with torch's result or refused before any parameter changes,
on CPUAdamW and on the engine's optimizer. Before, ``maximize=True``,
``decoupled_weight_decay=False`` and ``amsgrad=True`` set on a group (by
hand, or by loading a torch state) were accepted and ignored, and a
``torch.optim.Adam`` state went on as AdamW."""

import copy

import pytest
import torch

import infinity
from infinity.engine.faults import UsageError
from infinity.optim import CPUAdamW

# The AdamW inputs of torch's own optimizer tests (common_optimizers.optim_inputs_func_adamw /
# _adam), as group keys: what torch does with each is the reference.
CASES = [
    dict(),
    dict(weight_decay=0.1),
    dict(weight_decay=0.1, maximize=True),
    dict(maximize=True),
    dict(lr=torch.tensor(0.001)),
    dict(betas=(torch.tensor(0.9), torch.tensor(0.99))),
    dict(weight_decay=0.5, decoupled_weight_decay=False),           # torch.optim.Adam's L2 decay
    dict(weight_decay=0.5, decoupled_weight_decay=False, maximize=True),
    dict(foreach=False), dict(fused=True),                         # implementation choices: no effect
]
REFUSED = [dict(amsgrad=True), dict(capturable=True), dict(differentiable=True)]


def params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(17, 5, generator=g)), torch.nn.Parameter(torch.randn(33, generator=g))]


def torch_opt(ps, case):
    kw = dict(case)
    cls = torch.optim.Adam if kw.get("decoupled_weight_decay") is False else torch.optim.AdamW
    kw.pop("decoupled_weight_decay", None)
    kw.pop("fused", None)  # a CPU reference: the result is the same maths
    kw.setdefault("weight_decay", 0.01)
    return cls(ps, lr=kw.pop("lr", 0.001), foreach=kw.pop("foreach", False), **kw)


def by_hand(case):
    """``case`` as a user sets it on a group by hand: the decay mode under both
    its names (torch's decoupled_weight_decay, infinity's adamw_mode), which
    must agree (a lone change of one is refused: see the test below)."""
    out = dict(case)
    if "decoupled_weight_decay" in out:
        out["adamw_mode"] = out["decoupled_weight_decay"]
    return out


def run(opt, ps, steps=5, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "plain")
def test_cpu_adamw_group_keys_give_torchs_result(case):
    ref, ours = params(), params()
    run(torch_opt(ref, case), ref)
    opt = CPUAdamW(ours, lr=0.001, weight_decay=0.01)
    opt.param_groups[0].update(by_hand(case))
    run(opt, ours)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", REFUSED, ids=lambda c: next(iter(c)))
def test_cpu_adamw_refuses_what_it_cannot_honour_before_changing_anything(case):
    ps = params()
    before = [p.detach().clone() for p in ps]
    opt = CPUAdamW(ps)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], **case})
    key = next(iter(case))
    with pytest.raises(ValueError, match=rf"param_groups\[1\]: {key}=True: .*set {key}=False"):
        run(opt, ps, steps=1)
    assert all(torch.equal(a, b) for a, b in zip(ps, before)) and not opt.state


def test_a_torch_adam_state_goes_on_as_adam():
    ref, ours = params(), params()
    torch_adam = torch.optim.Adam(ref, lr=0.01, weight_decay=0.5, foreach=False)
    run(torch_adam, ref, steps=3)
    with torch.no_grad():
        for a, b in zip(ours, ref):
            a.copy_(b)
    opt = CPUAdamW(ours, lr=0.01)
    opt.load_state_dict(copy.deepcopy(torch_adam.state_dict()))  # torch's loader shares the step tensors
    assert opt.param_groups[0]["adamw_mode"] is False
    run(torch_adam, ref, steps=3, seed=2)
    run(opt, ours, steps=3, seed=2)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_two_names_of_the_decay_mode_must_agree():
    ps = params()
    opt = CPUAdamW(ps, adamw_mode=False)  # sets both names
    assert opt.param_groups[0]["decoupled_weight_decay"] is False
    opt.param_groups[0]["adamw_mode"] = True
    with pytest.raises(ValueError, match="adamw_mode=True and decoupled_weight_decay=False disagree"):
        run(opt, ps, steps=1)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x.square().mean()


@pytest.mark.parametrize("overlap", ["step", "backward"])
@pytest.mark.parametrize("case", [dict(maximize=True), dict(weight_decay=0.5, decoupled_weight_decay=False)],
                         ids=["maximize", "adam_l2"])
def test_engine_group_keys_give_torchs_result(tmp_path, case, overlap):
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    ropt = torch_opt(list(ref.parameters()), dict(case, lr=0.01))
    cfg = infinity.Config(device="cpu", dtype="fp32", offload_params="host", offload_optimizer="host",
                          overlap=overlap)
    model, opt = infinity.initialize(model, cfg, lr=0.01, weight_decay=0.01)
    try:
        opt.param_groups[0].update(by_hand(case))
        g = torch.Generator().manual_seed(3)
        for _ in range(4):
            x = torch.randn(4, 8, generator=g)
            for m, o in ((model, opt), (ref, ropt)):
                m(x).backward()
                o.step()
                o.zero_grad()
        got = infinity.full_state_dict(model)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6)
    finally:
        infinity.close(model)


def test_engine_refuses_amsgrad_before_any_update():
    model, opt = infinity.initialize(Net(), infinity.Config(device="cpu", dtype="fp32"), lr=0.01)
    try:
        before = {k: v.clone() for k, v in infinity.full_state_dict(model).items()}
        model(torch.randn(2, 8)).backward()
        opt.param_groups[0]["amsgrad"] = True
        with pytest.raises(UsageError, match=r"optimizer.param_groups\[0\]: amsgrad=True: .*set amsgrad=False"):
            opt.step()
        opt.zero_grad()
        with pytest.raises(UsageError, match="amsgrad=True"):  # the next pass, before its backward can update
            model(torch.randn(2, 8))
        after = infinity.full_state_dict(model)
        assert all(torch.equal(before[k], after[k]) for k in before)
    finally:
        infinity.close(model)
