"""bf16 master weights: the parameter itself is the master, kept in bf16 and
written by stochastic rounding from a counter-based hash, so a run is
reproducible and a resumed run bit-exact.

The native kernel (``inf_adam_step_bf16p``) does the step; this module holds
the rounding in torch ops (the pure-torch fallback) and the names. The
generator is described in the native note "stochastic rounding of the bf16
master" in native/src/adam_bf16p.inc; :func:`stochastic_round` gives its bytes exactly.
"""

from __future__ import annotations

import torch

__all__ = ["MASTER_DTYPES", "check_master_dtype", "check_seed", "step_key", "stochastic_round"]

MASTER_DTYPES = ("fp32", "bf16")
_M32, _M64 = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF


def check_master_dtype(master_dtype, where: str = "master_dtype") -> str:
    """``master_dtype`` if it is one of :data:`MASTER_DTYPES`, else ValueError naming ``where``."""
    if master_dtype not in MASTER_DTYPES:
        raise ValueError(f"{where}={master_dtype!r} is not a master dtype; choose one of {list(MASTER_DTYPES)} "
                         "(fp32: a 4-byte master per parameter; bf16: the bf16 parameter is the master, "
                         "updated by stochastic rounding)")
    return master_dtype


def check_seed(seed, where: str = "seed") -> int:
    """``seed`` if it is an int in [0, 2**64), else ValueError naming ``where``."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _M64:
        raise ValueError(f"{where}={seed!r}: the rounding seed must be an int in [0, 2**64)")
    return seed


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def step_key(seed: int, stream: int, step: int) -> int:
    """K of the Note: the 64-bit key of one tensor (``stream``) at one ``step``."""
    return _mix64((_mix64(_mix64(seed) ^ stream) + step) & _M64)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 of int64 x in [0, 2^32), in 16-bit halves of c (no int64 overflow)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def stochastic_round(x: torch.Tensor, *, seed: int, stream: int, step: int, offset: int = 0) -> torch.Tensor:
    """``x`` (fp32, any shape) rounded to bf16 as the native kernel rounds a
    master: element i of ``x`` (flat) is the element ``offset + i`` of tensor
    ``stream`` at ``step``. A new tensor shaped like ``x``."""
    flat = x.detach().reshape(-1).to(torch.float32)
    idx = torch.arange(offset, offset + flat.numel(), dtype=torch.int64)
    k = step_key(seed, stream, step)
    hi = idx >> 32
    hi0 = int(hi[0]) if flat.numel() else 0
    keys = torch.tensor([_mix64(k ^ h) & _M32 for h in range(hi0, int(hi[-1]) + 1 if flat.numel() else hi0)],
                        dtype=torch.int64)
    h = (idx & _M32) ^ keys[hi - hi0] if flat.numel() else idx
    h = h ^ (h >> 16)
    h = _mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x846CA68B)
    h = h ^ (h >> 16)
    u = flat.view(torch.int32).to(torch.int64) & _M32
    top = ((u + (h >> 16)) & _M32) >> 16
    top = torch.where(torch.isnan(flat), 0x7FC0, top)
    return torch.where(top >= 0x8000, top - 0x10000, top).to(torch.int16).view(torch.bfloat16).view(x.shape)
