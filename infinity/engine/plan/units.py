"""Paging units: which parameters move together, and their flat layout.

Policy (which modules form units) is :func:`partition`; the layout of one
unit's parameters inside its flat buffers is :class:`Layout`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn


__all__ = ["Slot", "Layout", "Unit", "partition", "build_units"]

# Each parameter starts on a multiple of this many elements: 128 bytes of
# fp32, so vector loads in the kernels and copies start on cache lines.
ALIGN_ELEMS = 32


def _align(n: int, a: int = ALIGN_ELEMS) -> int:
    return -(-n // a) * a


@dataclass
class Slot:
    """One parameter's place in its unit's flat buffers (offsets in elements)."""

    param: nn.Parameter
    name: str          # first qualified name in the model
    offset: int
    numel: int
    shape: torch.Size
    trainable: bool
    group: int = 0     # optimizer param-group index (trainable only)
    step: int = 0      # optimizer steps taken (torch keeps this per parameter)


class Layout:
    """Flat layout of a unit: trainable parameters first (grouped by optimizer
    param group), then frozen ones. Optimizer buffers (fp32 master, grads,
    moments) cover only ``[0, trainable_numel)``; the compute copy covers
    ``[0, numel)``. ``numel`` is padded to ``pad_to`` so a later ZeRO stage can
    split every buffer into equal shards. ``align``: elements each trainable
    slot starts on (and the shards' unit), a multiple of ALIGN_ELEMS; int8
    moments need whole blocks ([Note: low-bit moments in the engine] in
    opt_kinds.py)."""

    def __init__(self, named: Sequence[Tuple[str, nn.Parameter]], group_of: Dict[int, Optional[int]],
                 pad_to: int = 1, align: int = ALIGN_ELEMS):
        # A parameter mapped to None is in no optimizer group: frozen, as torch leaves it unchanged.
        trains = [p.requires_grad and group_of.get(id(p), 0) is not None for _, p in named]
        trainable = [np_ for np_, t in zip(named, trains) if t]
        frozen = [np_ for np_, t in zip(named, trains) if not t]
        trainable.sort(key=lambda np_: group_of.get(id(np_[1]), 0))  # stable: registration order in a group
        self.slots: List[Slot] = []
        off = 0
        for n, p in trainable:
            self.slots.append(Slot(p, n, off, p.numel(), p.shape, True, group_of.get(id(p), 0)))
            off = _align(off + p.numel(), align)
        self.trainable_numel = _align(off, max(pad_to, 1) * align) if trainable else 0
        off = self.trainable_numel
        for n, p in frozen:
            self.slots.append(Slot(p, n, off, p.numel(), p.shape, False))
            off = _align(off + p.numel())
        self.numel = _align(off, max(pad_to, 1) * ALIGN_ELEMS)
        self.trainable_slots = [s for s in self.slots if s.trainable]

    def grad_buckets(self, max_elems: int) -> List[Tuple[int, int]]:
        """Runs ``[i, j)`` of trainable slot indices whose span (first offset
        to last end, in elements) is at most ``max_elems``, in slot order; a
        slot alone larger than that is a run of its own."""
        runs: List[Tuple[int, int]] = []
        ts = self.trainable_slots
        i = 0
        while i < len(ts):
            j = i + 1
            while j < len(ts) and ts[j].offset + ts[j].numel - ts[i].offset <= max_elems:
                j += 1
            runs.append((i, j))
            i = j
        return runs

    @staticmethod
    def zero_padding(buf: torch.Tensor, slots: List[Slot]) -> None:
        """Zeroes the elements of ``buf`` outside ``slots`` (the alignment gaps
        and the tail), leaving the slots' data as it is."""
        end = 0
        for s in slots:
            if s.offset > end:
                buf[end:s.offset].zero_()
            end = s.offset + s.numel
        buf[end:].zero_()


class Unit:
    """A group of parameters that moves between tiers together.

    ``layout`` places each parameter in the unit's flat buffers; ``place`` is
    its frozen placement (placement.UnitPlacement). Each owner keeps its own
    record here and is the only one to write it: ``dev`` (residency.py),
    ``host`` (host_cache.py), ``grads`` (grads.py), ``opt`` (optstate.py).
    """

    def __init__(self, index: int, name: str, modules: List[nn.Module], layout: Layout):
        self.index = index
        self.name = name
        self.modules = modules
        self.layout = layout
        self.place = None   # placement.UnitPlacement, set once by the engine
        self.dev = None     # residency.DeviceRecord
        self.host = None    # host_cache.HostRecord
        self.grads = None   # grads.GradRecord
        self.opt = None     # optstate.OptRecord

    @property
    def compute_numel(self) -> int:
        return self.layout.numel

    @property
    def trainable_numel(self) -> int:
        return self.layout.trainable_numel

    def __repr__(self) -> str:
        state = self.dev.state.value if self.dev is not None else "unplaced"
        pins = self.dev.pins if self.dev is not None else 0
        return f"Unit({self.index}, {self.name!r}, {self.layout.numel} elems, {state}, pins={pins})"


def build_units(model: nn.Module, unit_classes, group_of: Dict[int, int], shards: int,
                align: int = 0) -> List[Unit]:
    """The root unit (index 0: every parameter in no unit module, and those
    shared between units, such as tied embeddings) and one unit per module
    of :func:`partition` that owns parameters of its own. ``align``: the
    trainable slots' alignment in elements (0: ALIGN_ELEMS; see Layout)."""
    align = align or ALIGN_ELEMS
    owners: Dict[int, List[str]] = {}
    params: Dict[int, nn.Parameter] = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for pname, p in mod.named_parameters(prefix=mod_name, recurse=False):
            owners.setdefault(id(p), []).append(pname)
            params[id(p)] = p
    unit_mods = partition(model, unit_classes)
    assigned: Dict[int, int] = {}
    per_unit: List[List[Tuple[str, nn.Parameter]]] = [[] for _ in unit_mods]
    for ui, (uname, umod) in enumerate(unit_mods):
        prefix = uname + "."
        for pname, p in umod.named_parameters(prefix=uname):
            # A parameter also owned outside this unit (tied weights) lives in
            # the root unit, which is resident whenever any unit computes.
            if id(p) in assigned or any(not o.startswith(prefix) for o in owners[id(p)]):
                continue
            assigned[id(p)] = ui
            per_unit[ui].append((pname, p))
    root = [(owners[pid][0], p) for pid, p in params.items() if pid not in assigned]
    units = [Unit(0, "<root>", [model], Layout(root, group_of, shards, align))]
    for ui, (uname, umod) in enumerate(unit_mods):
        if per_unit[ui]:
            units.append(Unit(len(units), uname, [umod], Layout(per_unit[ui], group_of, shards, align)))
    return units


def _matches(module: nn.Module, classes: Sequence[Union[str, type]]) -> bool:
    for c in classes:
        if isinstance(c, str):
            if type(module).__name__ == c or f"{type(module).__module__}.{type(module).__name__}" == c:
                return True
        elif isinstance(module, c):
            return True
    return False


def partition(model: nn.Module, unit_classes: Optional[Sequence[Union[str, type]]] = None
              ) -> List[Tuple[str, nn.Module]]:
    """The modules that form paging units, outermost first, in registration order.

    Default policy: every child of every ``nn.ModuleList`` (transformer blocks).
    With ``unit_classes``: every module whose class matches. A module nested
    inside another unit is not a unit of its own. Everything else belongs to
    the root unit. Containers that are never called (``ModuleList``,
    ``ModuleDict``) are not units: a unit's hooks must run when it computes,
    so the search goes on inside them.
    """
    found: List[Tuple[str, nn.Module]] = []

    def visit(prefix: str, mod: nn.Module) -> None:
        for name, child in mod.named_children():
            q = f"{prefix}.{name}" if prefix else name
            is_unit = _matches(child, unit_classes) if unit_classes else isinstance(mod, nn.ModuleList)
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                is_unit = False
            if is_unit and any(p is not None for p in child.parameters()):
                found.append((q, child))
            else:
                visit(q, child)

    visit("", model)
    if unit_classes:
        _check_classes_match(model, unit_classes)
    return found


def _check_classes_match(model: nn.Module, classes: Sequence[Union[str, type]]) -> None:
    """Each of ``Config.unit_classes`` must match some module: one that
    matches none (a misspelt name) left the whole model in the root unit,
    nothing offloaded, silently."""
    mods = list(model.modules())
    unmatched = [c for c in classes if not any(_matches(m, [c]) for m in mods)]
    if unmatched:
        names = sorted({type(m).__name__ for m in mods})
        show = [c if isinstance(c, str) else c.__name__ for c in unmatched]
        raise ValueError(f"Config.unit_classes: {show} match no module of the model; its module classes are "
                         f"{names[:20]}{' ...' if len(names) > 20 else ''}")
