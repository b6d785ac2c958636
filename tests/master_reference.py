"""Plain reference of AdamW over a bf16 master (native/src/adam_bf16p.inc),
written apart from infinity's own code: the update is tests/moment_reference.py's
on the widened parameter, and the stochastic rounding is computed here with
numpy's wrapping uint32/uint64 arithmetic from [Note: stochastic rounding of
the bf16 master]'s definition (infinity's torch fallback splits multiplies
into 16-bit halves instead).
"""

from __future__ import annotations

import numpy as np
import torch

from moment_reference import ref_step, ref_update


def mix64(z):
    z = np.uint64(z)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def sr_round(x: torch.Tensor, seed: int, stream: int, step: int, offset: int) -> torch.Tensor:
    """fp32 x (flat) rounded to bf16, element i being index offset + i."""
    with np.errstate(over="ignore"):
        k = mix64(mix64(mix64(seed) ^ np.uint64(stream)) + np.uint64(step))
    idx = np.arange(offset, offset + x.numel(), dtype=np.uint64)
    key = np.array([mix64(k ^ np.uint64(h)) for h in (idx >> np.uint64(32)).tolist()], dtype=np.uint64)
    h = (idx ^ key).astype(np.uint32)  # low 32 bits of index ^ key
    with np.errstate(over="ignore"):
        h ^= h >> np.uint32(16)
        h *= np.uint32(0x7FEB352D)
        h ^= h >> np.uint32(15)
        h *= np.uint32(0x846CA68B)
        h ^= h >> np.uint32(16)
        u = x.reshape(-1).float().numpy().view(np.uint32)
        r = (u + (h >> np.uint32(16))) >> np.uint32(16)
    r = np.where(np.isnan(x.reshape(-1).numpy()), np.uint32(0x7FC0), r).astype(np.uint16)
    return torch.from_numpy(r.view(np.int16).copy()).view(torch.bfloat16)


def ref_master_step(p: torch.Tensor, g, state: dict, *, seed, stream, step, offset=0, **hp) -> None:
    """One step on a bf16 master p (in place) over a state of fp32, bf16 or
    8-bit moments (updated in place, as moment_reference.ref_step)."""
    x = p.float()
    if state["exp_avg"].dtype == torch.float32:
        ref_update(x, g, state["exp_avg"], state["exp_avg_sq"], step=step, **hp)
    else:
        ref_step(x, g, state, step=step, **hp)
    p.copy_(sr_round(x, seed, stream, step, offset).view(p.shape))
