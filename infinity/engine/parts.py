"""The record of an engine's parts, built once by core.py.

[Note: parts by name]
The parts below core (the schedules, values, the pressure monitor) are
handed this frozen record instead of the Engine: each field names one part,
so what a part uses is written in one place and no part can reach the
engine's own state. Fields are set once; the owners inside keep their own
records on the units.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List, Optional

if TYPE_CHECKING:
    from .faults import FaultState
    from .fence import Fence
    from .mechanism.host_room import HostRoom
    from .mechanism.nvme import NvmeTier
    from .mechanism.zero import Sharding
    from .owners.grads import Gradients
    from .owners.host_cache import HostCache
    from .owners.optstate import OptimizerState
    from .owners.residency import Residency
    from .plan.placement import Modes
    from .plan.trace import Trace
    from .plan.units import Unit
    from .stats import Stats

__all__ = ["Parts"]


@dataclass(frozen=True)
class Parts:
    """An engine's parts, by name (see [Note: parts by name])."""

    units: "List[Unit]"            # index 0 is the root unit
    modes: "Modes"                 # the placement's modes, decided once
    trace: "Trace"                 # the recorded order of unit uses
    stats: "Stats"                 # counters of the step window
    mover: object                  # copies and host jobs (mechanism/mover.py)
    sharding: "Sharding"           # ZeRO shards and collectives (world 1 without torch.distributed)
    nvme: "Optional[NvmeTier]"     # swap homes, or None
    faults: "FaultState"           # the failed state
    fence: "Fence"                 # waits before a unit's state changes (a background save)
    room: "HostRoom"               # the shared host pool
    host_cache: "HostCache"        # owner of u.host
    grads: "Gradients"             # owner of u.grads
    optstate: "OptimizerState"     # owner of u.opt
    residency: "Residency"         # owner of u.dev
    values_changed: Callable       # (unit, slots=None): parameter values changed in their home
