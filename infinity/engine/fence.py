"""The engine's fence and its two moments of the run, for a background
checkpoint (checkpoint/background.py) to install in one call.

[Note: the engine's fence]
Every change of a unit's state (an update, a write of its values, a spill,
the refresh of a device copy) first calls ``fence.wait_unit(u)``. By
default that does nothing. A background save installs a waiter that blocks
until the save has copied the unit out (see [Note: a background save] in
background.py), plus what to do after each step (say a failed save once) and
before the engine closes (finish the save). The engine never imports the
checkpoint package: what it calls is handed to it here.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = ["Fence"]


class Fence:
    """One per engine. ``pending`` is the installer's handle of the save in
    flight (None when none): the checkpoint package reads and clears it."""

    def __init__(self):
        self._wait: Optional[Callable[[Any], None]] = None
        self._after_step: Optional[Callable[[], None]] = None
        self._before_close: Optional[Callable[[], None]] = None
        self.pending: Any = None

    def install(self, pending: Any, wait_unit: Callable[[Any], None], after_step: Callable[[], None],
                before_close: Callable[[], None]) -> None:
        """A background save starts: ``wait_unit(u)`` gates every change of
        unit ``u``; ``after_step()`` runs after each optimizer step and
        ``before_close()`` before the engine tears down, until the next install."""
        self.pending, self._wait = pending, wait_unit
        self._after_step, self._before_close = after_step, before_close

    def lift(self, wait_unit: Callable[[Any], None]) -> None:
        """The save that installed ``wait_unit`` ended: changes no longer wait
        (a later save's waiter stays). The callbacks stay until ``pending`` is cleared."""
        if self._wait is wait_unit:
            self._wait = None

    def wait_unit(self, u) -> None:
        """Before any change of ``u``'s state (see [Note: the engine's fence])."""
        w = self._wait
        if w is not None:
            w(u)

    def after_step(self) -> None:
        """At the end of every optimizer step."""
        if self._after_step is not None and self.pending is not None:
            self._after_step()

    def before_close(self) -> None:
        """Before the engine's teardown (it reads the tiers that close removes)."""
        if self._before_close is not None and self.pending is not None:
            self._before_close()
