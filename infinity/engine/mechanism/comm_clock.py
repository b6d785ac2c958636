"""Timing of the collectives: their own durations and the time threads wait for them.

[Note: exposed communication time]
Two figures per engine, both in seconds, summed over the run and over the
last step (``Stats.comm_seconds`` / ``comm_wait_seconds``, and their
``step_`` figures):
- ``comm_seconds``, what the collectives take on their own: a group runs its
  collectives one after another, so each asynchronous one counts from the
  later of its issue and the previous one's completion to its own
  completion (the time the group's links were busy with it). The completion
  is taken where it happens, not where someone waits: on the CPU a clock
  thread waits for every asynchronous collective in issue order (gloo's
  reduce-scatter has no future to hang a callback on); on CUDA a callback on
  the Work's future (NCCL marks it complete when the kernels are done);
- ``comm_wait_seconds``, the exposed part: the time threads of the engine
  (the thread running forward and backward, the optimizer's) spent blocked
  in a collective's ``wait()`` (:class:`~infinity.engine.mechanism.zero.CollectiveTicket`,
  which includes the copy that follows a reduction to the host), and the
  whole duration of synchronous collectives, which count in both figures.
The share of the collectives hidden behind compute is then
``1 - comm_wait_seconds / comm_seconds``. Control messages (which slots got
a gradient, norm sums) are not timed, as they are not counted in the bytes.
"""

from __future__ import annotations

import queue
import threading
import time

__all__ = ["CommClock"]


class CommClock:
    """Mechanism: measures the collectives' durations and the waits for them into ``stats``."""

    def __init__(self, stats):
        self.stats = stats
        self._lock = threading.Lock()
        self._last_end = 0.0          # completion of the latest collective timed
        self._queue: "queue.Queue" = queue.Queue()
        self._thread = None

    def issued(self, work, on_cuda: bool) -> None:
        """An asynchronous collective ``work`` was issued just now."""
        t0 = time.perf_counter()
        if on_cuda:
            work.get_future().then(lambda _f: self._done(t0))
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="infinity-comm-clock", daemon=True)
            self._thread.start()
        self._queue.put((work, t0))

    def close(self, timeout_s: float = 30.0) -> None:
        """Ends the clock thread once the collectives queued before are timed
        (waits at most ``timeout_s`` seconds): an engine that closes leaves no thread."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout_s)

    def _watch(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work, t0 = item
            try:
                work.wait()
            except Exception:  # a failed collective: its waiter reports it
                pass
            self._done(t0)
            del work, item

    def _done(self, t0: float) -> None:
        end = time.perf_counter()
        with self._lock:
            self.stats.comm_seconds += max(0.0, end - max(t0, self._last_end))
            self._last_end = max(self._last_end, end)

    def waited(self, seconds: float) -> None:
        """A thread was blocked ``seconds`` on a collective."""
        with self._lock:
            self.stats.comm_wait_seconds += seconds

    def synchronous(self, t0: float) -> None:
        """A synchronous collective started at ``t0`` (``time.perf_counter()``) just returned."""
        end = time.perf_counter()
        with self._lock:
            self.stats.comm_seconds += end - t0
            self.stats.comm_wait_seconds += end - t0
            self._last_end = max(self._last_end, end)
