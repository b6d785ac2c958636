"""A CPU mover that runs copies in CUDA's latest legal schedule (issue 36).

On a GPU a copy issued on a stream may run at any time between its issue
and the first wait for it (or for a later copy of the same stream); on the
CPU the default mover runs it at once on a worker thread, so a missing
wait rarely shows. ``LazyMover`` queues every host-to-device,
device-to-host and gradient copy on its stream (FIFO) and runs it only when
something waits for it or for a later copy on that stream: ``done()`` is
False until then. A wait the engine forgot then reads the bytes from before
the copy, and a source overwritten before its copy ran is copied
overwritten, as on a GPU at its worst. Host jobs and chains keep their
threads (they are host threads on CUDA too).

    with emulated_cuda_ordering():
        ...  # every engine built inside uses LazyMover
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from typing import Callable, Iterator, List

from infinity.engine.mechanism import mover as mover_mod
from infinity.engine.mechanism.mover import CpuMover, Ticket, _cast_into, _drain

__all__ = ["LazyMover", "emulated_cuda_ordering"]


class _Stream:
    """Copies in issue order, run only when waited for (see the module docstring)."""

    def __init__(self, name: str):
        self.name = name
        self.queue: deque = deque()
        self.lock = threading.RLock()
        self.ran = 0  # copies run so far (the tests check that copies were deferred at all)

    def push(self, fn: Callable[[], None]) -> "LazyTicket":
        t = LazyTicket(self, fn)
        with self.lock:
            self.queue.append(t)
        return t

    def drain_to(self, t: "LazyTicket") -> None:
        with self.lock:
            while not t.ran and self.queue:
                self.queue.popleft().run()

    def drain(self) -> None:
        with self.lock:
            while self.queue:
                self.queue.popleft().run()


class LazyTicket(Ticket):
    """A copy queued on a :class:`_Stream`."""

    def __init__(self, stream: _Stream, fn: Callable[[], None]):
        self.stream, self.fn = stream, fn
        self.ran, self.error = False, None

    def run(self) -> None:
        try:
            self.fn()
        except BaseException as e:  # noqa: BLE001 - kept for the waiter, as an event's error would be
            self.error = e
        self.ran, self.fn = True, None
        self.stream.ran += 1

    def done(self) -> bool:
        return self.ran

    def wait(self) -> None:
        self.stream.drain_to(self)
        if self.error is not None:
            raise self.error


class LazyMover(CpuMover):
    """CpuMover whose copies run in CUDA's latest legal schedule; gradients
    leave in buckets, as on CUDA."""

    batches_grads = True

    def __init__(self) -> None:
        super().__init__()
        self.streams: List[_Stream] = [_Stream("h2d"), _Stream("d2h")]

    def h2d(self, dst, src, *, fresh: bool = False) -> Ticket:
        return self.streams[0].push(lambda: dst.copy_(src))

    def d2h(self, dst, src) -> Ticket:
        return self.streams[1].push(lambda: dst.copy_(src))

    def grad_out(self, host_dst, dev_grad, accumulate: bool) -> Ticket:
        src = dev_grad.reshape(-1)  # kept alive by the closure, as record_stream keeps it on CUDA
        return self.streams[1].push(lambda: _cast_into(host_dst, src, accumulate))

    def synchronize(self) -> None:
        _drain(self._chain, self._host)  # their jobs issue copies on the streams
        for s in self.streams:
            s.drain()
        _drain(self._h2d, self._d2h)

    def close(self, wait: bool = True) -> None:
        if wait:
            for s in self.streams:
                s.drain()
        super().close(wait)


@contextlib.contextmanager
def emulated_cuda_ordering() -> Iterator[List[LazyMover]]:
    """Engines initialized inside use :class:`LazyMover` (CPU devices only);
    yields the list of the movers made, for the caller's checks."""
    made: List[LazyMover] = []
    real = mover_mod.make_mover

    def make(device):
        if device.type == "cuda":
            return real(device)
        m = LazyMover()
        made.append(m)
        return m

    import infinity.engine.core as core
    core.make_mover = make
    try:
        yield made
    finally:
        core.make_mover = real
