"""Fused AdamW step over fp32 CPU buffers: the maths of infinity's optimizer.

One call updates, in a single pass over memory, fp32 master weights and their
``exp_avg``/``exp_avg_sq`` (fp32, bf16, or block-scaled 8-bit codes: see
:mod:`infinity.optim.moments`) from gradients that are fp32, bf16 or fp16,
and optionally writes the updated weights as bf16/fp16/fp32 into a second
buffer (the compute copy the offload engine sends to the device).

The native kernel (``native/src/adam_kernel.inc``) runs when the library is
built; otherwise :func:`_fallback_step` computes the same maths with torch ops.
"""

from __future__ import annotations

import array
import ctypes
import math
from typing import NamedTuple, List, Optional, Sequence, Tuple

import torch

from ..system import native
from ..io.engine import chunk_count
from . import master as _master
from . import moments as _moments

__all__ = ["group_hyper", "Hyper", "adamw_step_", "check_hyperparameters"]

_GRAD_DT = {torch.float32: native.DT_F32, torch.bfloat16: native.DT_BF16, torch.float16: native.DT_F16}
_OUT_DT = _GRAD_DT
# Moment dtype of the exp_avg buffers: fp32, bf16, or uint8 codes (int8 with block scales).
_MOMENT_DT = {torch.float32: native.DT_F32, torch.bfloat16: native.DT_BF16, torch.uint8: native.DT_I8}


def check_hyperparameters(lr: float, betas: Sequence[float], eps: float, weight_decay: float) -> None:
    """Raise ValueError naming the hyper-parameter that is out of range."""
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr >= 0.0):
        raise ValueError(f"Invalid lr: {lr!r} (must be a finite float >= 0)")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps >= 0.0):
        raise ValueError(f"Invalid eps: {eps!r} (must be a finite float >= 0)")
    if len(betas) != 2:
        raise ValueError(f"Invalid betas: {betas!r} (must be a pair (beta1, beta2))")
    for i, b in enumerate(betas):
        if not (isinstance(b, (int, float)) and 0.0 <= b < 1.0):
            raise ValueError(f"Invalid beta{i + 1} (betas[{i}]): {b!r} (must be in [0, 1))")
    if not (isinstance(weight_decay, (int, float)) and math.isfinite(weight_decay) and weight_decay >= 0.0):
        raise ValueError(f"Invalid weight_decay: {weight_decay!r} (must be a finite float >= 0)")


class Hyper(NamedTuple):
    """One param group's AdamW hyper-parameters as the kernel takes them."""
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    adamw_mode: bool   # decoupled weight decay (AdamW); False: L2 added to the gradient (Adam)
    sign: float        # -1.0 with maximize=True: the gradient is negated, as torch does


# torch.optim.Adam/AdamW group keys infinity's AdamW has no counterpart for,
# with what to do instead. A group that turns one on is refused, never ignored.
_REFUSED = {
    "amsgrad": "infinity's AdamW has no AMSGrad variant (it keeps no max of exp_avg_sq); set amsgrad=False",
    "capturable": "infinity's CPU AdamW is not captured in CUDA graphs; set capturable=False",
    "differentiable": "infinity's AdamW step is not differentiable; set differentiable=False",
}


def _number(v, what: str) -> float:
    if isinstance(v, torch.Tensor):
        if v.numel() != 1:
            raise ValueError(f"Invalid {what}: a tensor of {v.numel()} elements (must be one number)")
        return float(v)
    return v


def group_hyper(group: dict, where: str = "param group") -> Hyper:
    """The hyper-parameters of a torch param group (``lr``, ``betas``,
    ``eps``, ``weight_decay``, and torch's ``maximize``,
    ``decoupled_weight_decay``, or infinity's ``adamw_mode``), checked:
    ValueError naming ``where`` and the key for a value out of range, for a
    torch option infinity cannot honour (``amsgrad``, ``capturable``,
    ``differentiable`` turned on), or for ``adamw_mode`` and
    ``decoupled_weight_decay`` that disagree. ``foreach`` and ``fused`` only
    choose torch's implementation and are ignored. One-element tensors are
    read as numbers (torch accepts tensor ``lr`` and betas)."""
    for key, why in _REFUSED.items():
        if group.get(key):
            raise ValueError(f"{where}: {key}={group[key]!r}: {why}")
    betas = group["betas"]
    if len(betas) != 2:
        raise ValueError(f"{where}: Invalid betas: {betas!r} (must be a pair (beta1, beta2))")
    h = Hyper(_number(group["lr"], "lr"), _number(betas[0], "beta1"), _number(betas[1], "beta2"),
              _number(group["eps"], "eps"), _number(group["weight_decay"], "weight_decay"),
              _adamw_mode(group, where), -1.0 if group.get("maximize") else 1.0)
    try:
        check_hyperparameters(h.lr, (h.beta1, h.beta2), h.eps, h.weight_decay)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return h


def _adamw_mode(group: dict, where: str) -> bool:
    """Decoupled weight decay: torch's ``decoupled_weight_decay`` (AdamW
    True, Adam False) or infinity's ``adamw_mode``, which must agree when both are set."""
    dec, mode = group.get("decoupled_weight_decay"), group.get("adamw_mode")
    if dec is not None and mode is not None and bool(dec) != bool(mode):
        raise ValueError(f"{where}: adamw_mode={mode!r} and decoupled_weight_decay={dec!r} disagree; set both "
                         "(True: AdamW's decoupled decay, False: Adam's L2 decay)")
    return bool(mode if mode is not None else (dec if dec is not None else True))


def _check_buffer(t: torch.Tensor, what: str, i: int, numel: int, dtypes) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}[{i}] must be a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse or t.layout != torch.strided:
        raise TypeError(f"{what}[{i}] is sparse ({t.layout}); infinity's AdamW needs dense tensors")
    if t.device.type != "cpu":
        raise TypeError(f"{what}[{i}] is on {t.device}; the CPU AdamW kernel needs CPU tensors")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{what}[{i}] has dtype {t.dtype}; expected {names}")
    if not t.is_contiguous():
        raise ValueError(f"{what}[{i}] is not contiguous (shape {tuple(t.shape)}, stride {t.stride()})")
    if t.numel() != numel:
        raise ValueError(f"{what}[{i}] has {t.numel()} elements but params[{i}] has {numel}")


def adamw_step_(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs: Sequence[torch.Tensor],
                exp_avg_sqs: Sequence[torch.Tensor], *, step: int, lr: float, beta1: float, beta2: float,
                eps: float, weight_decay: float, adamw_mode: bool = True, grad_scale: float = 1.0,
                outs: Optional[Sequence[torch.Tensor]] = None, num_threads: Optional[int] = None,
                validate: bool = True, sum_chunk_bytes: Optional[int] = None,
                exp_avg_scales: Optional[Sequence[torch.Tensor]] = None,
                exp_avg_sq_scales: Optional[Sequence[torch.Tensor]] = None,
                saves: Optional[Tuple[Sequence[torch.Tensor], ...]] = None,
                seed: Optional[int] = None, streams: Optional[Sequence[int]] = None,
                offsets: Optional[Sequence[int]] = None,
                ) -> Optional[List[Tuple[array.array, array.array, array.array]]]:
    """One AdamW (``adamw_mode=True``) or Adam-with-L2 step, in place.

    Args:
        params: CPU master weights (updated in place), one dtype for the
            call: fp32, or bf16 (a bf16 master: the new value, computed in
            fp32 from the widened parameter, is stored by stochastic rounding
            with random bits hashed from ``seed``, ``streams[i]``, ``step``
            and each element's index ``offsets[i] + j`` in its tensor: see
            :mod:`infinity.optim.master`; needs ``seed``; no ``outs``, ``saves``
            or ``sum_chunk_bytes``, since the parameter is the compute copy).
        grads: gradients, fp32, bf16 or fp16, one dtype for the whole call;
            multiplied by ``grad_scale`` first (pass ``1/loss_scale`` to unscale).
        exp_avgs, exp_avg_sqs: moments, updated in place, one dtype for the
            call: fp32; bf16 (stored rounded to nearest even); or uint8 codes
            of block-scaled 8-bit moments (``exp_avg_sqs`` then holds codes of
            sqrt(exp_avg_sq)), which need ``exp_avg_scales`` and
            ``exp_avg_sq_scales``: fp32, ``moments.num_blocks(numel)`` each,
            updated in place. :func:`infinity.optim.moments.encode` makes them
            from fp32 moments; all-zero codes and scales are moments of zero.
        step: the step number after incrementing (1 for the first step), used
            for the bias corrections ``1 - beta**step``.
        outs: optional copy-out buffers, one dtype for the call (bf16, fp16 or
            fp32), written with the updated weights (round to nearest even).
        num_threads: threads for this call (default :func:`native.default_num_threads`).
        validate: check devices, dtypes, contiguity and sizes (the offload
            engine passes False for buffers it allocated itself).
        sum_chunk_bytes: also take the CRC32C sums of the updated ``params``,
            ``exp_avgs`` and ``exp_avg_sqs``, a tile at a time while it is in
            cache, in the swap store's chunks of this many bytes (a power of
            two >= 4096; :attr:`SwapStore.sum_chunk_bytes
            <infinity.io.SwapStore.sum_chunk_bytes>`), and return them: per
            tensor, the three ``array('I')`` to pass as ``SwapStore.write(...,
            crcs=)``. Needs the native library.
        saves: ``(params, exp_avgs, exp_avg_sqs, outs)`` buffers, one per
            tensor each, the same sizes (fp32; ``outs``' of ``outs``' dtype,
            None without ``outs`` or where their old bytes are not wanted), that receive the old contents of those
            buffers before the step writes them: a speculative update's undo
            state. Natively saved in the step's own pass ([Note: the undo
            state saved in the step's pass] in native/src/adam.cpp); the new
            values are the same bits as without ``saves``. Not with
            ``sum_chunk_bytes``.

        seed: the run's rounding seed (int in [0, 2**64)), bf16 params only.
        streams: per tensor, an id (int >= 0) mixed into its rounding bits, so
            tensors stepped together do not round alike (default all 0).
        offsets: per tensor, the index of its element 0 in the whole tensor
            (a shard starting mid-tensor; a multiple of ``moments.QBLOCK`` with
            8-bit moments); default all 0. Rounding never depends on how a
            tensor is split or on threads or ISA.

    All tensors of index i must have the same number of elements. Many tensors
    cost one native call: the work is split across threads by element count.
    """
    _check_lengths(params, grads, exp_avgs, exp_avg_sqs, outs)
    if len(params) == 0:
        return [] if sum_chunk_bytes is not None else None
    gdtype = grads[0].dtype
    odtype = outs[0].dtype if outs is not None else None
    mdtype = exp_avgs[0].dtype
    pdtype = params[0].dtype if isinstance(params[0], torch.Tensor) else None
    if validate:
        _check_call(params, grads, exp_avgs, exp_avg_sqs, outs, gdtype, odtype, step, lr, beta1, beta2, eps,
                    weight_decay, pdtype)
        _check_moments(params, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales, mdtype)
    if pdtype == torch.bfloat16:
        _check_master_call(params, mdtype, outs, sum_chunk_bytes, saves, seed, streams, offsets)
        _master_step(params, grads, exp_avgs, exp_avg_sqs, (exp_avg_scales, exp_avg_sq_scales), gdtype, step, lr,
                     beta1, beta2, eps, weight_decay, grad_scale, adamw_mode, num_threads, seed,
                     streams or [0] * len(params), offsets or [0] * len(params))
        return None
    if seed is not None or streams is not None or offsets is not None:
        raise ValueError("adamw_step_: seed, streams and offsets are the rounding of a bf16 master; "
                         f"these params are {pdtype}")
    bc1 = 1.0 - beta1 ** step
    bc2 = 1.0 - beta2 ** step
    if saves is not None:
        _check_saves(saves, params, outs, sum_chunk_bytes)
        if not (native.available() and mdtype == torch.float32):  # saved beforehand, by copies
            for dst, src in zip(saves, (params, exp_avgs, exp_avg_sqs, outs if outs is not None else [])):
                for d, t in zip(dst or [], src):
                    d.copy_(t)
            saves = None
    if sum_chunk_bytes is not None:
        _check_sum_chunk_bytes(sum_chunk_bytes)
        if mdtype != torch.float32:
            raise ValueError(f"adamw_step_(sum_chunk_bytes=...) takes fp32 moments only, got {mdtype}")
    if mdtype != torch.float32:
        scales = (exp_avg_scales, exp_avg_sq_scales)
        if native.available():
            _native_lowbit_step(params, grads, exp_avgs, exp_avg_sqs, scales, outs, gdtype, odtype, lr, beta1,
                                beta2, eps, weight_decay, bc1, bc2, grad_scale, adamw_mode, num_threads)
        else:
            _fallback_lowbit_step(params, grads, exp_avgs, exp_avg_sqs, scales, outs, lr, beta1, beta2, eps,
                                  weight_decay, bc1, bc2, grad_scale, adamw_mode)
        return None
    if native.available():
        return _native_step(params, grads, exp_avgs, exp_avg_sqs, outs, gdtype, odtype, lr, beta1, beta2, eps,
                            weight_decay, bc1, bc2, grad_scale, adamw_mode, num_threads, sum_chunk_bytes, saves)
    else:
        _fallback_step(params, grads, exp_avgs, exp_avg_sqs, outs, lr, beta1, beta2, eps, weight_decay,
                       bc1, bc2, grad_scale, adamw_mode)


def _check_lengths(params, grads, exp_avgs, exp_avg_sqs, outs) -> None:
    n = len(params)
    if not (len(grads) == len(exp_avgs) == len(exp_avg_sqs) == n) or (outs is not None and len(outs) != n):
        raise ValueError(f"adamw_step_: list lengths differ: params {n}, grads {len(grads)}, "
                         f"exp_avgs {len(exp_avgs)}, exp_avg_sqs {len(exp_avg_sqs)}"
                         + (f", outs {len(outs)}" if outs is not None else ""))


def _check_saves(saves, params, outs, sum_chunk_bytes) -> None:
    """``saves`` of :func:`adamw_step_`: four lists (outs' None without
    outs) matching their buffers' sizes and dtypes."""
    if sum_chunk_bytes is not None:
        raise ValueError("adamw_step_: saves and sum_chunk_bytes cannot be combined")
    if len(saves) != 4 or any(saves[k] is None for k in range(3)) or (saves[3] is not None and outs is None):
        raise ValueError("adamw_step_(saves=...) takes (params, exp_avgs, exp_avg_sqs, outs), outs None "
                         "without outs (or where their old bytes are not kept)")
    for k, what in enumerate(("params", "exp_avgs", "exp_avg_sqs", "outs")):
        if saves[k] is None:
            continue
        for i, d in enumerate(saves[k]):
            want = torch.float32 if k < 3 else outs[i].dtype
            if i >= len(params) or d.numel() != params[i].numel() or d.dtype != want or not d.is_contiguous() \
                    or d.device.type != "cpu":
                raise ValueError(f"adamw_step_: saves of {what}[{i}] must be a contiguous CPU {want} tensor of "
                                 f"{params[i].numel() if i < len(params) else '?'} elements")
        if len(saves[k]) != len(params):
            raise ValueError(f"adamw_step_: saves of {what}: {len(saves[k])} tensors for {len(params)}")


def _check_call(params, grads, exp_avgs, exp_avg_sqs, outs, gdtype, odtype, step, lr, beta1, beta2, eps,
                weight_decay, pdtype=torch.float32) -> None:
    """The checks of ``validate=True``: hyper-parameters, step, then each
    buffer's type, layout, device, dtype (grads and outs: one dtype per call)
    and size."""
    check_hyperparameters(lr, (beta1, beta2), eps, weight_decay)
    if step < 1:
        raise ValueError(f"Invalid step: {step!r} (must be >= 1 after incrementing)")
    for i in range(len(params)):
        numel = params[i].numel() if isinstance(params[i], torch.Tensor) else -1
        _check_buffer(params[i], "params", i, numel,
                      (pdtype,) if pdtype in (torch.float32, torch.bfloat16) else (torch.float32, torch.bfloat16))
        _check_buffer(grads[i], "grads", i, numel, (gdtype,) if gdtype in _GRAD_DT else tuple(_GRAD_DT))
        _check_buffer(exp_avgs[i], "exp_avgs", i, numel, tuple(_MOMENT_DT))
        _check_buffer(exp_avg_sqs[i], "exp_avg_sqs", i, numel, tuple(_MOMENT_DT))
        if outs is not None:
            _check_buffer(outs[i], "outs", i, numel, (odtype,) if odtype in _OUT_DT else tuple(_OUT_DT))


def _check_moments(params, exp_avgs, exp_avg_sqs, exp_avg_scales, exp_avg_sq_scales, mdtype) -> None:
    """One moment dtype for the call; block scales exactly when it is uint8 (8-bit codes)."""
    for what, ts in (("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)):
        for i, t in enumerate(ts):
            if t.dtype != mdtype:
                raise TypeError(f"{what}[{i}] has dtype {t.dtype} but exp_avgs[0] has {mdtype}; "
                                "the moments of one call share one dtype")
    scales = (("exp_avg_scales", exp_avg_scales), ("exp_avg_sq_scales", exp_avg_sq_scales))
    if mdtype != torch.uint8:
        for what, s in scales:
            if s is not None:
                raise ValueError(f"{what} given for {mdtype} moments; block scales belong to uint8 (8-bit) "
                                 "moments only")
        return
    for what, s in scales:
        if s is None or len(s) != len(params):
            raise ValueError(f"8-bit (uint8) moments need {what}, one fp32 tensor per parameter "
                             f"(got {'none' if s is None else len(s)} for {len(params)} parameters)")
        for i, t in enumerate(s):
            _check_buffer(t, what, i, _moments.num_blocks(params[i].numel()), (torch.float32,))


def _check_sum_chunk_bytes(sum_chunk_bytes: int) -> None:
    if not native.available():
        raise RuntimeError("adamw_step_(sum_chunk_bytes=...): the sums need infinity's native library, "
                           "which is not loaded")
    if sum_chunk_bytes < 4096 or sum_chunk_bytes & (sum_chunk_bytes - 1):
        raise ValueError(f"sum_chunk_bytes={sum_chunk_bytes}: must be a power of two >= 4096")


def _native_step(params, grads, exp_avgs, exp_avg_sqs, outs, gdtype, odtype, lr, beta1, beta2, eps,
                 weight_decay, bc1, bc2, grad_scale, adamw_mode, num_threads, sum_chunk_bytes=None, saves=None):
    n = len(params)
    ptrs = [t.data_ptr() for t in params]
    ptrs += [t.data_ptr() for t in grads]
    ptrs += [t.data_ptr() for t in exp_avgs]
    ptrs += [t.data_ptr() for t in exp_avg_sqs]
    ptrs += [t.data_ptr() for t in outs] if outs is not None else [0] * n
    ptr_arr = native.carray(ctypes.c_int64, 5 * n)(*ptrs)
    numel_arr = native.carray(ctypes.c_int64, n)(*[t.numel() for t in params])
    hp = native.AdamHParams(lr, beta1, beta2, eps, weight_decay, bc1, bc2, grad_scale, int(bool(adamw_mode)),
                            num_threads or native.default_num_threads())
    odt = _OUT_DT[odtype] if odtype is not None else native.DT_NONE
    sums = None
    if saves is not None:
        save_arr = native.carray(ctypes.c_int64, 4 * n)(*[t.data_ptr() for ts in saves[:3] for t in ts],
                                                        *([t.data_ptr() for t in saves[3]] if saves[3] is not None
                                                          else [0] * n))
        rc = native.lib().inf_adam_step_save(native.selected_isa(), n, ptr_arr, numel_arr, _GRAD_DT[gdtype], odt,
                                             ctypes.byref(hp), save_arr)
    elif sum_chunk_bytes is None:
        rc = native.lib().inf_adam_step(native.selected_isa(), n, ptr_arr, numel_arr, _GRAD_DT[gdtype], odt,
                                        ctypes.byref(hp))
    else:
        sums = [tuple(array.array("I", bytes(4 * chunk_count(4 * t.numel(), sum_chunk_bytes))) for _ in range(3))
                for t in params]
        sum_arr = native.carray(ctypes.c_int64, 3 * n)(*[sums[i][k].buffer_info()[0] for k in range(3)
                                                         for i in range(n)])
        rc = native.lib().inf_adam_step_sums(native.selected_isa(), n, ptr_arr, numel_arr, _GRAD_DT[gdtype], odt,
                                             ctypes.byref(hp), sum_chunk_bytes, sum_arr)
    if rc != 0:
        raise RuntimeError(f"inf_adam_step failed with code {rc} "
                           f"({'bad argument' if rc == native.E_INVAL else 'ISA unavailable'})")
    return sums


def _native_lowbit_step(params, grads, exp_avgs, exp_avg_sqs, scales, outs, gdtype, odtype, lr, beta1, beta2,
                        eps, weight_decay, bc1, bc2, grad_scale, adamw_mode, num_threads) -> None:
    """inf_adam_step_moments over bf16 or 8-bit moments."""
    n = len(params)
    mdt = _MOMENT_DT[exp_avgs[0].dtype]
    ptrs = [t.data_ptr() for ts in (params, grads, exp_avgs, exp_avg_sqs) for t in ts]
    ptrs += [t.data_ptr() for t in outs] if outs is not None else [0] * n
    for s in scales:
        ptrs += [t.data_ptr() for t in s] if mdt == native.DT_I8 else [0] * n
    ptr_arr = native.carray(ctypes.c_int64, 7 * n)(*ptrs)
    numel_arr = native.carray(ctypes.c_int64, n)(*[t.numel() for t in params])
    hp = native.AdamHParams(lr, beta1, beta2, eps, weight_decay, bc1, bc2, grad_scale, int(bool(adamw_mode)),
                            num_threads or native.default_num_threads())
    odt = _OUT_DT[odtype] if odtype is not None else native.DT_NONE
    rc = native.lib().inf_adam_step_moments(native.selected_isa(), n, ptr_arr, numel_arr, _GRAD_DT[gdtype], odt,
                                            mdt, ctypes.byref(hp))
    if rc != 0:
        raise RuntimeError(f"inf_adam_step_moments failed with code {rc} "
                           f"({'bad argument' if rc == native.E_INVAL else 'ISA unavailable'})")


def _fallback_lowbit_step(params, grads, exp_avgs, exp_avg_sqs, scales, outs, lr, beta1, beta2, eps,
                          weight_decay, bc1, bc2, grad_scale, adamw_mode) -> None:
    """bf16/8-bit moments without the native library: widen, step in fp32, store back."""
    for i in range(len(params)):
        state = {"exp_avg": exp_avgs[i], "exp_avg_sq": exp_avg_sqs[i]}
        if exp_avgs[i].dtype == torch.uint8:
            state.update(exp_avg_scale=scales[0][i], exp_avg_sq_scale=scales[1][i])
        m, v = _moments.decode(state)
        _fallback_step([params[i]], [grads[i]], [m], [v], [outs[i]] if outs is not None else None, lr, beta1,
                       beta2, eps, weight_decay, bc1, bc2, grad_scale, adamw_mode)
        new = _moments.encode(m, v, "int8" if exp_avgs[i].dtype == torch.uint8 else "bf16")
        exp_avgs[i].copy_(new["exp_avg"])
        exp_avg_sqs[i].copy_(new["exp_avg_sq"])
        if exp_avgs[i].dtype == torch.uint8:
            scales[0][i].copy_(new["exp_avg_scale"])
            scales[1][i].copy_(new["exp_avg_sq_scale"])


def _fallback_step(params, grads, exp_avgs, exp_avg_sqs, outs, lr, beta1, beta2, eps, weight_decay,
                   bc1, bc2, grad_scale, adamw_mode) -> None:
    """The same maths with torch ops (torch.optim.AdamW foreach=False order)."""
    step_size = lr / bc1
    bc2_sqrt = math.sqrt(bc2)
    for i, p in enumerate(params):
        g = grads[i].float() if grads[i].dtype != torch.float32 else grads[i]
        if grad_scale != 1.0:
            g = g * grad_scale
        if weight_decay != 0:
            if adamw_mode:
                p.mul_(1.0 - lr * weight_decay)
            else:
                g = g.add(p, alpha=weight_decay)
        exp_avgs[i].lerp_(g, 1.0 - beta1)
        exp_avg_sqs[i].mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = (exp_avg_sqs[i].sqrt() / bc2_sqrt).add_(eps)
        p.addcdiv_(exp_avgs[i], denom, value=-step_size)
        if outs is not None:
            outs[i].view(-1).copy_(p.view(-1))


def _check_master_call(params, mdtype, outs, sum_chunk_bytes, saves, seed, streams, offsets) -> None:
    """The options of a bf16-master call: a seed; per-tensor streams and
    offsets (block-aligned for 8-bit moments); nothing that needs an fp32 master."""
    for what, v in (("outs", outs), ("sum_chunk_bytes", sum_chunk_bytes), ("saves", saves)):
        if v is not None:
            raise ValueError(f"adamw_step_: {what} is not taken with bf16 params (a bf16 master is its own "
                             "compute copy); pass fp32 params for it")
    if seed is None:
        raise ValueError("adamw_step_: bf16 params (a bf16 master) need seed=, the run's stochastic-rounding seed")
    _master.check_seed(seed, "adamw_step_ seed")
    for what, vals in (("streams", streams), ("offsets", offsets)):
        if vals is None:
            continue
        if len(vals) != len(params):
            raise ValueError(f"adamw_step_: {len(vals)} {what} for {len(params)} params")
        for i, v in enumerate(vals):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2 ** (64 if what == "streams" else 63):
                raise ValueError(f"adamw_step_: {what}[{i}]={v!r} must be an int >= 0")
            if what == "offsets" and mdtype == torch.uint8 and v % _moments.QBLOCK:
                raise ValueError(f"adamw_step_: offsets[{i}]={v} is not a multiple of {_moments.QBLOCK}: a shard "
                                 "of 8-bit moments must start on a block edge of its tensor")


def _master_step(params, grads, exp_avgs, exp_avg_sqs, scales, gdtype, step, lr, beta1, beta2, eps, weight_decay,
                 grad_scale, adamw_mode, num_threads, seed, streams, offsets) -> None:
    """One step over bf16 masters: inf_adam_step_bf16p, or the same in torch ops."""
    n = len(params)
    bc1, bc2 = 1.0 - beta1 ** step, 1.0 - beta2 ** step
    if native.available():
        q8 = exp_avgs[0].dtype == torch.uint8
        ptrs = [t.data_ptr() for ts in (params, grads, exp_avgs, exp_avg_sqs) for t in ts] + [0] * n  # no outs
        for s in scales:
            ptrs += [t.data_ptr() for t in s] if q8 else [0] * n
        hp = native.AdamHParams(lr, beta1, beta2, eps, weight_decay, bc1, bc2, grad_scale, int(bool(adamw_mode)),
                                num_threads or native.default_num_threads())
        rc = native.lib().inf_adam_step_bf16p(
            native.selected_isa(), n, native.carray(ctypes.c_int64, 7 * n)(*ptrs),
            native.carray(ctypes.c_int64, n)(*[t.numel() for t in params]),
            native.carray(ctypes.c_int64, n)(*offsets), native.carray(ctypes.c_uint64, n)(*streams),
            _GRAD_DT[gdtype], _MOMENT_DT[exp_avgs[0].dtype], ctypes.byref(hp), seed, step)
        if rc != 0:
            raise RuntimeError(f"inf_adam_step_bf16p failed with code {rc} "
                               f"({'bad argument' if rc == native.E_INVAL else 'ISA unavailable'})")
        return
    for i, p in enumerate(params):
        x = p.float()
        args = ([x], [grads[i]], [exp_avgs[i]], [exp_avg_sqs[i]])
        if exp_avgs[i].dtype == torch.float32:
            _fallback_step(*args, None, lr, beta1, beta2, eps, weight_decay, bc1, bc2, grad_scale, adamw_mode)
        else:
            _fallback_lowbit_step(*args, tuple([s[i]] if s is not None else None for s in scales), None, lr, beta1,
                                  beta2, eps, weight_decay, bc1, bc2, grad_scale, adamw_mode)
        p.copy_(_master.stochastic_round(x, seed=seed, stream=streams[i], step=step, offset=offsets[i]))
