"""SIGTERM ends a run as SIGINT does.

[Note: SIGTERM]
``timeout``, Slurm and Kubernetes stop a job with SIGTERM, whose default
action kills the process on the spot: no ``finally`` block, no atexit
handler, so the swap files and the lock of the run stay behind. So the first
``initialize`` in the main thread installs a handler, unless the program (or
its launcher) has one of its own: it raises :class:`Terminated`, a
``SystemExit`` with code 143 (128 + SIGTERM), in the main thread. The step it
interrupts is aborted; if it had changed any state, the engine is failed
(see [Note: a run is consistent or it says so]) so nothing half-updated is
served or saved. The ``finally`` blocks and atexit handlers then run,
``infinity.close`` among them, and the process exits with status 143. The
handler puts the default action back first: a second SIGTERM kills at once
(what is left is reclaimed by the next run on the directory).
"""

from __future__ import annotations

import signal
import sys
import threading

__all__ = ["Terminated", "install_sigterm_handler"]

EXIT_SIGTERM = 128 + signal.SIGTERM


class Terminated(SystemExit):
    """Raised in the main thread by SIGTERM (exit status 143)."""

    def __init__(self) -> None:
        super().__init__(EXIT_SIGTERM)


def _on_sigterm(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    sys.stderr.write("infinity: SIGTERM received: the step is aborted, swap files are removed, exit status 143\n")
    raise Terminated()


def install_sigterm_handler() -> bool:
    """Installs the handler of [Note: SIGTERM] if SIGTERM still has its
    default action and this is the main thread; True if it did."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False  # the program's own handler (or an ignored signal) stays
    signal.signal(signal.SIGTERM, _on_sigterm)
    return True
