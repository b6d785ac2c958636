"""A fixed ring of pinned blocks for gradients that cross to the host and
are then upcast or added there (CUDA; see [Note: a gradient's way to the
host] in mover.py).

[Note: the gradient staging ring]
A gradient that the host adds into an fp32 buffer (accumulation, ZeRO,
data parallelism) or upcasts cannot go straight into its destination: it
lands in pinned staging first. torch's caching host allocator would give
each gradient a pinned block of its size rounded up to a power of two,
kept for the life of the process and outside ``host_memory`` (cuda-review
P2). Instead the mover owns a ring of ``GRAD_STAGING_BLOCKS`` pinned
blocks, each at most ``GRAD_STAGING_BLOCK_BYTES`` and at most the largest
unit's gradients (placement.grad_staging), carved from the host pool once
(so inside ``host_memory``, in the placement's minimum and the estimator's
host need): a gradient crosses in block-sized pieces, each piece's block
given back by the host thread once its add or upcast is done. A gradient
larger than the ring waits for blocks (the autograd thread stalls only
while every block is in flight), so the pinned staging stays bounded
whatever the model. Where the placement foresaw no staging (a backward
after ``step()`` without ``zero_grad()`` adds on the host once), the ring
is allocated pinned outside the pool on first use.
"""

from __future__ import annotations

import threading
from typing import Callable, List, Optional, Tuple

import torch

from ..plan.limits import GRAD_STAGING_BLOCK_BYTES, GRAD_STAGING_BLOCKS

__all__ = ["StagingRing", "finish_piece", "AllDone"]


class StagingRing:
    """``blocks`` pinned byte blocks of ``block_bytes`` each; ``alloc(n)``
    makes one (default: a pinned uint8 tensor of n bytes)."""

    def __init__(self, blocks: int = GRAD_STAGING_BLOCKS, block_bytes: int = GRAD_STAGING_BLOCK_BYTES,
                 alloc: Optional[Callable[[int], torch.Tensor]] = None):
        self.block_bytes = block_bytes
        self._alloc = alloc or (lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True))
        self._bufs: List[torch.Tensor] = []
        self._count = blocks
        self._free: List[int] = []
        self._cond = threading.Condition()

    def take(self) -> Tuple[int, torch.Tensor]:
        """A free block (index, bytes); waits while every block is in flight."""
        with self._cond:
            if not self._bufs:
                self._bufs = [self._alloc(self.block_bytes) for _ in range(self._count)]
                self._free = list(range(self._count))
            while not self._free:
                self._cond.wait()
            i = self._free.pop()
            return i, self._bufs[i]

    def give(self, i: int) -> None:
        """Block ``i`` is free again."""
        with self._cond:
            self._free.append(i)
            self._cond.notify()

    @property
    def free_blocks(self) -> int:
        """Blocks not in flight now."""
        with self._cond:
            return len(self._free) if self._bufs else self._count

    @property
    def pinned_bytes(self) -> int:
        """Bytes the ring holds (0 until first used)."""
        return len(self._bufs) * self.block_bytes

    def pieces(self, numel: int, elem_size: int):
        """``(start, stop)`` element ranges of a gradient of ``numel``
        elements of ``elem_size`` bytes, one block each."""
        per = max(1, self.block_bytes // elem_size)
        return [(a, min(a + per, numel)) for a in range(0, numel, per)]


def finish_piece(ev, dst: torch.Tensor, stage: torch.Tensor, accumulate: bool, ring: StagingRing, i: int,
                 cast: Callable[[torch.Tensor, torch.Tensor, bool], None]) -> None:
    """On the grad thread: once the piece's copy (event ``ev``) is done,
    ``cast(dst, stage, accumulate)`` (``dst (+)= stage``); block ``i`` goes back."""
    try:
        ev.synchronize()
        cast(dst, stage, accumulate)
    finally:
        ring.give(i)


class AllDone:
    """The futures of one gradient's pieces as one (``done``, ``result``)."""

    __slots__ = ("futs",)

    def __init__(self, futs: list):
        self.futs = futs

    def done(self) -> bool:
        return all(f.done() for f in self.futs)

    def result(self) -> None:
        for f in self.futs:
            f.result()
