import pytest
import torch

import infinity


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts seeded and with torch's thread count as it found it:
    a test that sets threads (``infinity train``'s ``torch_threads``) must not
    change the rounding of the tests after it."""
    threads = torch.get_num_threads()
    torch.manual_seed(0)
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def simd_params():
    """Every ISA variant this CPU and build support, plus the torch fallback."""
    return infinity.native.simd_levels() + ["fallback"]


@pytest.fixture
def backend(request, monkeypatch):
    """Selects a kernel variant for the duration of a test ("fallback" = pure torch)."""
    level = request.param
    if level == "fallback":
        monkeypatch.setattr(infinity.native, "available", lambda: False)
        yield level
    else:
        with infinity.native.use_simd(level):
            yield level
