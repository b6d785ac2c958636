"""Replaying the tape on the CPU: which operations to run, and running them.

[Note: replaying the tape]
A backward pass over the tape marks each operation "run" (its result is
observed: by a wanted tensor, or by a run operation reading it), "rng"
(its result is never observed but it draws random numbers: it runs on
scratch of the same size and strides, so the generator advances exactly
as in eager construction) or skipped. A tensor is thus materialised only
from its last whole overwrite on. The forward pass then runs the tape
once, frees each intermediate after its last use, and hands a unit's
values to the sink right after the last operation writing them.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .ops import EMPTY, short
from .tape import Op, Ref, SetRng

if TYPE_CHECKING:
    from .recorder import Recorder


def plan(rec: "Recorder", wanted: Set[int]) -> List[Optional[str]]:
    """The backward pass of [Note: replaying the tape]: per tape entry
    ``"set"`` (a generator change), ``"run"``, ``"rng"`` or None (skipped),
    so that the bases in ``wanted`` end up with their final values."""
    live = set(wanted)
    status: List[Optional[str]] = [None] * len(rec.tape)
    for i in range(len(rec.tape) - 1, -1, -1):
        op = rec.tape[i]
        if isinstance(op, SetRng):
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
        b = rec.bases[min(live)]
        raise RuntimeError(f"infinity.init: {rec.names.get(b.index, 'a tensor')} has no recorded operation "
                           "that creates it")
    return status


def touched(op: Op) -> Set[int]:
    """Every base ``op`` reads, creates or writes."""
    out = set(op.reads) | {b for _, b in op.outputs}
    if op.target is not None:
        out.add(op.target)
    return out


def _last_uses(tape: List[Any], status: List[Optional[str]]) -> Dict[int, int]:
    """base -> index of the last run operation touching it."""
    last_use: Dict[int, int] = {}
    for i, op in enumerate(tape):
        if status[i] == "run":
            for b in touched(op):
                last_use[b] = i
    return last_use


def replay(rec: "Recorder", wanted: Set[int], status: List[Optional[str]],
           on_written: Callable[[int, Dict[int, torch.Tensor]], None],
           releasable: Callable[[int], bool]) -> Dict[int, torch.Tensor]:
    """Runs the tape from ``rng_start`` following ``status`` (see
    :func:`plan`). ``on_written(i, real)`` is called after tape index
    ``i`` (``real``: base -> flat CPU tensor of every base held). A base
    is dropped after its last use, a wanted one only once
    ``releasable(base)``. Returns the bases still held at the end."""
    last_use = rec.last_use = _last_uses(rec.tape, status)
    real: Dict[int, torch.Tensor] = {}
    scratch = Scratch()
    uninitialised: List[str] = []
    torch.set_rng_state(rec.rng_start)
    prev_dtype = torch.get_default_dtype()
    torch.set_default_dtype(rec.default_dtype)
    try:
        with torch.no_grad():
            for i, op in enumerate(rec.tape):
                st = status[i]
                if st == "set":
                    torch.set_rng_state(op.state)
                elif st == "run":
                    run_op(rec, op, real, uninitialised)
                elif st == "rng":
                    run_on_scratch(rec, op, real, scratch)
                    scratch.trim()
                held = sum(t.numel() * t.element_size() for t in real.values())
                rec.peak_held_bytes = max(rec.peak_held_bytes, held)
                on_written(i, real)
                if st == "run":
                    for b in touched(op):
                        if last_use[b] == i and (b not in wanted or releasable(b)):
                            real.pop(b, None)
    finally:
        torch.set_default_dtype(prev_dtype)
    if uninitialised:
        # stacklevel: replay <- materialize() <- Recorder.materialize <- the
        # engine, which is where a user looks for lazy-init warnings.
        warnings.warn("infinity.init: " + ", ".join(sorted(set(uninitialised))) + " come from torch.empty "
                      "and were never overwritten; zero-filled (eager construction would leave uninitialised "
                      "memory). If an initialiser ran on them, it is one torch skips on meta tensors and "
                      "infinity could not see: call it as torch.nn.init.<name>", RuntimeWarning, stacklevel=5)
    return real


def resolve(rec: "Recorder", op: Op, real: Dict[int, torch.Tensor], scratch: Optional["Scratch"] = None):
    """``op``'s recorded (args, kwargs) with each :class:`Ref` a CPU view of
    its base (from ``real``, else of ``scratch``) and meta devices as CPU."""
    def one(x: Any) -> Any:
        if not isinstance(x, Ref):
            if isinstance(x, torch.device) and x.type == "meta":
                return torch.device("cpu")
            if isinstance(x, str) and x == "meta":
                return "cpu"
            return x
        if x.base in real:
            flat = real[x.base]
        elif scratch is not None:
            b = rec.bases[x.base]
            flat = scratch.get(b.numel, b.dtype, target=x.base == op.target)
        else:
            raise RuntimeError(f"infinity.init (internal): {op.label} needs {rec.names.get(x.base, 'a tensor')} "
                               "before it was materialised")
        return flat.as_strided(x.size, x.stride, x.offset)

    return tree_map(one, op.args), tree_map(one, op.kwargs)


def run_op(rec: "Recorder", op: Op, real: Dict[int, torch.Tensor], uninitialised: List[str]) -> None:
    """Runs ``op`` for its values; new bases it creates join ``real`` (flat).
    Bases from ``torch.empty`` are zero-filled and named in ``uninitialised``."""
    if op.target is not None and op.target not in real:
        if not op.full:
            raise RuntimeError(f"infinity.init (internal): {op.label} updates "
                               f"{rec.names.get(op.target, 'a tensor')} before it exists")
        b = rec.bases[op.target]
        real[op.target] = torch.empty(b.numel, dtype=b.dtype)
    args, kwargs = resolve(rec, op, real)
    out = op.func(*args, **kwargs)
    if not op.outputs:
        return
    leaves, _ = tree_flatten(out)
    for (i, b), (_, shape, dtype) in zip(op.outputs, op.out_meta):
        t = leaves[i]
        if t.shape != shape or t.dtype != dtype:
            raise RuntimeError(f"infinity.init: replaying {op.label} gave {tuple(t.shape)} {t.dtype}, recorded "
                               f"{tuple(shape)} {dtype}")
        if short(op.func) in EMPTY:
            uninitialised.append(rec.names.get(b, f"a tensor of shape {tuple(shape)}"))
            t.zero_()
        base = rec.bases[b]
        if t.untyped_storage().nbytes() < base.numel * t.element_size():
            raise RuntimeError(f"infinity.init: replaying {op.label} gave a smaller storage than recorded")
        flat = torch.empty(0, dtype=base.dtype).set_(t.untyped_storage(), 0, (base.numel,), (1,))
        real[b] = flat


def run_on_scratch(rec: "Recorder", op: Op, real: Dict[int, torch.Tensor], scratch: "Scratch") -> None:
    """Runs a random ``op`` whose result nobody reads, on scratch."""
    args, kwargs = resolve(rec, op, real, scratch)
    op.func(*args, **kwargs)  # drawn only to advance the generator


class Scratch:
    """One buffer for targets and one for inputs of operations run only to
    advance the generator, reused while at most ``KEEP_BYTES``.

    [Note: the replay's scratch is not kept]
    A draw that a later initialisation overwrites (``nn.Embedding``'s
    ``normal_`` before Hugging Face's ``_init_weights``) runs on scratch the
    size of its tensor. Kept for the whole replay, the largest such tensor
    (a 128256 x 4096 vocabulary: 2 GiB in fp32) stayed resident beside every
    unit materialised after it, the pool and the unit in progress included:
    measured on the Llama-3-8B shape, initialise's peak was that much above
    what the units needed. A buffer above ``KEEP_BYTES`` is therefore freed
    right after its draw (:meth:`trim`); smaller ones are reused, so many
    small draws do not each map and fault fresh memory."""

    KEEP_BYTES = 16 << 20

    def __init__(self) -> None:
        self._bufs: Dict[bool, torch.Tensor] = {}

    def trim(self) -> None:
        """Frees the buffers larger than ``KEEP_BYTES`` (see the Note above)."""
        for k in [k for k, b in self._bufs.items() if b.numel() > self.KEEP_BYTES]:
            del self._bufs[k]

    def get(self, numel: int, dtype: torch.dtype, target: bool) -> torch.Tensor:
        """A ``numel``-element ``dtype`` view of the target or input buffer."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        buf = self._bufs.get(target)
        if buf is None or buf.numel() < nbytes:
            buf = self._bufs[target] = torch.empty(nbytes, dtype=torch.uint8)
        return buf[:nbytes].view(dtype)
