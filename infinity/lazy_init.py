"""``infinity.init``: build models larger than RAM without ever holding them.

    with infinity.init(config):
        model = build_model()          # parameters on the meta device: no storage
    model, opt = infinity.initialize(model, config)   # each unit materialised on its own

Under the context every module is created on the meta device, and a
``TorchFunctionMode`` records, in program order, each operation that creates
a tensor or writes into one (``torch.empty``, ``nn.init.normal_``,
``Tensor.uniform_``, ``mul_``, ...). ``initialize`` later replays that tape
(see [Note: replaying the tape]) on the CPU, from the global RNG state the
program had when it entered the context, and hands each paging unit's final
values to the engine as soon as the last operation writing them has run, so
only the units in progress (plus one scratch tensor the size of the largest
tensor) are ever in RAM.

[Note: reproducibility]
Eager construction draws every random number from torch's one global CPU
generator, in construction order, including draws that a later
re-initialisation throws away (``nn.Linear.__init__`` draws a Kaiming uniform
that ``GPT._init`` then overwrites). The replay runs every random operation
in the same order on a tensor of the same size and strides, so it consumes
the same numbers: a model built under ``infinity.init`` after
``torch.manual_seed(s)`` holds bit-for-bit the parameters of the model built
eagerly after ``torch.manual_seed(s)``. On leaving the context the global
generator is advanced exactly as eager construction would have left it (a
"dry" replay of the random operations alone, into scratch), so whatever the
program draws afterwards (data order, dropout) is the same too; ``initialize``
restores the generator after its own replay. ``torch.manual_seed`` or
``torch.set_rng_state`` called inside the context are honoured (a change of
the generator's state between two recorded operations is replayed as such);
``torch.get_rng_state`` (and so ``torch.random.fork_rng``) is refused there,
since it would read a state that no initialisation has advanced yet.

Config.seed: ``init`` does not reseed on its own. torch seeds its generator
at random at start-up, so "the program never seeded" cannot be told apart
from a deliberate seed, and seeding from ``Config.seed`` unconditionally would
override the program's own ``torch.manual_seed``. Pass
``infinity.init(config, seed=config.seed)`` (or call ``torch.manual_seed``)
to make the build reproducible from the config.

Refused (a ``NotImplementedError`` naming the operation and the tensor):
explicit ``generator=`` arguments, random operations whose draws depend on
tensor values (``multinomial``, ``poisson``), random operations producing
real (non-meta) tensors inside the context (they would run now, out of
order), other unknown random-looking operations, ``set_``/``resize_`` of a
recorded tensor. A parameter whose value comes from ``torch.empty`` that
nothing overwrote is zero-filled with a warning (eager construction would
leave uninitialised memory there).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn
import torch.nn.init as nn_init
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = ["init", "Recorder", "recorder_of"]

# module -> the recorder of the context it was built in. Weak: a dropped
# model frees its tape.
_RECORDERS: "weakref.WeakKeyDictionary[nn.Module, Recorder]" = weakref.WeakKeyDictionary()
_ACTIVE = threading.local()


def recorder_of(model: nn.Module) -> Optional["Recorder"]:
    """The recorder of the ``infinity.init`` context ``model`` was built in, or None."""
    return _RECORDERS.get(model)


# ---------------------------------------------------------------------------- op classes
# Short names (func.__name__). Random operations that overwrite their target
# whole: what they draw does not depend on what the target held, so a dead
# one can run on scratch to consume the same numbers.
_RNG_WRITE = {"uniform_", "normal_", "random_", "bernoulli_", "exponential_", "geometric_", "log_normal_",
              "cauchy_", "trunc_normal_", "_no_grad_trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
              "xavier_uniform_", "xavier_normal_", "orthogonal_", "sparse_", "_no_grad_uniform_",
              "_no_grad_normal_"}
_RNG_CREATE = {"rand", "randn", "randint", "randperm", "normal", "rand_like", "randn_like", "randint_like",
               "bernoulli"}
# Deterministic writes that overwrite a whole target without reading it.
_FULL_WRITE = {"fill_", "zero_", "copy_", "constant_", "ones_", "zeros_", "eye_", "dirac_", "_no_grad_fill_",
               "_no_grad_zero_"} | _RNG_WRITE
# In-place on metadata only (views, autograd flags): no value changes.
_META_ONLY = {"requires_grad_", "retain_grad", "share_memory_", "t_", "transpose_", "squeeze_", "unsqueeze_",
              "as_strided_", "detach_", "swapdims_", "swapaxes_", "rename_"}
_REFUSED = {"multinomial", "poisson", "set_", "resize_", "resize_as_", "_standard_gamma", "binomial"}
# Name tokens ("kaiming_normal_" -> kaiming, normal) of random operations.
_RNG_TOKENS = {"normal", "uniform", "bernoulli", "dropout", "multinomial", "poisson", "exponential", "cauchy",
               "geometric", "random", "binomial"}
_EMPTY = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"}
_INPLACE_DUNDER = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                   "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
                   "__imatmul__"}
# nn.init functions that return at once on meta tensors without any tensor
# operation the mode could see; patched while the context is open.
_PATCHED_INIT = ("_no_grad_trunc_normal_", "orthogonal_", "dirac_", "sparse_")


def _short(func: Callable) -> str:
    return getattr(func, "__name__", None) or type(func).__name__


def _label(func: Callable) -> str:
    mod = getattr(func, "__module__", None)
    qual = getattr(func, "__qualname__", _short(func))
    if mod == "torch.nn.init":
        return f"torch.nn.init.{_short(func)}"
    if qual.startswith(("TensorBase.", "Tensor.")):
        return "Tensor." + qual.split(".", 1)[1]
    if qual.startswith("_VariableFunctionsClass."):
        return "torch." + qual.split(".", 1)[1]
    return f"{mod}.{qual}" if mod else qual


def _is_mutating(name: str, kwargs: Dict[str, Any]) -> bool:
    if isinstance(kwargs.get("out"), torch.Tensor):
        return True
    if name in _INPLACE_DUNDER:
        return True
    return name.endswith("_") and not name.startswith("__")


def _looks_random(name: str) -> bool:
    tokens = [t for t in name.lower().split("_") if t]
    return any(t in _RNG_TOKENS or t.startswith("rand") or t.endswith("dropout") for t in tokens)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


# ---------------------------------------------------------------------------- the tape


@dataclass
class _Base:
    """One storage created under the context: the unit of materialisation."""

    index: int
    dtype: torch.dtype
    numel: int          # elements of ``dtype`` in the whole storage
    keep: torch.Tensor  # a meta tensor on it: keeps the storage (and its key) alive
    created_by: str


@dataclass(frozen=True)
class _Ref:
    """A recorded tensor argument: a view of base ``base``."""

    base: int
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    offset: int
    dtype: torch.dtype


@dataclass
class _Op:
    func: Callable
    label: str
    args: tuple
    kwargs: dict
    target: Optional[int] = None          # base written in place
    target_ref: Optional[_Ref] = None
    full: bool = False                    # overwrites the whole target without reading it
    rng: bool = False                     # draws from the global generator
    outputs: List[Tuple[int, int]] = field(default_factory=list)  # (output leaf index, new base)
    reads: Set[int] = field(default_factory=set)
    out_meta: List[Tuple[int, torch.Size, torch.dtype]] = field(default_factory=list)


@dataclass
class _SetRng:
    """The program changed the generator's state itself (manual_seed)."""

    state: torch.Tensor


class _Mode(TorchFunctionMode):
    def __init__(self, rec: "Recorder"):
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.rec._observe(func, args, kwargs, out)
        return out


class Recorder:
    """The tape of one ``infinity.init`` context and its replay.

    Holds only meta tensors and small constants (real tensors given to
    recorded operations are copied when recorded, as eager construction
    would have read them then)."""

    def __init__(self) -> None:
        self.bases: List[_Base] = []
        self._by_key: Dict[int, int] = {}
        self.tape: List[Any] = []
        self.modules: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
        self._names: Dict[int, str] = {}   # base -> "Linear.weight" (for messages)
        self.rng_start: Optional[torch.Tensor] = None
        self.rng_end: Optional[torch.Tensor] = None   # after eager construction (None: not computed)
        self._rng_seen: Optional[torch.Tensor] = None
        self.default_dtype = torch.get_default_dtype()
        self.last_use: Dict[int, int] = {}
        self.peak_held_bytes = 0   # most bytes of materialised tensors held at once by a replay

    # ------------------------------------------------------------------ recording

    def tracks(self, t: torch.Tensor) -> bool:
        return t.is_meta and _storage_key(t) in self._by_key

    def _base_of(self, t: torch.Tensor) -> Optional[int]:
        return self._by_key.get(_storage_key(t)) if t.is_meta else None

    def _describe(self, t: torch.Tensor) -> str:
        b = self._base_of(t)
        what = f"tensor of shape {tuple(t.shape)} ({t.dtype})"
        if b is not None and b in self._names:
            return f"{self._names[b]} ({what})"
        return what

    def _new_base(self, t: torch.Tensor, label: str) -> int:
        nbytes = t.untyped_storage().nbytes()
        b = _Base(len(self.bases), t.dtype, nbytes // t.element_size(), t, label)
        self.bases.append(b)
        self._by_key[_storage_key(t)] = b.index
        return b.index

    def _note_rng(self) -> None:
        # Meta operations draw nothing, so the real generator changes under
        # the context only if the program reseeds it: replay that change.
        now = torch.default_generator.get_state()
        if not torch.equal(now, self._rng_seen):
            self.tape.append(_SetRng(now))
            self._rng_seen = now

    def _encode(self, label: str, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            if isinstance(x, torch.Generator):
                raise NotImplementedError(f"infinity.init: {label} was given an explicit generator; lazy "
                                          "initialisation replays the global generator only. Drop generator= "
                                          "or build this model eagerly")
            return x
        if x.is_meta:
            b = self._base_of(x)
            if b is None:
                raise NotImplementedError(f"infinity.init: {label} reads a meta {self._describe(x)} that was not "
                                          "created under this infinity.init context; its values are unknown")
            if x.dtype != self.bases[b].dtype:
                raise NotImplementedError(f"infinity.init: {label} uses a {x.dtype} view of a "
                                          f"{self.bases[b].dtype} tensor ({self._describe(x)}); not supported")
            return _Ref(b, tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.dtype)
        # A real tensor read by a recorded operation: copied now, since
        # eager construction reads it now.
        return x.detach().clone()

    def _observe(self, func: Callable, args: tuple, kwargs: dict, out: Any) -> None:
        name = _short(func)
        mutating = _is_mutating(name, kwargs)
        out_leaves, _ = tree_flatten(out)
        new = [(i, t) for i, t in enumerate(out_leaves)
               if isinstance(t, torch.Tensor) and t.is_meta and _storage_key(t) not in self._by_key]
        if not new and not mutating:
            # Queries and views: a view shares its base's storage, and the
            # replay rebuilds views from (size, stride, offset).
            if name in _RNG_CREATE or name in _REFUSED or _looks_random(name):
                self._refuse_real_random(func, out_leaves)
            return
        if mutating and name in _META_ONLY:
            return
        label = _label(func)
        target_t = self._target(args, kwargs) if mutating else None
        if mutating and (target_t is None or not target_t.is_meta):
            if name in _RNG_WRITE or _looks_random(name):
                self._refuse_real_random(func, [target_t])
            return  # an eager operation on a real tensor: already done
        subject = target_t if target_t is not None else new[0][1]
        if name in _REFUSED:
            raise NotImplementedError(f"infinity.init: {label} on {self._describe(subject)} cannot be replayed "
                                      "faithfully (its random draws depend on values, or it replaces storage)")
        rng = name in _RNG_WRITE if mutating else name in _RNG_CREATE
        if not rng and _looks_random(name):
            raise NotImplementedError(f"infinity.init: {label} on {self._describe(subject)} looks random but is "
                                      "not one infinity knows how to replay; build this model eagerly or "
                                      "initialise the tensor with torch.nn.init")
        where = f"{label} on {self._describe(subject)}"
        if kwargs.get("generator") is not None:
            self._encode(where, kwargs["generator"])
        self._note_rng()
        op = _Op(func, label, (), {}, rng=rng)
        if target_t is not None:
            tb = self._base_of(target_t)
            if tb is None:
                raise NotImplementedError(f"infinity.init: {label} writes into a meta "
                                          f"{self._describe(target_t)} not created under this context")
            op.target = tb
            op.target_ref = self._encode(label, target_t)
            whole = (target_t.storage_offset() == 0 and target_t.numel() == self.bases[tb].numel
                     and target_t.is_contiguous())
            op.full = whole and name in _FULL_WRITE
        leaves, spec = tree_flatten((args, kwargs))
        enc = [self._encode(where, x) for x in leaves]
        op.args, op.kwargs = tree_unflatten(enc, spec)
        op.reads = {x.base for x in enc if isinstance(x, _Ref)}
        if op.full:
            # Reading the target only for its shape (the target argument itself).
            if not any(isinstance(x, _Ref) and x.base == op.target and x != op.target_ref for x in enc):
                op.reads.discard(op.target)
        for i, t in new:
            op.outputs.append((i, self._new_base(t, label)))
            op.out_meta.append((i, t.shape, t.dtype))
        self.tape.append(op)

    @staticmethod
    def _target(args: tuple, kwargs: dict) -> Optional[torch.Tensor]:
        if isinstance(kwargs.get("out"), torch.Tensor):
            return kwargs["out"]
        if args and isinstance(args[0], torch.Tensor):
            return args[0]
        for k in ("tensor", "self", "input"):
            if isinstance(kwargs.get(k), torch.Tensor):
                return kwargs[k]
        return None

    @staticmethod
    def _refuse_real_random(func: Callable, leaves: Sequence[Any]) -> None:
        for t in leaves:
            if isinstance(t, torch.Tensor) and not t.is_meta and t.device.type == "cpu":
                raise NotImplementedError(
                    f"infinity.init: {_label(func)} drew random numbers into a real CPU tensor inside the context "
                    "(an explicit device=); it would run before the recorded initialisations instead of in "
                    "construction order. Create it without device= or outside the context")

    def _note_module(self, module: nn.Module, name: str, value: Any) -> None:
        self.modules.add(module)
        _RECORDERS[module] = self
        if isinstance(value, nn.Module):
            self.modules.add(value)
            _RECORDERS[value] = self
        elif isinstance(value, torch.Tensor) and value.is_meta:
            b = self._base_of(value)
            if b is not None:
                self._names.setdefault(b, f"{type(module).__name__}.{name}")

    # ------------------------------------------------------------------ replay

    # [Note: replaying the tape]
    # A backward pass over the tape marks each operation "run" (its result is
    # observed: by a wanted tensor, or by a run operation reading it), "rng"
    # (its result is never observed but it draws random numbers: it runs on
    # scratch of the same size and strides, so the generator advances exactly
    # as in eager construction) or skipped. A tensor is thus materialised only
    # from its last whole overwrite on. The forward pass then runs the tape
    # once, frees each intermediate after its last use, and hands a unit's
    # values to the sink right after the last operation writing them.

    def _plan(self, wanted: Set[int]) -> List[Optional[str]]:
        live = set(wanted)
        status: List[Optional[str]] = [None] * len(self.tape)
        for i in range(len(self.tape) - 1, -1, -1):
            op = self.tape[i]
            if isinstance(op, _SetRng):
                status[i] = "set"
                continue
            writes = {b for _, b in op.outputs}
            if op.target is not None:
                writes.add(op.target)
            if writes & live:
                status[i] = "run"
                live -= {b for _, b in op.outputs}
                if op.full:
                    live.discard(op.target)
                live |= op.reads
            elif op.rng:
                status[i] = "rng"
        if live:
            b = self.bases[min(live)]
            raise RuntimeError(f"infinity.init: {self._names.get(b.index, 'a tensor')} has no recorded operation "
                               "that creates it")
        return status

    def _replay(self, wanted: Set[int], status: List[Optional[str]],
                on_written: Callable[[int, Dict[int, torch.Tensor]], None],
                releasable: Callable[[int], bool]) -> Dict[int, torch.Tensor]:
        """Runs the tape from ``rng_start`` following ``status`` (see
        :meth:`_plan`). ``on_written(i, real)`` is called after tape index
        ``i`` (``real``: base -> flat CPU tensor of every base held). A base
        is dropped after its last use, a wanted one only once
        ``releasable(base)``. Returns the bases still held at the end."""
        last_use: Dict[int, int] = {}
        for i, op in enumerate(self.tape):
            if status[i] == "run":
                for b in self._touched(op):
                    last_use[b] = i
        self.last_use = last_use
        real: Dict[int, torch.Tensor] = {}
        scratch = _Scratch()
        uninitialised: List[str] = []
        torch.set_rng_state(self.rng_start)
        prev_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.default_dtype)
        try:
            with torch.no_grad():
                for i, op in enumerate(self.tape):
                    st = status[i]
                    if st == "set":
                        torch.set_rng_state(op.state)
                    elif st == "run":
                        self._run(op, real, uninitialised)
                    elif st == "rng":
                        self._run_on_scratch(op, real, scratch)
                    held = sum(t.numel() * t.element_size() for t in real.values())
                    self.peak_held_bytes = max(self.peak_held_bytes, held)
                    on_written(i, real)
                    if st == "run":
                        for b in self._touched(op):
                            if last_use[b] == i and (b not in wanted or releasable(b)):
                                real.pop(b, None)
        finally:
            torch.set_default_dtype(prev_dtype)
        if uninitialised:
            warnings.warn("infinity.init: " + ", ".join(sorted(set(uninitialised))) + " come from torch.empty "
                          "and were never overwritten; zero-filled (eager construction would leave uninitialised "
                          "memory). If an initialiser ran on them, it is one torch skips on meta tensors and "
                          "infinity could not see: call it as torch.nn.init.<name>", RuntimeWarning, stacklevel=4)
        return real

    @staticmethod
    def _touched(op: "_Op") -> Set[int]:
        out = set(op.reads) | {b for _, b in op.outputs}
        if op.target is not None:
            out.add(op.target)
        return out

    def _resolve(self, op: _Op, real: Dict[int, torch.Tensor], scratch: Optional["_Scratch"] = None):
        def one(x: Any) -> Any:
            if not isinstance(x, _Ref):
                if isinstance(x, torch.device) and x.type == "meta":
                    return torch.device("cpu")
                if isinstance(x, str) and x == "meta":
                    return "cpu"
                return x
            if x.base in real:
                flat = real[x.base]
            elif scratch is not None:
                b = self.bases[x.base]
                flat = scratch.get(b.numel, b.dtype, target=x.base == op.target)
            else:
                raise RuntimeError(f"infinity.init (internal): {op.label} needs {self._names.get(x.base, 'a tensor')} "
                                   "before it was materialised")
            return flat.as_strided(x.size, x.stride, x.offset)

        return tree_map(one, op.args), tree_map(one, op.kwargs)

    def _run(self, op: _Op, real: Dict[int, torch.Tensor], uninitialised: List[str]) -> None:
        if op.target is not None and op.target not in real:
            if not op.full:
                raise RuntimeError(f"infinity.init (internal): {op.label} updates "
                                   f"{self._names.get(op.target, 'a tensor')} before it exists")
            b = self.bases[op.target]
            real[op.target] = torch.empty(b.numel, dtype=b.dtype)
        args, kwargs = self._resolve(op, real)
        out = op.func(*args, **kwargs)
        if not op.outputs:
            return
        leaves, _ = tree_flatten(out)
        for (i, b), (_, shape, dtype) in zip(op.outputs, op.out_meta):
            t = leaves[i]
            if t.shape != shape or t.dtype != dtype:
                raise RuntimeError(f"infinity.init: replaying {op.label} gave {tuple(t.shape)} {t.dtype}, recorded "
                                   f"{tuple(shape)} {dtype}")
            if _short(op.func) in _EMPTY:
                uninitialised.append(self._names.get(b, f"a tensor of shape {tuple(shape)}"))
                t.zero_()
            base = self.bases[b]
            if t.untyped_storage().nbytes() < base.numel * t.element_size():
                raise RuntimeError(f"infinity.init: replaying {op.label} gave a smaller storage than recorded")
            flat = torch.empty(0, dtype=base.dtype).set_(t.untyped_storage(), 0, (base.numel,), (1,))
            real[b] = flat

    def _run_on_scratch(self, op: _Op, real: Dict[int, torch.Tensor], scratch: "_Scratch") -> None:
        args, kwargs = self._resolve(op, real, scratch)
        op.func(*args, **kwargs)  # drawn only to advance the generator

    def advance_rng(self) -> None:
        """Computes the generator state eager construction would have left
        (a replay of the random operations alone, into scratch) and sets it."""
        self._replay(set(), self._plan(set()), lambda i, real: None, lambda b: True)
        self.rng_end = torch.get_rng_state()

    def materialize(self, units_params: List[List[nn.Parameter]],
                    sink: Callable[[int, List[torch.Tensor]], None]) -> None:
        """Runs the recorded initialisation once and calls ``sink(i, values)``
        exactly once per unit ``i`` (``values``: CPU fp32 tensors, one per
        parameter of ``units_params[i]``, in that order) as soon as the unit's
        values are final, holding only the units in progress (the sink must
        copy what it keeps). Afterwards the modules' meta buffers (and meta
        tensor attributes) are real. The global RNG state is left as it was
        at the call."""
        unit_bases: List[List[Tuple[nn.Parameter, Optional[int]]]] = []
        wanted: Set[int] = set()
        for params in units_params:
            row = []
            for p in params:
                b = self._base_of(p) if p.is_meta else None
                if p.is_meta and b is None:
                    raise ValueError(f"infinity.init: parameter {self._param_name(p)} is on the meta device but its "
                                     "storage was not created under the infinity.init context (was it replaced "
                                     "after the with block, e.g. by .to() or .half()?)")
                row.append((p, b))
                if b is not None:
                    wanted.add(b)
            unit_bases.append(row)
        holders = self._meta_holders()
        held_bases = {self._base_of(t) for _, _, t in holders}
        wanted |= held_bases
        status = self._plan(wanted)
        # A unit is due right after the last run operation writing its bases.
        last_write: Dict[int, int] = {}
        for i, op in enumerate(self.tape):
            if status[i] == "run":
                for b in [b for _, b in op.outputs] + ([op.target] if op.target is not None else []):
                    last_write[b] = i
        due: Dict[int, List[int]] = {}
        users: Dict[int, int] = {}
        for ui, row in enumerate(unit_bases):
            at = max([last_write[b] for _, b in row if b is not None], default=-1)
            due.setdefault(at, []).append(ui)
            for _, b in row:
                if b is not None:
                    users[b] = users.get(b, 0) + 1

        def releasable(b: int) -> bool:
            return users.get(b, 0) == 0 and b not in held_bases

        def emit(ui: int, i: int, real: Dict[int, torch.Tensor]) -> None:
            values = []
            for p, b in unit_bases[ui]:
                if b is None:
                    values.append(p.detach().to("cpu", torch.float32))
                    continue
                v = real[b].as_strided(tuple(p.shape), tuple(p.stride()), p.storage_offset())
                v = v if v.dtype == torch.float32 else v.float()
                values.append(v)
                _make_real(p, v)
            sink(ui, values)
            del values
            for _, b in unit_bases[ui]:
                if b is not None:
                    users[b] -= 1
                    # The engine has copied it; later reads keep it until their turn.
                    if releasable(b) and self.last_use.get(b, -1) <= i:
                        real.pop(b, None)

        def on_written(i: int, real: Dict[int, torch.Tensor]) -> None:
            for ui in due.get(i, ()):
                emit(ui, i, real)

        user_state = torch.get_rng_state()
        try:
            for ui in due.get(-1, ()):
                emit(ui, -1, {})
            real = self._replay(wanted, status, on_written, releasable)
            if self.rng_end is not None and not torch.equal(torch.get_rng_state(), self.rng_end):
                raise RuntimeError("infinity.init: the replay drew a different amount of random numbers than "
                                   "when the context closed; an operation's draws depend on values. Build this "
                                   "model eagerly")
        finally:
            torch.set_rng_state(user_state)
        for mod, name, t in holders:
            flat = real[self._base_of(t)]
            v = flat.as_strided(tuple(t.shape), tuple(t.stride()), t.storage_offset())
            if v.numel() != flat.numel():
                v = v.clone()  # do not keep a whole base alive for a slice of it
            if name in mod._buffers:
                mod._buffers[name] = v
            else:
                object.__setattr__(mod, name, v)

    def _meta_holders(self) -> List[Tuple[nn.Module, str, torch.Tensor]]:
        """(module, attribute, meta tensor) of every module buffer, and plain
        tensor attribute, recorded under the context."""
        out = []
        for mod in list(self.modules):
            for name, b in mod._buffers.items():
                if b is not None and b.is_meta and self._base_of(b) is not None:
                    out.append((mod, name, b))
            for name, v in vars(mod).items():
                if (isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter) and v.is_meta
                        and self._base_of(v) is not None):
                    out.append((mod, name, v))
        return out

    def _param_name(self, p: torch.Tensor) -> str:
        for mod in list(self.modules):
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


class _Scratch:
    """One buffer for targets and one for inputs of operations run only to
    advance the generator; grown to the largest tensor seen."""

    def __init__(self) -> None:
        self._bufs: Dict[bool, torch.Tensor] = {}

    def get(self, numel: int, dtype: torch.dtype, target: bool) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        buf = self._bufs.get(target)
        if buf is None or buf.numel() < nbytes:
            buf = self._bufs[target] = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes].view(dtype)


# ---------------------------------------------------------------------------- the context


@contextlib.contextmanager
def init(config: Any = None, *, seed: Optional[int] = None, advance_rng: bool = True) -> Iterator[Recorder]:
    """Builds the models constructed inside it without storage; see the module docstring.

    Args:
        config: the ``infinity.Config`` the model will be initialised with
            (kept for symmetry with ``initialize``; ``Config.seed`` is not
            applied implicitly, see the module docstring).
        seed: if given, ``torch.manual_seed(seed)`` on entry.
        advance_rng: leave the global generator where eager construction
            would (costs one replay of the random draws, about the time eager
            initialisation spends drawing). ``False`` leaves it where it was
            on entry.

    Yields the :class:`Recorder`. Contexts do not nest.
    """
    from .config import Config
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"infinity.init: config must be an infinity.Config or None, got {type(config).__name__}")
    if getattr(_ACTIVE, "rec", None) is not None:
        raise RuntimeError("infinity.init: contexts do not nest")
    if not hasattr(torch.utils, "swap_tensors"):
        raise RuntimeError(f"infinity.init needs torch >= 2.3 (torch.utils.swap_tensors); this is {torch.__version__}")
    if seed is not None:
        torch.manual_seed(seed)
    rec = Recorder()
    rec.rng_start = rec._rng_seen = torch.default_generator.get_state()
    from torch.nn.modules import module as _m
    handles = [
        _m.register_module_parameter_registration_hook(lambda m, n, v: rec._note_module(m, n, v)),
        _m.register_module_buffer_registration_hook(lambda m, n, v: rec._note_module(m, n, v)),
        _m.register_module_module_registration_hook(lambda m, n, v: rec._note_module(m, n, v)),
    ]
    originals = {name: getattr(nn_init, name) for name in _PATCHED_INIT}
    for name, fn in originals.items():
        setattr(nn_init, name, _recording(rec, fn))
    get_state = torch.get_rng_state
    torch.get_rng_state = torch.random.get_rng_state = _refuse_get_rng_state
    _ACTIVE.rec = rec
    ok = False
    try:
        with torch.device("meta"), _Mode(rec):
            yield rec
        rec._note_rng()
        ok = True
    finally:
        _ACTIVE.rec = None
        torch.get_rng_state = torch.random.get_rng_state = get_state
        for name, fn in originals.items():
            setattr(nn_init, name, fn)
        for h in handles:
            h.remove()
    if ok and advance_rng:
        rec.advance_rng()


def _refuse_get_rng_state() -> torch.Tensor:
    # Under the context nothing has been drawn yet, so the state read here
    # would differ from eager construction's, and restoring it later
    # (torch.random.fork_rng does) would replay different numbers.
    raise NotImplementedError("infinity.init: torch.get_rng_state() (or torch.random.fork_rng) inside the context "
                              "would see the generator before any initialisation drew from it, unlike eager "
                              "construction; seed with torch.manual_seed instead, or build this model eagerly")


def _recording(rec: Recorder, original: Callable) -> Callable:
    """``original`` (an nn.init function that skips meta tensors) recorded as one operation."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = args[0] if args else kwargs.get("tensor")
        # Bookkeeping only: the mode need not see the recorder's own queries.
        with torch._C.DisableTorchFunction():
            mine = isinstance(t, torch.Tensor) and rec.tracks(t)
            if mine:
                rec._observe(original, args, kwargs, t)
        if mine:
            return t
        return original(*args, **kwargs)

    wrapper.__name__ = original.__name__
    wrapper.__doc__ = original.__doc__
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper
