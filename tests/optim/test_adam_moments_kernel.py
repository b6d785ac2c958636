"""The native AdamW over bf16 and block-scaled 8-bit moments against a plain
PyTorch reference (tests/moment_reference.py), bit for bit, on every ISA.
See [Note: 8-bit moments] and [Note: bf16 moments] in native/src/adam_q8.inc."""

import math

import pytest
import torch

from infinity.optim import adamw_step_, moments
from infinity.system import native
from moment_reference import QB, ref_quantize, ref_step

pytestmark = pytest.mark.skipif(not native.available(), reason="native library not built")

# Sizes around vector widths (8, 16) and blocks (256): short last blocks, one element, several blocks.
SIZES = [1, 7, 15, 17, 255, 256, 257, 513, 4097]
HP = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same(a, b, what):
    """Same bytes; NaNs (whose payloads torch's conversions do not keep) only at the same places."""
    if a.is_floating_point():
        nan = torch.isnan(a)
        assert torch.equal(nan, torch.isnan(b)), f"{what}: NaNs at different places"
        a, b = a[~nan], b[~nan]
    assert torch.equal(bits(a), bits(b)), f"{what}: {int((bits(a) != bits(b)).sum())} elements differ"


def make_state(n, mdtype, seed=0, m_scale=0.1, v_scale=0.01):
    """A starting state (fp32 moments encoded by the reference), as tensors."""
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(n, generator=gen) * m_scale
    v = torch.rand(n, generator=gen) * v_scale
    if mdtype == "bf16":
        return {"exp_avg": m.to(torch.bfloat16), "exp_avg_sq": v.to(torch.bfloat16)}
    qm, sm = ref_quantize(m, True)
    qw, sw = ref_quantize(v.double().sqrt().float(), False)
    return {"exp_avg": qm, "exp_avg_sq": qw, "exp_avg_scale": sm, "exp_avg_sq_scale": sw}


def kernel_step(p, g, state, out=None, **kw):
    q8 = state["exp_avg"].dtype == torch.uint8
    adamw_step_([p], [g], [state["exp_avg"]], [state["exp_avg_sq"]], outs=[out] if out is not None else None,
                exp_avg_scales=[state["exp_avg_scale"]] if q8 else None,
                exp_avg_sq_scales=[state["exp_avg_sq_scale"]] if q8 else None, **kw)


def clone_state(state):
    return {k: t.clone() for k, t in state.items()}


def run_both(n, gdtype, mdtype, odtype, adamw_mode, grads, level, p0=None, state0=None, hp=HP):
    """Steps the kernel (at ``level``) and the reference from the same start
    with the given per-step gradients; asserts equal bytes after every step."""
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen) if p0 is None else p0.clone()
    state = make_state(n, mdtype) if state0 is None else state0
    rp, rstate = p.clone(), clone_state(state)
    out = torch.empty(n, dtype=odtype) if odtype is not None else None
    rout = out.clone() if out is not None else None
    for step, g in enumerate(grads, 1):
        kw = dict(hp, step=step, adamw_mode=adamw_mode)
        with native.use_simd(level):
            kernel_step(p, g.to(gdtype), state, out, **kw)
        ref_step(rp, g.to(gdtype), rstate, rout, **kw)
        where = f"{level} n={n} step {step}"
        assert_same(p, rp, f"param, {where}")
        for k in state:
            assert_same(state[k], rstate[k], f"{k}, {where}")
        if out is not None:
            assert_same(out, rout, f"copy-out, {where}")
    return p, state


@pytest.mark.parametrize("level", native.simd_levels())
@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mdtype", ["bf16", "int8"])
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_kernel_equals_reference(level, gdtype, mdtype, adamw_mode):
    odtype = {torch.float32: torch.bfloat16, torch.bfloat16: None, torch.float16: torch.float16}[gdtype]
    for n in SIZES:
        gen = torch.Generator().manual_seed(n + 1)
        grads = [torch.randn(n, generator=gen) for _ in range(3)]
        run_both(n, gdtype, mdtype, odtype, adamw_mode, grads, level)


@pytest.mark.parametrize("mdtype", ["bf16", "int8"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_many_tensors_one_call_every_thread_count(mdtype, threads):
    """Tensors of many sizes in one call (thread bounds fall inside tensors,
    on block edges for 8-bit): each gets the bytes of its own reference step,
    on every level."""
    sizes = [5, 70000, 1, 300, 33001, 4097]
    q8 = mdtype == "int8"
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(7 + n)).bfloat16() for n in sizes]
    ref = []
    for i, n in enumerate(sizes):
        rp, rstate, rout = torch.randn(n, generator=torch.Generator().manual_seed(n)), make_state(n, mdtype, i), \
            torch.empty(n, dtype=torch.bfloat16)
        ref_step(rp, grads[i], rstate, rout, step=1, **HP)
        ref.append((rp, rstate, rout))
    for level in native.simd_levels():
        ps = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in sizes]
        states = [make_state(n, mdtype, i) for i, n in enumerate(sizes)]
        outs = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
        with native.use_simd(level):
            adamw_step_(ps, grads, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states], outs=outs,
                        exp_avg_scales=[s["exp_avg_scale"] for s in states] if q8 else None,
                        exp_avg_sq_scales=[s["exp_avg_sq_scale"] for s in states] if q8 else None,
                        num_threads=threads, step=1, **HP)
        for i, (rp, rstate, rout) in enumerate(ref):
            assert_same(ps[i], rp, f"{level} param of tensor {i}")
            assert_same(outs[i], rout, f"{level} copy-out of tensor {i}")
            for k in rstate:
                assert_same(states[i][k], rstate[k], f"{level} {k} of tensor {i}")


def tie_and_special_grads():
    """Five blocks: exp_avg code midpoints (with beta1 = beta2 = 0 and a zero
    state, m = g and sqrt(v) = |g|, so these are exact ties of the quantiser);
    sqrt(exp_avg_sq) code midpoints; special values; a block below FLT_MIN;
    a block of zeros."""
    from moment_reference import M_TABLE, W_TABLE
    mid_m = ((M_TABLE[:-1] + M_TABLE[1:]) / 2).float()
    mid_w = ((W_TABLE[:-1] + W_TABLE[1:]) / 2).float()
    b0 = torch.cat([mid_m, -mid_m, torch.tensor([1.0, -0.75])])
    b1 = torch.cat([mid_w, torch.tensor([1.0])])
    special = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-40, -1e-45, 2.0 ** -126, 1e18, -1e30,
                            3e-39, 1.0, -2.0 ** -20, 2.0 ** -17 * 3, 2.0 ** -18 * 5])
    b2 = torch.cat([special, torch.randn(QB - special.numel(), generator=torch.Generator().manual_seed(1))])
    b3 = torch.rand(QB, generator=torch.Generator().manual_seed(2)) * 1e-39
    g = torch.cat([b0, torch.zeros(QB - b0.numel()), b1, torch.zeros(QB - b1.numel()), b2, b3, torch.zeros(QB)])
    return g.float()


@pytest.mark.parametrize("level", native.simd_levels())
@pytest.mark.parametrize("mdtype", ["bf16", "int8"])
def test_ties_specials_denormals_zero_and_huge_gradients(level, mdtype):
    g = tie_and_special_grads()
    n = g.numel()
    zero = {"exp_avg": torch.zeros(n, dtype=torch.uint8 if mdtype == "int8" else torch.bfloat16)}
    zero["exp_avg_sq"] = zero["exp_avg"].clone()
    if mdtype == "int8":
        zero.update(exp_avg_scale=torch.zeros(n // QB), exp_avg_sq_scale=torch.zeros(n // QB))
    hp = dict(HP, beta1=0.0, beta2=0.0)
    p, state = run_both(n, torch.float32, mdtype, torch.bfloat16, True, [g], level, state0=zero, hp=hp)
    if mdtype == "int8":  # the ties went to the even codes; tiny and zero blocks have scale 0
        even = [k + k % 2 for k in range(120)]
        assert state["exp_avg"][:120].tolist() == even
        assert state["exp_avg"][120:240].tolist() == [0x80 | k for k in even]
        assert state["exp_avg_sq"][QB:QB + 240].tolist() == [k + k % 2 for k in range(240)]
        assert state["exp_avg_scale"].tolist()[3:] == [0.0, 0.0]
    p, state = run_both(n, torch.float32, mdtype, torch.bfloat16, True, [g * 0.5, g], level, p0=p,
                        state0=state, hp=hp)
    # Two more steps with the usual betas on top, still equal to the reference.
    run_both(n, torch.float32, mdtype, None, False, [g, -g], level, p0=p, state0=state)


@pytest.mark.parametrize("level", native.simd_levels())
@pytest.mark.parametrize("mdtype", ["bf16", "int8"])
def test_nonfinite_gradients_spoil_their_own_elements_as_fp32_does(level, mdtype):
    """NaN and +-Inf gradients: the same params turn NaN, and the same moments
    non-finite, as with fp32 moments; every other element of their blocks stays finite."""
    n = 1000
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(n, generator=gen)
    g[3], g[50], g[77], g[300] = math.nan, math.inf, -math.inf, math.inf
    p32, m32, v32 = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    p = p32.clone()
    state = make_state(n, mdtype)
    state = {k: torch.zeros_like(t) for k, t in state.items()}
    with native.use_simd(level):
        for step in range(1, 4):
            adamw_step_([p32], [g], [m32], [v32], step=step, **HP)
            kernel_step(p, g, state, step=step, **HP)
            m, v = moments.decode(state)
            for mine, fp32, what in ((p, p32, "param"), (m, m32, "exp_avg"), (v, v32, "exp_avg_sq")):
                assert torch.equal(torch.isnan(mine), torch.isnan(fp32)), f"{what} NaNs differ at step {step}"
                assert torch.equal(torch.isinf(mine), torch.isinf(fp32)), f"{what} Infs differ at step {step}"
    assert torch.isnan(p[[3, 50, 77, 300]]).all()
    assert int(torch.isfinite(p).sum()) == n - 4
