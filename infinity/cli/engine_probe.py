"""The engine's own time on the compute thread, per parameter tensor and per
op of a unit, in forward and in backward, for ``infinity doctor --profile``
([Note: the engine's time per parameter] in engine/plan/step_time.py).

Two models of tiny units run through infinity (parameters and optimizer on
the host) and in plain PyTorch, interleaved, medians of each pass. Their
ops cost next to nothing, so the difference is the engine's own time. The
two have the same parameter tensors (6 units of 12, a transformer block's
count) and differ only in parameter-free ops (4 GELUs after each linear in
the second: 144 ops more a pass), so of the differences ``D = a * tensors + c * ops`` the two
unknowns follow: ``c`` from the ops the second adds, ``a`` from the rest.
The ops are counted by costs.count_pass, as the step model counts a real
model's.

The step boundary ([Note: the step boundary] in step_time.py): each
``step()`` + ``zero_grad()`` of the models through infinity, less the time
its updates took (``optimizer_wait_seconds``), is the engine's own time
there. A third model of the same units with a third of the tensors (2 pairs
a unit: 48 tensors against 144) separates the part per step from the part
per parameter tensor.
"""

from __future__ import annotations

import copy
import statistics
import time
from typing import Dict, List, Tuple

import torch
import torch.nn as nn

from ..engine.plan.costs import count_pass

__all__ = ["engine_overhead"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_PHASES = ("forward", "backward")


class _Blocks(nn.Module):
    """6 units of ``pairs`` x (LayerNorm, Linear), with 4 GELUs after each linear when ``gelu``."""

    def __init__(self, gelu: bool, pairs: int = 6):
        super().__init__()
        pair = lambda: [nn.LayerNorm(8), nn.Linear(8, 8)] + ([nn.GELU() for _ in range(4)] if gelu else [])  # noqa: E731
        self.blocks = nn.ModuleList(nn.Sequential(*[m for _ in range(pairs) for m in pair()]) for _ in range(6))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x.sum()


def _ops(gelu: bool, dtype: torch.dtype) -> Dict[str, int]:
    """Ops of the model's units (the root's included) per phase, as the step model counts them."""
    with torch.device("meta"):
        meta = _Blocks(gelu)
    units = {i + 1: [b] for i, b in enumerate(meta.blocks)}
    costs = count_pass(meta, lambda m: m(torch.zeros(2, 8, device="meta", dtype=dtype)), units, dtype)
    return {ph: sum(len(v) for v in getattr(costs, ph).values()) for ph in _PHASES}


def _passes(model: nn.Module, x: torch.Tensor, device: torch.device) -> Tuple[float, float]:
    """(forward s, backward s) of one pass of ``model`` on ``x``."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *_: None)
    t0 = time.perf_counter()
    loss = model(x)
    sync(device)
    t1 = time.perf_counter()
    loss.backward()
    sync(device)
    return t1 - t0, time.perf_counter() - t1


def _boundary(model, opt) -> float:
    """Seconds of one ``step()`` + ``zero_grad()`` of ``model`` outside its updates."""
    from ..api import stats
    w0, t0 = stats(model)["optimizer_wait_seconds"], time.perf_counter()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0 - (stats(model)["optimizer_wait_seconds"] - w0)


def _differences(tiny: nn.Module, device: torch.device, dtype: str, reps: int) -> List[float]:
    """Median seconds infinity adds to ``tiny``'s forward and backward, and
    its step boundary's (see the module docstring)."""
    from ..api import close, initialize
    from ..config.runtime import Config
    plain = copy.deepcopy(tiny).to(device=device, dtype=_DTYPES[dtype])
    cfg = Config(device=device.type, dtype=dtype, offload_params="host", offload_optimizer="host",
                 unit_classes=["Sequential"])
    model, opt = initialize(tiny, cfg, lr=0.0)  # an fp32 model: the engine casts its compute copy
    x = torch.randn(2, 8, device=device, dtype=_DTYPES[dtype])
    ours, base = [], []
    try:
        for _ in range(reps + 2):
            base.append(_passes(plain, x, device))
            ours.append(_passes(model, x, device) + (_boundary(model, opt),))
            plain.zero_grad(set_to_none=True)
    finally:
        close(model)
    med = statistics.median
    return [med(o[k] for o in ours[2:]) - med(b[k] for b in base[2:]) for k in range(2)] + [
        med(o[2] for o in ours[2:])]


def engine_overhead(device: torch.device, dtype: str, reps: int = 7) -> Dict[str, Dict[str, float]]:
    """``{"param_overhead_s": {phase: s per parameter tensor}, "engine_op_overhead_s":
    {phase: s per op}, "step_overhead_s": {"fixed": s a step, "per_tensor": s}}``
    of the engine on ``device`` in ``dtype`` (see the module docstring)."""
    tensors, few = (sum(1 for _ in _Blocks(False, pairs).parameters()) for pairs in (6, 2))
    ops = [_ops(g, _DTYPES[dtype]) for g in (False, True)]
    diff = [_differences(_Blocks(g), device, dtype, reps) for g in (False, True)]
    per_tensor, per_op = {}, {}
    for k, ph in enumerate(_PHASES):
        c = max(0.0, (diff[1][k] - diff[0][k]) / (ops[1][ph] - ops[0][ph]))
        per_op[ph] = c
        per_tensor[ph] = max(0.0, (diff[0][k] - c * ops[0][ph]) / tensors)
    many, fewer = statistics.mean(d[2] for d in diff), _differences(_Blocks(False, 2), device, dtype, reps)[2]
    step = max(0.0, (many - fewer) / (tensors - few))
    return {"param_overhead_s": per_tensor, "engine_op_overhead_s": per_op,
            "step_overhead_s": {"fixed": max(0.0, fewer - step * few), "per_tensor": step}}
