"""Saved tensors that follow their unit between device ranges.

[Note: saved tensors follow their unit]
Autograd keeps tensors for backward, and some of them are views of
parameters: ``F.linear`` saves ``weight.t()``. Such a view points at the
device-arena range the unit had in forward. Reassigning ``param.data`` when
the unit is evicted and fetched again does not move the view, so if backward
fetches the unit into another range, the view reads whatever lies in the old
range now (another unit's weights; on CUDA, bytes a copy is writing). Units of
equal size hide this: first fit gives them their old range back.

So while a pageable unit runs forward with grad, a pair of saved-tensor hooks
is active (pushed by the unit's forward pre-hook, popped by its forward hook):

- pack: a tensor whose memory lies in the arena is stored as an
  :class:`ArenaRef` (unit, byte offset inside the unit's range, size, stride,
  dtype), never as memory; anything else goes to the hooks that were active
  before ours (the user's, e.g. ``save_on_cpu``), or is kept as a detached alias
  with its version, checked on unpack as autograd itself would.
- unpack: the unit is made resident (fetched if it was evicted; see
  ``Residency.ensure_for_unpack``) and the view is rebuilt on its current range.

Hooks turn off autograd's own version check, so it is redone here: a
parameter whose version changed after it was saved raises torch's error. The
engine bumps a parameter's version whenever its values change (an optimizer
update, ``load_pretrained``; see ``Engine.values_changed``), so a
``retain_graph`` backward after ``optimizer.step()`` raises as in torch. Inside ``torch.utils.checkpoint`` regions no hooks are pushed:
checkpoint matches saved tensors by count between forward and recomputation,
and the engine keeps a recomputed unit in place until its backward is done
instead (see ``Residency.begin_recompute``). Root and external units never move
during a pass, and permanent units never move at all, so no hooks are needed
for them.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..faults import UsageError

__all__ = ["ArenaRef", "SavedTensorRouter"]

_push = torch._C._autograd._push_saved_tensors_default_hooks
_pop = torch._C._autograd._pop_saved_tensors_default_hooks
_top = torch._C._autograd._top_saved_tensors_default_hooks


class ArenaRef:
    """A saved view of a unit's device copy, as a place rather than as memory."""

    __slots__ = ("unit", "offset", "size", "stride", "dtype", "param", "version")

    def __init__(self, unit, offset: int, t: torch.Tensor, param, version: int):
        self.unit = unit
        self.offset = offset          # bytes from the start of the unit's range
        self.size = t.size()
        self.stride = t.stride()
        self.dtype = t.dtype
        self.param = param            # the parameter it is a view of (None: not a parameter view)
        self.version = version        # that parameter's version at pack time


def _version_error(what: str, saved: int, now: int) -> RuntimeError:
    return UsageError(
        f"one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"{what} is at version {now}; expected version {saved} instead (infinity checks saved tensors itself, "
        "as its saved-tensor hooks replace autograd's own check). Hint: do the in-place change out of place, "
        "or after backward")


class SavedTensorRouter:
    """Packs arena views as :class:`ArenaRef` and rebuilds them on unpack.

    ``residency`` owns the arena (``tier.arena``), finds the unit at a byte
    offset (``unit_at``) and brings a unit back for an unpack
    (``ensure_for_unpack``); ``param_slot`` maps id of a parameter to (unit,
    slot index); ``faults`` fails the engine on an error during an unpack.
    """

    def __init__(self, residency, param_slot: dict, faults):
        self.residency, self.param_slot, self.faults = residency, param_slot, faults
        self._stack: list = []  # per push: the hooks that were on top before (or None)
        self.rebind()

    def rebind(self) -> None:
        """Follows the engine to a new arena (the device budget grew); saved
        references are places in units, so they stay valid."""
        arena = self.residency.tier.arena
        self._lo = arena.data_ptr()
        self._hi = self._lo + arena.numel()
        self._arena = arena
        self._views: Dict[torch.dtype, torch.Tensor] = {}

    def drop_buffers(self) -> None:
        """After teardown: forgets the arena and its views (see Engine._drop_buffers)."""
        self._arena, self._views = None, {}

    # -- context --------------------------------------------------------------------

    def push(self) -> bool:
        """Makes the hooks active on this thread; False (nothing pushed) inside
        a checkpoint region. Pair every True with :meth:`pop`."""
        outer = _top(True)
        if outer is not None and getattr(outer[0], "__module__", "") == "torch.utils.checkpoint":
            return False
        self._stack.append(outer)
        pack, unpack = self._make_hooks(outer)
        _push(pack, unpack)
        return True

    def pop(self) -> None:
        _pop()
        self._stack.pop()

    def _make_hooks(self, outer: Optional[Tuple[Callable, Callable]]):
        outer_pack = outer[0] if outer is not None else None
        outer_unpack = outer[1] if outer is not None else None

        def pack(t: torch.Tensor) -> Any:
            ref = self._pack_arena(t)
            if ref is not None:
                return ref
            if outer_pack is not None:
                return ("outer", outer_pack(t))
            return ("plain", t.detach(), t._version)

        def unpack(obj: Any) -> torch.Tensor:
            if isinstance(obj, ArenaRef):
                return self._unpack_arena(obj)
            if obj[0] == "outer":
                return outer_unpack(obj[1])
            _, t, version = obj
            if t._version != version:
                raise _version_error(f"a saved tensor of shape {tuple(t.shape)}", version, t._version)
            return t

        return pack, unpack

    # -- arena views ----------------------------------------------------------------

    def _pack_arena(self, t: torch.Tensor) -> Optional[ArenaRef]:
        if t.layout is not torch.strided:
            return None
        ptr = t.data_ptr()
        if not (self._lo <= ptr < self._hi):
            return None
        base = t._base if t._base is not None else t
        hit = self.param_slot.get(id(base))
        u = hit[0] if hit is not None else self.residency.unit_at(ptr - self._lo)
        if u is None or u.dev.range is None:
            raise RuntimeError(f"infinity: a tensor saved for backward lies in the device arena at byte "
                               f"{ptr - self._lo} but in no resident unit (internal error)")
        offset = ptr - self._lo - u.dev.range
        param = base if hit is not None else None
        return ArenaRef(u, offset, t, param, param._version if param is not None else 0)

    def _unpack_arena(self, ref: ArenaRef) -> torch.Tensor:
        u = ref.unit
        with self.faults.guard("backward (a saved tensor)"):
            self.residency.ensure_for_unpack(u)
        if ref.param is not None and ref.param._version != ref.version:
            name = u.layout.slots[self.param_slot[id(ref.param)][1]].name
            raise _version_error(f"parameter {name!r} (unit {u.name!r})", ref.version, ref.param._version)
        view = self._views.get(ref.dtype)
        if view is None:
            view = self._views[ref.dtype] = self._arena.view(ref.dtype)
        item = view.element_size()
        return view.as_strided(ref.size, ref.stride, (u.dev.range + ref.offset) // item)
