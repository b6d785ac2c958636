"""Managed parameters answer torch calls made outside forward with their true values.

[Note: parameters outside forward]
Outside a pass a parameter whose unit is not resident points at a NaN
stand-in (residency.py): the values live in infinity's tiers. Read or
written there, a plain parameter would give NaN, and an in-place edit
(``with torch.no_grad(): p.fill_(5.0)``) would land in the stand-in and be
lost, silently. So between passes every managed parameter's class is
:class:`ManagedParameter`, whose ``__torch_function__``:

- passes metadata through (shape, dtype, device, requires_grad, hooks);
- reads: runs the call on the parameter's true values (its compute copy,
  one unit read at a time and cached until a value changes). Results that
  alias those values are :class:`ValueCopy` tensors, which refuse in-place
  writes: a write there would not reach the parameter;
- writes (in-place calls on the parameter, ``p[i] = v``, ``p.data = t``):
  run on the fp32 value and write it through to every tier (master, compute
  home, device copy). ``model.load_state_dict`` batches its writes per unit;
- ``p.data`` is a view object that reads and writes through the same way;
- ``p.grad`` is None when no gradient is held; between backward and step
  the gradients are in the tiers, so it raises naming the infinity way.

During the root module's forward the classes are ``nn.Parameter`` again
(forward pays nothing); a unit's forward called on its own, or a
recomputation in backward, is recognised by its pin, and the backward's own
hooks run with the engine's ``quiet`` flag. Under ZeRO-3 with several ranks a read is a
collective, and a single in-place write needs every rank: both raise,
naming ``model.state_dict()`` / ``model.load_state_dict()`` (which every
rank calls, as with FSDP).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.nn as nn
from torch._C import DisableTorchFunctionSubclass

from ..faults import UsageError

__all__ = ["ManagedParameter", "ValueCopy", "ParamGuard"]

_META_ATTRS = {"shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "ndim", "layout", "names",
               "is_cuda", "is_cpu", "is_sparse", "is_quantized", "is_meta", "is_mkldnn", "is_mps", "is_xpu",
               "is_nested", "output_nr", "_version", "_backward_hooks", "_post_accumulate_grad_hooks",
               "is_sparse_csr", "_base", "itemsize", "nbytes", "retains_grad", "__class__", "__dict__"}
_META_METHODS = {"size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex",
                 "is_signed", "stride", "is_contiguous", "register_hook", "register_post_accumulate_grad_hook",
                 "__len__", "get_device", "retain_grad", "is_shared", "is_pinned", "_is_view", "ndimension",
                 "__hash__", "_is_zerotensor", "is_inference", "__torch_function__"}
_NO_STORAGE = {"data_ptr", "untyped_storage", "storage", "_typed_storage", "set_", "resize_", "resize_as_",
               "share_memory_", "detach_", "as_strided_", "_storage", "storage_offset"}
_INPLACE_DUNDER = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
                   "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__", "__setitem__"}


def _plain(func, args, kwargs):
    with DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _map(obj: Any, fn) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(x, fn) for x in obj) if type(obj) in (list, tuple) else obj
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    return obj


def _in_place(name: str) -> bool:
    return (name.endswith("_") and not name.startswith("__")) or name in _INPLACE_DUNDER


def _target(t: torch.Tensor) -> Optional[nn.Parameter]:
    """The managed parameter ``t`` stands for (itself or its ``.data`` view), or None."""
    d = t.__dict__
    return t if "_infinity_guard" in d else d.get("_infinity_of")


class ManagedParameter(nn.Parameter):
    """The class of a managed parameter between passes (see [Note: parameters outside forward])."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__", "__delete__"):
            return _attribute(func, name, getattr(getattr(func, "__self__", None), "__name__", ""), args, kwargs)
        if name in _META_METHODS or func is torch.autograd.grad:
            # autograd.grad differentiates w.r.t. the leaf itself (its graph's
            # node), not its values: the parameter passes as it is.
            return _plain(func, args, kwargs)
        managed = [t for t in _tensors((args, kwargs)) if isinstance(t, ManagedParameter) and _target(t) is not None]
        live = [p for p in (_target(t) for t in managed) if not p._infinity_guard.live(p)]
        if not live:
            return _plain(func, args, kwargs)
        guard = live[0]._infinity_guard
        if name == "requires_grad_":
            _check_requires_grad(live[0], args[1] if len(args) > 1 else kwargs.get("requires_grad", True))
            return args[0]
        if name in _NO_STORAGE:
            raise UsageError(f"{name}() on parameter {guard.name(live[0])!r}, managed by infinity: outside forward "
                             "it has no storage of its own (its values live in infinity's tiers). Read it with "
                             "model.state_dict() or use its values (p.detach().clone()), not its memory")
        if "out" in kwargs and any(_target(t) is not None for t in _tensors(kwargs["out"])):
            raise UsageError(f"out= a managed parameter ({guard.name(live[0])!r}): write it with p.copy_(result)")
        if _in_place(name) and args and isinstance(args[0], torch.Tensor) and _target(args[0]) is not None:
            return guard.write(func, args, kwargs)
        return guard.read(func, args, kwargs)

    def _ordinary(self) -> Optional[nn.Parameter]:
        """An ordinary Parameter holding the true values (None: not managed)."""
        p = _target(self)
        if p is None:
            return None
        value = p._infinity_guard.value(p).as_subclass(torch.Tensor).clone()
        return nn.Parameter(value, requires_grad=p.requires_grad)

    def __reduce_ex__(self, proto):
        # torch.save(p) / pickle: the true values, as an ordinary Parameter.
        out = self._ordinary()
        return super().__reduce_ex__(proto) if out is None else out.__reduce_ex__(proto)

    def __deepcopy__(self, memo):
        out = self._ordinary()
        if out is None:
            return super().__deepcopy__(memo)
        memo[id(self)] = out
        return out


class ValueCopy(torch.Tensor):
    """A tensor aliasing a managed parameter's values read outside forward:
    usable like any tensor, but in-place writes raise (they would change a
    copy, not the parameter)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "as_subclass" or name in ("__get__", "__set__") or name in _META_METHODS:
            return _plain(func, args, kwargs)
        if _in_place(name) and args and type(args[0]) is ValueCopy:
            raise UsageError(f"{name}() on a tensor that aliases the values of parameter "
                             f"{args[0].__dict__.get('_infinity_name', '?')!r}, read outside forward: infinity "
                             "keeps the values in its tiers, so this write would not reach the parameter. Write "
                             "the parameter itself (with torch.no_grad(): p.copy_(...) / p.mul_(...)) or use "
                             "model.load_state_dict(...)")
        out = _plain(func, args, kwargs)
        srcs = [t for t in _tensors((args, kwargs)) if type(t) is ValueCopy]
        return _wrap_aliases(out, srcs, srcs[0].__dict__.get("_infinity_name", "?")) if srcs else out

    def __reduce_ex__(self, proto):
        return self.as_subclass(torch.Tensor).__reduce_ex__(proto)


def _tensors(obj: Any) -> List[torch.Tensor]:
    out: List[torch.Tensor] = []
    _map(obj, lambda t: out.append(t) or t)
    return out


def _storage_ptr(t: torch.Tensor) -> int:
    with DisableTorchFunctionSubclass():
        return t.untyped_storage().data_ptr() if t.layout is torch.strided and t.device.type != "meta" else -1


_VALUE_TAGS = ("_infinity_of_value", "_infinity_version")


def _wrap_aliases(out: Any, values: List[torch.Tensor], name: str) -> Any:
    """``out`` with every tensor that shares storage with one of ``values`` made a ValueCopy."""
    ptrs = {_storage_ptr(v): v for v in values}
    ptrs.pop(-1, None)
    ptrs.pop(0, None)

    def wrap(t):
        src = ptrs.get(_storage_ptr(t)) if type(t) is torch.Tensor else None
        if src is not None:
            with DisableTorchFunctionSubclass():
                t = t.as_subclass(ValueCopy)
            t._infinity_name = name
            for k in _VALUE_TAGS:
                if k in src.__dict__:
                    t.__dict__[k] = src.__dict__[k]
        return t

    return _map(out, wrap) if ptrs else out


def _check_requires_grad(p: nn.Parameter, value: bool) -> None:
    if bool(value) != p.requires_grad:
        raise UsageError(
            f"{'unfreezing' if value else 'freezing'} parameter {p._infinity_guard.name(p)!r} after "
            "infinity.initialize: which parameters train is fixed at initialize (it places their optimizer "
            "state). Set requires_grad before initialize, or infinity.close(model) and initialize again")


def _attribute(func, kind: str, attr: str, args, kwargs):
    t = args[0]
    p = _target(t) if isinstance(t, torch.Tensor) else None
    if p is None or p._infinity_guard.live(p) or attr in _META_ATTRS and kind == "__get__":
        return _plain(func, args, kwargs)
    guard = p._infinity_guard
    if attr == "data":
        if kind == "__get__":
            return guard.data_view(p)
        value = args[1]
        if tuple(value.shape) != tuple(p.shape) or value.dtype != p.dtype or value.device != p.device:
            raise UsageError(
                f"p.data = a tensor of shape {tuple(value.shape)}, {value.dtype} on {value.device}, for parameter "
                f"{guard.name(p)!r} ({tuple(p.shape)}, {p.dtype} on {p.device}) after infinity.initialize: a "
                "managed parameter keeps its shape, and its dtype and device are Config.dtype and "
                "Config.device. Write values with p.copy_(t) or model.load_state_dict(...)")
        if getattr(value, "_infinity_of_value", None) is p and guard.unchanged(value):
            return None  # model.to() with this parameter's own values: nothing to write
        return guard.write(torch.Tensor.copy_, (t, value), {})
    if attr == "grad":
        return guard.grad(p, kind, args)
    if attr == "requires_grad" and kind == "__set__":
        _check_requires_grad(p, args[1])
        return None
    return guard.read(func, args, kwargs)


class ParamGuard:
    """The [Note: parameters outside forward] of one engine's parameters."""

    def __init__(self, eng):
        self.eng = eng
        self.params = [s.param for u in eng.units for s in u.layout.slots]
        self.batch: Optional[Dict[int, Dict[int, torch.Tensor]]] = None  # load_state_dict: unit -> slot -> fp32
        self.collective = 0  # state_dict() calls in progress: every rank reads alike
        self._key: Optional[tuple] = None
        self._buf: Optional[torch.Tensor] = None
        for p in self.params:
            p._infinity_guard = self

    # -- class switching (engine.begin_pass / end_pass) -------------------------------------

    def arm(self) -> None:
        """Between passes: every managed parameter answers through this guard."""
        for p in self.params:
            p.__class__ = ManagedParameter

    def disarm(self) -> None:
        """A pass runs: ordinary parameters (forward and backward pay nothing)."""
        for p in self.params:
            p.__class__ = nn.Parameter

    def release(self) -> None:
        """``infinity.close``: ordinary parameters for good."""
        self.disarm()
        for p in self.params:
            p.__dict__.pop("_infinity_guard", None)
        self.clear()

    # -- reads ----------------------------------------------------------------------------------

    def live(self, p: nn.Parameter) -> bool:
        """True where ``p``'s own storage is what torch should see: the engine
        itself is at work, a unit's forward runs with ``p``'s unit pinned, or
        autograd runs a backward."""
        eng = self.eng
        return eng.quiet.active or torch._C._current_graph_task_id() != -1 or \
            (eng.hooks.in_unit_call and eng.param_slot[id(p)][0].dev.pins > 0)

    def name(self, p: nn.Parameter) -> str:
        u, i = self.eng.param_slot[id(p)]
        return u.layout.slots[i].name

    def value(self, p: nn.Parameter, device=None) -> torch.Tensor:
        """``p``'s true values (compute dtype) as a new tensor on ``device``
        (default ``p``'s own; the CPU within ``state_dict()``, whose entries
        are CPU tensors: no round trip through the GPU)."""
        eng = self.eng
        self._check_readable(p)
        u, i = eng.param_slot[id(p)]
        s = u.layout.slots[i]
        key = (u.index, eng.values_version)
        if self._key != key:
            self._buf = None
            with eng.faults.guard("reading a parameter outside forward"):
                self._buf = eng.values.read(u, "compute")
            self._key = key
        if device is None:
            device = "cpu" if self.collective else p.device
        out = self._buf[s.offset:s.offset + s.numel].view(s.shape).to(device, copy=True)
        out.__dict__["_infinity_of_value"] = p
        out.__dict__["_infinity_version"] = eng.values_version
        return out

    def unchanged(self, value: torch.Tensor) -> bool:
        return value.__dict__.get("_infinity_version") == self.eng.values_version

    def clear(self) -> None:
        self._key, self._buf = None, None

    def enter(self) -> None:
        """A module's ``state_dict()`` starts (called on every rank alike)."""
        self.collective += 1

    def leave(self) -> None:
        self.collective = max(0, self.collective - 1)
        if not self.collective:
            self.clear()

    def _check_readable(self, p) -> None:
        eng = self.eng
        if eng.modes.zero == 3 and eng.sharding.world > 1 and not self.collective:
            raise UsageError(
                f"reading parameter {self.name(p)!r} outside forward under ZeRO-3 on {eng.sharding.world} ranks: "
                "each rank holds a shard, so a read is a collective. Call model.state_dict() or "
                "infinity.full_state_dict(model) on every rank")
        if eng.schedule is not None and eng.schedule.updates_in_flight():
            raise UsageError(
                f"reading parameter {self.name(p)!r} between backward and optimizer.step() with "
                "overlap='backward': some units are already being updated, so their values are neither the "
                "old nor the new ones. Read after optimizer.step(), or use overlap='step'")

    def read(self, func, args, kwargs):
        """Runs ``func`` on the true values of the managed parameters in its arguments."""
        values: List[torch.Tensor] = []

        def swap(t):
            p = _target(t)
            if p is None:
                return t
            v = self.value(p)
            values.append(v)
            return v

        out = _plain(func, _map(args, swap), _map(kwargs, swap))
        return _wrap_aliases(out, values, self.name(_target(args[0]))
                             if args and isinstance(args[0], torch.Tensor) and _target(args[0]) is not None
                             else "?")

    def data_view(self, p: nn.Parameter) -> torch.Tensor:
        """``p.data`` outside forward: a tensor that reads and writes through to ``p``."""
        with DisableTorchFunctionSubclass():
            v = torch.Tensor._make_subclass(ManagedParameter, torch.Tensor.data.__get__(p), False)
        v._infinity_of = p
        return v

    def grad(self, p: nn.Parameter, kind: str, args):
        eng = self.eng
        held = eng.grads.micro_batches > 0
        if kind == "__get__" and not held:
            return None
        if kind == "__set__" and args[1] is None:
            return _plain(torch.Tensor.grad.__set__, args, {})
        raise UsageError(
            f"p.grad of parameter {self.name(p)!r}, managed by infinity: its gradient goes straight from "
            "autograd into infinity's tiers, not to p.grad. Clip with infinity.Config(max_grad_norm=...) (the "
            "norm is optimizer.last_grad_norm after step()); gradients cannot be set by hand")

    # -- writes ---------------------------------------------------------------------------------

    def write(self, func, args, kwargs):
        """Runs the in-place ``func`` on ``args[0]``'s parameter's fp32 value and writes it through."""
        eng = self.eng
        p = _target(args[0])
        u, i = eng.param_slot[id(p)]
        s = u.layout.slots[i]
        if eng.in_pass and eng.pass_grad:
            raise UsageError(
                f"writing parameter {s.name!r} between a forward and its backward: the forward's saved "
                "tensors would no longer match. Call backward() first, or run that forward under "
                "torch.no_grad()")
        if eng.sharding.world > 1 and self.batch is None:
            raise UsageError(
                f"writing parameter {s.name!r} outside forward on {eng.sharding.world} ranks: each rank holds "
                "shards of it, so every rank must write it alike. Use model.load_state_dict(sd) on every rank")
        eng.optimizer.flush()  # delayed mode: the queued update lands first, not over this write
        whole = getattr(func, "__name__", "") == "copy_" and tuple(args[1].shape) == tuple(s.shape)
        # A whole copy lands on the CPU, where the tiers are written from: a
        # batch of them (load_state_dict) holds no device memory.
        cur = torch.empty(s.shape, dtype=torch.float32) if whole else self._fp32(p, u, s)
        new = (cur,) + tuple(_map(a, lambda t: self.value(_target(t)) if _target(t) is not None else t)
                             for a in args[1:])
        _plain(func, new, kwargs)
        if self.batch is not None:
            self.batch.setdefault(u.index, {})[i] = cur
        else:
            self._store(u, {i: cur})
        return args[0] if getattr(func, "__name__", "") != "__setitem__" else None

    def _fp32(self, p, u, s) -> torch.Tensor:
        """``p``'s current value in fp32 (the master when it trains), as a new tensor on ``p``'s device."""
        if s.trainable:
            with self.eng.faults.guard("writing a parameter outside forward"):
                master = self.eng.values.read(u, "master")
            return master[s.offset:s.offset + s.numel].view(s.shape).to(p.device, torch.float32, copy=True)
        return self.value(p).float()

    def _store(self, u, values: Dict[int, torch.Tensor]) -> None:
        eng = self.eng
        with eng.faults.guard("writing a parameter outside forward"):
            eng.values.write(u, {i: v.reshape(-1) for i, v in values.items()})
        self.clear()

    def flush_batch(self) -> None:
        """Writes the batched values of ``load_state_dict``, a unit at a time, in unit order (every rank alike)."""
        batch, self.batch = self.batch, None
        for u in self.eng.units:
            if batch and u.index in batch:
                self._store(u, batch[u.index])
