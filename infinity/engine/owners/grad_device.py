"""The device path of a unit's gradients: gathered in one flat device
buffer, reduce-scattered on the device group, the own shard copied to the
host. The device-side part of :class:`~infinity.engine.owners.grads.Gradients`
(which owns the records, counts the bytes and keeps the tickets); whether a
run takes this path is decided once, in placement.py ([Note: where
gradients are reduced] in plan/paths.py).

[Note: a unit's gradients on the device]
A unit's first gradient of the window opens its flat buffer (the host
gradients' dtype, so the reduction sums the same values the host path
would; the alignment gaps zeroed, as the host buffer's are) and each
gradient is copied (or added) into its slot on the device, then freed.
When the unit's last gradient has landed the schedule asks for the
reduction: slots that got no gradient on this rank are zeroed (the sum
must not read stale bytes), and :meth:`Sharding.reduce_to_host`
issues the reduce-scatter and the copy of the own shard into the host
shard buffer (stage 0: the all-reduce, and the copy of the whole sum into
the unit's host gradient buffer). The flat buffer and the device shard count as transient
device bytes (``device_reduce_bytes``) from the unit's first gradient until
the shard is on the host; the gradient owner's backpressure waits for the
oldest reduction when the next unit's buffer would not fit the reserve
(``ZERO_REDUCING_UNITS`` units: one filling, one being reduced).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ..plan.units import Layout

__all__ = ["DeviceGrad", "open_full", "land_slot", "zero_missing", "issue_reduction", "drop_full"]


@dataclass
class DeviceGrad:
    """A unit's gradients on the device path (written by this file's functions)."""

    full: Optional[torch.Tensor] = None  # the flat gradient while it fills (device)
    nbytes: int = 0                      # transient device bytes it counts (full + shard)


def open_full(d: DeviceGrad, layout: Layout, numel: int, dtype: torch.dtype, device: torch.device,
              nbytes: int) -> None:
    """Allocates ``d``'s flat buffer of ``numel`` elements on ``device``,
    alignment gaps zeroed; ``nbytes`` is what it counts as transient."""
    d.full = torch.empty(numel, dtype=dtype, device=device)
    Layout.zero_padding(d.full, layout.trainable_slots)
    d.nbytes = nbytes


def land_slot(d: DeviceGrad, layout: Layout, ti: int, g: torch.Tensor, accumulate: bool) -> None:
    """Gradient ``g`` of trainable slot ``ti`` into ``d``'s flat buffer (added when ``accumulate``)."""
    s = layout.trainable_slots[ti]
    dst = d.full[s.offset:s.offset + s.numel]
    if accumulate:
        dst.add_(g.reshape(-1))
    else:
        dst.copy_(g.reshape(-1))


def zero_missing(d: DeviceGrad, layout: Layout, written: List[bool]) -> None:
    """Zeroes the slots that got no gradient in this window (they hold stale bytes)."""
    for s, w in zip(layout.trainable_slots, written):
        if not w:
            d.full[s.offset:s.offset + s.numel].zero_()


def issue_reduction(d: DeviceGrad, layout: Layout, written: List[bool], sharding, host_out: torch.Tensor,
                    mover) -> Tuple[object, int]:
    """Starts the reduction of ``d``'s flat buffer (slots not ``written``
    zeroed first) and the copy of its result into ``host_out``: the own
    shard's sum (a reduce-scatter) when ``host_out`` is a shard, the whole
    sum (an all-reduce, stage 0) when it has the buffer's size. (The ticket,
    which keeps the device buffers alive until the copy is done; the
    transient device bytes they count.) ``d`` is empty again."""
    zero_missing(d, layout, written)
    full = d.full
    dev_out = None
    if host_out.numel() != full.numel():
        dev_out = torch.empty(host_out.numel(), dtype=full.dtype, device=full.device)
    ticket = sharding.reduce_to_host(host_out, full, dev_out, mover)
    d.full = None
    return ticket, d.nbytes


def drop_full(d: DeviceGrad) -> int:
    """Forgets a flat buffer never reduced (``zero_grad()`` before ``step()``);
    the transient bytes it counted (0 if none)."""
    if d.full is None:
        return 0
    d.full = None
    return d.nbytes
