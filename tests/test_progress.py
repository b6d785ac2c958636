"""Throughput figures and the progress callback (issue 35; [Note: model
FLOPs] in infinity/progress.py)."""

import pytest
import torch
import torch.nn as nn

import infinity
from infinity.progress import model_flops_per_token, peak_tflops


def _model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    m[0].bias.requires_grad_(False)  # frozen: 4 FLOPs a token, not 6
    return m


def test_on_steps_reports_every_nth_step_with_the_model_flops(tmp_path):
    m = _model()
    trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in m.parameters() if not p.requires_grad)
    model, opt = infinity.initialize(m, infinity.Config(device="cpu", dtype="fp32", swap_paths=[str(tmp_path)]),
                                     lr=1e-2)
    try:
        want = 6 * trainable + 4 * frozen
        assert want == 6 * (128 + 17) + 4 * 16
        assert model_flops_per_token(model) == infinity.stats(model)["model_flops_per_token"] == want
        seen = []
        handle = infinity.on_steps(model, opt, seen.append, every=2, tokens_per_step=32)
        for _ in range(5):
            model(torch.randn(32, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        assert [r["step"] for r in seen] == [2, 4] and [r["steps"] for r in seen] == [2, 4]
        r = seen[-1]
        assert r["tokens_per_s"] == pytest.approx(32 / r["s_per_step"])
        assert r["tflops"] == pytest.approx(model_flops_per_token(model) * 32 / r["s_per_step"] / 1e12)
        assert r["mfu"] is None  # no peak for the CPU device
        handle.remove()
        model(torch.randn(32, 8)).sum().backward()
        opt.step()
        assert len(seen) == 2
        with pytest.raises(ValueError, match="every=0"):
            infinity.on_steps(model, opt, print, every=0)
    finally:
        infinity.close(model)


def test_peak_is_unknown_on_the_cpu():
    assert peak_tflops(torch.device("cpu"), torch.bfloat16) is None
