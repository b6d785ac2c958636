"""Plain-PyTorch reference of AdamW over bf16 and block-scaled 8-bit moments
(native/src/adam_q8.inc), written apart from infinity's own code:

- the update is the kernel's op sequence in torch ops that round as the
  kernel does (addcmul_ is a fused multiply-add; a tensor divisor, where
  torch would multiply by a Python-float divisor's reciprocal; sqrt in
  double, rounded once: correctly rounded);
- the 8-bit quantiser searches a sorted table of every code's value for the
  nearest, ties to the even code, not the kernel's bit arithmetic. Scales: the largest finite magnitude of each block of 256
  (0 below FLT_MIN).
"""

from __future__ import annotations

import math

import torch

QB = 256
M_INF, M_NAN, W_INF, W_NAN = 0x7E, 0x7F, 0xFE, 0xFF


def code_table(mbits: int, count: int) -> torch.Tensor:
    """Values of codes 0..count-1 of a float code with 4 exponent bits (1.0 at
    exponent 15) and ``mbits`` mantissa bits, subnormal at exponent 0."""
    vals = []
    for c in range(count):
        e, f = c >> mbits, c & ((1 << mbits) - 1)
        vals.append(f * 2.0 ** -(14 + mbits) if e == 0 else (1 + f / 2 ** mbits) * 2.0 ** (e - 15))
    return torch.tensor(vals, dtype=torch.float64)


M_TABLE = code_table(3, 121)  # exp_avg magnitudes: 120 is 1.0
W_TABLE = code_table(4, 241)  # sqrt(exp_avg_sq): 240 is 1.0


def blocks(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1)
    pad = (-flat.numel()) % QB
    return torch.cat([flat, torch.zeros(pad, dtype=flat.dtype)]).view(-1, QB)


def nearest(y: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Index of the table value nearest each y (fp32, finite, >= 0), ties to
    the even index: a sorted-table search and an exact (float64) comparison
    of the two neighbours."""
    flat = y.reshape(-1).double()
    hi = torch.searchsorted(table, flat).clamp(max=table.numel() - 1)
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = (flat - table[lo]).abs(), (table[hi] - flat).abs()
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    return torch.where(pick_hi, hi, lo).view(y.shape)


def ref_quantize(x: torch.Tensor, signed: bool):
    """(uint8 codes shaped like x, fp32 scales) of fp32 x."""
    b = blocks(x.float())
    a = b.abs()
    s = torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax(1)
    s = torch.where(s >= 2.0 ** -126, s, torch.zeros_like(s))
    inv = torch.where(s > 0, torch.ones_like(s) / s, torch.zeros_like(s))
    y = a * inv[:, None]
    y = torch.where(torch.isfinite(y), y, torch.zeros_like(y))
    c = nearest(y, M_TABLE if signed else W_TABLE)
    c = torch.where(a == math.inf, M_INF if signed else W_INF, c)
    if signed:
        c = c + 0x80 * torch.signbit(b).long()
    c = torch.where(torch.isnan(b), M_NAN if signed else W_NAN, c)
    return c.to(torch.uint8).view(-1)[: x.numel()].view(x.shape), s


def ref_dequantize(codes: torch.Tensor, scales: torch.Tensor, signed: bool) -> torch.Tensor:
    c = blocks(codes).long()
    mag = c & 0x7F if signed else c
    table = (M_TABLE if signed else W_TABLE).float()
    x = table[mag.clamp(max=table.numel() - 1)] * scales[:, None]
    x = torch.where(mag == (M_INF if signed else W_INF), math.inf, x)
    if signed:
        x = torch.where(c >= 0x80, -x, x)
    x = torch.where(mag == (M_NAN if signed else W_NAN), math.nan, x)
    return x.view(-1)[: codes.numel()].view(codes.shape)


def ref_update(p, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay, adamw_mode=True, grad_scale=1.0):
    """One fp32 step in place on p, m, v (fp32); returns sqrt(new v)."""
    g = g.float() * grad_scale
    if adamw_mode:
        p.mul_(1.0 - lr * weight_decay)
    else:
        g = g.add(p, alpha=weight_decay)
    m.addcmul_(torch.full_like(m, 1.0 - beta1), g - m)  # fma(1-b1, g-m, m); lerp_ differs for 1-b1 >= 0.5
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    root = v.double().sqrt().float()
    denom = root / torch.full_like(root, math.sqrt(1.0 - beta2 ** step)) + eps
    p.add_((m * -(lr / (1.0 - beta1 ** step))) / denom)
    return root


def ref_step(p, g, state: dict, out=None, **hp) -> None:
    """One step over a state of bf16 moments (exp_avg, exp_avg_sq) or 8-bit
    ones (codes + exp_avg_scale, exp_avg_sq_scale), all updated in place."""
    q8 = state["exp_avg"].dtype == torch.uint8
    if q8:
        m = ref_dequantize(state["exp_avg"], state["exp_avg_scale"], True)
        w = ref_dequantize(state["exp_avg_sq"], state["exp_avg_sq_scale"], False)
        v = w * w
    else:
        m, v = state["exp_avg"].float(), state["exp_avg_sq"].float()
    root = ref_update(p, g, m, v, **hp)
    if out is not None:
        out.copy_(p)
    if q8:
        for key, x, signed in (("exp_avg", m, True), ("exp_avg_sq", root, False)):
            codes, scales = ref_quantize(x, signed)
            state[key].copy_(codes)
            state[key + "_scale"].copy_(scales)
    else:
        state["exp_avg"].copy_(m)
        state["exp_avg_sq"].copy_(v)
