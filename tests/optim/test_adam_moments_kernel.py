"""The native AdamW over bf16 and block-scaled 8-bit moments against a plain
PyTorch reference (tests/moment_reference.py), bit for bit, on every ISA.
See [Note: 8-bit moments] and [Note: bf16 moments] in native/src/adam_q8.inc."""

import math

import pytest
import torch

from infinity.optim import adamw_step_, moments
from infinity.system import native
from moment_reference import QB, ref_dequantize, ref_quantize, ref_step

pytestmark = pytest.mark.skipif(not native.available(), reason="native library not built")

# Sizes around vector widths (8, 16) and blocks (256): short last blocks, one element, several blocks.
SIZES = [1, 7, 15, 17, 255, 256, 257, 513, 4097]
HP = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)


def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same(a, b, what):
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


def run_both(n, gdtype, mdtype, odtype, adamw_mode, grads, level, p0=None, state0=None):
    """Steps the kernel (at ``level``) and the reference from the same start
    with the given per-step gradients; asserts equal bytes after every step."""
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen) if p0 is None else p0.clone()
    state = make_state(n, mdtype) if state0 is None else state0
    rp, rstate = p.clone(), clone_state(state)
    out = torch.empty(n, dtype=odtype) if odtype is not None else None
    rout = out.clone() if out is not None else None
    for step, g in enumerate(grads, 1):
        kw = dict(HP, step=step, adamw_mode=adamw_mode)
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
