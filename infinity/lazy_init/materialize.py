"""Materialisation into paging units: one replay of the tape that hands each
unit's final values to the engine as soon as they exist, then makes the
modules' meta buffers and parameters real."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.nn as nn

from .replay import plan, replay

if TYPE_CHECKING:
    from .recorder import Recorder

# Per unit, each parameter with the base it is a view of (None: not meta).
UnitBases = List[List[Tuple[nn.Parameter, Optional[int]]]]
Sink = Callable[[int, List[torch.Tensor]], None]


def materialize(rec: "Recorder", units_params: List[List[nn.Parameter]], sink: Sink) -> None:
    """See :meth:`Recorder.materialize`."""
    unit_bases, wanted = _unit_bases(rec, units_params)
    holders = _meta_holders(rec)
    held_bases = {rec.base_of(t) for _, _, t in holders}
    wanted |= held_bases
    status = plan(rec, wanted)
    delivery = _Delivery(rec, status, unit_bases, held_bases, sink)
    user_state = torch.get_rng_state()
    try:
        delivery.on_written(-1, {})   # units with nothing recorded: due before the replay
        real = replay(rec, wanted, status, delivery.on_written, delivery.releasable)
        if rec.rng_end is not None and not torch.equal(torch.get_rng_state(), rec.rng_end):
            raise RuntimeError("infinity.init: the replay drew a different amount of random numbers than "
                               "when the context closed; an operation's draws depend on values. Build this "
                               "model eagerly")
    finally:
        torch.set_rng_state(user_state)
    _install_holders(rec, holders, real)


def _unit_bases(rec: "Recorder", units_params: List[List[nn.Parameter]]) -> Tuple[UnitBases, Set[int]]:
    """Each unit's parameters with their bases, and the set of those bases."""
    unit_bases: UnitBases = []
    wanted: Set[int] = set()
    for params in units_params:
        row = []
        for p in params:
            b = rec.base_of(p) if p.is_meta else None
            if p.is_meta and b is None:
                raise ValueError(f"infinity.init: parameter {_param_name(rec, p)} is on the meta device but its "
                                 "storage was not created under the infinity.init context (was it replaced "
                                 "after the with block, e.g. by .to() or .half()?)")
            row.append((p, b))
            if b is not None:
                wanted.add(b)
        unit_bases.append(row)
    return unit_bases, wanted


class _Delivery:
    """Hands each unit to the sink right after the last run operation
    writing its bases, and lets the replay free a base once every unit
    using it has been delivered."""

    def __init__(self, rec: "Recorder", status: List[Optional[str]], unit_bases: UnitBases,
                 held_bases: Set[Optional[int]], sink: Sink) -> None:
        self.rec = rec
        self.unit_bases = unit_bases
        self.held_bases = held_bases
        self.sink = sink
        # A unit is due right after the last run operation writing its bases.
        last_write: Dict[int, int] = {}
        for i, op in enumerate(rec.tape):
            if status[i] == "run":
                for b in [b for _, b in op.outputs] + ([op.target] if op.target is not None else []):
                    last_write[b] = i
        self.due: Dict[int, List[int]] = {}
        self.users: Dict[int, int] = {}
        for ui, row in enumerate(unit_bases):
            at = max([last_write[b] for _, b in row if b is not None], default=-1)
            self.due.setdefault(at, []).append(ui)
            for _, b in row:
                if b is not None:
                    self.users[b] = self.users.get(b, 0) + 1

    def releasable(self, b: int) -> bool:
        """Whether no undelivered unit and no module buffer still needs base ``b``."""
        return self.users.get(b, 0) == 0 and b not in self.held_bases

    def on_written(self, i: int, real: Dict[int, torch.Tensor]) -> None:
        """Delivers the units due after tape index ``i``."""
        for ui in self.due.get(i, ()):
            self._emit(ui, i, real)

    def _emit(self, ui: int, i: int, real: Dict[int, torch.Tensor]) -> None:
        values = []
        for p, b in self.unit_bases[ui]:
            if b is None:
                values.append(p.detach().to("cpu", torch.float32))
                continue
            v = real[b].as_strided(tuple(p.shape), tuple(p.stride()), p.storage_offset())
            v = v if v.dtype == torch.float32 else v.float()
            values.append(v)
            _make_real(p, v)
        self.sink(ui, values)
        del values
        for _, b in self.unit_bases[ui]:
            if b is not None:
                self.users[b] -= 1
                # The engine has copied it; later reads keep it until their turn.
                if self.releasable(b) and self.rec.last_use.get(b, -1) <= i:
                    real.pop(b, None)


def _install_holders(rec: "Recorder", holders: List[Tuple[nn.Module, str, torch.Tensor]],
                     real: Dict[int, torch.Tensor]) -> None:
    """Replaces each recorded meta buffer or tensor attribute by its real value."""
    for mod, name, t in holders:
        flat = real[rec.base_of(t)]
        v = flat.as_strided(tuple(t.shape), tuple(t.stride()), t.storage_offset())
        if v.numel() != flat.numel():
            v = v.clone()  # do not keep a whole base alive for a slice of it
        if name in mod._buffers:
            mod._buffers[name] = v
        else:
            object.__setattr__(mod, name, v)


def _meta_holders(rec: "Recorder") -> List[Tuple[nn.Module, str, torch.Tensor]]:
    """(module, attribute, meta tensor) of every module buffer, and plain
    tensor attribute, recorded under the context."""
    out = []
    for mod in list(rec.modules):
        for name, b in mod._buffers.items():
            if b is not None and b.is_meta and rec.base_of(b) is not None:
                out.append((mod, name, b))
        for name, v in vars(mod).items():
            if (isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter) and v.is_meta
                    and rec.base_of(v) is not None):
                out.append((mod, name, v))
    return out


def _param_name(rec: "Recorder", p: torch.Tensor) -> str:
    for mod in list(rec.modules):
        for name, q in mod._parameters.items():
            if q is p:
                return f"{type(mod).__name__}.{name} (shape {tuple(p.shape)})"
    return f"of shape {tuple(p.shape)}"


def _make_real(p: nn.Parameter, value: torch.Tensor) -> None:
    """Turns meta parameter ``p`` into a CPU one holding ``value``, in place
    (every reference to ``p`` sees it; its Python attributes are kept): the
    engine then re-points its ``.data`` at its own buffers, which torch
    refuses for a meta tensor."""
    if not p.is_meta:
        return
    new = nn.Parameter(value, requires_grad=p.requires_grad)
    attrs = dict(p.__dict__)
    try:
        if weakref.getweakrefs(p):
            # nn.RNNBase keeps weak references to its weights. They follow the
            # Python object, whose identity the swap keeps; swap_tensors
            # refuses them only to be conservative, so swap the impls alone.
            torch._C._swap_tensor_impl(p, new)
        else:
            torch.utils.swap_tensors(p, new)
            p.__dict__.clear()
            p.__dict__.update(attrs)
    except RuntimeError as e:
        raise RuntimeError(f"infinity.init: cannot turn the meta parameter of shape {tuple(p.shape)} into a real "
                           f"one: {e}") from e
