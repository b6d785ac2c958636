"""An op's price in the step model ([Note: an op's time] in engine/plan/costs.py):
products at their shape on the profile's grid, attention counted as one call
each way and priced at its measured rate, compute-bound elementwise ops per
element. Exact figures on made-up profiles; nothing is timed."""

import math

import pytest
import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from infinity.engine.plan.costs import OpCost, count_pass
from infinity.engine.plan.profile import Profile
from infinity.engine.plan.step_time import op_seconds
from infinity.models import GPT, GPTConfig

SIZES = (64, 256, 1024)


def grid(rate):
    return [[m, n, k, rate(m, n, k)] for m in SIZES for n in SIZES for k in SIZES]


def profile(**kw) -> Profile:
    base = dict(name="test", source="made up", device="cpu", gemm_flops={"fp32": [[64, 1e10], [1024, 2e10]]},
                mem_bw=1e20, op_overhead_s=0.0, h2d_bw=1e9, d2h_bw=1e9, adamw_params_per_s={"fp32": 1e8},
                disk_read_bw=1e9, disk_write_bw=1e9)
    base.update(kw)
    return Profile(**base)


def test_grid_rate_is_exact_at_its_points_log_linear_between_and_clamped():
    p = profile(gemm_shapes={"fp32": grid(lambda m, n, k: 1e9 * (m + 2 * n + 4 * k))})
    assert p.gemm_rate("fp32", 1.0, (256, 64, 1024)) == pytest.approx(1e9 * (256 + 128 + 4096))
    # m = 128 is halfway between 64 and 256 in log size: the rate is the mean of the two
    assert p.gemm_rate("fp32", 1.0, (128, 64, 64)) == pytest.approx(1e9 * ((64 + 256) / 2 + 128 + 256))
    assert p.gemm_rate("fp32", 1.0, (8, 4096, 1)) == pytest.approx(1e9 * (64 + 2048 + 256))  # clamped
    # no shape, or a dtype without a grid: the square sizes' rate (side of the same work: 1024 -> 2e10)
    assert p.gemm_rate("fp32", 2 * 1024 ** 3) == pytest.approx(2e10)
    assert p.gemm_rate("bf16", 2 * 1024 ** 3, (64, 64, 64)) == pytest.approx(2e10)


def test_an_incomplete_grid_is_named():
    with pytest.raises(ValueError, match=r"gemm_shapes\['fp32'\] must hold every"):
        profile(gemm_shapes={"fp32": grid(lambda *s: 1e9)[:-1]})
    with pytest.raises(ValueError, match="all positive"):
        profile(gemm_shapes={"fp32": [[64, 64, 64, 0.0]]})


def test_each_op_is_priced_at_its_kernels_rate():
    p = profile(gemm_shapes={"fp32": grid(lambda m, n, k: 5e10 if m == 256 else 1e10)},
                attention_flops={"fp32": {"forward": [[64, 1e9], [1024, 4e9]], "backward": [[64, 5e8]]}},
                op_rates={"fp32": {"gelu": 1e8}}, op_overhead_s=1e-6, mem_bw=1e9)
    mm = OpCost(2 * 256 ** 3, 10, "mm", (256, 256, 256), 256 * 256)
    assert op_seconds(mm, p, "fp32") == pytest.approx(2 * 256 ** 3 / 5e10 + 1e-6)
    att = OpCost(1_000_000, 10, "attention", (256, 256, 64), 1)
    assert op_seconds(att, p, "fp32") == pytest.approx(1e6 / 2.5e9 + 1e-6)  # 256: halfway from 64 to 1024
    bwd = OpCost(1_000_000, 10, "attention_backward", (256, 256, 64), 1)
    assert op_seconds(bwd, p, "fp32") == pytest.approx(1e6 / 5e8 + 1e-6)
    gelu = OpCost(0, 8, "gelu", (), 1000)
    assert op_seconds(gelu, p, "fp32") == pytest.approx(1000 / 1e8 + 1e-6)
    # not measured: the roofline (bytes at the memory bandwidth), as before
    assert op_seconds(OpCost(0, 8000, "silu", (), 1000), p, "fp32") == pytest.approx(8000 / 1e9 + 1e-6)
    assert op_seconds(OpCost(0, 8000, "gelu", (), 1000), p, "bf16") == pytest.approx(8000 / 1e9 + 1e-6)


def test_attention_is_counted_as_one_call_each_way():
    cfg = GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=2, n_embd=64)
    with torch.device("meta"):
        m = GPT(cfg)
    x = torch.zeros(3, 32, dtype=torch.long, device="meta")
    c = count_pass(m, lambda mm: mm(x, x), {i + 1: [b] for i, b in enumerate(m.blocks)}, torch.float32)
    shape = (3, 2, 32, 32)  # batch, heads, length, head dim
    for ph, name, fl in (("forward", "attention", sdpa_flop_count(shape, shape, shape)),
                         ("backward", "attention_backward", sdpa_backward_flop_count(shape, shape, shape, shape))):
        ops = [o for o in getattr(c, ph)[1] if "attention" in o.name]
        assert [(o.name, o.flops, o.shape) for o in ops] == [(name, fl, (32, 32, 32))]
        assert not any(o.name in ("bmm", "_safe_softmax", "_softmax") for o in getattr(c, ph)[1])
    products = [o for o in c.forward[1] if o.name == "addmm"]
    assert [o.shape for o in products] == [(96, 192, 64), (96, 64, 64), (96, 256, 64), (96, 64, 256)]
    assert all(o.flops == 2 * math.prod(o.shape) for o in products)
