"""The CUDA path of the engine (copy streams, events, pinned host pool),
against plain PyTorch on the same GPU: the reference runs the engine's kernels
(TF32 off), so the CPU suite's rtol of 1e-5 applies. Skipped without a GPU;
scripts/gpu/check.sh runs it there. INFINITY_TEST_DEVICE=cpu runs the same
tests on the CPU (the dry run of scripts/gpu/check.sh proves the file that way)."""

import os

# Before CUDA starts: cuBLAS is only reproducible across streams with a fixed workspace.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

import infinity  # noqa: E402
from engine_utils import (add_lag, cuda_lag, deterministic, min_device_budget, set_ieee_fp32, small_gpt,  # noqa: E402
                          train_pair, unequal_net, unit_bytes)

DEVICE = os.environ.get("INFINITY_TEST_DEVICE", "cuda")
ON_CUDA = DEVICE.startswith("cuda")
pytestmark = pytest.mark.skipif(ON_CUDA and not torch.cuda.is_available(), reason="needs CUDA")

UB = unit_bytes(small_gpt())
# On the CPU the file only has to prove itself (scripts/gpu/check.sh --dry-run): fewer steps.
STEPS, RACE_STEPS = (10, 6) if ON_CUDA else (4, 3)


@pytest.fixture(autouse=True)
def _ieee_fp32():
    set_ieee_fp32()  # the reference and the engine must run the same fp32 kernels
    yield


def cfg(**kw):
    base = dict(device=DEVICE, dtype="fp32", device_memory=8 * UB, host_memory="256MiB", prefetch_depth=2)
    base.update(kw)
    if base.get("offload_optimizer") == "none":
        base["device_memory"] = 64 << 20
    return infinity.Config(**base)


@pytest.mark.parametrize("offload_optimizer", ["host", "none"])
@pytest.mark.parametrize("overlap", ["step", "backward"])
def test_cuda_parity(offload_optimizer, overlap):
    model, opt, _, _ = train_pair(small_gpt, cfg(offload_optimizer=offload_optimizer, overlap=overlap),
                                  steps=STEPS, device=DEVICE)
    s = infinity.stats(model)
    assert s["peak_bytes"]["device"] <= s["budget_bytes"]["device"]
    if offload_optimizer == "host" and ON_CUDA:
        assert s["host_pinned"]


def test_cuda_bf16_trains():
    m, opt = infinity.initialize(small_gpt(), cfg(dtype="bf16"), lr=3e-3, weight_decay=0.0)
    x = torch.randint(0, 256, (4, 32), device=DEVICE)
    losses = []
    for _ in range(20):
        loss = m(x, x)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses[-1] < losses[0] - 0.5


MODELS = {"gpt": small_gpt, "unequal": unequal_net}


@pytest.mark.parametrize("model", ["gpt", "unequal"])
@pytest.mark.parametrize("offload_params", ["host", "none"])
@pytest.mark.parametrize("overlap", ["step", "backward"])
def test_cuda_race(model, offload_params, overlap):
    # At the minimum budget with prefetch_depth=1 backward refetches units of
    # unequal size into other ranges (review A1). A GPU sleep of ~1 ms before
    # each block's forward and backward lets the copy streams run ahead of
    # compute (review E2): a missing wait changes the bits, or the result.
    make = MODELS[model]
    kw = dict(device=DEVICE, dtype="fp32", host_memory="64MiB", offload_params=offload_params, overlap=overlap,
              prefetch_depth=1)
    config = infinity.Config(**kw, device_memory=min_device_budget(make, **kw))
    lag = cuda_lag(1.0) if ON_CUDA else (lambda: None)

    def lagged():
        m = make()
        add_lag(m, lag)
        return m

    with deterministic():
        plain, _, losses, _ = train_pair(make, config, steps=RACE_STEPS, device=DEVICE)
        slow, _, slow_losses, _ = train_pair(lagged, config, steps=RACE_STEPS, device=DEVICE)
    assert slow_losses == losses, "the lag changed the losses"
    a, b = infinity.full_state_dict(plain), infinity.full_state_dict(slow)
    infinity.api.close(plain)
    infinity.api.close(slow)
    assert all(torch.equal(a[k], b[k]) for k in a), "the lag changed the parameters"
