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
