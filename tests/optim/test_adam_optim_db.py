"""torch's own optimizer-test inputs for AdamW (``optim_db`` of
``torch.testing._internal.common_optimizers``), run through ``CPUAdamW``
and through the engine: each gives torch's result, or is refused naming
its key before any parameter changes (issue 33). The inputs are read from
the installed torch, so a new torch brings its new cases."""

import copy

import pytest
import torch

from test_adam_torch_options import Net  # the same small model as the hand-written cases

import infinity
from infinity.engine.faults import UsageError
from infinity.optim import CPUAdamW


def adamw_inputs():
    """(description, keyword arguments) of torch's AdamW test inputs on the CPU in fp32."""
    from torch.testing._internal.common_optimizers import optim_db  # needs expecttest (scripts/setup_env.sh)
    info = next(o for o in optim_db if o.optim_cls is torch.optim.AdamW)
    return [(i.desc, dict(i.kwargs)) for i in info.optim_inputs_func(device="cpu", dtype=torch.float32)]


INPUTS = adamw_inputs()
REFUSED = {"amsgrad", "capturable", "differentiable"}


def refused_key(kw):
    return next((k for k in REFUSED if kw.get(k)), None)


def test_torch_has_adamw_inputs():
    assert len(INPUTS) >= 4 and any(kw.get("maximize") for _, kw in INPUTS)


def grads(ps, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=g) for p in ps] for _ in range(steps)]


@pytest.mark.parametrize("desc,kw", INPUTS, ids=[d for d, _ in INPUTS])
def test_cpu_adamw_on_torchs_inputs(desc, kw):
    g = torch.Generator().manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(17, 5, generator=g)), torch.nn.Parameter(torch.randn(33, generator=g))]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    ropt = torch.optim.AdamW(ref, foreach=False, **kw)
    opt = CPUAdamW(ours)
    opt.param_groups[0].update(kw)  # torch's keys, as a group holds them
    key = refused_key(kw)
    for gs in grads(ref, 5):
        for p, q, gr in zip(ref, ours, gs):
            p.grad, q.grad = gr.clone(), gr.clone()
        ropt.step()
        if key:
            before = [q.detach().clone() for q in ours]
            with pytest.raises(ValueError, match=rf"{key}=True"):
                opt.step()
            assert all(torch.equal(a, b) for a, b in zip(ours, before))
            return
        opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=desc)


@pytest.mark.parametrize("overlap", ["step", "backward"])
@pytest.mark.parametrize("desc,kw", INPUTS, ids=[d for d, _ in INPUTS])
def test_engine_on_torchs_inputs(desc, kw, overlap):
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    ropt = torch.optim.AdamW(ref.parameters(), foreach=False, **kw)
    cfg = infinity.Config(device="cpu", dtype="fp32", offload_params="host", offload_optimizer="host",
                          overlap=overlap)
    model, opt = infinity.initialize(model, cfg)
    key = refused_key(kw)
    try:
        opt.param_groups[0].update(kw)
        g = torch.Generator().manual_seed(3)
        for _ in range(4):
            x = torch.randn(4, 8, generator=g)
            if key:  # refused when the pass starts, before an update can run in its backward
                before = {k: v.clone() for k, v in infinity.full_state_dict(model).items()}
                with pytest.raises(UsageError, match=rf"{key}=True"):
                    model(x).backward()
                after = infinity.full_state_dict(model)
                assert all(torch.equal(before[k], after[k]) for k in before)
                return
            for m, o in ((model, opt), (ref, ropt)):
                m(x).backward()
                o.step()
                o.zero_grad()
        got = infinity.full_state_dict(model)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=f"{desc}: {k}")
    finally:
        infinity.close(model)
