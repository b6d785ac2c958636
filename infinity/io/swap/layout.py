"""Where a :class:`~infinity.io.SwapStore` keeps each key: the key's entry, its
split over the swap paths (striping) and the extents its pieces occupy in the
paths' files (:class:`~infinity.io.extent_allocator.ExtentAllocator`), growing
the files when they are not preallocated."""

from __future__ import annotations

import array
import errno as _errno
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, List, Optional

import torch

from ..engine import chunk_bytes
from ..errors import SwapFullError
from .path import SwapPath

if TYPE_CHECKING:
    from .handle import IOHandle


@dataclass
class Piece:
    """The part of a key's bytes ``[rel, rel + nbytes)`` stored at ``offset`` of one path's file."""

    path_index: int
    offset: int
    rel: int
    nbytes: int
    crcs: Optional[array.array] = None  # uint32 per checksum chunk; set when the write completes


@dataclass
class SwapEntry:
    key: Hashable
    nbytes: int
    dtype: torch.dtype
    shape: tuple
    pieces: List[Piece]
    pending: List["IOHandle"] = field(default_factory=list)  # transfers in flight on this key
    stored: bool = False  # True once a write completed successfully


class SwapLayout:
    """Placement of keys on the store's paths (call with the store's lock held).

    ``paths`` is the store's list of :class:`SwapPath`, shared, not copied.
    """

    def __init__(self, paths: List[SwapPath], block_size: int, stripe_bytes: int,
                 capacity_bytes: Optional[int], grow_bytes: int):
        self.paths = paths
        self.block_size = block_size
        self.stripe_bytes = stripe_bytes
        self.capacity_bytes = capacity_bytes
        self.grow_bytes = grow_bytes

    def replace(self, old: Optional[SwapEntry], key: Hashable, n: int) -> List[Piece]:
        """Pieces for a new write of ``n`` bytes under ``key``, whose entry was
        ``old`` (already out of the index): its extents when the size is
        unchanged (overwrite in place), else new ones, ``old``'s freed."""
        if old is not None and old.nbytes == n:
            return [Piece(p.path_index, p.offset, p.rel, p.nbytes) for p in old.pieces]
        if old is not None:
            self.free_pieces(old.pieces)
        return self.place(key, n)

    def plan(self, n: int) -> List[Piece]:
        """Split of ``n`` bytes over paths (offsets left unset)."""
        k = len(self.paths)
        if n == 0:
            return []
        if k > 1 and n > self.stripe_bytes:
            # Shares are whole checksum chunks, so the sums of each piece are
            # a slice of the key's (see write(crcs=)).
            c = chunk_bytes(self.block_size)
            share = -(-n // (k * c)) * c
            pieces, rel = [], 0
            for i in range(k):
                ln = min(share, n - rel)
                if ln <= 0:
                    break
                pieces.append(Piece(i, -1, rel, ln))
                rel += ln
            return pieces
        # Whole on one path: the one with most free space (ties: lowest index).
        best = max(range(k), key=lambda i: (self.paths[i].alloc.free_bytes, -i))
        return [Piece(best, -1, 0, n)]

    def place(self, key: Hashable, n: int) -> List[Piece]:
        pieces = self.plan(n)
        done: List[Piece] = []
        try:
            for p in pieces:
                p.offset = self.alloc_on(self.paths[p.path_index], p.nbytes, key)
                done.append(p)
        except BaseException:
            self.free_pieces(done)
            raise
        return pieces

    def alloc_on(self, sp: SwapPath, nbytes: int, key: Hashable) -> int:
        off = sp.alloc.alloc(nbytes)
        if off is not None:
            return off
        need = sp.alloc.round(nbytes)
        if self.capacity_bytes is not None:
            raise SwapFullError(_errno.ENOSPC,
                                f"swap store full: key {key!r} needs {need} bytes on '{sp.dir}', which has "
                                f"{sp.alloc.free_bytes} of {sp.alloc.capacity} bytes free (largest free "
                                f"extent {sp.alloc.largest_free()} bytes); raise capacity_bytes or free keys")
        what = f"key {key!r} ({nbytes} bytes)"
        try:
            sp.grow(max(need, self.grow_bytes), what)
        except SwapFullError:
            if need >= self.grow_bytes:
                raise
            sp.grow(need, what)  # the disk may still hold what this key needs
        off = sp.alloc.alloc(nbytes)
        assert off is not None
        return off

    def free_pieces(self, pieces: List[Piece]) -> None:
        for p in pieces:
            if p.offset >= 0:
                self.paths[p.path_index].alloc.free(p.offset)
