"""The CUDA path of the engine (copy streams, events, pinned host pool).
Skipped without a GPU; scripts/gpu_check.sh runs it where one is present."""

import pytest
import torch

import infinity
from engine_utils import small_gpt, train_pair, unit_bytes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

UB = unit_bytes(small_gpt())


def cfg(**kw):
    base = dict(device="cuda", dtype="fp32", device_memory=8 * UB, host_memory="256MiB", prefetch_depth=2)
    base.update(kw)
    if base.get("offload_optimizer") == "none":
        base["device_memory"] = 64 << 20
    return infinity.Config(**base)


@pytest.mark.parametrize("offload_optimizer", ["host", "none"])
@pytest.mark.parametrize("overlap", ["step", "backward"])
def test_cuda_parity(offload_optimizer, overlap):
    # The reference runs on the CPU; fp32 GPU matmuls (TF32 off) agree to ~1e-5.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    def fwd(m, x, y):
        if m in infinity.api._ENGINES:  # the managed model computes on the GPU
            return m(x.cuda(), y.cuda()).cpu()
        return m(x, y)

    model, opt, _, _ = train_pair(small_gpt, cfg(offload_optimizer=offload_optimizer, overlap=overlap),
                                  steps=10, forward=fwd, rtol=1e-4)
    s = infinity.stats(model)
    assert s["peak_bytes"]["device"] <= s["budget_bytes"]["device"]
    if offload_optimizer == "host":
        assert s["host_pinned"]


def test_cuda_bf16_trains():
    m, opt = infinity.initialize(small_gpt(), cfg(dtype="bf16"), lr=3e-3, weight_decay=0.0)
    x = torch.randint(0, 256, (4, 32), device="cuda")
    losses = []
    for _ in range(20):
        loss = m(x, x)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses[-1] < losses[0] - 0.5
