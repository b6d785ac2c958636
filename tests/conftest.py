import pytest
import torch

import infinity


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


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
