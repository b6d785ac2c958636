"""A meta pass over a few of a model's repeated blocks, extrapolated to all.

[Note: a meta pass over repeated units]
The planner's meta passes (the op costs in costs.py, the saved activations in
activations.py) cost a Python dispatch per op even when the op is answered
from the cache ([Note: a meta pass from a cache] in metacache.py), so an 8 B
model's 32 blocks cost 32 times one block. A transformer's blocks are the
same module repeated: the paging units that sit side by side in one
``nn.ModuleList`` or ``nn.Sequential`` with the same structure (module types,
parameter and buffer names, shapes, dtypes) form a *run*. The pass is made
twice on the model with the run cut to its first ``KEEP`` and ``KEEP + 1``
blocks (the container's other children kept); a quantity ``q`` linear in
the number of blocks is then ``q(n) = q(K) + (n - K) * (q(K + 1) - q(K))``,
which also counts what each block adds outside its own module (a
checkpoint wrapper's saved input, ops between blocks). Per-unit figures of
the blocks cut away are the last kept block's. Each consumer checks what it
can (the extra block's figures equal the one before it, nothing counted
once disappears) and else makes the full pass, so the answer is the full
pass's or nothing is saved: tests/engine/plan/test_repeats.py compares both
on the built-in GPT and a Hugging Face Llama, with checkpointing on and off.
A forward that indexes its blocks by a count of its own (``range(n_layer)``
rather than iterating the container) fails on the cut model, and the full
pass is made.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Sequence

import torch.nn as nn

__all__ = ["Run", "find_run", "cut", "KEEP"]

KEEP = 2        # blocks kept in the smaller cut (the first may differ in what it reads from the root)
MIN_RUN = KEEP + 3  # shorter runs are passed in full: the two cut passes would cost about as much


@dataclass
class Run:
    """``units``: the unit indices of the repeated blocks, in the container's
    order; ``container``: the ``ModuleList``/``Sequential`` holding them;
    ``keys``: their keys in it."""

    units: List[int]
    container: nn.Module
    keys: List[str]

    @property
    def n(self) -> int:
        return len(self.units)


def _signature(mod: nn.Module) -> tuple:
    mods = tuple((n, type(m)) for n, m in mod.named_modules())
    ts = tuple((n, tuple(t.shape), t.dtype, t.requires_grad)
               for n, t in list(mod.named_parameters()) + list(mod.named_buffers()))
    return mods, ts


def find_run(model: nn.Module, unit_modules: Dict[int, Sequence[nn.Module]]) -> Optional[Run]:
    """The longest run of at least ``MIN_RUN`` single-module units, side by
    side in one ModuleList or Sequential with the same structure; None if none."""
    unit_of = {id(mods[0]): ui for ui, mods in unit_modules.items() if len(mods) == 1}
    best: Optional[Run] = None
    for cont in model.modules():
        if not isinstance(cont, (nn.ModuleList, nn.Sequential)):
            continue
        cur: Optional[Run] = None
        sig = None
        for key, child in cont._modules.items():
            ui = unit_of.get(id(child)) if child is not None else None
            s = _signature(child) if ui is not None else None
            if ui is not None and cur is not None and s == sig:
                cur.units.append(ui)
                cur.keys.append(key)
                continue
            if cur is not None and cur.n >= MIN_RUN and (best is None or cur.n > best.n):
                best = cur
            cur, sig = (Run([ui], cont, [key]), s) if ui is not None else (None, None)
        if cur is not None and cur.n >= MIN_RUN and (best is None or cur.n > best.n):
            best = cur
    return best


@contextlib.contextmanager
def cut(container: nn.Module, keys: Sequence[str], keep: int) -> Iterator[None]:
    """``container`` without the run's blocks after its first ``keep`` (``keys``:
    the run's keys in it), restored after."""
    saved = container._modules
    drop = set(keys[keep:])
    kept = [(k, m) for k, m in saved.items() if k not in drop]
    # ModuleList indexes by position: renumber so len() and [i] see the kept blocks only.
    container._modules = (dict((str(i), m) for i, (_, m) in enumerate(kept))
                          if isinstance(container, nn.ModuleList) else dict(kept))
    try:
        yield
    finally:
        container._modules = saved
