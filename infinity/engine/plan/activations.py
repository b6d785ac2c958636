"""What autograd saves for backward in one forward, measured on meta tensors.

The model's forward runs on meta inputs under ``saved_tensors_hooks``; every
tensor autograd keeps for backward is summed once per storage, parameters
excluded (they are the tiers'). No memory is touched.

[Note: attention on meta tensors]
On meta tensors ``scaled_dot_product_attention`` cannot pick a fused kernel
and falls back to the math path, which saves the ``batch x heads x seq x seq``
scores: at sequence 2048 that is several times what the run keeps. A real run
takes a fused kernel (flash on the CPU for float inputs; flash or memory-
efficient on CUDA), which saves only query, key, value, the output, the
per-row log-sum-exp (fp32) and the mask when one is given. During the
measurement a ``TorchFunctionMode`` replaces each SDPA call with a stand-in
that returns the output's shape and saves exactly those tensors. Eager
attention (``attn_implementation="eager"``) is ordinary matmul and softmax,
measured as it is. Counted from the fused kernel's saved list (torch
2.13's ``_scaled_dot_product_flash_attention_for_cpu`` backward), checked
against a real CPU forward in tests/engine/test_activations.py.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .metacache import SHARED, MetaCache
from .repeats import KEEP, Run, cut, find_run

__all__ = ["activation_bytes", "checkpointing_state"]


def activation_bytes(model: nn.Module, run: Callable[[nn.Module], torch.Tensor],
                     unit_modules=()) -> Dict[str, int]:
    """What autograd saves for backward in ``run(model)`` (a forward on meta
    tensors returning the loss), parameters excluded, each storage once:
    ``saved`` (bytes), ``unit`` (the most saved inside one call of one of
    ``unit_modules``, the paging units' modules, measured with activation
    checkpointing off: what a block's backward holds, and with checkpointing
    what its recomputation adds), ``checkpointing`` (1 if the model
    checkpoints) and ``saved_other`` (``saved`` with checkpointing the other
    way, where the model can switch it: the built-in GPT, Hugging Face
    models; else -1). Attention through SDPA is counted as its fused kernel
    saves it (see [Note: attention on meta tensors])."""
    on = checkpointing_state(model)
    rep = find_run(model, {i: [m] for i, m in enumerate(unit_modules)})
    saved, unit = _saved_repeated(model, run, unit_modules, rep)
    other = -1
    with _checkpointing(model, not on) as switched:
        if switched:
            other, unit_other = _saved_repeated(model, run, unit_modules, rep)
            unit = unit_other if on else unit
    return {"saved": saved, "unit": unit, "checkpointing": int(on), "saved_other": other}


class _FusedAttention(torch.autograd.Function):
    """SDPA as a fused kernel keeps it for backward: the output's shape, and
    query, key, value, output, log-sum-exp and the mask saved."""

    @staticmethod
    def forward(ctx, q, k, v, mask):
        out = q.new_empty(q.shape[:-1] + v.shape[-1:])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse, *([] if mask is None else [mask]))
        return out

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - a measurement never runs backward
        raise RuntimeError("the fused-attention stand-in only measures what a forward saves")


class _FusedAttentionMode(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` to :class:`_FusedAttention`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
            return _FusedAttention.apply(q, k, v, mask)
        return func(*args, **kwargs)


def _saved_repeated(model: nn.Module, run, unit_modules, rep: Optional[Run]):
    """:func:`_saved`, from two short passes when the units hold a run of
    repeated blocks ([Note: a meta pass over repeated units] in repeats.py)."""
    if rep is not None:
        try:
            with cut(rep.container, rep.keys, KEEP):
                s_small, u_small = _saved(model, run, unit_modules)
            with cut(rep.container, rep.keys, KEEP + 1):
                s_big, u_big = _saved(model, run, unit_modules)
        except Exception:  # noqa: BLE001 - the forward cannot run cut (it counts its blocks itself): pass in full
            s_small = s_big = -1
        if s_big >= s_small >= 0:
            return s_small + (rep.n - KEEP) * (s_big - s_small), max(u_small, u_big)
    return _saved(model, run, unit_modules)


def _saved(model: nn.Module, run, unit_modules):
    """(bytes saved in all, the most saved within one unit module's call)."""
    params = {id(p) for p in model.parameters()}
    seen: Dict[int, int] = {}
    keep, stack, per_call = [], [], [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base if t._base is not None else t
        if id(base) not in params and id(t) not in params and id(base) not in seen:
            keep.append(base)  # referenced, so its id stays its own
            seen[id(base)] = base.numel() * base.element_size()
            if stack:
                stack[-1] += seen[id(base)]
        return t

    def pre(mod, args):
        stack.append(0)

    def post(mod, args, out):
        per_call.append(stack.pop())

    handles = [h for m in unit_modules for h in (m.register_forward_pre_hook(pre), m.register_forward_hook(post))]
    try:
        # The cache answers repeated ops' shapes ([Note: a meta pass from a cache] in metacache.py).
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _FusedAttentionMode(), MetaCache(SHARED):
            run(model)
    finally:
        for h in handles:
            h.remove()
    return sum(seen.values()), max(per_call)


def checkpointing_state(model: nn.Module) -> bool:
    """Whether ``model`` checkpoints activations (the built-in GPT's
    ``cfg.checkpoint``, Hugging Face's gradient checkpointing)."""
    gpt = getattr(getattr(model, "cfg", None), "checkpoint", None)
    return bool(gpt) if gpt is not None else bool(getattr(model, "is_gradient_checkpointing", False))


@contextlib.contextmanager
def _checkpointing(model: nn.Module, on: bool):
    """Activation checkpointing switched to ``on`` for a measurement (the
    built-in GPT's ``cfg.checkpoint``, Hugging Face's gradient checkpointing);
    yields whether the model could be switched, and switches it back."""
    was = checkpointing_state(model)
    cfg = getattr(model, "cfg", None)
    if cfg is not None and hasattr(cfg, "checkpoint"):
        cfg.checkpoint = on
        try:
            yield True
        finally:
            cfg.checkpoint = was
    elif getattr(model, "supports_gradient_checkpointing", False):
        (model.gradient_checkpointing_enable if on else model.gradient_checkpointing_disable)()
        try:
            yield True
        finally:
            (model.gradient_checkpointing_enable if was else model.gradient_checkpointing_disable)()
    else:
        yield False
