"""Throughput figures users compare across systems (tokens/s, model TFLOPS,
MFU) and a progress callback for Python-API loops.

[Note: model FLOPs]
The figure is the model's FLOPs, not the hardware's: 6 per trainable
parameter per token (2 forward, 4 backward: the input's gradient and the
weight's) and 4 per frozen parameter (its weight gets no gradient), as
PaLM's MFU and most training reports count them. Attention's own
sequence-squared FLOPs and activation recomputation are left out, so the
figure is comparable across systems and checkpointing settings; it
undercounts long-sequence runs. A "token" is one row position of the
batch: the caller says how many a step has. MFU divides by the device's
dense peak for the compute dtype (``PEAK_TFLOPS``, from the vendors' data
sheets); on the CPU device or an unknown GPU it is None.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn as nn

from .api import engine_of, stats

__all__ = ["PEAK_TFLOPS", "model_flops_per_token", "peak_tflops", "StepMeter", "on_steps"]

# Dense tensor-core peak TFLOPS per GPU (no sparsity), by a substring of
# torch.cuda.get_device_name(): (bf16/fp16, tf32 for fp32). NVIDIA data sheets:
# H100/H200 SXM, H100 PCIe, A100, L40S, RTX 4090 (Ada whitepaper, fp32 accumulate), RTX 3090.
PEAK_TFLOPS = {
    "H200": (989.4, 494.7), "H100 PCIe": (756.0, 378.0), "H100": (989.4, 494.7), "A100": (312.0, 156.0),
    "L40S": (362.1, 183.0), "RTX 4090": (165.2, 82.6), "RTX 3090": (71.0, 35.6),
}


def model_flops_per_token(model: nn.Module) -> int:
    """FLOPs of one token's forward and backward through ``model`` (an
    ``infinity.initialize``-d model): see [Note: model FLOPs]."""
    return stats(model)["model_flops_per_token"]


def peak_tflops(device: torch.device, dtype: torch.dtype) -> Optional[float]:
    """The dense peak TFLOPS of ``device`` for compute in ``dtype``, or None
    (the CPU device, a GPU not in ``PEAK_TFLOPS``)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, (half, single) in PEAK_TFLOPS.items():
        if key in name:
            return half if dtype in (torch.bfloat16, torch.float16) else single
    return None


class StepMeter:
    """Per-step throughput of ``model``: call :meth:`record` after each
    optimizer step. ``tokens_per_step``: tokens one step trains on, over all
    ranks (None: no tokens/s, TFLOPS or MFU)."""

    def __init__(self, model: nn.Module, tokens_per_step: Optional[int] = None):
        eng = engine_of(model)
        self.model, self.tokens_per_step = model, tokens_per_step
        self.world = eng.sharding.world
        self.flops_per_token = model_flops_per_token(model)
        self.peak = peak_tflops(eng.device, eng.modes.dtype)
        self._t = time.perf_counter()
        self._steps = stats(model)["steps"]

    def record(self) -> Dict[str, Any]:
        """``infinity.stats(model)`` plus ``s_per_step`` (seconds a step, since
        the last record), ``tokens_per_s``, ``tflops`` (model TFLOPS per
        device) and ``mfu`` (a fraction of the device's peak; None where
        unknown)."""
        now, st = time.perf_counter(), stats(self.model)
        n = max(1, st["steps"] - self._steps)
        dt = (now - self._t) / n
        self._t, self._steps = now, st["steps"]
        rec = dict(st, s_per_step=dt, tokens_per_s=None, tflops=None, mfu=None)
        if self.tokens_per_step:
            rec["tokens_per_s"] = self.tokens_per_step / dt
            rec["tflops"] = self.flops_per_token * self.tokens_per_step / self.world / dt / 1e12
            rec["mfu"] = rec["tflops"] / self.peak if self.peak else None
        return rec


def on_steps(model: nn.Module, optimizer: torch.optim.Optimizer, fn: Callable[[Dict[str, Any]], None], *,
             every: int = 1, tokens_per_step: Optional[int] = None):
    """Calls ``fn(record)`` after every ``every``-th ``optimizer.step()``
    (skipped steps included), ``record`` being :meth:`StepMeter.record`'s
    (``step`` added: the steps taken). Returns the hook's handle
    (``.remove()`` stops it)."""
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"on_steps: every={every!r} must be a positive int")
    meter, count = StepMeter(model, tokens_per_step), [0]

    def hook(opt, args, kwargs) -> None:
        count[0] += 1
        if count[0] % every == 0:
            rec = meter.record()
            rec["step"] = count[0]
            fn(rec)

    return optimizer.register_step_post_hook(hook)
