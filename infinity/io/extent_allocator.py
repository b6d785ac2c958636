"""First-fit allocator of aligned byte ranges (extents) in a fixed or growing space.

Used for swap files (offsets in a file) and for the host pool's arena (offsets
in one mapping). Pure bookkeeping: it never touches the bytes.
"""

from __future__ import annotations

import bisect
from typing import List, Optional, Tuple

__all__ = ["ExtentAllocator"]


class ExtentAllocator:
    """Allocates ``[offset, offset + size)`` ranges within ``[0, capacity)``.

    Sizes are rounded up to ``alignment`` bytes, so every offset is aligned.
    Freed ranges are merged with free neighbours, so space is reused after
    :meth:`free` without fragmenting into slivers. First fit keeps small and
    short-lived extents at low offsets. Not thread-safe: callers lock.
    """

    def __init__(self, capacity: int, alignment: int = 4096):
        if alignment <= 0 or capacity < 0 or capacity % alignment:
            raise ValueError(f"capacity={capacity} must be a non-negative multiple of alignment={alignment}")
        self.alignment = alignment
        self.capacity = capacity
        self._starts: List[int] = [0] if capacity else []  # free ranges sorted by start
        self._sizes: List[int] = [capacity] if capacity else []
        self._used: dict = {}  # offset -> size of allocated extents
        self.used_bytes = 0

    def round(self, size: int) -> int:
        """``size`` rounded up to the alignment (bytes)."""
        a = self.alignment
        return max(a, -(-size // a) * a)

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    def largest_free(self) -> int:
        """Size in bytes of the largest free range."""
        return max(self._sizes, default=0)

    def alloc(self, size: int) -> Optional[int]:
        """Offset of a new extent of ``size`` bytes (rounded up), or None if no free range fits."""
        need = self.round(size)
        for i, s in enumerate(self._sizes):
            if s >= need:
                off = self._starts[i]
                if s == need:
                    del self._starts[i]
                    del self._sizes[i]
                else:
                    self._starts[i] = off + need
                    self._sizes[i] = s - need
                self._used[off] = need
                self.used_bytes += need
                return off
        return None

    def alloc_high(self, size: int) -> Optional[int]:
        """Like :meth:`alloc`, but takes the top of the highest free range that
        fits. Callers that allocate two classes of sizes from opposite ends
        keep each class's holes reusable by the same class."""
        need = self.round(size)
        for i in range(len(self._sizes) - 1, -1, -1):
            s = self._sizes[i]
            if s >= need:
                off = self._starts[i] + s - need
                if s == need:
                    del self._starts[i]
                    del self._sizes[i]
                else:
                    self._sizes[i] = s - need
                self._used[off] = need
                self.used_bytes += need
                return off
        return None

    def free(self, offset: int) -> int:
        """Release the extent at ``offset``; returns its (rounded) size in bytes."""
        try:
            size = self._used.pop(offset)
        except KeyError:
            raise ValueError(f"offset {offset} is not an allocated extent") from None
        self.used_bytes -= size
        self._insert_free(offset, size)
        return size

    def grow(self, new_capacity: int) -> None:
        """Extend the space to ``new_capacity`` bytes (a multiple of the alignment)."""
        if new_capacity % self.alignment or new_capacity < self.capacity:
            raise ValueError(f"new capacity {new_capacity} must be >= {self.capacity} and aligned "
                             f"to {self.alignment}")
        if new_capacity > self.capacity:
            self._insert_free(self.capacity, new_capacity - self.capacity)
            self.capacity = new_capacity

    def size_of(self, offset: int) -> int:
        return self._used[offset]

    def free_ranges(self) -> List[Tuple[int, int]]:
        """Free (offset, size) ranges, sorted by offset."""
        return list(zip(self._starts, self._sizes))

    def extents(self) -> List[Tuple[int, int]]:
        """Allocated (offset, size) pairs, sorted."""
        return sorted(self._used.items())

    def _insert_free(self, off: int, size: int) -> None:
        i = bisect.bisect_left(self._starts, off)
        # Merge with the previous and the next free range when they touch.
        if i > 0 and self._starts[i - 1] + self._sizes[i - 1] == off:
            i -= 1
            off = self._starts[i]
            size += self._sizes[i]
            del self._starts[i]
            del self._sizes[i]
        if i < len(self._starts) and off + size == self._starts[i]:
            size += self._sizes[i]
            del self._starts[i]
            del self._sizes[i]
        self._starts.insert(i, off)
        self._sizes.insert(i, size)
