"""The native fixed-split sum of squares (inf_sum_squares): the same bits on
every ISA, thread count and calling thread; the order its Note documents;
float64's result within rounding; NaN/Inf; empty ranges; bad input."""

import math
import struct
import threading

import pytest
import torch

from infinity.optim.sumsq import sum_of_squares
from infinity.system import native

pytestmark = pytest.mark.skipif(not native.available(), reason="native library not built")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SIZES = [0, 1, 15, 16, 17, 33, 4097, 65536, 65536 + 5, 3 * 65536 + 17]
BLOCK, LANES = 1 << 16, 16  # kSumBlock (sumsq.cpp), kSumLanes (sumsq_kernel.inc)


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _ranges(n, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n + 7, generator=gen) * torch.logspace(-4, 3, n + 7)[torch.randperm(n + 7, generator=gen)])
    x = x.to(dtype)
    return [x[:n], x[n:n + 3], x[n + 3:]]  # several ranges, some starting off a vector boundary


def _model(ranges) -> float:
    """The Note's order, in float64 torch ops that are each exact IEEE steps."""
    total = torch.zeros((), dtype=torch.float64)
    for r in ranges:
        d = r.double()
        for s in range(0, d.numel(), BLOCK):
            blk = d[s:s + BLOCK]
            pad = torch.cat([blk, blk.new_zeros(-blk.numel() % LANES)]).view(-1, LANES)
            acc = torch.zeros(LANES, dtype=torch.float64)
            for row in pad:
                acc = acc + row * row
            w = LANES // 2
            while w >= 1:
                acc = torch.cat([acc[:w] + acc[w:2 * w], acc[2 * w:]])
                w //= 2
            total = total + acc[0]
    return float(total)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_isa_gives_the_scalar_bytes(dtype):
    levels = native.simd_levels()
    for n in SIZES:
        ranges = _ranges(n, dtype, seed=n)
        got = {}
        for level in levels:
            with native.use_simd(level):
                got[level] = _bits(sum_of_squares(ranges))
        assert len(set(got.values())) == 1, f"n={n}: {got}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_order_is_the_notes(dtype):
    for n in (1, 17, 4097, 65536 + 5):
        ranges = _ranges(n, dtype, seed=n)
        for level in native.simd_levels():
            with native.use_simd(level):
                assert _bits(sum_of_squares(ranges)) == _bits(_model(ranges)), (level, n)


def test_threads_and_the_calling_thread_do_not_change_the_bits():
    ranges = _ranges(5 * BLOCK + 123, torch.float32, seed=1) + _ranges(3 * BLOCK, torch.float32, seed=2)
    ref = _bits(sum_of_squares(ranges, num_threads=1))
    for threads in (0, 2, 3, 7):
        assert _bits(sum_of_squares(ranges, num_threads=threads)) == ref, threads
    out = []
    t = threading.Thread(target=lambda: out.append(_bits(sum_of_squares(ranges, num_threads=1))))
    t.start()
    t.join()
    assert out == [ref]


@pytest.mark.parametrize("dtype", DTYPES)
def test_float64_result_within_rounding(dtype):
    for n in SIZES:
        ranges = _ranges(n, dtype, seed=3 * n)
        exact = math.fsum(v * v for r in ranges for v in r.double().tolist())
        got = sum_of_squares(ranges)
        count = sum(r.numel() for r in ranges)
        # Every term is >= 0: the relative error of any order of additions is below count * 2^-53.
        assert abs(got - exact) <= count * 2.0 ** -53 * exact, (n, got, exact)
        torch_ref = torch.cat([r.double() for r in ranges]).square().sum().item()
        assert got == pytest.approx(torch_ref, rel=1e-12, abs=0.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_propagate(dtype):
    for bad, check in ((float("nan"), math.isnan), (float("inf"), lambda v: v == math.inf),
                       (float("-inf"), lambda v: v == math.inf)):
        for n, at in ((1, 0), (40, 33), (BLOCK + 9, BLOCK + 2)):
            x = torch.ones(n, dtype=dtype)
            x[at] = bad
            for level in native.simd_levels():
                with native.use_simd(level):
                    assert check(sum_of_squares([x])), (bad, n, level)


def test_empty():
    assert _bits(sum_of_squares([])) == _bits(0.0)
    assert _bits(sum_of_squares([torch.empty(0), torch.ones(4)[4:]])) == _bits(0.0)
    assert sum_of_squares([torch.empty(0), torch.tensor([3.0]), torch.empty(0)]) == 9.0


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="tensor 1 is torch.float16"):
        sum_of_squares([torch.ones(3), torch.ones(3, dtype=torch.float16)])
    with pytest.raises(ValueError, match="tensor 0 is torch.float64"):
        sum_of_squares([torch.ones(3, dtype=torch.float64)])
    with pytest.raises(ValueError, match="contiguous CPU tensor"):
        sum_of_squares([torch.ones(4, 4).t()])
