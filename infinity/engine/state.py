"""States of a paging unit's buffers, and the legal transitions between them.

[Note: where the valid copy of a unit lives]
Every paging unit has one *compute copy* of its parameters (the dtype the
model runs in). Its home is the host tier (``offload_params="host"``) or the
device tier (``"none"``: fetched once, never evicted). The device copy goes
through these states:

    ABSENT    no device buffer; the home copy (host) is the only valid copy.
    FETCHING  a device buffer is allocated and a host-to-device copy is in
              flight (ticket in ``unit.fetch_ticket``); the parameters'
              ``.data`` already point into the buffer, but compute must wait
              on the ticket before touching them.
    RESIDENT  the device buffer holds a valid copy equal to the home copy.

``unit.pins`` counts the users that need the device copy now (a forward in
progress, a backward pending); a unit with pins > 0 is never evicted. The
legal moves:

    ABSENT   -> FETCHING   fetch or prefetch (device bytes allocated)
    FETCHING -> RESIDENT   the copy's ticket completed and was waited on
    FETCHING -> ABSENT     the unit is dropped before use (only when unpinned,
                           after waiting for the copy: the buffer is in use by it)
    RESIDENT -> ABSENT     eviction (unpinned) or invalidation after an
                           optimizer step changed the home copy

[Note: pins]
What keeps a resident unit in place, strongest first:

- ``pins`` (hard): a forward running in the unit, the whole pass for the root
  and for units used outside their own forward (placed at the top of the
  arena), and a recomputation in backward until the unit's backward is done
  (checkpoint holds recomputed views the engine cannot re-route). Never evicted.
- protected: units whose saved tensors were unpacked since the last hook
  (the backward node that unpacked them has not run yet). Never evicted.
- ``bwd_count`` (soft): the unit's backward is pending. Saved tensors follow
  their unit (see [Note: saved tensors follow their unit]), so such a unit
  can give way when a unit needed *now* finds no room, after every unheld
  unit; it is fetched again when its backward unpacks a saved tensor.
- nothing: evicted first, furthest next use first.

A backward fetch (the multi-grad hook on a unit's outputs) only takes room
that no held unit occupies; without it the fetch waits in ``Engine._wanted``
for the next hook or the first unpack. This matters because the hook that
fetches unit k-1 fires before the one that releases unit k (both watch the
same tensor), so at a budget of one unit the release must come first.
Hence the minimum device budget is the pass units plus ``prefetch_depth + 1``
of the largest other units, with nothing extra for backward.

Gradients go through their own states (per unit, per step):

    CLEAN       the host gradient buffer holds nothing for this step
    ACCUMULATING  gradients of at least one backward pass were added
    CONSUMED    the optimizer step read them (zero_grad or the next step
                makes them CLEAN again; the buffer is not zeroed, the next
                flush overwrites instead of adding)

Every transition goes through :func:`transition`, which checks it against
the table below, so an illegal move (evicting a unit in use, fetching a unit
twice) fails at once with the unit's name rather than as a wrong number later.
"""

from __future__ import annotations

import enum

__all__ = ["DeviceState", "GradState", "transition", "IllegalTransition"]


class DeviceState(enum.Enum):
    ABSENT = "absent"
    FETCHING = "fetching"
    RESIDENT = "resident"


class GradState(enum.Enum):
    CLEAN = "clean"
    ACCUMULATING = "accumulating"
    CONSUMED = "consumed"


class IllegalTransition(RuntimeError):
    """A unit's buffer was moved between states in a way the table forbids (a bug)."""


_LEGAL = {
    DeviceState.ABSENT: {DeviceState.FETCHING},
    DeviceState.FETCHING: {DeviceState.RESIDENT, DeviceState.ABSENT},
    DeviceState.RESIDENT: {DeviceState.ABSENT},
    GradState.CLEAN: {GradState.ACCUMULATING, GradState.CLEAN},
    GradState.ACCUMULATING: {GradState.ACCUMULATING, GradState.CONSUMED, GradState.CLEAN},
    GradState.CONSUMED: {GradState.CLEAN, GradState.ACCUMULATING},
}


def transition(unit_name: str, kind: str, current: enum.Enum, new: enum.Enum) -> enum.Enum:
    """Returns ``new`` if ``current -> new`` is legal; raises IllegalTransition naming the unit otherwise."""
    if new not in _LEGAL[current]:
        raise IllegalTransition(f"unit {unit_name!r}: illegal {kind} transition {current.value} -> {new.value}")
    return new
