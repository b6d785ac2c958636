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
            got.append(pool.acquire(32 * 1024, timeout=300))

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


# -- release, CUDA registration, fork ------------------------------------------------------------


def _mapped(ptr: int, nbytes: int, maps: str = None) -> bool:
    """True when some mapping of this process (or of ``maps``, a /proc/PID/maps text) overlaps [ptr, ptr+nbytes)."""
    if maps is None:
        with open("/proc/self/maps") as f:
            maps = f.read()
    for line in maps.splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo < ptr + nbytes and ptr < hi:
            return True
    return False


class RecordingLibc:
    """mlock/munlock that succeed and record (name, ptr, n, still mapped at the call)."""

    def __init__(self):
        self.calls = []

    def mlock(self, ptr, n):
        self.calls.append(("mlock", ptr, n, _mapped(ptr, n)))
        return 0

    def munlock(self, ptr, n):
        self.calls.append(("munlock", ptr, n, _mapped(ptr, n)))
        return 0


def test_close_unlocks_then_unmaps_once(monkeypatch):
    libc = RecordingLibc()
    monkeypatch.setattr(hp, "_libc", lambda: libc)
    pool = HostPool(1 << 16, pin="mlock")
    ptr = pool.base_ptr
    assert pool.pinned and pool.pin_method == "mlock"
    pool.close()
    pool.close()  # idempotent
    assert libc.calls == [("mlock", ptr, 1 << 16, True), ("munlock", ptr, 1 << 16, True)]  # unlocked while mapped
    assert not _mapped(ptr, 1 << 16) and not pool.pinned
    with pytest.raises(RuntimeError, match="65536 bytes is closed"):
        pool.acquire(1)


def test_garbage_collection_unlocks_then_unmaps(monkeypatch):
    import gc
    libc = RecordingLibc()
    monkeypatch.setattr(hp, "_libc", lambda: libc)
    pool = HostPool(1 << 16, pin="mlock")
    with pool.acquire(100) as b:
        b.view(torch.uint8).fill_(7)
    ptr = pool.base_ptr
    del pool, b
    gc.collect()
    assert [c[0] for c in libc.calls] == ["mlock", "munlock"] and libc.calls[1][3]
    assert not _mapped(ptr, 1 << 16)


def test_a_live_view_keeps_the_memory_mapped_until_it_goes(monkeypatch):
    import gc
    libc = RecordingLibc()
    monkeypatch.setattr(hp, "_libc", lambda: libc)
    pool = HostPool(1 << 16, pin="mlock")
    ptr = pool.base_ptr
    buf = pool.acquire(400)
    v = buf.view(torch.float32)
    v.fill_(1.5)
    pool.close()
    assert [c[0] for c in libc.calls] == ["mlock", "munlock"]  # unlocked at once
    assert _mapped(ptr, 1 << 16) and float(v.sum()) == 150.0  # but still mapped: no segfault
    del v, buf
    gc.collect()
    assert not _mapped(ptr, 1 << 16)


class FakeCudart:
    """torch.cuda.cudart() stand-in: records each call with the device in effect."""

    def __init__(self, register_code=0):
        self.register_code = register_code
        self.calls = []
        self.device = None

    def cudaHostRegister(self, ptr, n, flags):
        self.calls.append(("register", ptr, n, flags, self.device))
        return self.register_code

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr, self.device))
        return 0

    def cudaError(self, code):
        return code

    def cudaGetErrorString(self, code):
        return {2: "out of memory"}.get(code, "unknown")


@pytest.fixture
def fake_cuda(monkeypatch):
    """A fake CUDA runtime for HostPool: (cudart, list of clear calls)."""
    import contextlib
    cudart = FakeCudart()
    cleared = []

    @contextlib.contextmanager
    def device(index):
        prev, cudart.device = cudart.device, index
        try:
            yield
        finally:
            cudart.device = prev

    monkeypatch.setattr(hp.torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(hp, "_cuda_device", device)
    monkeypatch.setattr(hp, "_cuda_clear_last_error", lambda: cleared.append(cudart.device) or 2)
    monkeypatch.setattr(hp, "_warned", set())
    return cudart, cleared


def test_cuda_registration_under_the_given_device(fake_cuda):
    cudart, cleared = fake_cuda
    pool = HostPool(1 << 16, pin="cuda", device="cuda:1")
    ptr = pool.base_ptr
    assert pool.pinned and pool.pin_method == "cuda" and pool.pin_reason == ""
    assert cudart.calls == [("register", ptr, 1 << 16, 0, 1)]
    pool.close()
    pool.close()
    assert cudart.calls[1:] == [("unregister", ptr, 1)] and not cleared  # once, on device 1, nothing to clear
    assert not _mapped(ptr, 1 << 16)


def test_failed_cuda_registration_clears_the_error_and_stays_usable(fake_cuda):
    cudart, cleared = fake_cuda
    cudart.register_code = 2
    with pytest.warns(RuntimeWarning, match=r"NOT page-locked: cudaHostRegister of 65536 bytes on cuda:1 failed: "
                                            r"CUDA error 2 \(out of memory\)"):
        pool = HostPool(1 << 16, pin="cuda", device=1)
    assert cleared == [1]  # cleared once, on the thread and device of the failed call
    assert not pool.pinned and pool.pin_method == "none" and "CUDA error 2" in pool.pin_reason
    with pool.acquire(4000) as b:  # usable, unpinned
        b.view(torch.uint8).fill_(3)
        assert int(b.view(torch.uint8).sum()) == 3 * 4000
    pool.close()
    assert [c[0] for c in cudart.calls] == ["register"]  # never registered, so never unregistered


def test_failed_registration_says_when_the_error_could_not_be_cleared(fake_cuda, monkeypatch):
    cudart, _ = fake_cuda
    cudart.register_code = 2
    monkeypatch.setattr(hp, "_cuda_clear_last_error", lambda: None)
    with pytest.warns(RuntimeWarning):
        pool = HostPool(1 << 16, pin="cuda", device=0)
    assert "could not be cleared" in pool.pin_reason
    pool.close()


def test_device_must_be_cuda():
    with pytest.raises(ValueError, match="device='cpu'"):
        HostPool(1 << 16, device="cpu")


def test_runtime_functions_come_from_libraries_already_loaded():
    import os
    assert hp._runtime_function("libc.so", "getpid")() == os.getpid()
    assert hp._runtime_function("libc.so", "no_such_symbol_here") is None
    assert hp._runtime_function("libno-such-library.so", "getpid") is None
    if hp._loaded_library("libcudart.so") is None:  # a CPU build: nothing to clear, and no error raised
        assert hp._cuda_clear_last_error() is None


@pytest.mark.parametrize("pin", ["none", "mlock"])
def test_forked_child_does_not_inherit_the_pool(pin):
    import mmap
    import os
    pool = HostPool(1 << 20, pin=pin)
    assert pool.fork_excluded
    control = mmap.mmap(-1, 1 << 16)  # no MADV_DONTFORK: the child must see this one
    control_ptr = torch.frombuffer(control, dtype=torch.uint8).data_ptr()
    with pool.acquire(4096) as b:
        b.view(torch.uint8).fill_(5)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: report what is mapped, close its (absent) pool, leave without cleanup
            try:
                with open("/proc/self/maps") as f:
                    maps = f.read()
                pool.close()  # neither unlocks nor unmaps in the child: keeps the mmap object instead
                os.write(w, f"{len(hp._forked_away)}\n{maps}".encode())
            finally:
                os._exit(0)
        os.close(w)
        chunks = []
        while chunk := os.read(r, 1 << 16):
            chunks.append(chunk)
        os.close(r)
        assert os.waitpid(pid, 0)[1] == 0
        kept, maps = b"".join(chunks).decode().split("\n", 1)
        assert kept == "1"
        assert _mapped(control_ptr, 1 << 16, maps), "the check itself is broken"
        assert not _mapped(pool.base_ptr, pool.capacity_bytes, maps)
        assert int(b.view(torch.uint8).sum()) == 5 * 4096  # the parent's pool is intact
    pool.close()
