"""How optimizer state is stored: fp32 moments to their stored dtype (bf16,
or int8 codes with block scales) and back. Pure; used by the
optimizer-state owner (optstate.py) and the loaders. See [Note: low-bit
moments in the engine] in plan/opt_kinds.py.
"""

from __future__ import annotations

from typing import Optional

import torch

from ...optim import moments as qmoments
from ..plan.opt_kinds import scale_kind

__all__ = ["to_fp32", "encode_moment"]


def to_fp32(kind: str, t: torch.Tensor, scales: Optional[torch.Tensor]) -> torch.Tensor:
    """fp32 values of a stored moment ``kind`` (bf16, or int8 codes with
    their ``scales``): what ``CPUAdamW.state_dict`` gives (infinity/optim/moments.py)."""
    if t.dtype != torch.uint8:
        return t.float()
    x = qmoments.dequantize(t, scales, signed=kind == "exp_avg")
    return x if kind == "exp_avg" else x * x  # exp_avg_sq is kept as codes of its square root


def encode_moment(kind: str, x: torch.Tensor, moment_dtype: str) -> dict:
    """fp32 moment ``x`` of ``kind`` stored as ``moment_dtype``: {kind: tensor}
    and, for int8, its scales; the same bytes as ``moments.encode`` (one
    block grid: ``x`` starts on a block)."""
    if moment_dtype == "fp32":
        return {kind: x}
    if moment_dtype == "bf16":
        return {kind: x.to(torch.bfloat16)}
    x = x.to(torch.float32)
    if kind == "exp_avg_sq":
        x = x.double().sqrt().float()  # sqrt in double, rounded once: as moments.encode
    codes, scales = qmoments.quantize(x, signed=kind == "exp_avg")
    return {kind: codes, scale_kind(kind): scales}
