"""The host tier's device and release, on the CPU (a fake CUDA runtime)."""

import contextlib

import pytest
import torch

from infinity.engine.tiers import HostTier
from infinity.io import host_pool as hp


def test_host_tier_pins_on_its_device_and_closes_once(monkeypatch):
    calls = []

    class Cudart:
        def cudaHostRegister(self, ptr, n, flags):
            calls.append(("register", dev[0]))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", dev[0]))
            return 0

    dev = [None]

    @contextlib.contextmanager
    def device(index):
        dev[0] = index
        yield
        dev[0] = None

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    monkeypatch.setattr(hp, "_cuda_device", device)
    tier = HostTier(1 << 20, 1 << 21, pin=True, device=torch.device("cuda", 3))
    t = tier.alloc(100, torch.float32)
    t.fill_(1.0)
    assert tier.pinned and calls == [("register", 3)]
    peak = tier.peak_bytes
    tier.close()
    tier.close()
    assert calls == [("register", 3), ("unregister", 3)] and tier.peak_bytes == peak and not tier.pinned
    with pytest.raises(RuntimeError, match="tier is closed"):
        tier.acquire(10, torch.float32)
    assert float(t.sum()) == 100.0  # a live view keeps the (unlocked) mapping until it goes


def test_host_tier_on_cpu_ignores_the_device():
    tier = HostTier(1 << 16, 1 << 16, pin=False, device=torch.device("cpu"))
    assert tier.pool.pin_method == "none"
    tier.close()
