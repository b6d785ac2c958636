"""CPUAdamW as a torch.optim.Optimizer: state dicts, LR schedulers, bad input."""

import pytest
import torch

from infinity.optim import CPUAdamW, adamw_step_


def _train(opt, params, grads):
    for g in grads:
        for p, gi in zip(params, g):
            p.grad = gi.clone()
        opt.step()


def _grads(shapes, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]


SHAPES = [(10, 4), (7,), (3, 3, 3)]


@pytest.mark.parametrize("direction", ["torch_to_ours", "ours_to_torch"])
def test_state_dict_round_trip_with_torch(direction):
    init = [torch.randn(s) for s in SHAPES]
    first, second = _grads(SHAPES, 5, 1), _grads(SHAPES, 5, 2)
    # Reference: torch all the way.
    ref = [t.clone().requires_grad_() for t in init]
    opt_ref = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, foreach=False)
    _train(opt_ref, ref, first + second)

    a = [t.clone().requires_grad_() for t in init]
    b = [t.clone().requires_grad_() for t in init]
    if direction == "torch_to_ours":
        opt_a = torch.optim.AdamW(a, lr=1e-2, weight_decay=0.1, foreach=False)
        opt_b = CPUAdamW(b, lr=1e-2, weight_decay=0.1)
    else:
        opt_a = CPUAdamW(a, lr=1e-2, weight_decay=0.1)
        opt_b = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1, foreach=False)
    _train(opt_a, a, first)
    sd = opt_a.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    with torch.no_grad():
        for x, y in zip(b, a):
            x.copy_(y)
    opt_b.load_state_dict(sd)
    for i in range(len(SHAPES)):
        assert opt_b.state[b[i]]["step"].item() == 5
        assert torch.equal(opt_b.state[b[i]]["exp_avg"], sd["state"][i]["exp_avg"])
    _train(opt_b, b, second)
    for x, r in zip(b, ref):
        scale = max(1.0, r.abs().max().item())
        assert (x - r).abs().max().item() <= 1e-6 * scale


def test_state_dict_preserves_our_group_options():
    p = torch.randn(4, requires_grad=True)
    opt = CPUAdamW([p], lr=1e-3, adamw_mode=False, num_threads=1)
    p.grad = torch.randn(4)
    opt.step()
    q = torch.randn(4, requires_grad=True)
    opt2 = CPUAdamW([q], lr=5.0)
    opt2.load_state_dict(opt.state_dict())
    assert opt2.param_groups[0]["lr"] == 1e-3
    assert opt2.param_groups[0]["adamw_mode"] is False
    assert opt2.param_groups[0]["num_threads"] == 1


@pytest.mark.parametrize("sched", ["step", "lambda", "cosine"])
def test_lr_scheduler_changes_step_like_torch(sched):
    init = [torch.randn(s) for s in SHAPES]
    grads = _grads(SHAPES, 12, 3)
    ref = [t.clone().requires_grad_() for t in init]
    mine = [t.clone().requires_grad_() for t in init]
    opt_ref = torch.optim.AdamW(ref, lr=0.05, foreach=False)
    opt = CPUAdamW(mine, lr=0.05)

    def make(o):
        if sched == "step":
            return torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.3)
        if sched == "lambda":
            return torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e))
        return torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=12)

    s_ref, s = make(opt_ref), make(opt)
    lrs, ref_lrs = [], []
    for g in grads:
        for p, r, gi in zip(mine, ref, g):
            p.grad = gi.clone()
            r.grad = gi.clone()
        opt.step()
        opt_ref.step()
        s.step()
        s_ref.step()
        lrs.append(opt.param_groups[0]["lr"])
        ref_lrs.append(opt_ref.param_groups[0]["lr"])
    assert lrs == ref_lrs
    assert len(set(round(x, 12) for x in lrs)) > 1, "scheduler did not change the lr"
    for x, r in zip(mine, ref):
        scale = max(1.0, r.abs().max().item())
        assert (x - r).abs().max().item() <= 1e-6 * scale
    # A changed lr really changes the update: without the scheduler the result differs.
    plain = [t.clone().requires_grad_() for t in init]
    _train(CPUAdamW(plain, lr=0.05), plain, grads)
    assert not torch.allclose(plain[0], mine[0])


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=-1e-3), "lr"),
    (dict(lr=float("nan")), "lr"),
    (dict(eps=-1e-8), "eps"),
    (dict(betas=(1.0, 0.999)), "beta1"),
    (dict(betas=(0.9, -0.1)), "beta2"),
    (dict(betas=(0.9,)), "betas"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(num_threads=0), "num_threads"),
])
def test_bad_hyperparameters_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CPUAdamW([torch.zeros(3, requires_grad=True)], **kwargs)


def test_bad_lr_from_group_change_is_named():
    p = torch.zeros(3, requires_grad=True)
    opt = CPUAdamW([p])
    opt.param_groups[0]["lr"] = -1.0
    p.grad = torch.ones(3)
    with pytest.raises(ValueError, match="lr"):
        opt.step()


def test_bad_params_are_named():
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\]\[1\].*float64"):
        CPUAdamW([torch.zeros(3, requires_grad=True), torch.zeros(3, dtype=torch.float64, requires_grad=True)])
    with pytest.raises(TypeError, match="bfloat16"):
        CPUAdamW([torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)])
    with pytest.raises(TypeError, match="meta"):
        CPUAdamW([torch.zeros(3, device="meta", requires_grad=True)])
    nc = torch.zeros(4, 5).t().requires_grad_()
    with pytest.raises(ValueError, match="contiguous"):
        CPUAdamW([nc])
    opt = CPUAdamW([torch.zeros(3, requires_grad=True)])
    with pytest.raises(TypeError, match=r"param_groups\[1\]"):
        opt.add_param_group({"params": [torch.zeros(2, dtype=torch.float16, requires_grad=True)]})


def test_sparse_grad_is_refused():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = CPUAdamW(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match="sparse"):
        opt.step()


def test_functional_bad_input_is_named():
    n = 8
    p, g, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n)
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match=r"exp_avgs\[0\] has 7 elements"):
        adamw_step_([p], [g], [torch.zeros(7)], [v], **kw)
    with pytest.raises(TypeError, match=r"params\[0\].*float64"):
        adamw_step_([p.double()], [g], [m], [v], **kw)
    with pytest.raises(TypeError, match=r"grads\[0\].*int32"):
        adamw_step_([p], [g.int()], [m], [v], **kw)
    with pytest.raises(ValueError, match=r"grads\[0\] is not contiguous"):
        adamw_step_([torch.zeros(4, 2).view(-1)], [torch.zeros(2, 4).t()], [m], [v], **kw)
    with pytest.raises(TypeError, match=r"outs\[0\].*int8"):
        adamw_step_([p], [g], [m], [v], outs=[torch.zeros(n, dtype=torch.int8)], **kw)
    with pytest.raises(ValueError, match="list lengths differ"):
        adamw_step_([p, p], [g], [m], [v], **kw)
    with pytest.raises(ValueError, match="step"):
        adamw_step_([p], [g], [m], [v], **dict(kw, step=0))
    with pytest.raises(ValueError, match="beta2"):
        adamw_step_([p], [g], [m], [v], **dict(kw, beta2=1.5))
