"""ExtentAllocator: the SwapStore's and HostPool's placement policy, checked against a brute-force model."""

import random

import pytest

from infinity.io import ExtentAllocator


def test_alloc_free_merge_and_reuse():
    a = ExtentAllocator(64 * 4096)
    x = a.alloc(1)          # rounds up to one 4 KiB unit
    y = a.alloc(4097)       # two units
    z = a.alloc(4096)
    assert (x, y, z) == (0, 4096, 3 * 4096)
    assert a.used_bytes == 4 * 4096
    a.free(y)
    assert a.alloc(8192) == 4096          # the hole is reused first (first fit)
    a.free(x)
    a.free(4096)
    a.free(z)
    assert a.used_bytes == 0 and a.largest_free() == 64 * 4096  # neighbours merged back into one range
    assert a.alloc(65 * 4096) is None
    with pytest.raises(ValueError):
        a.free(12345)


def test_grow_extends_the_last_free_range():
    a = ExtentAllocator(0)
    assert a.alloc(1) is None
    a.grow(8192)
    assert a.alloc(8192) == 0
    a.grow(16384)
    assert a.alloc(4096) == 8192
    with pytest.raises(ValueError):
        a.grow(100)


def test_random_against_model():
    rng = random.Random(0)
    unit = 4096
    cap = 256
    a = ExtentAllocator(cap * unit)
    used = [False] * cap
    live = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            size = live.pop(off)
            assert a.free(off) == size
            for u in range(off // unit, (off + size) // unit):
                used[u] = False
        else:
            n = rng.randint(1, 20 * unit)
            units = -(-n // unit)
            off = a.alloc(n)
            # Model: first fit over the unit bitmap.
            expect = None
            run = 0
            for u in range(cap):
                run = run + 1 if not used[u] else 0
                if run == units:
                    expect = (u - units + 1) * unit
                    break
            assert off == expect
            if off is not None:
                live[off] = units * unit
                for u in range(off // unit, off // unit + units):
                    assert not used[u]
                    used[u] = True
        assert a.used_bytes == sum(used) * unit


def test_alloc_high_takes_the_top_and_classes_do_not_interleave():
    a = ExtentAllocator(100 * 4096, 4096)
    lo = [a.alloc(4 * 4096) for _ in range(3)]
    hi = [a.alloc_high(2 * 4096) for _ in range(3)]
    assert lo == [0, 4 * 4096, 8 * 4096]
    assert hi == [98 * 4096, 96 * 4096, 94 * 4096]
    a.free(lo[1])
    a.free(hi[1])
    # Each class's hole is reused by the same class.
    assert a.alloc(4 * 4096) == lo[1]
    assert a.alloc_high(2 * 4096) == hi[1]
    assert a.used_bytes == 18 * 4096
