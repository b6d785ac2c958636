"""Gradients leaving the device in buckets: the device-side staging of
:class:`~infinity.engine.owners.grads.Gradients` (which owns the records and
issues the copies).

[Note: gradients leave the device in buckets]
On CUDA each device-to-host copy costs about 50-80 µs of Python on the
autograd thread (two events, a stream switch, ``record_stream``, a ticket),
so a model's few hundred small parameters (biases, norms) cost more than
the bf16 backward at bench size. Where the mover asks for it
(``mover.batches_grads``: CUDA, and the CUDA-ordering emulator), a unit's
trainable slots are cut into buckets of consecutive slots spanning at most
``GRAD_BUCKET_BYTES`` (and a quarter of the device's gradient reserve). A
gradient of a bucketed slot is copied on the device into its bucket's
staging buffer (one device copy, a few µs) and freed; when the bucket's last
slot has landed, its slots cross to the host in one copy per run of
consecutive slots with the same accumulate flag (usually one). The
alignment gaps inside a run are zero in the staging buffer, so the host
buffer's gaps stay zero. A slot alone larger than a bucket keeps the
per-parameter path: staging it would only add a device copy. Buckets whose
slots did not all get a gradient this backward are sent at the end of the
backward (``flush_all``). The staging buffer counts as transient device
bytes from its allocation until its last copy is done; the copies keep it
alive ([Note: gradient copies keep their source alive] in mover.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from ..plan.units import Layout

__all__ = ["Bucket", "make_buckets", "bucket_elems", "open_stage", "land", "runs_of"]


@dataclass
class Bucket:
    """Consecutive trainable slots ``[first, end)`` of a unit, elements
    ``[start, stop)`` of its flat gradient; ``stage`` while being filled."""

    first: int
    end: int
    start: int
    stop: int
    stage: Optional[torch.Tensor] = None
    left: int = 0                                  # slots still to land in this backward
    landed: List[Tuple[int, bool]] = field(default_factory=list)  # (slot index, accumulate)

    @property
    def nbytes(self) -> int:
        return 0 if self.stage is None else self.stage.numel() * self.stage.element_size()


def bucket_elems(reserve_bytes: int, cap_bytes: int, elem_size: int) -> int:
    """Elements a bucket may span: ``cap_bytes`` and a quarter of the device's
    gradient reserve (bytes), whichever is smaller, over ``elem_size`` bytes."""
    limit = cap_bytes if reserve_bytes <= 0 else min(cap_bytes, reserve_bytes // 4)
    return max(1, limit // max(1, elem_size))


def make_buckets(layout: Layout, max_elems: int) -> Tuple[List[Bucket], List[int]]:
    """``layout``'s buckets (runs of two or more slots) and, per trainable
    slot, the index of its bucket (-1: the per-parameter path)."""
    ts = layout.trainable_slots
    buckets: List[Bucket] = []
    of = [-1] * len(ts)
    for i, j in layout.grad_buckets(max_elems):
        if j - i < 2:
            continue
        for k in range(i, j):
            of[k] = len(buckets)
        buckets.append(Bucket(i, j, ts[i].offset, ts[j - 1].offset + ts[j - 1].numel))
    return buckets, of


def open_stage(b: Bucket, layout: Layout, like: torch.Tensor) -> None:
    """Allocates ``b``'s staging buffer on ``like``'s device, in its dtype,
    with the alignment gaps between its slots zeroed."""
    b.stage = torch.empty(b.stop - b.start, dtype=like.dtype, device=like.device)
    end = b.start
    for s in layout.trainable_slots[b.first:b.end]:
        if s.offset > end:
            b.stage[end - b.start:s.offset - b.start].zero_()
        end = s.offset + s.numel


def land(b: Bucket, layout: Layout, ti: int, g: torch.Tensor, accumulate: bool) -> bool:
    """Copies gradient ``g`` of trainable slot ``ti`` into ``b``'s staging
    buffer (on the device); True when it was the bucket's last slot."""
    s = layout.trainable_slots[ti]
    b.stage[s.offset - b.start:s.offset - b.start + s.numel].copy_(g.reshape(-1))
    b.landed.append((ti, accumulate))
    b.left -= 1
    return b.left == 0


def runs_of(b: Bucket, layout: Layout) -> List[Tuple[int, int, bool]]:
    """(start, stop, accumulate) element ranges of the unit's flat gradient
    holding ``b``'s landed slots: maximal runs of consecutive slots with the
    same accumulate flag, gaps between them included."""
    ts = layout.trainable_slots
    out: List[Tuple[int, int, bool]] = []
    prev = None
    for ti, acc in sorted(b.landed):
        s = ts[ti]
        if prev is not None and prev[0] == ti - 1 and prev[1] == acc:
            out[-1] = (out[-1][0], s.offset + s.numel, acc)
        else:
            out.append((s.offset, s.offset + s.numel, acc))
        prev = (ti, acc)
    return out
