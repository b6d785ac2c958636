"""torch calls that would silently do nothing on a managed model raise instead.

[Note: gradients torch cannot see]
A managed parameter's gradient goes from autograd straight into infinity's
tiers; ``p.grad`` stays None. ``torch.nn.utils.clip_grad_norm_`` (what
Hugging Face, Accelerate and most loops call) would then see no gradient,
clip nothing and return a norm of 0, silently. So ``initialize`` wraps
``clip_grad_norm_`` and ``clip_grad_value_`` once: called with any managed
parameter they raise, naming ``Config.max_grad_norm`` (clipping over all
units before any update; the norm is ``optimizer.last_grad_norm``). Other
parameters go to torch's own functions unchanged. ``torch.compile`` of a
managed model raises the same way (see ``_guard_compile``).
"""

from __future__ import annotations

import functools

import torch

from ..faults import UsageError

__all__ = ["install_torch_guards"]

_installed = False


def _managed(params, engines) -> bool:
    slots = [eng.param_slot for eng in engines]
    return any(id(p) in s for p in params for s in slots)


def _guard(fn, what: str, engines_of):
    @functools.wraps(fn)
    def wrapper(parameters, *args, **kwargs):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if _managed(params, engines_of()):
            raise UsageError(
                f"torch.nn.utils.{what} on parameters managed by infinity: their gradients live in infinity's "
                "tiers (p.grad is None), so torch would clip nothing. Set infinity.Config(max_grad_norm=...): "
                "infinity clips over all units before any update, and optimizer.last_grad_norm is the norm")
        return fn(params, *args, **kwargs)
    wrapper.__infinity_guard__ = True
    return wrapper


def _guard_compile(fn, engines_of):
    """``torch.compile`` of a managed model (or of its bound ``_call_impl``,
    which ``nn.Module.compile`` compiles) raises: dynamo would trace into the
    paging hooks, whose parameter swaps a graph cannot hold."""
    @functools.wraps(fn)
    def wrapper(model=None, *args, **kwargs):
        target = getattr(model, "__self__", model)
        if any(eng.model is target for eng in engines_of()):
            raise UsageError(
                "torch.compile of a model managed by infinity: its hooks page parameters in and out between "
                "modules, which a compiled graph cannot follow. Train it uncompiled")
        return fn(model, *args, **kwargs)
    wrapper.__infinity_guard__ = True
    return wrapper


def install_torch_guards(engines_of) -> None:
    """Wraps torch's gradient clipping and ``torch.compile`` once (``engines_of()``: the live engines)."""
    global _installed
    if _installed:
        return
    if not getattr(torch.compile, "__infinity_guard__", False):
        torch.compile = _guard_compile(torch.compile, engines_of)
    import torch.nn.utils as nn_utils
    import torch.nn.utils.clip_grad as clip_grad
    for name in ("clip_grad_norm_", "clip_grad_value_"):
        fn = getattr(clip_grad, name)
        if getattr(fn, "__infinity_guard__", False):
            continue
        guarded = _guard(fn, name, engines_of)
        setattr(clip_grad, name, guarded)
        setattr(nn_utils, name, guarded)
    _installed = True
