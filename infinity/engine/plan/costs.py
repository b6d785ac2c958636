"""What each unit's forward and backward compute costs, counted on the meta
device: every aten op the pass runs, with its FLOPs (torch's flop counter
registry: matrix products, convolutions, attention) and the bytes it reads
and writes. Nothing is computed and no memory is touched.

[Note: an op's time]
The time model (step_time.py, ``op_seconds``) prices an op as a roofline plus
a fixed cost: ``max(work / its rate, bytes / memory bandwidth) + per-op
overhead``, each figure from the hardware profile (profile.py), where the
rate is the one of the kernel that runs, as the profile measured it:

- a matrix product (mm, addmm, bmm, baddbmm) at its own shape ``(m, n, k)``
  (the profile's grid of shapes, interpolated; a square-size rate where the
  profile has no grid): products at a model's shapes run at other rates than
  a square product of the same FLOPs;
- attention (``F.scaled_dot_product_attention``) as one op forward and one
  backward, at the rate of the fused kernel the device runs: the meta device
  falls back to the math decomposition (matmuls and a softmax), which the
  CPU's flash kernel is 4-8x slower than at a small model's shapes. The
  count records the call itself ([Note: attention counted as the call]);
- an op the profile has a per-element rate for (GELU, SiLU, softmax, layer
  norm and their backwards: transcendental, compute-bound on a CPU) at
  ``elements / rate``, the elements of its first result.

Views cost nothing. The ops are attributed to the unit whose forward (or backward) is
running: module hooks mark where a unit's forward starts and ends, and full
backward hooks where its backward does, so a checkpointed unit's
recomputation counts in its backward, where it runs.
"""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from .attention import FUSED_ATTENTION, AttentionAsCall, attention_cost
from .metacache import SHARED, MetaCache
from .repeats import KEEP, Run, cut, find_run

__all__ = ["OpCost", "PassCosts", "count_pass", "ROOT_TAIL"]

# The root's backward ops after the units' backward (the embeddings'), apart
# from those before it (loss, head): they run at the other end of backward.
ROOT_TAIL = -1


@dataclass(frozen=True)
class OpCost:
    """One op: ``flops`` (0 unless a matrix product, convolution or attention),
    ``nbytes`` read + written, ``name`` (the aten op's name, ``"attention"``
    or ``"attention_backward"``), ``shape`` (a product's ``(m, n, k)``;
    attention's ``(query length,)``) and ``numel`` (elements of its first
    result). See [Note: an op's time]."""

    flops: int
    nbytes: int
    name: str = ""
    shape: Tuple[int, ...] = ()
    numel: int = 0


@dataclass
class PassCosts:
    """The ops of one forward + backward, per unit index (0: the root and
    everything outside the units; in backward ``ROOT_TAIL``: the root's ops
    after the units' backward)."""

    forward: Dict[int, List[OpCost]] = field(default_factory=dict)
    backward: Dict[int, List[OpCost]] = field(default_factory=dict)
    dispatched: int = 0   # ops the meta passes dispatched (the work of counting; a cached op included)

    def flops(self, phase: str, unit: int) -> int:
        """FLOPs of ``unit`` in ``phase`` ("forward" or "backward")."""
        return sum(o.flops for o in getattr(self, phase).get(unit, []))


def _nbytes(x) -> int:
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


class _Counter(MetaCache):
    """Records each op's cost under the running unit; ops are answered from
    the cache when seen before ([Note: a meta pass from a cache] in metacache.py)."""

    def __init__(self, costs: PassCosts, cache: Optional[Dict] = None):
        super().__init__(cache)
        self.costs, self.unit, self.phase = costs, 0, "forward"
        self.op_costs: Dict[object, Optional[OpCost]] = {}
        self.mute = 0

    @contextlib.contextmanager
    def muted(self):
        """Ops run meanwhile are not recorded (an attention call's math path)."""
        self.mute += 1
        try:
            yield
        finally:
            self.mute -= 1

    def record(self, cost: OpCost) -> None:
        getattr(self.costs, self.phase).setdefault(self.unit, []).append(cost)

    def seen(self, func, args, kwargs, out, key) -> None:
        if self.mute:
            return
        cost = self.op_costs.get(key, _MISSING) if key is not None else _MISSING
        if cost is _MISSING:
            cost = _op_cost(func, args, kwargs, out)
            if key is not None:
                self.op_costs[key] = cost
        if cost is not None:
            self.record(cost)


_MISSING = object()


# The matrix products priced at their shape, and the position of their left operand.
_PRODUCTS = {"mm": 0, "addmm": 1, "bmm": 0, "baddbmm": 1}


def _op_cost(func, args, kwargs, out) -> Optional[OpCost]:
    """The op's cost ([Note: an op's time]); None for views and ops costing nothing."""
    if not func._schema.name.startswith("aten::") or func.is_view:
        return None
    name = func._schema.name[len("aten::"):]
    if name in FUSED_ATTENTION:
        return attention_cost(args[:3] if "backward" not in name else args[1:4], out, "backward" in name)
    fl = 0
    f = flop_registry.get(func._overloadpacket)
    if f is not None:
        fl = int(f(*args, **kwargs, out_val=out))
    outs = tree_flatten(out)[0]
    nb = sum(_nbytes(a) for a in tree_flatten((args, kwargs))[0]) + sum(_nbytes(o) for o in outs)
    shape: Tuple[int, ...] = ()
    if name in _PRODUCTS:
        a, b = args[_PRODUCTS[name]], args[_PRODUCTS[name] + 1]
        shape = (int(a.shape[-2]), int(b.shape[-1]), int(a.shape[-1]))
    first = next((o for o in outs if isinstance(o, torch.Tensor)), None)
    return OpCost(fl, nb, name, shape, first.numel() if first is not None else 0) if fl or nb else None


def count_pass(model: nn.Module, run: Callable[[nn.Module], torch.Tensor], unit_modules: Dict[int, List[nn.Module]],
               dtype: torch.dtype) -> PassCosts:
    """The ops of ``run(model)`` (a forward on meta inputs returning the loss)
    and of its backward, per unit (``unit_modules``: unit index -> its
    modules), with the model's floating parameters in ``dtype`` (the compute
    copy's). ``model`` must be on the meta device; it is not changed (a copy
    is counted). Repeated blocks are counted from two short passes ([Note: a
    meta pass over repeated units] in repeats.py)."""
    if any(p.device.type != "meta" for p in model.parameters()):
        raise ValueError("count_pass: build the model on the meta device (with torch.device('meta'))")
    rep = find_run(model, unit_modules)
    if rep is not None:
        try:
            small, big = (_count(model, run, unit_modules, dtype, rep, k) for k in (KEEP, KEEP + 1))
        except Exception:  # noqa: BLE001 - the forward cannot run cut (it counts its blocks itself): pass in full
            small = big = None
        got = _extrapolate(small, big, rep) if small is not None else None
        if got is not None:
            return got
    return _count(model, run, unit_modules, dtype, None, 0)


def _count(model, run, unit_modules, dtype, rep: Optional[Run], keep: int) -> PassCosts:
    """One counted pass on a copy of ``model`` (with ``rep``'s blocks cut to
    ``keep``: the cut model is copied)."""
    memo: Dict[int, object] = {}  # the copy's modules by the originals' ids, so unit_modules still names them
    with cut(rep.container, rep.keys, keep) if rep is not None else contextlib.nullcontext():
        m = copy.deepcopy(model, memo)
    m.to(dtype)
    costs = PassCosts()
    counter = _Counter(costs, SHARED)
    handles = []
    for ui, mods in unit_modules.items():
        for mc in (memo[id(mod)] for mod in mods if id(mod) in memo):  # a block cut away is not in the copy
            handles += [mc.register_forward_pre_hook(lambda *_a, ui=ui: setattr(counter, "unit", ui)),
                        mc.register_forward_hook(lambda *_a: setattr(counter, "unit", 0)),
                        mc.register_full_backward_pre_hook(lambda *_a, ui=ui: setattr(counter, "unit", ui)),
                        mc.register_full_backward_hook(lambda *_a: setattr(counter, "unit", ROOT_TAIL))]
    try:
        with counter, AttentionAsCall(counter):
            loss = run(m)
            counter.phase, counter.unit = "backward", 0
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    costs.dispatched = counter.hits + counter.misses
    return costs


def _extrapolate(small: PassCosts, big: PassCosts, rep: Run) -> Optional[PassCosts]:
    """The full pass's costs from passes over ``KEEP`` and ``KEEP + 1`` of
    ``rep``'s blocks; None when the two do not differ by one block."""
    out = PassCosts()
    out.dispatched = small.dispatched + big.dispatched
    runs, last = set(rep.units), rep.units[KEEP]
    for phase in ("forward", "backward"):
        s, b, o = getattr(small, phase), getattr(big, phase), getattr(out, phase)
        if Counter(b.get(rep.units[KEEP - 1], [])) != Counter(b.get(last, [])):
            return None
        for ui in set(s) | set(b):
            if ui in runs:
                continue
            cs, cb = Counter(s.get(ui, [])), Counter(b.get(ui, []))
            if cs - cb:  # the extra block took ops away: not a repeat
                return None
            o[ui] = list((cs + _times(cb - cs, rep.n - KEEP)).elements())
        for j, ui in enumerate(rep.units):
            ops = s.get(ui) if j < KEEP else b.get(last)
            if ops:
                o[ui] = list(ops)
    return out


def _times(c: Counter, k: int) -> Counter:
    return Counter({op: n * k for op, n in c.items()})
