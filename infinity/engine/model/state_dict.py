"""``model.state_dict()`` and ``model.load_state_dict()`` of a managed model
give and take the true values.

[Note: state_dict of a managed model]
torch's ``state_dict()`` reads each parameter with ``detach()``, which
outside a pass reads the true values ([Note: parameters outside forward] in
param_guard.py). A post-hook on every module that holds managed parameters
makes each entry an ordinary CPU tensor (read here too when a pass is
running, where the parameter may be a stand-in). ``keep_vars=True``
entries (the parameters themselves, which infinity's own readers ask for)
are left alone. A model whose parameters would not fit in RAM raises,
naming ``infinity.export_pretrained`` and ``infinity.save_checkpoint``.

``load_state_dict`` goes through torch's own code (its key and shape checks,
``strict``, the missing and unexpected keys it returns); each ``param.copy_``
is a write through the guard, batched per unit and written when torch's load
is done. ``assign=True`` would replace managed parameters and is refused.
Under ZeRO every rank calls both, as with FSDP.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from ...system import sysinfo
from ..faults import UsageError
from ...config.runtime import format_bytes
from .param_guard import ParamGuard, ValueCopy

__all__ = ["install_state_dict_hooks", "install_model_methods", "remove_model_methods"]

RAM_FRACTION = 0.8  # of what the process may still use: above it, state_dict() refuses


def install_state_dict_hooks(model: nn.Module, eng, guard: ParamGuard) -> list:
    """Registers the hooks of [Note: state_dict of a managed model]; returns their handles."""
    handles = [model.register_state_dict_pre_hook(lambda mod, prefix, keep_vars: _begin(eng, guard, keep_vars))]
    for module in model.modules():
        if any(p is not None and id(p) in eng.param_slot for p in module._parameters.values()):
            if module is not model:
                handles.append(module.register_state_dict_pre_hook(lambda mod, prefix, keep_vars: guard.enter()))
            handles.append(module.register_state_dict_post_hook(
                lambda mod, sd, prefix, meta: _replace(mod, sd, prefix, eng, guard)))
            handles.append(module.register_load_state_dict_pre_hook(_refuse_assign))
    if not any(id(p) in eng.param_slot for p in model._parameters.values() if p is not None):
        handles.append(model.register_state_dict_post_hook(lambda mod, sd, prefix, meta: guard.leave()))
    return handles


def _begin(eng, guard: ParamGuard, keep_vars: bool) -> None:
    """The outermost state_dict() call: room checked, reads counted as collective from here."""
    _check_room(eng, keep_vars)
    guard.collective = 0  # a state_dict() that raised earlier left its count behind
    guard.enter()


def _replace(module: nn.Module, sd: dict, prefix: str, eng, guard: ParamGuard) -> None:
    for name, p in module._parameters.items():
        key = prefix + name
        v = sd.get(key)
        if p is None or v is None or isinstance(v, nn.Parameter) or id(p) not in eng.param_slot:
            continue  # keep_vars=True: the parameter object itself was asked for
        eng.faults.check("model.state_dict()")
        v = v if type(v) is ValueCopy else guard.value(p)
        sd[key] = v.as_subclass(torch.Tensor).to("cpu")
    guard.leave()


def _check_room(eng, keep_vars: bool) -> None:
    """Raises UsageError when the parameters would take more than RAM_FRACTION of the RAM left."""
    if keep_vars:
        return
    need, room = sum(u.place.compute_bytes for u in eng.units), sysinfo.available_ram()
    if need > RAM_FRACTION * room:
        raise UsageError(
            f"model.state_dict(): the parameters take {need} bytes ({format_bytes(need)}), more than "
            f"{int(RAM_FRACTION * 100)}% of the RAM this process may still use ({format_bytes(room)}). Stream them "
            "instead: infinity.export_pretrained(model, out_dir) (Hugging Face layout) or "
            "infinity.save_checkpoint(path, model, optimizer)")


def _refuse_assign(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
    if local_metadata.get("assign_to_params_buffers"):
        raise UsageError("load_state_dict(..., assign=True) on a model managed by infinity: it would replace the "
                         "managed parameters with the given tensors, which infinity does not hold. Load with "
                         "assign=False (the values are written into infinity's tiers)")


def install_model_methods(model: nn.Module, eng, guard: ParamGuard) -> None:
    """``model.load_state_dict`` batched per unit, and ``model.zero_grad``
    that also forgets infinity's gradients (Hugging Face's Trainer calls it
    instead of the optimizer's)."""
    cls = type(model)

    @functools.wraps(cls.load_state_dict)
    def load_state_dict(state_dict, strict: bool = True, assign: bool = False):
        guard.batch = {}
        try:
            out = cls.load_state_dict(model, state_dict, strict=strict, assign=assign)
        except BaseException:
            guard.batch = None  # torch raised before its load finished: nothing is written
            raise
        guard.flush_batch()
        return out

    @functools.wraps(cls.zero_grad)
    def zero_grad(set_to_none: bool = True):
        if eng.optimizer is not None and not eng.closed:
            eng.optimizer.zero_grad(set_to_none)
        cls.zero_grad(model, set_to_none)

    model.__dict__["load_state_dict"] = load_state_dict
    model.__dict__["zero_grad"] = zero_grad


def remove_model_methods(model: nn.Module) -> None:
    for name in ("load_state_dict", "zero_grad"):
        model.__dict__.pop(name, None)
