"""States of a paging unit's buffers, and the legal transitions between them.

Each owner keeps a record on the unit (``unit.dev``, ``unit.host``,
``unit.grads``, ``unit.opt``) and moves its state only through
:func:`transition`, which checks the tables below, so an illegal move
(evicting a unit in use, fetching one twice, checking state in twice) fails
at once with the unit's name rather than as a wrong number later.

[Note: where the valid copy of a unit lives]
Every paging unit has one *compute copy* of its parameters (the dtype the
model runs in). Its home is the host tier (``offload_params="host"``), NVMe
(``"nvme"``: cached in the host tier, see [Note: host copy states]) or the
device (``"none"``: placed once, never evicted). The device copy
(``unit.dev.state``, residency.py):

    ABSENT    no device buffer; the home copy is the only valid one.
    FETCHING  a device buffer is allocated and a copy to it is in flight
              (``unit.dev.ticket``); the parameters' ``.data`` already point
              into it, but compute must wait on the ticket first.
    RESIDENT  the device buffer holds a copy equal to the home copy.

    ABSENT   -> FETCHING   fetch or prefetch (device bytes allocated)
    FETCHING -> RESIDENT   the copy's ticket completed and was waited on
    FETCHING -> ABSENT     dropped before use (unpinned, after waiting for the copy)
    RESIDENT -> ABSENT     eviction, or invalidation after an optimizer step

[Note: pins]
What keeps a resident unit in place, strongest first:

- ``dev.pins`` (hard): a forward running in the unit, the whole pass for the
  root and for units used outside their own forward (placed at the top of
  the arena), and a recomputation in backward until the unit's backward is
  done (checkpoint holds recomputed views the engine cannot re-route).
  Never evicted.
- protected: units whose saved tensors were unpacked since the last hook
  (the backward node that unpacked them has not run yet). Never evicted.
- ``dev.held`` (soft): the unit's backward is pending. Saved tensors follow
  their unit (see [Note: saved tensors follow their unit]), so such a unit
  can give way when a unit needed *now* finds no room, after every unheld
  unit; it is fetched again when its backward unpacks a saved tensor.
- nothing: evicted first, furthest next use first.

A backward fetch (the multi-grad hook on a unit's outputs) only takes room
that no held unit occupies; without it the fetch waits in ``Residency._wanted``
for the next hook or the first unpack. This matters because the hook that
fetches unit k-1 fires before the one that releases unit k (both watch the
same tensor), so at a budget of one unit the release must come first.
Hence the minimum device budget is the pass units plus ``prefetch_depth + 1``
of the largest other units, with nothing extra for backward.

[Note: host copy states]
``unit.host.state`` (host_cache.py):

    NONE          no host buffer (NVMe home: the swap file holds the copy)
    HOME          a permanent host buffer is the home (offload_params "host",
                  or the optimizer's copy-out target with params on the device)
    CLEAN         a cached copy equal to the NVMe one (possibly still being
                  read into: ``host.busy``)
    DIRTY         a cached copy newer than the NVMe one (an update wrote it);
                  written back, with the update's checksums, when evicted
    WRITING_BACK  evicted dirty: the write-back is in flight and the buffer
                  is freed when it is done; a new read waits for it

    NONE -> CLEAN (read, or a copy written whole) | HOME (placement, or taken back home)
    HOME -> NONE (spilled to the swap files under memory pressure)
    CLEAN -> DIRTY (update) | NONE (evicted) | HOME (a spilled unit taken back home)
    DIRTY -> CLEAN (written back, kept) | WRITING_BACK (evicted) | HOME (taken back home)
    WRITING_BACK -> NONE (the write is done)

[Note: optimizer-state states]
``unit.opt.state`` (optstate.py):

    NONE           no optimizer state (no trainable parameter)
    RESIDENT       master and moments in memory for good (host or device)
    HOME           on NVMe only
    READING_AHEAD  reads into host buffers in flight, not claimed by an update
    CHECKED_OUT    an update holds the host buffers

    NONE -> RESIDENT | HOME (placement)
    HOME -> READING_AHEAD (read ahead) | CHECKED_OUT (checked out)
    READING_AHEAD -> CHECKED_OUT (claimed) | HOME (dropped: memory needed now)
    CHECKED_OUT -> HOME (checked in, written back; or discarded unchanged)

[Note: gradient states]
``unit.grads.state`` is the step's content, ``unit.grads.home`` where the
buffer is (grads.py):

    CLEAN -> ACCUMULATING (the step's first gradient) -> CLEAN (the step read them)

    PERMANENT  a buffer kept for good (never moves)
    NONE       no buffer (NVMe optimizer state, ZeRO 2-3 full gradients)
    HOST       a transient host buffer
    SPILLED    on NVMe only (written when the unit's backward was done)
    LOADED     on NVMe, and read back into a host buffer (for the norm or the update)
    CLAIMED    an update during backward owns the host buffer and frees it (or,
               speculative, spills it: step() reads it again)

    NONE -> HOST | PERMANENT;  HOST -> SPILLED | CLAIMED | NONE;
    SPILLED -> HOST (read back to accumulate) | LOADED | NONE;
    LOADED -> SPILLED (dropped again) | NONE;  CLAIMED -> NONE | SPILLED
"""

from __future__ import annotations

import enum
import threading

__all__ = ["DeviceState", "HostState", "OptState", "GradState", "GradHome", "transition", "IllegalTransition",
           "Quiet"]


class DeviceState(enum.Enum):
    ABSENT = "absent"
    FETCHING = "fetching"
    RESIDENT = "resident"


class HostState(enum.Enum):
    NONE = "none"
    HOME = "home"
    CLEAN = "clean"
    DIRTY = "dirty"
    WRITING_BACK = "writing back"


class OptState(enum.Enum):
    NONE = "none"
    RESIDENT = "resident"
    HOME = "home"
    READING_AHEAD = "reading ahead"
    CHECKED_OUT = "checked out"


class GradState(enum.Enum):
    CLEAN = "clean"
    ACCUMULATING = "accumulating"


class GradHome(enum.Enum):
    PERMANENT = "permanent"
    NONE = "none"
    HOST = "host"
    SPILLED = "spilled"
    LOADED = "loaded"
    CLAIMED = "claimed"


class IllegalTransition(RuntimeError):
    """A unit's buffer was moved between states in a way the table forbids (a bug)."""


_LEGAL = {
    DeviceState.ABSENT: {DeviceState.FETCHING},
    DeviceState.FETCHING: {DeviceState.RESIDENT, DeviceState.ABSENT},
    DeviceState.RESIDENT: {DeviceState.ABSENT},
    HostState.NONE: {HostState.CLEAN, HostState.HOME},
    HostState.HOME: {HostState.NONE},
    HostState.CLEAN: {HostState.DIRTY, HostState.NONE, HostState.HOME},
    HostState.DIRTY: {HostState.CLEAN, HostState.WRITING_BACK, HostState.HOME},
    HostState.WRITING_BACK: {HostState.NONE},
    OptState.NONE: {OptState.RESIDENT, OptState.HOME},
    OptState.RESIDENT: set(),
    OptState.HOME: {OptState.READING_AHEAD, OptState.CHECKED_OUT},
    OptState.READING_AHEAD: {OptState.CHECKED_OUT, OptState.HOME},
    OptState.CHECKED_OUT: {OptState.HOME},
    GradState.CLEAN: {GradState.ACCUMULATING},
    GradState.ACCUMULATING: {GradState.CLEAN},
    GradHome.PERMANENT: set(),
    GradHome.NONE: {GradHome.HOST, GradHome.PERMANENT},
    GradHome.HOST: {GradHome.SPILLED, GradHome.CLAIMED, GradHome.NONE},
    GradHome.SPILLED: {GradHome.HOST, GradHome.LOADED, GradHome.NONE},
    GradHome.LOADED: {GradHome.SPILLED, GradHome.NONE},
    GradHome.CLAIMED: {GradHome.NONE, GradHome.SPILLED},
}


def transition(unit_name: str, kind: str, current: enum.Enum, new: enum.Enum) -> enum.Enum:
    """Returns ``new`` if ``current -> new`` is legal; raises IllegalTransition naming the unit otherwise."""
    if new not in _LEGAL[current]:
        raise IllegalTransition(f"unit {unit_name!r}: illegal {kind} transition {current.value} -> {new.value}")
    return new


class Quiet:
    """A re-entrant "the engine itself touches parameters now" flag, so the
    recording pass's watcher (hooks._Watcher) ignores those uses."""

    def __init__(self) -> None:
        self._depth = 0
        self._lock = threading.Lock()

    def __enter__(self) -> "Quiet":
        with self._lock:
            self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._depth -= 1

    @property
    def active(self) -> bool:
        return self._depth > 0
