"""HostPool: alignment, the hard budget (block or raise), reuse, locking and its refusal."""

import threading
import time
import warnings

import pytest
import torch

from infinity.io import HostPool, PoolExhausted
from infinity.io import host_pool as hp


def test_aligned_buffers_and_budget():
    with HostPool(1 << 20) as pool:
        bufs = [pool.acquire(n) for n in (1, 4095, 4096, 100_000)]
        for b in bufs:
            assert b.ptr % 4096 == 0
            assert b.capacity % 4096 == 0 and b.capacity >= b.nbytes
            assert b.tensor.numel() == b.nbytes and b.tensor.data_ptr() == b.ptr
        assert pool.used_bytes == sum(b.capacity for b in bufs)
        with pytest.raises(PoolExhausted, match="more than the whole budget"):
            pool.acquire((1 << 20) + 1)
        big = pool.free_bytes + 4096
        with pytest.raises(PoolExhausted, match="free"):
            pool.acquire(big, block=False)
        with pytest.raises(PoolExhausted):
            pool.acquire(big, timeout=0.05)
        for b in bufs:
            b.release()
        assert pool.used_bytes == 0
        assert pool.acquire(1 << 20, block=False).capacity == 1 << 20  # whole budget again after reuse


def test_blocking_acquire_waits_for_release():
    with HostPool(64 * 1024) as pool:
        held = pool.acquire(64 * 1024)
        got = []

        def taker():
            got.append(pool.acquire(32 * 1024, timeout=10))

        t = threading.Thread(target=taker)
        t.start()
        time.sleep(0.05)
        assert not got
        held.release()
        t.join()
        assert got and got[0].nbytes == 32 * 1024


def test_views_share_memory():
    with HostPool(1 << 16) as pool:
        with pool.acquire(4 * 100) as b:
            v = b.view(torch.float32, (10, 10))
            v.fill_(2.5)
            assert b.tensor.view(torch.float32)[99] == 2.5
            assert pool.owns(v.data_ptr(), 400)
        assert pool.used_bytes == 0


def test_locked_or_warned():
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        pool = HostPool(1 << 16, pin="mlock")
    assert pool.pinned == (pool.pin_method == "mlock")
    assert pool.pinned or "mlock" in pool.pin_reason
    pool.close()


def test_mlock_refused_warns_once_with_reason(monkeypatch):
    class FakeLibc:
        def mlock(self, ptr, n):
            import ctypes
            ctypes.set_errno(12)  # ENOMEM: what RLIMIT_MEMLOCK gives
            return -1

        def munlock(self, ptr, n):
            return 0

    monkeypatch.setattr(hp, "_libc", lambda: FakeLibc())
    monkeypatch.setattr(hp, "_warned", set())
    with pytest.warns(RuntimeWarning, match=r"NOT page-locked: mlock of 65536 bytes failed.*ulimit -l"):
        pool = HostPool(1 << 16, pin="mlock")
    assert not pool.pinned and pool.pin_method == "none" and "memlock limit" in pool.pin_reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second refusal for the same reason stays silent
        HostPool(1 << 16, pin="mlock").close()
    with pool.acquire(100) as b:  # still usable, still aligned
        assert b.ptr % 4096 == 0
    pool.close()
