"""The recorder of one ``infinity.init`` context: its tape, its replay, and
the registry the engine finds it by."""

from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn

from .materialize import materialize
from .replay import plan, replay
from .tape import Recording

# module -> the recorder of the context it was built in. Weak: a dropped
# model frees its tape.
_RECORDERS: "weakref.WeakKeyDictionary[nn.Module, Recorder]" = weakref.WeakKeyDictionary()


def recorder_of(model: nn.Module) -> Optional["Recorder"]:
    """The recorder of the ``infinity.init`` context ``model`` was built in, or None."""
    return _RECORDERS.get(model)


class Recorder(Recording):
    """The tape of one ``infinity.init`` context and its replay.

    Holds only meta tensors and small constants (real tensors given to
    recorded operations are copied when recorded, as eager construction
    would have read them then)."""

    def __init__(self) -> None:
        super().__init__()
        self.last_use: Dict[int, int] = {}
        self.peak_held_bytes = 0   # most bytes of materialised tensors held at once by a replay

    def adopt(self, module: nn.Module) -> None:
        """Remembers ``module`` and registers it for :func:`recorder_of`."""
        super().adopt(module)
        _RECORDERS[module] = self

    def advance_rng(self) -> None:
        """Computes the generator state eager construction would have left
        (a replay of the random operations alone, into scratch) and sets it."""
        replay(self, set(), plan(self, set()), lambda i, real: None, lambda b: True)
        self.rng_end = torch.get_rng_state()

    def materialize(self, units_params: List[List[nn.Parameter]],
                    sink: Callable[[int, List[torch.Tensor]], None]) -> None:
        """Runs the recorded initialisation once and calls ``sink(i, values)``
        exactly once per unit ``i`` (``values``: CPU fp32 tensors, one per
        parameter of ``units_params[i]``, in that order) as soon as the unit's
        values are final, holding only the units in progress (the sink must
        copy what it keeps). Afterwards the modules' meta buffers (and meta
        tensor attributes) are real. The global RNG state is left as it was
        at the call."""
        materialize(self, units_params, sink)
