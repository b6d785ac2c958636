"""The tape: what an ``infinity.init`` context writes down while the program
builds its model on the meta device.

Each storage created under the context becomes a :class:`Base`; each
operation that creates one or writes into one becomes an :class:`Op` whose
tensor arguments are :class:`Ref` views of bases; a change of the global
generator's state by the program itself becomes a :class:`SetRng`. The tape
holds only meta tensors and small constants, so recording costs no weight
memory.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from .ops import (FULL_WRITE, META_ONLY, REFUSED, RNG_CREATE, RNG_WRITE, is_mutating, label, looks_random, short,
                  storage_key)


@dataclass
class Base:
    """One storage created under the context: the unit of materialisation."""

    index: int
    dtype: torch.dtype
    numel: int          # elements of ``dtype`` in the whole storage
    keep: torch.Tensor  # a meta tensor on it: keeps the storage (and its key) alive
    created_by: str


@dataclass(frozen=True)
class Ref:
    """A recorded tensor argument: a view of base ``base``."""

    base: int
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass
class Op:
    """One recorded operation, its arguments encoded (see :meth:`Recording.encode`)."""

    func: Callable
    label: str
    args: tuple
    kwargs: dict
    target: Optional[int] = None          # base written in place
    target_ref: Optional[Ref] = None
    full: bool = False                    # overwrites the whole target without reading it
    rng: bool = False                     # draws from the global generator
    outputs: List[Tuple[int, int]] = field(default_factory=list)  # (output leaf index, new base)
    reads: Set[int] = field(default_factory=set)
    out_meta: List[Tuple[int, torch.Size, torch.dtype]] = field(default_factory=list)


@dataclass
class SetRng:
    """The program changed the generator's state itself (manual_seed)."""

    state: torch.Tensor


class Recording:
    """The recording half of a recorder: the tape of one context.

    Holds only meta tensors and small constants (real tensors given to
    recorded operations are copied when recorded, as eager construction
    would have read them then)."""

    def __init__(self) -> None:
        self.bases: List[Base] = []
        self._by_key: Dict[int, int] = {}
        self.tape: List[Any] = []
        self.modules: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
        self.names: Dict[int, str] = {}   # base -> "Linear.weight" (for messages)
        self.rng_start: Optional[torch.Tensor] = None
        self.rng_end: Optional[torch.Tensor] = None   # after eager construction (None: not computed)
        self.rng_seen: Optional[torch.Tensor] = None
        self.default_dtype = torch.get_default_dtype()

    # ------------------------------------------------------------------ lookups

    def tracks(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a view of a storage created under this context."""
        return t.is_meta and storage_key(t) in self._by_key

    def base_of(self, t: torch.Tensor) -> Optional[int]:
        """The base ``t`` is a view of, or None."""
        return self._by_key.get(storage_key(t)) if t.is_meta else None

    def describe(self, t: torch.Tensor) -> str:
        """``t`` for messages: its module attribute name where known."""
        b = self.base_of(t)
        what = f"tensor of shape {tuple(t.shape)} ({t.dtype})"
        if b is not None and b in self.names:
            return f"{self.names[b]} ({what})"
        return what

    def _new_base(self, t: torch.Tensor, label: str) -> int:
        nbytes = t.untyped_storage().nbytes()
        b = Base(len(self.bases), t.dtype, nbytes // t.element_size(), t, label)
        self.bases.append(b)
        self._by_key[storage_key(t)] = b.index
        return b.index

    # ------------------------------------------------------------------ recording

    def note_rng(self) -> None:
        """Records a change of the global generator's state since the last operation."""
        # Meta operations draw nothing, so the real generator changes under
        # the context only if the program reseeds it: replay that change.
        now = torch.default_generator.get_state()
        if not torch.equal(now, self.rng_seen):
            self.tape.append(SetRng(now))
            self.rng_seen = now

    def encode(self, label: str, x: Any) -> Any:
        """One argument leaf as the tape keeps it: a :class:`Ref` for a
        recorded meta tensor, a copy for a real one, ``x`` otherwise."""
        if not isinstance(x, torch.Tensor):
            if isinstance(x, torch.Generator):
                raise NotImplementedError(f"infinity.init: {label} was given an explicit generator; lazy "
                                          "initialisation replays the global generator only. Drop generator= "
                                          "or build this model eagerly")
            return x
        if x.is_meta:
            b = self.base_of(x)
            if b is None:
                raise NotImplementedError(f"infinity.init: {label} reads a meta {self.describe(x)} that was not "
                                          "created under this infinity.init context; its values are unknown")
            if x.dtype != self.bases[b].dtype:
                raise NotImplementedError(f"infinity.init: {label} uses a {x.dtype} view of a "
                                          f"{self.bases[b].dtype} tensor ({self.describe(x)}); not supported")
            return Ref(b, tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.dtype)
        # A real tensor read by a recorded operation: copied now, since
        # eager construction reads it now.
        return x.detach().clone()

    def observe(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> None:
        """Records ``func(*args, **kwargs) -> out`` if it creates a meta
        tensor or writes into a recorded one; refuses what cannot be replayed."""
        name = short(func)
        mutating = is_mutating(name, kwargs)
        out_leaves, _ = tree_flatten(out)
        new = [(i, t) for i, t in enumerate(out_leaves)
               if isinstance(t, torch.Tensor) and t.is_meta and storage_key(t) not in self._by_key]
        if not new and not mutating:
            # Queries and views: a view shares its base's storage, and the
            # replay rebuilds views from (size, stride, offset).
            if name in RNG_CREATE or name in REFUSED or looks_random(name):
                _refuse_real_random(func, out_leaves)
            return
        if mutating and name in META_ONLY:
            return
        target_t = _target(args, kwargs) if mutating else None
        if mutating and (target_t is None or not target_t.is_meta):
            if name in RNG_WRITE or looks_random(name):
                _refuse_real_random(func, [target_t])
            return  # an eager operation on a real tensor: already done
        self._record(func, name, mutating, target_t, new, args, kwargs)

    def _record(self, func: Callable, name: str, mutating: bool, target_t: Optional[torch.Tensor],
                new: List[Tuple[int, torch.Tensor]], args: tuple, kwargs: dict) -> None:
        lbl = label(func)
        subject = target_t if target_t is not None else new[0][1]
        rng = self._draws(name, lbl, subject, mutating)
        where = f"{lbl} on {self.describe(subject)}"
        if kwargs.get("generator") is not None:
            self.encode(where, kwargs["generator"])
        self.note_rng()
        op = Op(func, lbl, (), {}, rng=rng)
        if target_t is not None:
            self._set_target(op, name, target_t)
        self._set_args(op, where, args, kwargs)
        for i, t in new:
            op.outputs.append((i, self._new_base(t, lbl)))
            op.out_meta.append((i, t.shape, t.dtype))
        self.tape.append(op)

    def _draws(self, name: str, lbl: str, subject: torch.Tensor, mutating: bool) -> bool:
        """Whether the operation draws from the global generator; raises for
        one whose replay would not be faithful."""
        if name in REFUSED:
            raise NotImplementedError(f"infinity.init: {lbl} on {self.describe(subject)} cannot be replayed "
                                      "faithfully (its random draws depend on values, or it replaces storage)")
        rng = name in RNG_WRITE if mutating else name in RNG_CREATE
        if not rng and looks_random(name):
            raise NotImplementedError(f"infinity.init: {lbl} on {self.describe(subject)} looks random but is "
                                      "not one infinity knows how to replay; build this model eagerly or "
                                      "initialise the tensor with torch.nn.init")
        return rng

    def _set_target(self, op: Op, name: str, target_t: torch.Tensor) -> None:
        tb = self.base_of(target_t)
        if tb is None:
            raise NotImplementedError(f"infinity.init: {op.label} writes into a meta "
                                      f"{self.describe(target_t)} not created under this context")
        op.target = tb
        op.target_ref = self.encode(op.label, target_t)
        whole = (target_t.storage_offset() == 0 and target_t.numel() == self.bases[tb].numel
                 and target_t.is_contiguous())
        op.full = whole and name in FULL_WRITE

    def _set_args(self, op: Op, where: str, args: tuple, kwargs: dict) -> None:
        leaves, spec = tree_flatten((args, kwargs))
        enc = [self.encode(where, x) for x in leaves]
        op.args, op.kwargs = tree_unflatten(enc, spec)
        op.reads = {x.base for x in enc if isinstance(x, Ref)}
        if op.full:
            # Reading the target only for its shape (the target argument itself).
            if not any(isinstance(x, Ref) and x.base == op.target and x != op.target_ref for x in enc):
                op.reads.discard(op.target)

    def adopt(self, module: nn.Module) -> None:
        """Remembers a module built under the context (its buffers and
        tensor attributes are made real after the replay)."""
        self.modules.add(module)

    def note_module(self, module: nn.Module, name: str, value: Any) -> None:
        """A module registered a parameter, buffer or submodule ``value`` as ``name``."""
        self.adopt(module)
        if isinstance(value, nn.Module):
            self.adopt(value)
        elif isinstance(value, torch.Tensor) and value.is_meta:
            b = self.base_of(value)
            if b is not None:
                self.names.setdefault(b, f"{type(module).__name__}.{name}")


def _target(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
    """The tensor an in-place operation writes into."""
    if isinstance(kwargs.get("out"), torch.Tensor):
        return kwargs["out"]
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    for k in ("tensor", "self", "input"):
        if isinstance(kwargs.get(k), torch.Tensor):
            return kwargs[k]
    return None


def _refuse_real_random(func: Callable, leaves: Sequence[Any]) -> None:
    for t in leaves:
        if isinstance(t, torch.Tensor) and not t.is_meta and t.device.type == "cpu":
            raise NotImplementedError(
                f"infinity.init: {label(func)} drew random numbers into a real CPU tensor inside the context "
                "(an explicit device=); it would run before the recorded initialisations instead of in "
                "construction order. Create it without device= or outside the context")
