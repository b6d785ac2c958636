"""Counters of one engine: bytes moved, peaks, stalls, optimizer time."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Dict, Optional


@dataclass
class Stats:
    """Counters; :meth:`as_dict` is what ``infinity.stats(model)`` returns."""

    bytes_moved: Dict[str, int] = field(default_factory=lambda: {"h2d": 0, "d2h": 0, "nvme_read": 0,
                                                                  "nvme_write": 0})
    step_bytes_moved: Dict[str, int] = field(default_factory=dict)  # of the last completed step
    _step_start: Dict[str, int] = field(default_factory=dict)
    stall_seconds: float = 0.0         # compute waiting for data (host-side wait time)
    optimizer_seconds: float = 0.0     # time inside optimizer kernels, all units
    optimizer_wait_seconds: float = 0.0  # time step() waited for optimizer work or ran it itself
    fetches: int = 0
    prefetches: int = 0
    evictions: int = 0
    steps: int = 0
    skipped_steps: int = 0
    trace_invalidations: int = 0
    # Speculative updates ([Note: speculative updates] in step/speculate.py):
    spec_steps: int = 0              # steps whose updates ran during backward before the check
    spec_committed: int = 0          # of them, kept as they were
    spec_replayed: int = 0           # rolled back and redone with the clip coefficient
    spec_skipped: int = 0            # rolled back and skipped (a non-finite norm)
    spec_waited: int = 0             # steps that waited for step(): the last one clipped, or the back-off
    spec_units_without_room: int = 0  # units that waited for step(): no host room for their undo state
    spec_units_without_disk: int = 0  # units that waited for step(): no swap room for their new NVMe state
    spec_replay_seconds: float = 0.0  # rollbacks and redone updates
    spec_off: str = ""               # why speculation is not available in this run ("" if it is, or not needed)
    # See [Note: exposed communication time] in mechanism/comm_clock.py:
    comm_seconds: float = 0.0        # the collectives' own durations
    comm_wait_seconds: float = 0.0   # of them, what threads waited for (exposed)
    step_comm_seconds: float = 0.0   # the last step's
    step_comm_wait_seconds: float = 0.0
    _step_comm: tuple = (0.0, 0.0)
    step_seconds: float = 0.0        # the last step: end of the previous step() (or initialize) to the end of this one
    _window_t: Optional[float] = None

    def moved(self, link: str, nbytes: int) -> None:
        self.bytes_moved[link] = self.bytes_moved.get(link, 0) + nbytes

    def begin_step_window(self) -> None:
        self._step_start = dict(self.bytes_moved)

    def end_step_window(self) -> None:
        now = time.perf_counter()
        if self._window_t is not None:
            self.step_seconds = now - self._window_t
        self._window_t = now
        self.step_bytes_moved = {k: v - self._step_start.get(k, 0) for k, v in self.bytes_moved.items()}
        self._step_start = dict(self.bytes_moved)
        comm = (self.comm_seconds, self.comm_wait_seconds)
        self.step_comm_seconds, self.step_comm_wait_seconds = comm[0] - self._step_comm[0], comm[1] - self._step_comm[1]
        self._step_comm = comm


class Timer:
    """Adds elapsed seconds to an attribute of a Stats object."""

    __slots__ = ("stats", "attr", "t0")

    def __init__(self, stats: Stats, attr: str):
        self.stats, self.attr = stats, attr

    def __enter__(self) -> "Timer":
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        setattr(self.stats, self.attr, getattr(self.stats, self.attr) + time.perf_counter() - self.t0)
