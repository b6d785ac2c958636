"""``save_checkpoint(..., blocking=False)``: a checkpoint written while training goes on.

[Note: a background save]
The save's tensors are read unit by unit from the tiers on a thread of its
own while the next forward and backward run. The state at the call must be
what is written, not what later updates make of it (torch.distributed.
checkpoint's async save once wrote post-update values of CPU tensors,
pytorch #144657). So every change of a unit's state waits, in
:meth:`SaveFence.wait_unit`, until the save has copied all of that unit's
tensors out (into the file's staging buffers): the optimizer's update of
the unit (whether in ``step()`` or during backward), a write of its values
(``load_state_dict``, an in-place write, a load), a spill to NVMe and the
refresh of device-resident copies. Buffers, which forward may change
(BatchNorm's running statistics), are copied at the call. Reads need no fence, but a compute copy
cached in the host pool can be evicted and its buffer reused while the save
holds it, so the save copies such a copy under the host lock
(``Values.read_detached`` in values.py). The engine knows nothing of this: the save
installs its waiter into the engine's fence (see [Note: the engine's fence]
in fence.py). Forward and backward overlap the save; an
update of a unit not yet written waits for it. The save writes unit by unit
in the order the updates come, each unit's weights and moments together
(``Plan.stream``), so the first update waits for about one unit's share of
the save, and none if the forward gave the save time to pass it. The fence lifts for every unit when the save ends, also
when it fails; the error is raised by :meth:`AsyncCheckpoint.wait`, warned
about at the next ``step()``, and raised by the next ``save_checkpoint`` or
``load_checkpoint`` call.
"""

from __future__ import annotations

import threading
import warnings
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

from ..engine.faults import UsageError
from .plan import Plan, SlotSource

__all__ = ["AsyncCheckpoint", "SaveFence", "check_background_ok", "wait_pending", "warn_if_failed"]


class SaveFence:
    """Which units still have tensors to be written by a background save."""

    def __init__(self, plan: Plan):
        self._cv = threading.Condition()
        self._left = Counter(src.u.index for *_, src in plan.model_items + plan.optim_items
                             if isinstance(src, SlotSource))

    def item_done(self, source) -> None:
        """One tensor of the plan was copied out."""
        if not isinstance(source, SlotSource):
            return
        with self._cv:
            i = source.u.index
            self._left[i] -= 1
            if self._left[i] <= 0:
                del self._left[i]
                self._cv.notify_all()

    def lift(self) -> None:
        """The save ended (done or failed): nothing waits any more."""
        with self._cv:
            self._left.clear()
            self._cv.notify_all()

    def wait_unit(self, u) -> None:
        """Blocks until every tensor of unit ``u`` has been written."""
        with self._cv:
            while u.index in self._left:
                self._cv.wait()


class AsyncCheckpoint:
    """A checkpoint being written in the background (see [Note: a background save]).

    ``path`` is where it will be once complete; :meth:`wait` returns it, or
    raises the save's error (a full disk: :class:`CheckpointSpaceError`, the
    partial checkpoint removed and earlier ones intact)."""

    def __init__(self, eng, path: Path):
        self.path = path
        self._eng = eng
        self._done = threading.Event()
        self._error: Optional[BaseException] = None
        self.reported = False  # the error reached the user (wait, or a later call raised it)

    @classmethod
    def start(cls, eng, plan: Plan, job: Callable, path: Path) -> "AsyncCheckpoint":
        """Starts ``job(on_item)`` (save.py's writing) on its own thread, with the engine's fence up."""
        self = cls(eng, path)
        # Buffers (BatchNorm's running statistics) change in forward, where no
        # fence is: they are copied now, at the call.
        plan.model_items = [item if isinstance(item[3], SlotSource) else _taken_now(item) for item in plan.model_items]
        fence = SaveFence(plan)
        plan.reader.read = eng.values.read_detached
        # See [Note: the engine's fence] in fence.py: one call hands the engine all it runs for this save.
        eng.fence.install(self, fence.wait_unit, lambda: warn_if_failed(eng), lambda: _finish_at_close(eng))

        def run() -> None:
            try:
                job(fence.item_done)
            except BaseException as e:  # noqa: BLE001 - handed to wait() and the next calls
                self._error = e
            finally:
                fence.lift()
                eng.fence.lift(fence.wait_unit)
                self._done.set()

        threading.Thread(target=run, name="infinity-ckpt-save", daemon=True).start()
        return self

    def done(self) -> bool:
        """True once the save finished (complete or failed)."""
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> Path:
        """Waits for the save (at most ``timeout`` seconds); returns the
        checkpoint's path or raises its error (TimeoutError if not done)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"save_checkpoint(blocking=False) of {self.path} still writing after {timeout} s")
        if self._eng.fence.pending is self:
            self._eng.fence.pending = None
        if self._error is not None:
            self.reported = True
            raise self._error
        return self.path

    def __repr__(self) -> str:
        state = "writing" if not self.done() else ("failed" if self._error is not None else "complete")
        return f"AsyncCheckpoint({str(self.path)!r}, {state})"


def _taken_now(item):
    """``item`` (a plan entry) with its tensor copied now."""
    name, dtype, shape, source = item
    copy = source().detach().clone()
    return name, dtype, shape, lambda: copy


def wait_pending(eng) -> None:
    """Waits for a background save still writing; raises its error unless
    the user saw it already."""
    pending = eng.fence.pending
    if pending is None:
        return
    seen = pending.reported
    try:
        pending.wait()
    except BaseException:
        eng.fence.pending = None
        if not seen:
            raise


def warn_if_failed(eng) -> None:
    """At a step: a background save that failed and was never waited for is said once."""
    pending = eng.fence.pending
    if pending is not None and pending.done() and pending._error is not None and not pending.reported:
        pending.reported = True
        eng.fence.pending = None
        warnings.warn(f"infinity: the background checkpoint {str(pending.path)!r} failed and was not saved: "
                      f"{type(pending._error).__name__}: {pending._error}. Earlier checkpoints are intact; "
                      "training goes on", RuntimeWarning, stacklevel=5)


def _finish_at_close(eng) -> None:
    """Before the engine closes: a save still writing is finished (it reads
    the tiers close removes); its error is said, not raised: close always tears down."""
    try:
        wait_pending(eng)
    except Exception as e:  # noqa: BLE001 - close always tears down; the error is said, not lost
        warnings.warn(f"infinity.close: the background checkpoint failed and was not saved: {type(e).__name__}: "
                      f"{e}. Earlier checkpoints are intact", RuntimeWarning, stacklevel=5)


def check_background_ok(eng) -> None:
    """``blocking=False`` needs one rank at ZeRO stage 0: elsewhere the reads are collectives."""
    if eng.sharding.world > 1 or eng.modes.zero:
        raise UsageError("save_checkpoint(blocking=False): a background save runs on one rank at ZeRO stage 0 "
                         f"(this run: {eng.sharding.world} ranks, stage {eng.modes.zero}); under ZeRO its reads are "
                         "collectives that must keep the training's order. Use blocking=True")
