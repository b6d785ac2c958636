"""The rates of the kernels a model runs, for ``infinity doctor --profile``
([Note: an op's time] in engine/plan/costs.py): matrix products on a grid of
shapes, attention forward and backward at a few sequence lengths, and the
compute-bound elementwise ops per element. Each is timed as the mean over a
short window (profile_measure.timed), in the run's dtype on its device;
together about 3-4 s on this 2-core CPU.
"""

from __future__ import annotations

import itertools
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["gemm_grid", "attention_rates", "elementwise_rates", "GRID_SIZES"]

# Sizes of each of m, n, k. The CPU's: a small model's token counts and widths
# (64-1024 tokens a micro-batch, widths 256-1024); beyond them the edge's rate.
GRID_SIZES = {"cpu": (64, 256, 1024), "cuda": (256, 1024, 4096)}
ATTENTION_LENGTHS = (64, 256, 1024)
WINDOW = 0.05  # s a figure: short, so the whole grid stays within the profile's minute


def _timer() -> Callable:
    from .profile_measure import timed  # the profile's timer (imported late: profile_measure imports this)
    return timed


def gemm_grid(device: torch.device, dtype: torch.dtype, sizes=None) -> List[List[float]]:
    """[[m, n, k, FLOP/s], ...] of ``a @ b.t()`` (a linear layer's layout) for every (m, n, k) of ``sizes``."""
    timed = _timer()
    sizes = sizes or GRID_SIZES.get(device.type, GRID_SIZES["cuda"])
    out = []
    for m, n, k in itertools.product(sizes, repeat=3):
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(n, k, device=device).to(dtype)
        t = timed(lambda: torch.mm(a, b.t()), device, 3, window=WINDOW)
        out.append([m, n, k, 2.0 * m * n * k / t])
    return out


def attention_rates(device: torch.device, dtype: torch.dtype, lengths=ATTENTION_LENGTHS,
                    heads: int = 4, head_dim: int = 64) -> Dict[str, List[List[float]]]:
    """{"forward", "backward": [[length, FLOP/s], ...]} of causal
    ``F.scaled_dot_product_attention`` (the kernel the device picks), FLOPs
    as torch's counter gives them; batch ``1024 // length`` (at least 1)."""
    timed = _timer()
    out: Dict[str, List[List[float]]] = {"forward": [], "backward": []}
    for n in lengths:
        shape = (max(1, 1024 // n), heads, n, head_dim)
        q, k, v = (torch.randn(shape, device=device).to(dtype).requires_grad_() for _ in range(3))
        g = torch.randn(shape, device=device).to(dtype)
        fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device, 3, window=2 * WINDOW)

        def both():
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)
        bwd = max(timed(both, device, 3, window=2 * WINDOW) - fwd, 1e-9)
        out["forward"].append([n, sdpa_flop_count(shape, shape, shape) / fwd])
        out["backward"].append([n, sdpa_backward_flop_count(shape, shape, shape, shape) / bwd])
    return out


def _elementwise_ops(x: torch.Tensor, d: int) -> Dict[str, Callable[[], object]]:
    """The measured ops, each on ``x`` (rows of ``d``): aten calls as autograd makes them."""
    aten, g = torch.ops.aten, torch.randn_like(x)
    w, b = torch.ones(d, device=x.device, dtype=x.dtype), torch.zeros(d, device=x.device, dtype=x.dtype)
    _, mean, rstd = aten.native_layer_norm(x, [d], w, b, 1e-5)
    sm, lsm = aten._softmax(x, -1, False), aten._log_softmax(x, -1, False)
    return {
        "gelu": lambda: aten.gelu(x), "gelu_backward": lambda: aten.gelu_backward(g, x),
        "silu": lambda: aten.silu(x), "silu_backward": lambda: aten.silu_backward(g, x),
        "tanh": lambda: aten.tanh(x), "exp": lambda: aten.exp(x),
        "_softmax": lambda: aten._softmax(x, -1, False),
        "_softmax_backward_data": lambda: aten._softmax_backward_data(g, sm, -1, x.dtype),
        "_log_softmax": lambda: aten._log_softmax(x, -1, False),
        "_log_softmax_backward_data": lambda: aten._log_softmax_backward_data(g, lsm, -1, x.dtype),
        "native_layer_norm": lambda: aten.native_layer_norm(x, [d], w, b, 1e-5),
        "native_layer_norm_backward": lambda: aten.native_layer_norm_backward(g, x, [d], mean, rstd, w, b,
                                                                              [True, True, True]),
    }


def elementwise_rates(device: torch.device, dtype: torch.dtype, rows: int = 1024, d: int = 512) -> Dict[str, float]:
    """{aten op name: elements/s} of the compute-bound elementwise ops on ``rows`` x ``d`` elements."""
    timed = _timer()
    x = torch.randn(rows, d, device=device).to(dtype)
    return {name: rows * d / timed(fn, device, 3, window=WINDOW) for name, fn in _elementwise_ops(x, d).items()}
