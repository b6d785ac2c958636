"""``model.state_dict()`` of a managed model gives the true values.

[Note: state_dict of a managed model]
Outside forward a parameter whose unit is not resident points at a NaN
stand-in (residency.py), so torch's ``state_dict()`` would return NaN for
every offloaded parameter, silently. A post-hook on every module that holds
managed parameters replaces each such entry with the parameter's values in
its own dtype (the compute copy, read from whichever tier holds it, one unit
at a time) as an ordinary CPU tensor. ``keep_vars=True`` entries (the
parameters themselves, which infinity's own readers ask for) are left alone.
Under ZeRO the reads are collectives: every rank calls ``state_dict()``, as
with FSDP. A model whose parameters would not fit in RAM raises, naming
``infinity.export_pretrained`` and ``infinity.save_checkpoint``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from .. import sysinfo
from ..config import format_bytes
from .faults import UsageError

__all__ = ["install_state_dict_hooks"]

RAM_FRACTION = 0.8  # of what the process may still use: above it, state_dict() refuses


class _UnitCache:
    """The last unit's compute copy read, valid while no value changed."""

    def __init__(self, eng):
        self.eng = eng
        self._key: Optional[tuple] = None
        self._buf: Optional[torch.Tensor] = None

    def value(self, u, s) -> torch.Tensor:
        key = (u.index, self.eng.values_version)
        if self._key != key:
            self._buf = None
            self._buf = self.eng.read(u, "compute")
            self._key = key
        return self._buf[s.offset:s.offset + s.numel].view(s.shape).to("cpu", copy=True)

    def clear(self) -> None:
        self._key, self._buf = None, None


def install_state_dict_hooks(model: nn.Module, eng) -> list:
    """Registers the hooks of [Note: state_dict of a managed model]; returns their handles."""
    cache = _UnitCache(eng)
    handles = []
    for module in model.modules():
        if any(p is not None and id(p) in eng.param_slot for p in module._parameters.values()):
            handles.append(module.register_state_dict_post_hook(
                lambda mod, sd, prefix, meta: _replace(mod, sd, prefix, eng, cache)))
    handles.append(model.register_state_dict_pre_hook(lambda mod, prefix, keep_vars: _check_room(eng, keep_vars)))
    handles.append(model.register_state_dict_post_hook(lambda mod, sd, prefix, meta: cache.clear()))
    return handles


def _replace(module: nn.Module, sd: dict, prefix: str, eng, cache: _UnitCache) -> None:
    for name, p in module._parameters.items():
        key = prefix + name
        v = sd.get(key)
        if p is None or v is None or isinstance(v, nn.Parameter):
            continue  # keep_vars=True: the parameter object itself was asked for
        hit = eng.param_slot.get(id(p))
        if hit is None:
            continue
        eng.faults.check("model.state_dict()")
        u, i = hit
        sd[key] = cache.value(u, u.layout.slots[i])


def _check_room(eng, keep_vars: bool) -> None:
    if keep_vars:
        return
    need = sum(u.place.compute_bytes for u in eng.units)
    room = sysinfo.available_ram()
    if need > RAM_FRACTION * room:
        raise UsageError(
            f"model.state_dict(): the parameters take {need} bytes ({format_bytes(need)}), more than "
            f"{int(RAM_FRACTION * 100)}% of the RAM this process may still use ({format_bytes(room)}). Stream them "
            "instead: infinity.export_pretrained(model, out_dir) (Hugging Face layout) or "
            "infinity.save_checkpoint(path, model, optimizer)")
