"""What a checkpoint of one model holds, in the order it is streamed: unit by
unit, each unit's buffer read once from wherever it lives (see [Note: what a
checkpoint holds] in save.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..engine.faults import UsageError
from ..engine.plan.opt_kinds import QBLOCK, kind_dtype, kind_numel, state_kinds
from ..engine.plan.state import GradState
from .safetensors_io import nbytes

__all__ = ["Plan", "plan_checkpoint", "Item"]

# name, dtype, shape, source() -> the tensor's values (CPU or device, any layout)
Item = Tuple[str, torch.dtype, Tuple[int, ...], Callable[[], torch.Tensor]]


@dataclass
class Plan:
    """The tensors of a checkpoint (model file(s), optimizer file(s)), the
    tied names and, per parameter, its unit slot."""

    eng: object
    names: Dict[int, str]                      # id(param) -> its checkpoint name
    aliases: Dict[str, str]                    # other state_dict name -> checkpoint name
    buffers: Dict[str, torch.Tensor]           # persistent buffers by state_dict name
    model_items: List[Item] = field(default_factory=list)
    optim_items: List[Item] = field(default_factory=list)
    reader: "UnitReader" = None

    def __post_init__(self):
        self.reader = UnitReader(self.eng)

    @property
    def total_bytes(self) -> int:
        return sum(nbytes(d, s) for _, d, s, _ in self.model_items + self.optim_items)

    @property
    def step(self) -> int:
        """The largest Adam step count of any parameter (0 before the first step)."""
        return max((s.step for u in self.eng.units for s in u.layout.trainable_slots), default=0)

    def stream(self) -> List[Tuple[str, Item]]:
        """Every item as ("model" | "optimizer", item), in the order a save
        writes them: unit by unit, each unit's weights then its moments (its
        tensors are spread over the two files but written together, so a
        background save releases a unit soon: [Note: a background save]), in
        the order the units' updates came in the last step (last unit first
        with overlap="backward" unless clipping or fp16 hold the updates
        until ``step()``); the buffers last. Each file holds its tensors
        in this order."""
        rank = {u.index: k for k, u in enumerate(self.update_order())}

        def key(item: Item) -> int:
            src = item[3]
            return rank[src.u.index] if isinstance(src, SlotSource) else len(rank)
        tagged = [(key(it), 0, k, "model", it) for k, it in enumerate(self.model_items)]
        tagged += [(key(it), 1, k, "optimizer", it) for k, it in enumerate(self.optim_items)]
        return [(prefix, it) for *_, prefix, it in sorted(tagged, key=lambda t: t[:3])]

    def update_order(self) -> list:
        """Every unit: the trainable ones in the order the optimizer's
        schedule expects to update them next (the last step's order), then
        the frozen ones in program order."""
        sched = self.eng.schedule
        first = sched.update_order() if sched is not None else []
        seen = {u.index for u in first}
        return first + [u for u in self.eng.units if u.index not in seen]

    @property
    def moment_dtype(self) -> str:
        """The moments' stored dtype (Config.moment_dtype), as the manifest records it."""
        return self.eng.modes.moment_dtype

    def moment_shapes(self, moment_dtype: str) -> Dict[str, Tuple[int, ...]]:
        """Name -> shape of the optimizer tensors a checkpoint of ``moment_dtype`` holds for this model."""
        return {f"{kind}.{self.names[id(s.param)]}": _kind_shape(kind, s)
                for u in self.eng.units for kind in state_kinds(moment_dtype)[1:] for s in u.layout.trainable_slots}

    def param_steps(self) -> Dict[str, int]:
        return {self.names[id(s.param)]: int(s.step) for u in self.eng.units for s in u.layout.trainable_slots}

    def param_groups(self, optimizer) -> List[dict]:
        """The groups' hyper-parameters (JSON) with their parameters by name."""
        out = []
        for g in optimizer.param_groups:
            d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
            d["params"] = [self.names[id(p)] for p in g["params"]]
            out.append(d)
        return out

    def check_between_steps(self, what: str) -> None:
        """Refuses a save while gradients of an unfinished accumulation window are held."""
        eng = self.eng
        if eng.in_pass or any(u.grads.state is GradState.ACCUMULATING for u in eng.units):
            raise UsageError(f"{what}: gradients of a backward not yet stepped are held; they are not part of a "
                             "checkpoint, so the resumed run would differ. Call it after optimizer.step() (and "
                             "before the next backward)")


def _names(model: nn.Module) -> Tuple[Dict[int, str], Dict[str, str], Dict[str, torch.Tensor]]:
    """(id(param) -> first name, alias -> first name, persistent buffers by name)."""
    names: Dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    aliases, buffers = {}, {}
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) in names:
            if names[id(value)] != key:
                aliases[key] = names[id(value)]
        elif isinstance(value, torch.Tensor):
            buffers[key] = value
    return names, aliases, buffers


def plan_checkpoint(model: nn.Module, eng, exclude_frozen: bool = False) -> Plan:
    """The plan of ``model``'s checkpoint (``eng`` its engine)."""
    names, aliases, buffers = _names(model)
    plan = Plan(eng, names, aliases, buffers)
    for u in eng.units:
        _unit_items(plan, u, exclude_frozen)
    for key, b in buffers.items():
        plan.model_items.append((key, b.dtype, tuple(b.shape), lambda b=b: b))
    return plan


def _unit_items(plan: Plan, u, exclude_frozen: bool) -> None:
    dtype_of = {"master": plan.eng.optstate.dtype_of("master"), "compute": plan.eng.modes.dtype}
    for kind, want in (("master", True), ("compute", False)):
        for s in u.layout.slots:
            if s.trainable is not want or (not want and exclude_frozen):
                continue
            plan.model_items.append((plan.names[id(s.param)], dtype_of[kind], tuple(s.shape),
                                     SlotSource(plan.reader, u, kind, s)))
    md = plan.eng.modes.moment_dtype  # stored as they are: int8 codes with their scales
    for kind in state_kinds(md)[1:]:
        for s in u.layout.trainable_slots:
            plan.optim_items.append((f"{kind}.{plan.names[id(s.param)]}", kind_dtype(kind, md), _kind_shape(kind, s),
                                     SlotSource(plan.reader, u, kind, s)))


def _kind_shape(kind: str, s) -> Tuple[int, ...]:
    """A slot's tensor of ``kind``: the parameter's shape, or its int8 scales' (a scale per block)."""
    return tuple(s.shape) if kind in ("master", "compute", "exp_avg", "exp_avg_sq") else (kind_numel(kind, s.numel),)


class SlotSource:
    """The values of one slot of one of a unit's buffers (an item's source)."""

    __slots__ = ("reader", "u", "kind", "s")

    def __init__(self, reader, u, kind: str, s):
        self.reader, self.u, self.kind, self.s = reader, u, kind, s

    def __call__(self) -> torch.Tensor:
        return self.reader.slice(self.u, self.kind, self.s)


class UnitReader:
    """A unit's buffer of one kind, read from its tier when its first slot is
    asked for and dropped when another unit's or kind's is (bounded memory),
    the next one in :meth:`expect`'s order read meanwhile on a thread of its
    own (NVMe homes: the swap read overlaps the checkpoint write). So at most
    two units' buffers are held. Under ZeRO the reads are collectives, all
    issued from that one thread in the same order on every rank."""

    def __init__(self, eng):
        self.eng = eng
        self._key: Optional[tuple] = None
        self._buf: Optional[torch.Tensor] = None
        self._order: List[tuple] = []
        self._next: dict = {}  # key -> the key asked for after it
        self._units: Dict[tuple, object] = {}
        self._ahead: Optional[tuple] = None  # (key, future)
        self._pool = None
        self.read = eng.values.read_stored  # (unit, kind) -> buffer; a background save's copies what eviction could recycle

    def expect(self, items) -> None:
        """The order the buffers of ``items`` (a plan's item list) will be asked for."""
        self._order = []
        for _, _, _, src in items:
            if isinstance(src, SlotSource):
                key = (src.u.index, src.kind)
                self._units[key] = src.u
                if not self._order or self._order[-1] != key:
                    self._order.append(key)
        self._next = {}
        for k, nxt in zip(self._order, self._order[1:]):
            self._next.setdefault(k, nxt)  # the key's first appearance, as a scan would find

    def slice(self, u, kind: str, s) -> torch.Tensor:
        key = (u.index, kind)
        self._units.setdefault(key, u)
        if self._key != key:
            self._buf = None  # freed before the next one is read
            self._buf = self._take(key)
            self._key = key
            self._read_next(key)
        if kind.endswith("_scale"):  # int8 scales: the slot starts on a block (opt_kinds.slot_align)
            a = s.offset // QBLOCK
            return self._buf[a:a + kind_numel(kind, s.numel)]
        return self._buf[s.offset:s.offset + s.numel].view(s.shape)

    @property
    def resident(self) -> bool:
        """Whether the buffer the last slice came from is the unit's resident
        optimizer state itself (optstate.resident_view), not a copy: it holds
        still until the next update, so a write still reading it need not be
        waited for when the next buffer is taken (a temporary or pool buffer
        may be recycled then)."""
        if self._key is None or self._buf is None or self._key[1] == "compute":
            return False
        r = self.eng.optstate.resident_view(self._units[self._key], self._key[1])
        return r is not None and r.data_ptr() == self._buf.data_ptr()

    def _take(self, key: tuple) -> torch.Tensor:
        if self._ahead is not None:
            k, fut = self._ahead
            self._ahead = None
            buf = fut.result()  # a read's fault is raised here, on the caller's thread
            if k == key:
                return buf
        return self._submit(key).result()

    def _submit(self, key: tuple):
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="infinity-ckpt-state")
        return self._pool.submit(self.read, self._units[key], key[1])

    def _read_next(self, key: tuple) -> None:
        nxt = self._next.get(key)
        if nxt is not None:
            self._ahead = (nxt, self._submit(nxt))

    def done(self) -> None:
        """Drops the buffers; waits for a read still in flight (every rank issued it)."""
        self._buf, self._key = None, None
        if self._ahead is not None:
            _, fut = self._ahead
            self._ahead = None
            fut.exception()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
