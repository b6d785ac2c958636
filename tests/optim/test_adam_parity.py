"""CPUAdamW against torch.optim.AdamW / torch.optim.Adam (foreach=False)."""

import pytest
import torch

import infinity
from infinity.optim import CPUAdamW
from conftest import simd_params

SIZES = [1, 7, 15, 16, 17, 4097, 2**20 + 3]


def assert_close_to_scale(actual, expected, tol=1e-6):
    """max |a - e| <= tol * max(1, max |e|): 1e-6 relative to the parameter scale."""
    scale = max(1.0, expected.abs().max().item())
    diff = (actual - expected).abs().max().item()
    assert diff <= tol * scale, f"max abs diff {diff:.3e} > {tol:.0e} * scale {scale:.3f}"


def run_pair(make_params, ours_kwargs, torch_cls, torch_kwargs, steps, grad_fn=None, group_split=None):
    ref = make_params()
    mine = [p.detach().clone().requires_grad_(True) for p in ref]
    if group_split is None:
        ref_groups, my_groups = [{"params": ref}], [{"params": mine}]
    else:
        ref_groups = [dict(g, params=[ref[i] for i in idx]) for idx, g in group_split]
        my_groups = [dict(g, params=[mine[i] for i in idx]) for idx, g in group_split]
    opt_ref = torch_cls(ref_groups, foreach=False, **torch_kwargs)
    opt = CPUAdamW(my_groups, **ours_kwargs)
    for s in range(steps):
        for r, m in zip(ref, mine):
            g = grad_fn(r, s) if grad_fn else torch.randn_like(r)
            r.grad = g.clone()
            m.grad = g.clone()
        opt_ref.step()
        opt.step()
    return ref, mine, opt_ref, opt


@pytest.mark.parametrize("backend", simd_params(), indirect=True)
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("adamw_mode,weight_decay", [(True, 0.1), (True, 0.0), (False, 0.05)])
def test_parity_single_tensor(backend, size, adamw_mode, weight_decay):
    steps = 100 if size < 2**20 else 30
    torch_cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    kw = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=weight_decay)
    ref, mine, _, _ = run_pair(lambda: [torch.randn(size)], dict(kw, adamw_mode=adamw_mode), torch_cls, kw, steps)
    assert_close_to_scale(mine[0], ref[0])


@pytest.mark.parametrize("backend", simd_params(), indirect=True)
def test_parity_many_tensors_several_groups(backend):
    shapes = [(3, 5), (17,), (64, 65), (1,), (4097,), (2, 3, 4), (300, 7), (16,), (15,)] * 3
    make = lambda: [torch.randn(s) for s in shapes]
    n = len(shapes)
    groups = [
        (list(range(0, n, 3)), dict(lr=3e-3, weight_decay=0.0)),
        (list(range(1, n, 3)), dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=0.2)),
        (list(range(2, n, 3)), dict(eps=1e-6)),
    ]
    kw = dict(lr=5e-3, weight_decay=0.01)
    ref, mine, _, _ = run_pair(make, kw, torch.optim.AdamW, kw, 100, group_split=groups)
    for r, m in zip(ref, mine):
        assert_close_to_scale(m, r)


def test_parity_params_without_grad_are_skipped():
    a, b = torch.randn(10, requires_grad=True), torch.randn(10, requires_grad=True)
    ref = [a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()]
    opt = CPUAdamW([a, b], lr=0.1)
    opt_ref = torch.optim.AdamW(ref, lr=0.1, foreach=False)
    for s in range(5):
        g = torch.randn(10)
        a.grad = g.clone()
        ref[0].grad = g.clone()
        opt.step()
        opt_ref.step()
    assert b.grad is None and len(opt.state[b]) == 0
    assert_close_to_scale(a.detach(), ref[0].detach())
    assert torch.equal(b.detach(), ref[1].detach())


@pytest.mark.parametrize("backend", simd_params(), indirect=True)
@pytest.mark.parametrize("gdtype", [torch.bfloat16, torch.float16])
def test_reduced_precision_grads_match_torch_with_upcast(backend, gdtype):
    n = 4097
    p_ref = torch.randn(n)
    p = p_ref.clone()
    m, v = torch.zeros(n), torch.zeros(n)
    opt_ref = torch.optim.AdamW([p_ref.requires_grad_()], lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(1, 51):
        g = torch.randn(n).to(gdtype)
        p_ref.grad = g.float()
        opt_ref.step()
        infinity.optim.adamw_step_([p], [g], [m], [v], step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                                   weight_decay=0.1)
    assert_close_to_scale(p, p_ref.detach())


@pytest.mark.parametrize("backend", simd_params(), indirect=True)
@pytest.mark.parametrize("odtype", [torch.bfloat16, torch.float16, torch.float32])
def test_copy_out_equals_torch_rounding(backend, odtype):
    n = 2 * 4096 + 17
    p = torch.randn(n) * 1000
    # Values that sit on rounding boundaries, subnormals and overflow of fp16.
    p[:8] = torch.tensor([1.00390625, 1.01171875, -1.00390625, 65520.0, 70000.0, 1e-8, -3e-5, 0.0])
    m, v = torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=odtype)
    for step in range(1, 4):
        infinity.optim.adamw_step_([p], [torch.randn(n)], [m], [v], step=step, lr=1e-3, beta1=0.9, beta2=0.999,
                                   eps=1e-8, weight_decay=0.0, outs=[out])
        assert torch.equal(out, p.to(odtype)), "copy-out differs from param.to(dtype)"


@pytest.mark.parametrize("backend", simd_params(), indirect=True)
def test_nan_inf_gradients_propagate_like_torch(backend):
    n = 100
    p0 = torch.randn(n)
    g = torch.randn(n)
    g[3], g[50], g[77] = float("nan"), float("inf"), float("-inf")
    ref = p0.clone().requires_grad_()
    mine = p0.clone().requires_grad_()
    opt_ref = torch.optim.AdamW([ref], lr=1e-2, foreach=False)
    opt = CPUAdamW([mine], lr=1e-2)
    for _ in range(3):
        ref.grad = g.clone()
        mine.grad = g.clone()
        opt_ref.step()
        opt.step()
    torch.testing.assert_close(mine.detach(), ref.detach(), equal_nan=True, rtol=0, atol=1e-6)
    assert torch.isnan(mine[3]) and torch.isnan(mine[50]) and torch.isnan(mine[77])
    assert torch.isfinite(mine[torch.isfinite(g)]).all()
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(opt.state[mine][key], opt_ref.state[ref][key], equal_nan=True, rtol=0, atol=1e-6)


def test_grad_scale_unscales():
    n = 1000
    p1, p2 = torch.randn(n), None
    p2 = p1.clone()
    m1, v1, m2, v2 = torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n)
    g = torch.randn(n)
    kw = dict(step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    infinity.optim.adamw_step_([p1], [g * 1024], [m1], [v1], grad_scale=1 / 1024, **kw)
    infinity.optim.adamw_step_([p2], [g], [m2], [v2], **kw)
    assert torch.equal(p1, p2)
