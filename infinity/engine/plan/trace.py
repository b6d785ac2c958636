"""The recorded order in which units are used, for prefetching and eviction.

[Note: trace, replay, invalidate]
The first forward+backward of each kind (training with grad, or inference
without) is recorded: the sequence of unit fetch requests. Later passes
replay it: each request is checked against the expected next entry. While
they match, the prefetcher looks ahead in the trace, and eviction picks the
resident unit whose next use is furthest away (Belady's rule, optimal for a
known sequence). On the first mismatch the trace is dropped, the rest of the
pass runs on demand (least recently used eviction), and the next pass records
a fresh trace. Modules called twice, checkpoint recomputation and a forward
that calls blocks out of registration order are all just entries in the
sequence.
"""

from __future__ import annotations

import bisect
from typing import Dict, List, Optional

__all__ = ["Trace"]

NEVER = float("inf")


class Trace:
    """Unit-use sequences keyed by pass kind, with a replay cursor."""

    def __init__(self) -> None:
        self._traces: Dict[str, List[int]] = {}
        self._positions: Dict[str, Dict[int, List[int]]] = {}
        self.kind: Optional[str] = None
        self.recording: List[int] = []
        self.replaying = False
        self.cursor = 0
        self.invalidations = 0

    def begin_pass(self, kind: str) -> None:
        """Starts a pass (a forward and its backward, if any) of ``kind``."""
        self.end_pass()
        self.kind = kind
        self.cursor = 0
        self.recording = []
        self.replaying = kind in self._traces

    def end_pass(self) -> None:
        """Ends the current pass: a recorded sequence becomes the trace of its kind."""
        if self.kind is None:
            return
        if self.replaying:
            if self.cursor != len(self._traces[self.kind]):  # pass ended early: order changed
                self._invalidate()
        elif self.recording:
            seq = self.recording
            self._traces[self.kind] = seq
            pos: Dict[int, List[int]] = {}
            for i, u in enumerate(seq):
                pos.setdefault(u, []).append(i)
            self._positions[self.kind] = pos
        self.kind = None
        self.replaying = False
        self.recording = []

    def _invalidate(self) -> None:
        assert self.kind is not None
        self._traces.pop(self.kind, None)
        self._positions.pop(self.kind, None)
        self.replaying = False
        self.invalidations += 1

    def use(self, unit: int) -> None:
        """Records or checks one use of ``unit``."""
        if self.kind is None:
            return
        if self.replaying:
            seq = self._traces[self.kind]
            if self.cursor < len(seq) and seq[self.cursor] == unit:
                self.cursor += 1
                return
            self._invalidate()  # the rest of this pass runs on demand; the next one records
            self.recording = []
            return
        self.recording.append(unit)

    def upcoming(self, limit: int) -> List[int]:
        """The next ``limit`` entries of the trace after the cursor (empty when not replaying)."""
        if not self.replaying:
            return []
        seq = self._traces[self.kind]
        return seq[self.cursor:self.cursor + limit]

    def head(self, kind: str, limit: int) -> List[int]:
        """The first ``limit`` entries of the trace of ``kind`` (empty without
        one): what the next pass of that kind uses first (see [Note: the
        trace wraps around the step] in residency.py)."""
        return self._traces.get(kind, [])[:limit]

    def next_use(self, unit: int) -> float:
        """Trace index of ``unit``'s next use at or after the cursor; NEVER if none or not replaying."""
        if not self.replaying:
            return NEVER
        pos = self._positions[self.kind].get(unit)
        if not pos:
            return NEVER
        i = bisect.bisect_left(pos, self.cursor)
        return pos[i] if i < len(pos) else NEVER

    def used_again(self, unit: int) -> bool:
        """True unless the trace is replaying and ``unit`` has no use left in this pass."""
        return not self.replaying or self.next_use(unit) != NEVER

    @property
    def has_trace(self) -> bool:
        return self.replaying
