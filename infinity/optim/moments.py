"""Adam moments stored in fewer bytes: bf16, or block-scaled 8-bit codes.

The native kernel updates them in place (``inf_adam_step_moments``); this
module holds the same encodings in torch ops, for what happens outside a step:
making a state from fp32 moments (``load_state_dict``, a new state), reading it
back as fp32 (``state_dict``), and the pure-torch fallback. The codes are
exactly the kernel's, to the bit: the native notes "8-bit moments" (the
format) and "bf16 moments" (the rounding) in native/src/adam_q8.inc say why.

``moment_dtype`` names: ``"fp32"`` (torch's), ``"bf16"``, ``"int8"``. An int8
moment is a ``torch.uint8`` tensor of codes, shaped like its parameter, and an
fp32 scale per block of :data:`QBLOCK` elements (``ceil(numel / QBLOCK)``).
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch
import torch.nn.functional as F

__all__ = ["MOMENT_DTYPES", "QBLOCK", "check_moment_dtype", "encode", "decode", "num_blocks",
           "quantize", "dequantize"]

MOMENT_DTYPES = ("fp32", "bf16", "int8")
QBLOCK = 256  # INF_QBLOCK in native/include/infinity_native.h

_M_BITS, _W_BITS = 3, 4            # mantissa bits: exp_avg's code, sqrt(exp_avg_sq)'s code
_M_INF, _M_NAN = 0x7E, 0x7F        # exp_avg magnitude codes
_W_INF, _W_NAN = 0xFE, 0xFF        # sqrt(exp_avg_sq) codes
_FLT_MIN = 2.0 ** -126


def check_moment_dtype(moment_dtype, where: str = "moment_dtype") -> str:
    """``moment_dtype`` if it is one of :data:`MOMENT_DTYPES`, else ValueError naming ``where``."""
    if moment_dtype not in MOMENT_DTYPES:
        raise ValueError(f"{where}={moment_dtype!r} is not a moment dtype; choose one of {list(MOMENT_DTYPES)} "
                         "(fp32: torch's 8 bytes a parameter; bf16: 4; int8: block-scaled codes, ~2)")
    return moment_dtype


def num_blocks(numel: int) -> int:
    """Scales an int8 moment of ``numel`` elements has (one per QBLOCK elements)."""
    return -(-numel // QBLOCK)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """``x`` flat, zero-padded to whole blocks, as (blocks, QBLOCK)."""
    flat = x.reshape(-1)
    return F.pad(flat, (0, (-flat.numel()) % QBLOCK)).view(-1, QBLOCK)


def _code(x: torch.Tensor, mbits: int) -> torch.Tensor:
    """Nearest code (ties to even) of fp32 ``x`` in [0, 1], as int32: the
    kernel's q8_code to the bit (which finds it with one FMA per vector;
    here the fp32 bits are rounded to the code's width, and an IEEE add rounds
    below 2^-14)."""
    u = x.view(torch.int32)
    r = u + ((1 << (22 - mbits)) - 1) + ((u >> (23 - mbits)) & 1)
    normal = (r >> (23 - mbits)) - ((127 - 15) << mbits)
    big = float(2 ** (24 - 15 - mbits))
    sub = (x + big).view(torch.int32) - torch.tensor(big).view(torch.int32)
    return torch.where(x < 2.0 ** -14, sub, normal)


def _value(mag: torch.Tensor, mbits: int) -> torch.Tensor:
    """fp32 value of int32 magnitude codes (finite ones)."""
    normal = ((mag + ((127 - 15) << mbits)) << (23 - mbits)).view(torch.float32)
    return torch.where(mag < (1 << mbits), mag.float() * 2.0 ** -(14 + mbits), normal)


def _scales(blocks: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per block: the scale (largest finite magnitude; 0 below FLT_MIN) and its reciprocal (0 for 0)."""
    a = blocks.abs()
    s = torch.where(torch.isfinite(a), a, 0.0).amax(1)
    s = torch.where(s >= _FLT_MIN, s, 0.0)
    inv = torch.where(s > 0, torch.ones_like(s) / s, 0.0)
    return s, inv


def quantize(x: torch.Tensor, signed: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8, shaped like ``x``) and block scales (fp32) of fp32 ``x``:
    exp_avg (``signed=True``) or sqrt(exp_avg_sq) (``signed=False``)."""
    b = _blocks(x.detach().to(torch.float32))
    s, inv = _scales(b)
    a = b.abs()
    y = a * inv[:, None]
    c = _code(torch.where(torch.isfinite(y), y, 0.0), _M_BITS if signed else _W_BITS)
    c = torch.where(a == float("inf"), _M_INF if signed else _W_INF, c)
    if signed:
        c = c | ((b.view(torch.int32) >> 24) & 0x80)
    c = torch.where(torch.isnan(b), _M_NAN if signed else _W_NAN, c)
    return c.to(torch.uint8).view(-1)[: x.numel()].view(x.shape), s


def dequantize(codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> torch.Tensor:
    """fp32 values of ``quantize``'s codes and scales, shaped like ``codes``."""
    c = _blocks(codes).to(torch.int32)
    mag = c & 0x7F if signed else c
    x = _value(mag, _M_BITS if signed else _W_BITS) * scales.view(-1, 1)
    x = torch.where(mag == (_M_INF if signed else _W_INF), float("inf"), x)
    if signed:
        x = torch.where((c & 0x80) != 0, -x, x)
    x = torch.where(mag == (_M_NAN if signed else _W_NAN), float("nan"), x)
    return x.view(-1)[: codes.numel()].view(codes.shape)


def encode(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, moment_dtype: str) -> Dict[str, torch.Tensor]:
    """The state entries of fp32 moments stored as ``moment_dtype``:
    ``exp_avg``, ``exp_avg_sq`` and, for int8, ``exp_avg_scale`` and
    ``exp_avg_sq_scale``. New contiguous CPU tensors."""
    m = exp_avg.detach().to(device="cpu", dtype=torch.float32).contiguous()
    v = exp_avg_sq.detach().to(device="cpu", dtype=torch.float32).contiguous()
    if moment_dtype == "fp32":  # never the caller's memory (nor one buffer for both)
        return {"exp_avg": m.clone() if m.data_ptr() == exp_avg.data_ptr() else m,
                "exp_avg_sq": v.clone() if v.data_ptr() == exp_avg_sq.data_ptr() else v}
    if moment_dtype == "bf16":
        return {"exp_avg": m.to(torch.bfloat16), "exp_avg_sq": v.to(torch.bfloat16)}
    qm, sm = quantize(m, signed=True)
    # sqrt in double, rounded once: the correctly rounded fp32 sqrt the kernel takes.
    qw, sw = quantize(v.double().sqrt().float(), signed=False)
    return {"exp_avg": qm, "exp_avg_sq": qw, "exp_avg_scale": sm, "exp_avg_sq_scale": sw}


def decode(state: dict) -> Tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(exp_avg, exp_avg_sq)`` of a state in any moment dtype (new
    tensors, except fp32 moments, which are returned as they are)."""
    m, v = state["exp_avg"], state["exp_avg_sq"]
    if m.dtype == torch.uint8:
        w = dequantize(v, state["exp_avg_sq_scale"], signed=False)
        return dequantize(m, state["exp_avg_scale"], signed=True), w * w
    return m.float(), v.float()
