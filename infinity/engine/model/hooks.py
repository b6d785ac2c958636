"""Hooks that tie the engine to a model's forward and backward.

[Note: what each hook does]
- root forward pre-hook: a pass begins (trace cursor reset); the root unit and
  units used outside their own forward are fetched and pinned for the pass.
  In a recording pass a TorchFunctionMode watches for parameters used while
  their unit is not in use (see ``_Watcher``).
- unit forward pre-hook: fetch + pin the unit (waits for its prefetch; starts
  the next prefetches). With grad, a multi-grad hook on the unit's inputs
  (mode "all") marks the end of this call's backward, and the saved-tensor
  hooks of [Note: saved tensors follow their unit] are pushed.
- unit forward hook (also when forward raised): unpin, pop the saved-tensor
  hooks. With grad, a multi-grad hook on the outputs (mode "any") fires
  before the call's backward runs: the unit is held and fetched for it
  (see [Note: pins]).
- per-parameter post-accumulate-grad hook: the gradient leaves the device
  (engine.on_grad); when a unit's last gradient arrived, the optimizer may
  start on it (overlap="backward").
- root output hook: at the start of backward, queues a callback that runs
  when the whole backward is done: end of the pass, pins released.
A module called twice simply yields two entries in the trace and two
backward holds; a checkpointed module's recomputation is a fetch like any
other, whose pin lasts until the module's backward is done (see ``_make_pre``).

[Note: a unit's forward writing its input]
A unit call's inputs reach its forward through ``_PostBackward`` as
aliases (same storage and version counter, not views: autograd refuses an
in-place write to a custom Function's view of its input). When the
forward writes one in place (``x.mul_(2)``), the caller's tensor holds the
new values but not their autograd history; torch would have given it the
history of the write. So at the forward hook the caller's tensor is
rebased onto the alias (``x.copy_(alias)``, the same bytes) and its
version set back to the one the write left, so that tensors saved after
the write stay valid.

[Note: writes in forward]
Some forwards write their parameters in place: ``nn.Embedding(max_norm=)``
renormalises the rows it looks up, EMA codebooks and weight
re-normalisation update weights under ``no_grad``. torch's in-place call
moves the parameter's version counter (``p._version``; assigning ``p.data``
does not), so each unit call notes its parameters' versions after the
fetch and compares them at its forward hook, and the root's forward does
the same for the units pinned for the whole pass. A parameter whose
version moved was written in its device copy: ``Engine.forward_wrote``
writes it through to the master and the compute copies before the copy
can be evicted. Writes through ``p.data`` (a tensor with its own version
counter) are not seen; recomputations inside backward are not checked
(they repeat what the forward wrote).
"""

from __future__ import annotations

import functools
from typing import Any, List, Optional

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from ..core import Engine
from ..faults import UsageError
from ..plan.units import Unit

__all__ = ["install_hooks"]

# Functions that read metadata or register hooks, not parameter values.
_METADATA = {"__get__", "__set__", "size", "dim", "numel", "requires_grad_", "register_hook",
             "register_post_accumulate_grad_hook", "__repr__", "__format__", "data_ptr", "element_size",
             "is_floating_point", "__hash__", "__eq__", "stride", "is_contiguous", "detach"}


def _in_backward() -> bool:
    """True while autograd's engine runs a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def _internally(eng: Engine, where: str, fn, *args) -> None:
    """Runs an engine call that touches parameters itself, unseen by the
    recording pass's watcher; a fault it raises fails the engine (see
    [Note: a run is consistent or it says so]); ``where`` names the moment for its error."""
    with eng.faults.guard(where), eng.quiet:
        fn(*args)


def _fetch(res, u) -> None:
    """``u`` computes now: fetched (waiting for a prefetch), pinned, next units prefetched."""
    res.settle()
    res.fetch(u)


def _fetch_for_backward(res, u) -> None:
    res.settle()
    res.fetch_for_backward(u)


def _leaves(obj: Any, out: List[torch.Tensor]) -> List[torch.Tensor]:
    """The tensors in ``obj`` (nested tuples, lists, dicts). A plain
    recursive function: torch's tree_flatten builds a self-referencing
    closure per call, a reference cycle per hook call that only a full
    garbage collection frees."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _leaves(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _leaves(x, out)
    return out


def _grad_tensors(obj: Any) -> List[torch.Tensor]:
    return [t for t in _leaves(obj, []) if t.requires_grad]


def _replace(obj: Any, new: dict) -> Any:
    """``obj`` with each tensor whose id is in ``new`` replaced (plain tuples, lists and dicts rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return new.get(id(obj), obj)
    if type(obj) in (list, tuple):
        return type(obj)(_replace(x, new) for x in obj)
    if type(obj) is dict:
        return {k: _replace(v, new) for k, v in obj.items()}
    return obj


class _PostBackward(torch.autograd.Function):
    """Identity on a unit call's inputs; its backward runs once the gradients
    of all of them are complete: the call's backward is done.

    [Note: hooks without reference cycles]
    A hook that reaches the autograd graph from its closure (torch's
    ``register_multi_grad_hook(mode="all")`` keeps the inputs' grad_fns to
    count them) makes a cycle graph -> hook -> graph per unit call, and the
    whole graph then waits for a full garbage collection: memory grows
    between collections, unbounded by any budget. This Function (as FSDP2
    does) and the per-tensor hooks of ``_on_first_grad`` reference only
    long-lived objects (the hooks, the unit), so a graph is freed when
    backward drops it."""

    @staticmethod
    def forward(ctx, hooks, u, *tensors):
        ctx.hooks, ctx.unit = hooks, u
        # Aliases, not the inputs themselves: an input returned as it is
        # would be a view, which autograd forbids writing in place (see
        # [Note: a unit's forward writing its input]).
        return tuple(t.detach() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.hooks._post_backward(ctx.unit)
        return (None, None) + grads


def _rebase_written_inputs(io) -> None:
    """See [Note: a unit's forward writing its input]: each caller's tensor
    whose alias the unit's forward wrote in place takes the alias's history,
    as torch's in-place call would have given it, at the version it has."""
    ins, outs, versions = io
    for x, y, v in zip(ins, outs, versions):
        if y._version != v:
            now = x._version
            with torch.enable_grad():
                x.copy_(y)
            torch._C._autograd._unsafe_set_version_counter((x,), (now,))


def _on_first_grad(tensors: List[torch.Tensor], fn) -> None:
    """Calls ``fn()`` at the first gradient that reaches any of ``tensors``,
    once per backward (graph task); see [Note: hooks without reference cycles]."""
    seen = {"task": None}

    def hook(grad):
        task = torch._C._current_graph_task_id()
        if seen["task"] != task:
            seen["task"] = task
            fn()

    for t in tensors:
        t.register_hook(hook)


class _Watcher(TorchFunctionMode):
    """During a recording pass: finds parameters used while their unit is not
    pinned (used outside the unit's forward), fetches that unit at once and
    makes it resident for whole passes from then on."""

    def __init__(self, engine: Engine):
        super().__init__()
        self.engine = engine

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        eng = self.engine
        if not eng.quiet.active and getattr(func, "__name__", "") not in _METADATA:
            for a in _params_in(args, kwargs):
                hit = eng.param_slot.get(id(a))
                if hit is not None and hit[0].dev.pins == 0:
                    eng.note_external_use(hit[0])
        return func(*args, **kwargs)


def _params_in(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, nn.Parameter):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, nn.Parameter):
                    yield b


def _versions(u: Unit) -> List[int]:
    """The version counters of ``u``'s parameters (see [Note: writes in forward])."""
    return [s.param._version for s in u.layout.slots]


def _check_writes(eng: Engine, u: Unit, before: Optional[List[int]]) -> None:
    """Writes through what a forward wrote into ``u``'s parameters in place since ``before``."""
    if before is None:
        return
    changed = [i for i, s in enumerate(u.layout.slots) if s.param._version != before[i]]
    if changed:
        _internally(eng, "forward (a parameter written in place)", eng.forward_wrote, u, changed)


def _refuse_unsupported_modes() -> None:
    """Forward modes whose tensors infinity cannot page: refused before anything changes."""
    if torch.is_inference_mode_enabled():
        raise UsageError("forward under torch.inference_mode() on a model managed by infinity: inference "
                         "tensors cannot be written later, and infinity reuses its buffers. Use torch.no_grad()")


class Hooks:
    """Installed hooks of one engine (removable)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.handles: List[Any] = []
        self._watcher: Optional[_Watcher] = None
        eng = engine
        root = eng.model
        # per unit call in progress: (module, pinned, pushed saved hooks, parameter versions, inputs' aliases)
        self._calls: List[tuple] = []
        self._pass_versions: List[tuple] = []  # (unit, versions) of the units pinned for the pass
        self.handles.append(root.register_forward_pre_hook(self._root_pre, prepend=True))
        self.handles.append(root.register_forward_hook(self._root_post, always_call=True))
        for u in eng.units[1:]:
            for m in u.modules:
                self.handles.append(m.register_forward_pre_hook(self._make_pre(u), with_kwargs=True))
                self.handles.append(m.register_forward_hook(self._make_post(u), always_call=True))
        for u in eng.units:
            for ti, s in enumerate(u.layout.trainable_slots):
                self.handles.append(s.param.register_post_accumulate_grad_hook(self._make_grad_hook(u, ti)))

    @property
    def in_unit_call(self) -> bool:
        """A unit's forward runs (its pre-hook ran, its forward hook not yet)."""
        return bool(self._calls)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    # -- root -----------------------------------------------------------------------

    def _root_pre(self, module, args):
        eng = self.engine
        _refuse_unsupported_modes()
        with eng.faults.guard("forward"):
            eng.begin_pass(torch.is_grad_enabled())
        eng.guard.disarm()  # See [Note: parameters outside forward].
        self._pass_versions = [(u, _versions(u)) for u in eng.units if u.index == 0 or u.dev.external]
        if not eng.trace.has_trace and self._watcher is None:
            self._watcher = _Watcher(eng)
            self._watcher.__enter__()
        return None

    def _root_post(self, module, args, output):
        # Also runs when forward raised (output None then): the pass ends.
        eng = self.engine
        eng.guard.arm()
        pass_versions, self._pass_versions = self._pass_versions, []
        if output is not None:  # See [Note: writes in forward]
            for u, before in pass_versions:
                _check_writes(eng, u, before)
        if self._watcher is not None:
            w, self._watcher = self._watcher, None
            w.__exit__(None, None, None)
        outs = _grad_tensors(output)
        if eng.pass_grad and outs:
            _on_first_grad(outs, self._at_backward_start)
        else:
            eng.end_pass()
        return None

    def _at_backward_start(self) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self.engine.backward_done()

    # -- units ------------------------------------------------------------------------

    def _make_pre(self, u: Unit):
        def pre(module, args, kwargs):
            eng = self.engine
            _internally(eng, "forward (a unit's fetch)", _fetch, eng.residency, u)
            in_bwd = _in_backward()
            if in_bwd:
                # Recomputation (activation checkpointing) inside backward:
                # the pin stays until u's backward is done, not until the
                # forward hook, which an early-stopping recomputation never runs.
                eng.residency.begin_recompute(u)
            grad = torch.is_grad_enabled()
            pushed = bool(grad and not in_bwd and eng.saved is not None and not u.dev.external and eng.saved.push())
            ins = _grad_tensors((args, kwargs)) if grad else []
            outs = _PostBackward.apply(self, u, *ins) if ins else ()
            io = (ins, outs, [t._version for t in outs]) if ins else None
            self._calls.append((module, not in_bwd, pushed, None if in_bwd else _versions(u), io))
            if not ins:
                return None
            # The call's inputs pass through _PostBackward, whose backward marks the end of its backward.
            new = {id(a): b for a, b in zip(ins, outs)}
            return _replace(args, new), _replace(kwargs, new)
        return pre

    def _make_post(self, u: Unit):
        def post(module, args, output):
            # Also runs when forward (or our pre-hook) raised: undo only what this call's pre-hook did.
            eng = self.engine
            if not self._calls or self._calls[-1][0] is not module:
                return None
            _, pinned, pushed, before, io = self._calls.pop()
            if pushed:
                eng.saved.pop()
            try:
                if output is not None:
                    if io is not None:
                        _rebase_written_inputs(io)
                    _check_writes(eng, u, before)
            finally:
                if pinned:
                    eng.residency.unpin(u)
            if output is not None and torch.is_grad_enabled():
                outs = _grad_tensors(output)
                if outs:
                    _on_first_grad(outs, functools.partial(self._pre_backward, u))
            return None
        return post

    def _pre_backward(self, u: Unit) -> None:
        eng = self.engine
        _internally(eng, "backward (a unit's fetch)", _fetch_for_backward, eng.residency, u)

    def _post_backward(self, u: Unit) -> None:
        eng = self.engine
        _internally(eng, "backward", eng.residency.end_backward_of, u)

    def _make_grad_hook(self, u: Unit, ti: int):
        def hook(p):
            eng = self.engine
            _internally(eng, "backward (a gradient)", eng.on_grad, u, ti, p)
        return hook


def install_hooks(engine: Engine) -> Hooks:
    """Installs every hook of [Note: what each hook does]; returns the handle set."""
    return Hooks(engine)
