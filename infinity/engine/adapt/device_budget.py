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
    default that starts small and grows once (see the Note above)."""

    def __init__(self, engine):
        self.e = engine
        self.capacity: Optional[int] = None  # bytes to grow into, until the first step
        self.budget = 0

    def first_tier(self):
        """The device tier of ``initialize`` (raises BudgetError below the minimum)."""
        from ..mechanism.tiers import BudgetError
        need, budget = self.e.device_need(), self.e.config.device_memory
        if budget is None:
            budget, self.capacity = self.default(need.minimum)
        if budget < need.minimum:
            raise BudgetError(self._too_small(budget, need))
        return self._tier(budget)

    def _tier(self, budget: int):
        from ..mechanism.tiers import DeviceTier
        need = self.e.device_need()
        self.budget = budget
        return DeviceTier(self.e.device, budget, need.arena_bytes(budget), need.grad_reserve, need.opt_fixed)

    def _too_small(self, budget: int, need) -> str:
        from ...config.runtime import format_bytes
        units = self.e.units
        biggest = max(units[1:], key=lambda u: u.place.compute_bytes, default=units[0])
        return (f"device_memory={budget} bytes ({format_bytes(budget)}) is too small: it needs at least "
                f"{need.minimum} bytes ({format_bytes(need.minimum)}): the root unit "
                f"({units[0].place.compute_bytes} bytes), the largest unit {biggest.name!r} "
                f"({biggest.place.compute_bytes} bytes) and prefetch_depth={self.e.modes.depth} more units of up "
                f"to that size, {need.grad_reserve} bytes for gradients in flight"
                + (f" and {need.opt_fixed} bytes of optimizer state on the device" if need.opt_fixed else "")
                + ". Raise device_memory, lower prefetch_depth, or split the model into smaller units "
                  "(Config.unit_classes)")

    def default(self, minimum: int):
        """(budget, capacity to grow into or None) for ``device_memory=None``."""
        import torch
        dev, everything = self.e.device, self.e.device_need().everything
        if dev.type != "cuda":
            return everything, None  # the CPU "device" is RAM: no budget unless one is given
        free, _total = torch.cuda.mem_get_info(dev)
        free += torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        if self.e.modes.params_on_device:
            return max(minimum, int(free * 0.9)), None  # nothing pages: the arena holds every unit anyway
        torch.cuda.reset_peak_memory_stats(dev)  # the peak read after the first step is ours
        return initial_budget(free, everything, minimum), free

    def memory_peak(self) -> int:
        """The device allocator's peak bytes since initialize (CUDA)."""
        import torch
        return torch.cuda.max_memory_allocated(self.e.device)

    def after_step(self) -> None:
        """After the first step with the default budget, every unit has left
        the arena: grows the budget to what the pass left free."""
        from ..plan.state import DeviceState
        cap, self.capacity = self.capacity, None
        e = self.e
        if cap is None or any(u.dev.state is not DeviceState.ABSENT for u in e.units if not u.dev.permanent):
            return
        old = e.residency.tier
        new = grown_budget(cap, self.memory_peak(), old.arena_bytes + old.fixed_bytes, self.budget,
                           e.device_need().everything)
        if new is None:
            return
        peak = old.peak_bytes
        e.residency.set_tier(None)
        e.gradients.set_device(None)
        del old  # the old arena goes before the new one is allocated
        tier = self._tier(new)
        tier.peak_bytes = max(tier.peak_bytes, peak)
        e.residency.set_tier(tier)
        e.gradients.set_device(tier)
        if e.saved is not None:
            e.saved.rebind()
