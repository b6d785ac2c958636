"""The handle of one asynchronous :class:`~infinity.io.SwapStore` transfer."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Hashable, List, Optional

from ..errors import SwapIOError

if TYPE_CHECKING:
    from .store import SwapStore


class IOHandle:
    """An asynchronous :meth:`SwapStore.write` or :meth:`SwapStore.read`.

    :meth:`wait` blocks (without holding the GIL) until every part of the
    transfer ended and raises the first error, naming the key. It may be called
    any number of times, from any thread.
    """

    def __init__(self, store: "SwapStore", key: Hashable, op: str, nbytes: int):
        self.key = key
        self.op = op
        self.nbytes = nbytes
        self._store = store
        self._tickets: List[int] = []
        self._staging: list = []
        self._keep: list = []
        self._on_done = None
        self._lock = threading.Lock()
        self._finished = False
        self._error: Optional[BaseException] = None
        # True while its pieces are being submitted (the submitter holds
        # ``_lock`` meanwhile): not done, and not to be completed by others.
        self._submitting = False

    def done(self) -> bool:
        """True when the transfer has ended (successfully or not); never blocks."""
        if self._finished:
            return True
        if self._submitting:
            return False  # tickets still to come: the ones so far are not the transfer
        eng = self._store._engine
        return all(eng.done(t) for t in self._tickets)

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait at most ``timeout`` seconds (None: forever); returns the bytes moved.

        Raises :class:`SwapIOError` (errno set), :class:`ChecksumError`, or
        :class:`TimeoutError` if the transfer is still running at the deadline.
        """
        if not self._complete(timeout):
            raise TimeoutError(f"{self.op} of key {self.key!r} ({self.nbytes} bytes) still running after "
                               f"{timeout} s")
        if self._error is not None:
            raise self._error
        return self.nbytes

    def _complete(self, timeout: Optional[float] = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if self._finished:
                return True
            eng = self._store._engine
            while self._tickets:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    if not eng.wait(self._tickets[0], left):
                        return False
                except SwapIOError as exc:
                    if self._error is None:
                        self._error = type(exc)(exc.errno, f"{self.op} of key {self.key!r} failed: {exc.strerror}")
                self._tickets.pop(0)
            for buf in self._staging:
                buf.release()
            self._staging.clear()
            if self._on_done is not None:
                # Dropped once called: it refers to this handle (a cycle otherwise).
                on_done, self._on_done = self._on_done, None
                on_done(self._error)
            self._keep.clear()
            self._finished = True
        self._store._handle_finished(self)
        return True

    def __repr__(self) -> str:
        state = "done" if self._finished else "pending"
        return f"IOHandle({self.op} {self.key!r}, {self.nbytes} bytes, {state})"

