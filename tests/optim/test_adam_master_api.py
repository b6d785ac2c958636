"""CPUAdamW(master_dtype="bf16"): the bf16 parameters are the master, stepped
as the plain reference steps them (tests/master_reference.py), with their
positions as streams; a state-dict resume is bit-exact; bad options raise."""

import copy

import pytest
import torch

from infinity.optim import CPUAdamW
from master_reference import ref_master_step
from moment_reference import ref_quantize

HP = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
SHAPES = [(33, 17), (17,), (5, 3, 2), (1,)]


def make_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).bfloat16()) for s in SHAPES]


def set_grads(params, step, dtype=torch.bfloat16):
    for i, p in enumerate(params):
        if dtype != p.dtype:
            p.grad_dtype = None  # torch refuses a gradient of another dtype unless told
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i)).to(dtype)


def zero_state(n, mdtype):
    z = torch.zeros(n)
    if mdtype == "fp32":
        return {"exp_avg": z.clone(), "exp_avg_sq": z.clone()}
    if mdtype == "bf16":
        return {"exp_avg": z.bfloat16(), "exp_avg_sq": z.bfloat16()}
    qm, sm = ref_quantize(z, True)
    qw, sw = ref_quantize(z, False)
    return {"exp_avg": qm, "exp_avg_sq": qw, "exp_avg_scale": sm, "exp_avg_sq_scale": sw}


@pytest.mark.parametrize("mdtype", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("gdtype", [torch.bfloat16, torch.float32])
def test_steps_equal_the_reference(mdtype, gdtype):
    params = make_params()
    opt = CPUAdamW([{"params": params[:2]}, {"params": params[2:], "lr": 3e-3}], **HP, moment_dtype=mdtype,
                   master_dtype="bf16", seed=77)
    refs = [p.detach().clone().view(-1) for p in params]
    states = [zero_state(p.numel(), mdtype) for p in params]
    for step in range(1, 4):
        set_grads(params, step, gdtype)
        opt.step()
        for i, p in enumerate(params):
            lr = 3e-3 if i >= 2 else HP["lr"]
            ref_master_step(refs[i], p.grad.view(-1), states[i], seed=77, stream=i, step=step, lr=lr,
                            beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05)
            assert p.dtype == torch.bfloat16
            assert torch.equal(p.detach().view(-1).view(torch.int16), refs[i].view(torch.int16)), \
                f"param {i} step {step}"


@pytest.mark.parametrize("mdtype", ["fp32", "bf16", "int8"])
def test_state_dict_resume_is_bit_exact(mdtype):
    params = make_params(1)
    opt = CPUAdamW(params, **HP, moment_dtype=mdtype, master_dtype="bf16", seed=5)
    for step in range(1, 4):
        set_grads(params, step)
        opt.step()
    saved_params = [p.detach().clone() for p in params]
    saved = copy.deepcopy(opt.state_dict())
    assert all(g["seed"] == 5 for g in saved["param_groups"])
    for step in range(4, 7):
        set_grads(params, step)
        opt.step()
    resumed = [torch.nn.Parameter(t.clone()) for t in saved_params]
    opt2 = CPUAdamW(resumed, **HP, moment_dtype=mdtype, master_dtype="bf16", seed=999)  # the state's seed wins
    opt2.load_state_dict(saved)
    for step in range(4, 7):
        set_grads(resumed, step)
        opt2.step()
    for a, b in zip(params, resumed):
        assert torch.equal(a.detach().view(torch.int16), b.detach().view(torch.int16))


def test_seed_changes_the_rounding_and_bad_options_raise():
    runs = []
    for seed in (1, 2):
        params = make_params(2)
        opt = CPUAdamW(params, **HP, master_dtype="bf16", seed=seed)
        set_grads(params, 1)
        opt.step()
        runs.append(torch.cat([p.detach().view(-1) for p in params]).view(torch.int16))
    assert not torch.equal(runs[0], runs[1])
    with pytest.raises(TypeError, match="must be torch.bfloat16"):
        CPUAdamW([torch.nn.Parameter(torch.zeros(3))], master_dtype="bf16")
    with pytest.raises(TypeError, match="must be torch.float32"):
        CPUAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))])
    with pytest.raises(ValueError, match="master_dtype='fp16'"):
        CPUAdamW(make_params(), master_dtype="fp16")
    with pytest.raises(ValueError, match="seed=-1"):
        CPUAdamW(make_params(), master_dtype="bf16", seed=-1)
    params = make_params()
    opt = CPUAdamW(params, master_dtype="bf16")
    set_grads(params, 1, torch.float16)
    with pytest.raises(TypeError, match="gradient of torch.float16"):
        opt.step()
