"""``optimizer.state`` of a managed model: torch's per-parameter mapping
(``step``, ``exp_avg``, ``exp_avg_sq``), read from the tiers on access.

[Note: optimizer.state]
torch's ``Optimizer.state`` maps each parameter that has been stepped to
its state; code reads it for logging, LR finders and some schedulers. In
infinity the moments live in the units' flat buffers (host, NVMe, or the
device), so the mapping reads them on access, one unit at a time (the last
unit read is kept until a step or a load changes it), never the whole
model's at once. What it returns are copies: an in-place write to them, or
an assignment into the mapping, raises naming ``load_state_dict``, the way
to change the moments (a write to a copy would be lost, silently).
``del state[p]`` and ``state.clear()`` go through: the state starts again
from zero, as torch's next step would start it.
A parameter that has no state (not stepped yet, frozen, not managed) gives
``{}``, as torch's ``defaultdict`` does.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
from torch._C import DisableTorchFunctionSubclass

from ..faults import UsageError

__all__ = ["StateView", "StateCopy"]

_IN_PLACE_DUNDER = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
                    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__setitem__"}
_HOW = ("optimizer.state is read from infinity's tiers, so this write would be lost. Change the moments with "
        "optimizer.load_state_dict(sd) (sd = optimizer.state_dict(), edited)")


class StateCopy(torch.Tensor):
    """A copy of optimizer state read through ``optimizer.state``: usable
    like any tensor; in-place writes raise (see [Note: optimizer.state])."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if args and type(args[0]) is StateCopy and (
                name in _IN_PLACE_DUNDER or (name.endswith("_") and not name.startswith("__"))):
            raise UsageError(f"{name}() on a tensor of optimizer.state: {_HOW}")
        with DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and type(out) is torch.Tensor and args and type(args[0]) is StateCopy \
                and out.layout is torch.strided and out.untyped_storage().data_ptr() == \
                args[0].untyped_storage().data_ptr():
            return out.as_subclass(StateCopy)  # a view of the copy stays read-only
        return out


class _Entry(dict):
    """One parameter's state: a dict that refuses assignment."""

    def _refuse(self, *args, **kwargs):
        raise UsageError(f"assignment into optimizer.state[p]: {_HOW}")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _refuse


class StateView(MutableMapping):
    """``optimizer.state`` for the engine's units: ``param_slot`` maps a
    parameter's id to (unit, slot index); ``read(u, kind)`` gives a unit's
    full buffer of ``kind`` (Values.read); ``version()`` changes whenever the
    moments may have (steps, loads); ``ready()`` runs before a read."""

    def __init__(self, param_slot: Dict[int, Tuple[Any, int]], params: Callable[[], list],
                 read: Callable[[Any, str], Optional[torch.Tensor]], version: Callable[[], object],
                 ready: Callable[[], None], forget: Callable[[Optional[list]], None]):
        self._slot, self._params, self._read, self._version = param_slot, params, read, version
        self._ready = ready  # raises where the moments cannot be read now; waits for updates in flight
        self._forget = forget  # forget(params or None for all): their state starts again, as torch's del/clear
        self._cached: Optional[Tuple[object, int, Dict[str, torch.Tensor]]] = None

    def _stepped(self, p) -> Optional[Tuple[Any, Any]]:
        hit = self._slot.get(id(p))
        if hit is None:
            return None
        u, i = hit
        s = u.layout.slots[i]
        return (u, s) if s.trainable and s.step > 0 else None

    def _moments(self, u) -> Dict[str, torch.Tensor]:
        key = (self._version(), u.index)
        if self._cached is None or self._cached[:2] != key:
            self._cached = None  # the old unit's copies go before the new ones are read
            self._cached = key + ({k: self._read(u, k) for k in ("exp_avg", "exp_avg_sq")},)
        return self._cached[2]

    def __getitem__(self, p) -> dict:
        hit = self._stepped(p)
        if hit is None:
            return _Entry()
        u, s = hit
        self._ready()
        m = self._moments(u)
        sl = slice(s.offset, s.offset + s.numel)
        out = {"step": torch.tensor(float(s.step)).as_subclass(StateCopy)}
        for k, buf in m.items():
            out[k] = buf[sl].detach().to("cpu", copy=True).view(s.shape).as_subclass(StateCopy)
        return _Entry(out)

    def __setitem__(self, p, value) -> None:
        raise UsageError(f"assignment into optimizer.state: {_HOW}")

    def __delitem__(self, p) -> None:
        """``del optimizer.state[p]``: ``p``'s moments and step count start again from zero."""
        if p not in self:
            raise KeyError(p)
        self._forget([p])

    def clear(self) -> None:
        """``optimizer.state.clear()``: every parameter's state starts again from zero (a fresh AdamW)."""
        self._forget(None)

    def __iter__(self) -> Iterator:
        return (p for p in self._params() if self._stepped(p) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __contains__(self, p) -> bool:
        return self._stepped(p) is not None

    def __repr__(self) -> str:
        return f"<optimizer.state of {len(self)} parameters, read from infinity's tiers>"
