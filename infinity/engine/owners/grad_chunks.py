"""Gradients of a unit streamed in chunks: to NVMe chunk by chunk as autograd
finishes them, read back chunk by chunk by the unit's update.

[Note: gradients streamed in chunks]
A unit whose NVMe optimizer state is streamed in chunks ([Note: state
streamed in chunks] in optstate.py) would still hold its gradients in one
host buffer from its first gradient to its update: three buffers of the
largest unit at the host minimum (a 525 M-parameter vocabulary unit: 3 GiB
in bf16). Where nothing needs them whole (``plan.paths.grad_streaming``: one
rank, no ZeRO, no clipping or fp16 norm), they go through the
state's windows instead (``UnitPlacement.grad_chunked``):

- a parameter's gradient lands in the pool buffers of the chunks it
  overlaps (opened zeroed, or read back from NVMe when the chunk already
  holds this accumulation window's gradients), by the same copy or sum as a
  whole buffer (``Mover.grad_out``); a chunk is written to its own extent
  (``key(unit, "grad", c)``) and its buffer freed once every parameter in it
  has landed in this backward, or when the unit's backward is done
  (``spill``). Only one unit has open chunks at a time (another unit's are
  written first), and a chunk stays open only while a parameter in it has
  not landed: at most one chunk per trainable parameter;
- the update's stream (``OptimizerState.stream``) reads gradient chunk c+1
  while chunk c is updated, as it reads the state (``STREAM_GRAD_BUFFERS``);
  a chunk no parameter landed in this window is not read (the kernel reads
  only the ranges of parameters with gradients).

Bytes: the chunk's padding is zero as a whole buffer's is, each element is
the same copy or sum in the same order, and the kernel reads the same values
at the same indices, so the update is a whole buffer's bit for bit. The
host holds the open chunks and two stream chunks instead of whole units
(``placement.streamed_grad_bytes``); the gradients cross to NVMe once and
back once, as spilled whole gradients do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Set

import torch

from ..mechanism.nvme import key as swap_key

__all__ = ["ChunkedGrads", "GradStream", "Chunks"]


@dataclass
class Chunks:
    """One unit's gradient chunks in this accumulation window."""

    open: Dict[int, list] = field(default_factory=dict)  # chunk -> [tensor, pool handle, elements still to land]
    on_disk: Set[int] = field(default_factory=set)       # chunks written in this window


class GradStream:
    """What an update streaming ``u``'s gradients reads: ``current`` is the
    chunk being updated (None where no parameter in it got a gradient)."""

    def __init__(self, owner: "ChunkedGrads", u):
        self.owner, self.u = owner, u
        self.current: Optional[torch.Tensor] = None

    def read(self, c: int) -> Optional[tuple]:
        """(tensor, read handle, pool handle) of chunk ``c``, or None if it holds nothing of this window."""
        return self.owner.read(self.u, c)


class ChunkedGrads:
    """The chunk buffers (from ``room``, the host pool) and their NVMe
    extents of units whose gradients are streamed; ``mover`` copies or adds
    a gradient in (Mover.grad_out), ``dtype`` is the host gradients'."""

    def __init__(self, room, nvme, mover, dtype: torch.dtype):
        self.room, self.nvme, self.mover, self.dtype = room, nvme, mover, dtype
        self.compute = dtype != torch.float32  # the pool end of its size class (as Gradients' buffers)
        self._open_unit = None  # the one unit with chunks open

    def land(self, u, ti: int, g: torch.Tensor, accumulate: bool) -> None:
        """Trainable slot ``ti``'s gradient ``g`` into ``u``'s chunks (added
        when ``accumulate``); full chunks go to NVMe."""
        if self._open_unit is not None and self._open_unit is not u:
            self.close(self._open_unit)
        self._open_unit = u
        flat = g.reshape(-1)
        self._each(u, ti, lambda dst, lo, hi: self.mover.grad_out(dst, flat[lo:hi], accumulate).wait())

    def land_zeros(self, u, ti: int) -> None:
        """Zeros for trainable slot ``ti`` (torch's kept zero ``.grad``; see grad_kept.py)."""
        self._each(u, ti, lambda dst, lo, hi: dst.zero_())

    def _each(self, u, ti: int, fill) -> None:
        """``fill(dst, lo, hi)`` for each piece of slot ``ti`` in a chunk:
        ``dst`` the chunk buffer's view of the slot's elements [lo, hi)."""
        if self._open_unit is not None and self._open_unit is not u:
            self.close(self._open_unit)
        self._open_unit = u
        s, ch = u.layout.trainable_slots[ti], u.grads.chunks
        for c, (c0, c1) in enumerate(u.place.windows):
            a, b = max(c0, s.offset), min(c1, s.offset + s.numel)
            if a >= b:
                continue
            piece = ch.open.get(c) or self._open(u, c)
            fill(piece[0][a - c0:b - c0], a - s.offset, b - s.offset)
            piece[2] -= b - a
            if piece[2] == 0:
                self._write(u, c)

    def _open(self, u, c: int) -> list:
        """Chunk ``c``'s buffer: this window's gradients read back, or zeros."""
        c0, c1 = u.place.windows[c]
        ch = u.grads.chunks
        t, buf = self.room.acquire(c1 - c0, self.dtype, zero=c not in ch.on_disk, protect=u, compute=self.compute)
        if c in ch.on_disk:
            self.nvme.read(swap_key(u.index, "grad", c), t).wait()
        left = sum(max(0, min(c1, s.offset + s.numel) - max(c0, s.offset)) for s in u.layout.trainable_slots)
        ch.open[c] = piece = [t, buf, left]
        return piece

    def _write(self, u, c: int) -> None:
        t, buf, _ = u.grads.chunks.open.pop(c)
        self.room.defer_release(self.nvme.write(swap_key(u.index, "grad", c), t), buf)
        u.grads.chunks.on_disk.add(c)

    def close(self, u) -> None:
        """Writes every open chunk of ``u`` (its backward is done, or another unit's gradients come)."""
        for c in sorted(u.grads.chunks.open):
            self._write(u, c)
        if self._open_unit is u:
            self._open_unit = None

    def read(self, u, c: int) -> Optional[tuple]:
        """See GradStream.read."""
        if c not in u.grads.chunks.on_disk:
            return None
        c0, c1 = u.place.windows[c]
        t, buf = self.room.acquire(c1 - c0, self.dtype, protect=u, compute=self.compute)
        return t, self.nvme.read(swap_key(u.index, "grad", c), t), buf

    def drop(self, u) -> None:
        """Forgets ``u``'s chunks (its update read them, or the window was
        discarded): open buffers go back; the extents are overwritten next window."""
        ch = u.grads.chunks
        for t, buf, _ in ch.open.values():
            self.room.release(buf)
        ch.open.clear()
        ch.on_disk.clear()
        if self._open_unit is u:
            self._open_unit = None
