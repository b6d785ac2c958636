"""What happens after a fault: the engine's failed state, the errors users
get, and bounded retries of transient I/O errors.

[Note: a run is consistent or it says so]
A fault (an I/O error that retries did not clear, a checksum mismatch, an
exception in a worker thread, an illegal state transition) can leave a step
half done: some units updated, buffers that hold unverified bytes. So the
first fault that escapes any engine operation puts the engine into a failed
state (:class:`FaultState`). That operation raises the fault itself, with its
own type and message (key, path, offset, errno). Every later entry point
(forward, backward hooks, ``step``, ``zero_grad``, ``state_dict``,
``full_state_dict``) raises :class:`EngineFailedError` naming that first
fault and each unit's step counts, instead of re-raising stale errors or
returning a mix; ``infinity.close`` still tears everything down. Usage errors
raised on purpose before anything changed (:class:`UsageError`) do not fail
the engine.
"""

from __future__ import annotations

import contextlib
import errno as _errno
import threading
import time
from typing import Callable, Iterator, List, Optional

__all__ = ["EngineFailedError", "UsageError", "FaultState", "RETRY_ERRNOS", "RETRIES", "with_retries"]

# errnos a device may return once and not again (a cable, a controller reset,
# a network filesystem); ENOSPC too, since space freed by another process ends it.
RETRY_ERRNOS = frozenset({_errno.EIO, _errno.EAGAIN, _errno.EINTR, _errno.EBUSY, _errno.ETIMEDOUT,
                          _errno.ENOSPC})
RETRIES = 3                      # attempts after the first
RETRY_BACKOFF_S = (0.001, 0.01, 0.1)


class UsageError(RuntimeError):
    """A call the engine refuses before changing anything (the message names the right way)."""


class EngineFailedError(RuntimeError):
    """The engine failed earlier and its state may be incomplete; the message
    names the first fault and each unit's optimizer step counts."""

    def __init__(self, message: str, cause: BaseException):
        super().__init__(message)
        self.cause = cause


class FaultState:
    """The first fault of one engine (see [Note: a run is consistent or it says so])."""

    def __init__(self, describe_steps: Callable[[], str]):
        self.first: Optional[BaseException] = None
        self.where = ""
        self._describe_steps = describe_steps
        self._lock = threading.Lock()

    @property
    def failed(self) -> bool:
        return self.first is not None

    def record(self, exc: BaseException, where: str) -> None:
        """Records ``exc`` (raised in ``where``) as the engine's fault, if it is the first."""
        # An interrupt (SIGINT, SIGTERM: [Note: SIGTERM]) is a fault too: the
        # operation it stopped may have changed part of the state.
        if isinstance(exc, (UsageError, EngineFailedError)):
            return
        with self._lock:
            if self.first is None:
                self.first, self.where = exc, where

    def check(self, what: str) -> None:
        """Raises :class:`EngineFailedError` if the engine failed (``what``: the call refused)."""
        if self.first is None:
            return
        e = self.first
        raise EngineFailedError(
            f"{what}: the engine failed earlier ({self.where}: {type(e).__name__}: {e}); its state may be "
            f"incomplete, so nothing more is served from it. Optimizer steps per unit: {self._describe_steps()}. "
            "Close the model (infinity.close) and resume from the last checkpoint", e) from e

    @contextlib.contextmanager
    def guard(self, where: str) -> Iterator[None]:
        """Refuses to start on a failed engine; records what escapes as the fault."""
        self.check(where)
        try:
            yield
        except BaseException as e:
            self.record(e, where)
            raise


def retryable(exc: BaseException) -> bool:
    """A swap error worth another attempt: a transient errno, or a checksum
    mismatch on a read (a bit flipped on the way, not on disk, reads right again)."""
    from ..io.errors import ChecksumError, SwapFullError, SwapIOError
    if isinstance(exc, SwapFullError) or not isinstance(exc, SwapIOError):
        return False
    return isinstance(exc, ChecksumError) or exc.errno in RETRY_ERRNOS


def with_retries(submit: Callable[[], object], first: object, log: List[str]) -> object:
    """Waits for ``first`` (an I/O handle); while it fails with a retryable
    error, submits again (``submit()``) up to :data:`RETRIES` times with a
    short backoff. Raises the last error, its message saying how many
    attempts were made; ``log`` gets one line per retried error."""
    handle = first
    for attempt in range(RETRIES + 1):
        try:
            handle.wait()
            return handle
        except Exception as e:  # noqa: BLE001 - re-raised below unless retried
            if attempt == RETRIES or not retryable(e):
                if attempt and hasattr(e, "add_note"):
                    e.add_note(f"infinity: failed {attempt + 1} times (retried: {'; '.join(log[-attempt:])})")
                raise
            log.append(f"{type(e).__name__}: {e}")
            time.sleep(RETRY_BACKOFF_S[min(attempt, len(RETRY_BACKOFF_S) - 1)])
            handle = submit()
    return handle
