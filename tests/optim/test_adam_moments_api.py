"""CPUAdamW(moment_dtype=...) and infinity.optim.moments: the torch-side
encodings equal the reference's to the bit, state dicts are torch's format,
bad input is named."""

import math

import pytest
import torch

from infinity.optim import CPUAdamW, adamw_step_, moments
from conftest import simd_params
from moment_reference import M_TABLE, W_TABLE, ref_dequantize, ref_quantize


def nasty(n=3 * 256 + 40, seed=0):
    """Log-uniform magnitudes over 2^-40..2^10 with random signs, code-value
    midpoints, specials, a block below FLT_MIN and a block of zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.exp2(torch.rand(n, generator=gen) * 50 - 40) * torch.sign(torch.randn(n, generator=gen))
    mids = torch.cat([(M_TABLE[:-1] + M_TABLE[1:]) / 2, (W_TABLE[:-1] + W_TABLE[1:]) / 2]).float()
    x[:mids.numel()] = mids[:256 + 104]  # block 0 (scale 1.0 from 1.0 at index 120 of W's table's mids)
    x[0] = 1.0
    x[300:310] = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-40, -1e-45, 2.0 ** -126, 3e38, -1e-38])
    x[512:768] = torch.rand(256, generator=gen) * 1e-39
    return torch.cat([x, torch.zeros(256)])


@pytest.mark.parametrize("signed", [True, False])
def test_torch_quantiser_equals_reference_to_the_bit(signed):
    x = nasty()
    if not signed:
        x = x.abs()  # sqrt(exp_avg_sq) is >= 0 or NaN
    codes, scales = moments.quantize(x, signed)
    rcodes, rscales = ref_quantize(x, signed)
    assert torch.equal(codes, rcodes)
    assert torch.equal(scales.view(torch.int32), rscales.view(torch.int32))
    assert scales[0] == 1.0 and scales[2] == 0 and scales[4] == 0  # block 2: below FLT_MIN; 4: zeros
    back = moments.dequantize(codes, scales, signed)
    ref = ref_dequantize(rcodes, rscales, signed)
    assert torch.equal(torch.isnan(back), torch.isnan(x)) and torch.equal(torch.isnan(ref), torch.isnan(x))
    ok = ~torch.isnan(x)
    assert torch.equal(back[ok].view(torch.int32), ref[ok].view(torch.int32))
    # Re-quantising the dequantised values gives the same codes and scales.
    again, again_s = moments.quantize(back, signed)
    assert torch.equal(again, codes) and torch.equal(again_s, scales)


def test_bad_moment_dtype_is_named():
    p = torch.nn.Parameter(torch.zeros(3))
    for bad in ("int4", "float32", None, torch.bfloat16):
        with pytest.raises(ValueError, match=r"CPUAdamW moment_dtype=.*fp32.*bf16.*int8"):
            CPUAdamW([p], moment_dtype=bad)


def test_functional_scales_checked():
    p, g = torch.zeros(300), torch.zeros(300)
    q = torch.zeros(300, dtype=torch.uint8)
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="exp_avg_scales"):
        adamw_step_([p], [g], [q], [q.clone()], **kw)
    with pytest.raises(ValueError, match=r"exp_avg_sq_scales\[0\] has 1 elements"):
        adamw_step_([p], [g], [q], [q.clone()], exp_avg_scales=[torch.zeros(2)],
                    exp_avg_sq_scales=[torch.zeros(1)], **kw)
    with pytest.raises(TypeError, match="share one dtype"):
        adamw_step_([p], [g], [q], [torch.zeros(300, dtype=torch.bfloat16)], **kw)
    with pytest.raises(ValueError, match="block scales belong to uint8"):
        adamw_step_([p], [g], [torch.zeros(300)], [torch.zeros(300)], exp_avg_scales=[torch.zeros(2)], **kw)


def make_pair(moment_dtype, shapes=((300,), (17, 5), (1,))):
    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    mine = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    return ref, mine, torch.optim.AdamW(ref, lr=1e-2, foreach=False), CPUAdamW(mine, lr=1e-2,
                                                                               moment_dtype=moment_dtype)


def steps(params, opt, n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.mark.parametrize("backend", simd_params(), indirect=True)
@pytest.mark.parametrize("moment_dtype,tol", [("bf16", 2e-3), ("int8", 3e-2)])
def test_cpu_adamw_low_bit_close_to_torch(backend, moment_dtype, tol):
    """Not equal (the moments are rounded), but close: 20 steps of lr 1e-2
    move a parameter by up to ~0.2; the error stays a small part of that."""
    ref, mine, opt_ref, opt = make_pair(moment_dtype)
    steps(ref, opt_ref, 20)
    steps(mine, opt, 20)
    for r, m in zip(ref, mine):
        moved = (r.detach() - m.detach()).abs().max().item()
        assert moved <= tol, f"{moment_dtype}: max |diff| {moved:.3g} > {tol}"
    want = {"bf16": torch.bfloat16, "int8": torch.uint8}[moment_dtype]
    st = opt.state[mine[0]]
    assert st["exp_avg"].dtype == want and st["exp_avg_sq"].dtype == want
    assert ("exp_avg_scale" in st) == (moment_dtype == "int8")


@pytest.mark.parametrize("moment_dtype", ["bf16", "int8"])
def test_state_dict_is_torch_format_and_round_trips(moment_dtype):
    ref, mine, opt_ref, opt = make_pair(moment_dtype)
    steps(mine, opt, 3)
    before = {k: v.clone() for k, v in opt.state[mine[0]].items()}
    sd = opt.state_dict()
    st = sd["state"][0]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
    assert st["exp_avg"].dtype == torch.float32 and st["exp_avg"].shape == mine[0].shape
    m, v = moments.decode(before)
    assert torch.equal(st["exp_avg"], m) and torch.equal(st["exp_avg_sq"], v)
    # torch's AdamW takes it; loading it back gives the same bytes of state.
    opt_ref.load_state_dict(sd)
    opt.load_state_dict(sd)
    for k, t in before.items():
        assert torch.equal(opt.state[mine[0]][k], t), k
    assert opt.state[mine[0]]["exp_avg"].dtype != torch.float32


@pytest.mark.parametrize("moment_dtype", ["bf16", "int8"])
def test_load_torch_state_quantises(moment_dtype):
    ref, mine, opt_ref, opt = make_pair(moment_dtype)
    steps(ref, opt_ref, 3)
    opt.load_state_dict(opt_ref.state_dict())
    for r, m in zip(ref, mine):
        want = moments.encode(opt_ref.state[r]["exp_avg"], opt_ref.state[r]["exp_avg_sq"], moment_dtype)
        for k, t in want.items():
            assert torch.equal(opt.state[m][k], t), k
    steps(mine, opt, 1)  # and steps on from there


def test_fp32_default_state_unchanged():
    ref, mine, opt_ref, opt = make_pair("fp32")
    assert opt.moment_dtype == "fp32"
    steps(ref, opt_ref, 20)
    steps(mine, opt, 20)
    for r, m in zip(ref, mine):
        assert (r.detach() - m.detach()).abs().max().item() <= 1e-6
        assert opt.state[m]["exp_avg"].data_ptr() != opt.state[m]["exp_avg_sq"].data_ptr()
    assert set(opt.state[mine[0]]) == {"step", "exp_avg", "exp_avg_sq"}
    assert opt.state[mine[0]]["exp_avg"].dtype == torch.float32
    assert opt.state_dict()["state"][0]["exp_avg"] is opt.state[mine[0]]["exp_avg"]
