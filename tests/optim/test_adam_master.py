"""The native AdamW over a bf16 master against a plain reference
(tests/master_reference.py), bit for bit, on every ISA, grad dtype and moment
dtype; the rounding's independence of threads and shard splits; its errors.
See [Note: stochastic rounding of the bf16 master] in native/src/adam_bf16p.inc."""

import contextlib
import math

import pytest
import torch

from infinity.optim import adamw_step_
from infinity.system import native
from master_reference import ref_master_step, sr_round
from moment_reference import ref_quantize

SIZES = [1, 15, 16, 17, 4097]
HP = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
GDTYPES = [torch.bfloat16, torch.float16, torch.float32]
MDTYPES = ["fp32", "bf16", "int8"]
BACKENDS = native.simd_levels() + ["fallback"]


def backend_ctx(backend, monkeypatch):
    if backend == "fallback":
        monkeypatch.setattr(native, "available", lambda: False)
        return contextlib.nullcontext()
    return native.use_simd(backend)


def make_state(n, mdtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    m, v = torch.randn(n, generator=gen) * 0.01, torch.rand(n, generator=gen) * 1e-4
    if mdtype == "fp32":
        return {"exp_avg": m, "exp_avg_sq": v}
    if mdtype == "bf16":
        return {"exp_avg": m.bfloat16(), "exp_avg_sq": v.bfloat16()}
    qm, sm = ref_quantize(m, True)
    qw, sw = ref_quantize(v.double().sqrt().float(), False)
    return {"exp_avg": qm, "exp_avg_sq": qw, "exp_avg_scale": sm, "exp_avg_sq_scale": sw}


def kernel_step(ps, gs, states, **kw):
    q8 = states[0]["exp_avg"].dtype == torch.uint8
    adamw_step_(ps, gs, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                exp_avg_scales=[s["exp_avg_scale"] for s in states] if q8 else None,
                exp_avg_sq_scales=[s["exp_avg_sq_scale"] for s in states] if q8 else None, **kw)


def bits(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same(a, b, what):
    assert torch.equal(bits(a), bits(b)), f"{what}: {int((bits(a) != bits(b)).sum())} elements differ"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gdtype", GDTYPES)
@pytest.mark.parametrize("mdtype", MDTYPES)
def test_kernel_equals_reference(backend, gdtype, mdtype, monkeypatch):
    """Three steps of tensors of awkward sizes in one call, each with its own
    stream and an offset (8-bit: on a block edge; else near 2^32, so a tensor
    crosses the high word of its indices), equal to the reference's bytes."""
    offsets = [0, 256 * 3, 2 ** 32 - 7 if mdtype != "int8" else 2 ** 32, 5 * 256, 2 ** 32 - 4096]
    ps = [(torch.randn(n, generator=torch.Generator().manual_seed(n)) * 0.5).bfloat16() for n in SIZES]
    states = [make_state(n, mdtype, i) for i, n in enumerate(SIZES)]
    rps, rstates = [p.clone() for p in ps], [{k: t.clone() for k, t in s.items()} for s in states]
    streams = [11 * i + 1 for i in range(len(SIZES))]
    for step in (1, 2, 3):
        gs = [torch.randn(n, generator=torch.Generator().manual_seed(100 * step + n)).to(gdtype) for n in SIZES]
        with backend_ctx(backend, monkeypatch):
            kernel_step(ps, gs, states, step=step, seed=1234, streams=streams, offsets=offsets, **HP)
        monkeypatch.undo()
        for i in range(len(SIZES)):
            ref_master_step(rps[i], gs[i], rstates[i], seed=1234, stream=streams[i], step=step, offset=offsets[i],
                            **HP)
            assert_same(ps[i], rps[i], f"{backend} param {i} (n={SIZES[i]}) step {step}")
            for k in states[i]:
                assert_same(states[i][k], rstates[i][k], f"{backend} {k} {i} step {step}")


@pytest.mark.parametrize("mdtype", MDTYPES)
def test_threads_and_shard_splits_give_the_same_bytes(mdtype):
    """A tensor stepped whole (1, 2, 3 threads, every level) and as two shards
    with their offsets, in one call and in two: the same bytes."""
    n, cut = 70000, 256 * 101
    p0 = torch.randn(n, generator=torch.Generator().manual_seed(3)).bfloat16()
    g = torch.randn(n, generator=torch.Generator().manual_seed(4)).bfloat16()
    hp = dict(HP, step=5, seed=99)
    want = None
    for level in native.simd_levels():
        for threads in (1, 2, 3):
            p, st = p0.clone(), make_state(n, mdtype)
            with native.use_simd(level):
                kernel_step([p], [g], [st], num_threads=threads, streams=[7], **hp)
            want = want if want is not None else (p, st)
            assert_same(p, want[0], f"{level} {threads} threads")
            for k in st:
                assert_same(st[k], want[1][k], f"{level} {threads} threads {k}")
    p, st = p0.clone(), make_state(n, mdtype)
    halves = [(0, cut), (cut, n)]
    shards = [{k: t[a // 256 if k.endswith("scale") else a:-(-b // 256) if k.endswith("scale") else b]
               for k, t in st.items()} for a, b in halves]
    kernel_step([p[:cut], p[cut:]], [g[:cut], g[cut:]], shards, streams=[7, 7], offsets=[0, cut], **hp)
    assert_same(p, want[0], "two shards in one call")
    p2 = p0.clone()
    st2 = make_state(n, mdtype)
    for a, b in reversed(halves):
        sh = {k: t[a // 256 if k.endswith("scale") else a:-(-b // 256) if k.endswith("scale") else b]
              for k, t in st2.items()}
        kernel_step([p2[a:b]], [g[a:b]], [sh], streams=[7], offsets=[a], **hp)
    assert_same(p2, want[0], "two shards in two calls")
    for k in st:
        assert_same(st[k], want[1][k], f"shards {k}")
        assert_same(st2[k], want[1][k], f"shards in two calls {k}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_values_as_torch_bf16(backend, monkeypatch):
    """NaN gradients give NaN (0x7FC0) masters; Inf params stay Inf; NaN params stay NaN."""
    n = 40
    p = torch.linspace(-2, 2, n).bfloat16()
    p[5], p[6], p[7] = math.inf, -math.inf, math.nan
    g = torch.ones(n)
    g[3] = math.nan
    st = make_state(n, "fp32")
    with backend_ctx(backend, monkeypatch):
        kernel_step([p], [g], [st], step=1, seed=0, **HP)
    assert bits(p)[3] == 0x7FC0 and bits(p)[7] == 0x7FC0
    assert p[5] == math.inf and p[6] == -math.inf
    assert int(torch.isfinite(p.float()).sum()) == n - 4


def test_rounding_is_unbiased_and_varies_by_step_stream_and_seed():
    """A value 3/4 of the way from one bf16 to the next rounds up about 3/4 of
    the time (deterministic: one seed, 2^16 elements; 6 standard deviations);
    each of seed, stream and step changes the bits."""
    x = torch.full((1 << 16,), 1.0 + 3 * 2.0 ** -9)  # bf16 neighbours 1 and 1 + 2^-7
    r = sr_round(x, 1, 0, 1, 0).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2.0 ** -7}
    up = float((r > x).float().mean())
    assert 0.74 < up < 0.76
    base = bits(sr_round(x, 1, 0, 1, 0))
    for args in ((2, 0, 1, 0), (1, 1, 1, 0), (1, 0, 2, 0)):
        assert not torch.equal(base, bits(sr_round(x, *args)))


def test_errors_name_the_fix():
    p, g, st = torch.zeros(300, dtype=torch.bfloat16), torch.zeros(300), make_state(300, "int8")
    with pytest.raises(ValueError, match="seed="):
        kernel_step([p], [g], [st], step=1, **HP)
    with pytest.raises(ValueError, match="block edge"):
        kernel_step([p], [g], [st], step=1, seed=0, offsets=[100], **HP)
    with pytest.raises(ValueError, match="outs"):
        kernel_step([p], [g], [st], step=1, seed=0, outs=[torch.zeros(300)], **HP)
    with pytest.raises(ValueError, match="bf16 master"):
        kernel_step([p.float()], [g], [st], step=1, seed=0, **HP)
    with pytest.raises(TypeError, match="params\\[1\\]"):
        kernel_step([p, p.float()], [g, g], [st, st], step=1, seed=0, **HP)
