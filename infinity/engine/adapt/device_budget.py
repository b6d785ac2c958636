"""The default device budget (``Config.device_memory=None`` on CUDA).

[Note: the default device budget]
The device holds more than infinity's model state: activations, autograd's
gradients before they leave, cuBLAS and NCCL workspaces, the caching
allocator's slack. How much depends on the batch and the model, and shows
only once a pass has run. Taking 90% of the free memory up front (as this
engine once did) leaves the rest a tenth, which a long sequence exceeds.

So the budget is set twice. At ``initialize`` it is at most
``FIRST_PASS_SHARE`` of the free memory (never below the minimum the model
needs, never above what holding everything needs). After the first
optimizer step, when every unit has left the arena, the peak the caching
allocator saw is read: what was not infinity's own (arena, device optimizer
state) is the rest's need. The budget grows to the capacity minus
``HEADROOM`` times that need minus ``MARGIN_BYTES``, if that is more, and
the arena is reallocated at the new size. It never shrinks, and an explicit
``device_memory`` is never changed.

The old arena is let go of before the grown one is allocated (the two
together would not fit for a model whose compute copies pass half the
device). If the grown one still cannot be allocated (the pass showed less
than a later one needs, or another process took the memory meanwhile), the
budget stays at the size that ran, whose memory was just given back, with a
warning: the engine keeps a tier instead of failing the next forward.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["FIRST_PASS_SHARE", "HEADROOM", "MARGIN_BYTES", "initial_budget", "grown_budget"]

FIRST_PASS_SHARE = 0.5     # of the free device memory, until a pass has been measured
HEADROOM = 1.25            # times the measured need of everything else
MARGIN_BYTES = 256 << 20   # allocator slack and fragmentation


def initial_budget(free_bytes: int, need_all: int, minimum: int) -> int:
    """The budget for the first pass (bytes): ``FIRST_PASS_SHARE`` of
    ``free_bytes``, within [``minimum``, ``need_all``] (everything resident)."""
    return max(minimum, min(need_all, int(free_bytes * FIRST_PASS_SHARE)))


def grown_budget(capacity_bytes: int, peak_allocated: int, own_bytes: int, current: int,
                 need_all: int) -> Optional[int]:
    """The budget after the first step (bytes), or None to keep ``current``.

    ``capacity_bytes``: device memory free before infinity allocated anything;
    ``peak_allocated``: the caching allocator's peak since then; ``own_bytes``:
    what of it was infinity's own (the arena and device optimizer state).
    """
    others = max(0, peak_allocated - own_bytes)
    target = min(need_all, capacity_bytes - int(HEADROOM * others) - MARGIN_BYTES)
    return target if target > current else None


class DeviceBudget:
    """Sizes an engine's device tier: the explicit ``device_memory``, or the
    default that starts small and grows once (see the Note above). It is
    handed the units, the modes, the device and ``device_memory`` (bytes or
    None); the owners whose tier it replaces are handed to :meth:`after_step`."""

    def __init__(self, units, modes, device, device_memory: Optional[int]):
        self.units, self.modes, self.device, self.device_memory = units, modes, device, device_memory
        self.capacity: Optional[int] = None  # bytes to grow into, until the first step
        self.budget = 0

    def need(self):
        """The device tier's needs now (placement.DeviceNeed; external units count once known)."""
        from ..plan.placement import device_need
        return device_need([u.place for u in self.units],
                           [getattr(u, "dev", None) is not None and u.dev.external for u in self.units], self.modes)

    def minimum(self) -> int:
        """The smallest ``device_memory`` (bytes) this model and config run
        with: the root and external units, ``prefetch_depth + 1`` of the
        largest other units, the gradient reserve, the device-side optimizer
        state and 512 bytes of alignment per unit."""
        return self.need().minimum

    def first_tier(self):
        """The device tier of ``initialize`` (raises BudgetError below the minimum)."""
        from ..mechanism.tiers import BudgetError
        need, budget = self.need(), self.device_memory
        if budget is None:
            budget, self.capacity = self.default(need.minimum)
        if budget < need.minimum:
            raise BudgetError(self._too_small(budget, need))
        return self._tier(budget)

    def _tier(self, budget: int):
        from ..mechanism.tiers import DeviceTier
        need = self.need()
        self.budget = budget
        return DeviceTier(self.device, budget, need.arena_bytes(budget), need.grad_reserve, need.opt_fixed)

    def _too_small(self, budget: int, need) -> str:
        from ...config.runtime import format_bytes
        units = self.units
        biggest = max(units[1:], key=lambda u: u.place.compute_bytes, default=units[0])
        return (f"device_memory={budget} bytes ({format_bytes(budget)}) is too small: it needs at least "
                f"{need.minimum} bytes ({format_bytes(need.minimum)}): the root unit "
                f"({units[0].place.compute_bytes} bytes), the largest unit {biggest.name!r} "
                f"({biggest.place.compute_bytes} bytes) and prefetch_depth={self.modes.depth} more units of up "
                f"to that size, {need.grad_reserve} bytes for gradients in flight"
                + (f" and {need.opt_fixed} bytes of optimizer state on the device" if need.opt_fixed else "")
                + ". Raise device_memory, lower prefetch_depth, or split the model into smaller units "
                  "(Config.unit_classes)")

    def default(self, minimum: int):
        """(budget, capacity to grow into or None) for ``device_memory=None``."""
        import torch
        dev, everything = self.device, self.need().everything
        if dev.type != "cuda":
            return everything, None  # the CPU "device" is RAM: no budget unless one is given
        free, _total = torch.cuda.mem_get_info(dev)
        free += torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        if self.modes.params_on_device:
            return max(minimum, int(free * 0.9)), None  # nothing pages: the arena holds every unit anyway
        torch.cuda.reset_peak_memory_stats(dev)  # the peak read after the first step is ours
        return initial_budget(free, everything, minimum), free

    def memory_peak(self) -> int:
        """The device allocator's peak bytes since initialize (CUDA)."""
        import torch
        return torch.cuda.max_memory_allocated(self.device)

    def _grown_or_kept(self, new: int, old_budget: int):
        """The tier at ``new`` bytes, or, when the device is out of memory for
        it, at ``old_budget`` (the size that ran), with a warning."""
        import warnings

        import torch
        try:
            return self._tier(new)
        except torch.OutOfMemoryError as e:
            warnings.warn(f"infinity: the default device budget could not grow from {old_budget} to {new} bytes "
                          f"(out of device memory: {str(e).splitlines()[0][:200]}); it stays at {old_budget} "
                          "bytes. Set Config.device_memory to choose the size", RuntimeWarning, stacklevel=2)
            return self._tier(old_budget)

    def after_step(self, residency, grads, saved) -> None:
        """After the first step with the default budget, every unit has left
        the arena: grows the budget to what the pass left free. ``residency``
        and ``grads`` work on the device tier, ``saved`` (or None) holds views
        of its arena: all let go of the old arena before the new one is allocated."""
        from ..plan.state import DeviceState
        cap, self.capacity = self.capacity, None
        if cap is None or any(u.dev.state is not DeviceState.ABSENT for u in self.units if not u.dev.permanent):
            return
        old = residency.tier
        new = grown_budget(cap, self.memory_peak(), old.arena_bytes + old.fixed_bytes, self.budget,
                           self.need().everything)
        if new is None:
            return
        peak = old.peak_bytes
        residency.set_tier(None)
        grads.set_device(None)
        if saved is not None:
            saved.drop_buffers()
        old_budget = self.budget
        del old  # the old arena goes before the new one is allocated
        tier = self._grown_or_kept(new, old_budget)
        tier.peak_bytes = max(tier.peak_bytes, peak)
        residency.set_tier(tier)
        grads.set_device(tier)
        if saved is not None:
            saved.rebind()
