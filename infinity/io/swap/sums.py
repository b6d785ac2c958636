"""Checksums of a :class:`~infinity.io.SwapStore`: the sums a producer passes
to ``write(crcs=)``, the slices of a key's sums each request of its pieces
takes or gives, and the sums a piece keeps once its write completed.

One uint32 per checksum chunk (:func:`~infinity.io.engine.crc_count`
entries per request; docs/io.md, "Checksums"). A key striped over several
paths is split on whole chunks, so each piece's sums are a slice of the key's.
"""

from __future__ import annotations

import array
import ctypes
from typing import Hashable, List, Optional

from ...system.native import carray
from ..engine import chunk_bytes, crc_count
from .layout import Piece


def _as_u32(values) -> array.array:
    """``values`` (an array('I'), a ctypes/numpy uint32 array, a list) as an array('I')."""
    if isinstance(values, array.array) and values.typecode == "I":
        return values
    out = array.array("I")
    try:
        mv = memoryview(values)
    except TypeError:
        return array.array("I", values)
    if mv.itemsize != out.itemsize:
        raise TypeError(f"crcs: expected 32-bit unsigned sums, got items of {mv.itemsize} bytes")
    out.frombytes(mv.cast("B"))
    return out


def given_sums(key: Hashable, crcs, n: int, block_size: int, sum_chunk_bytes: Optional[int],
               checksum_name: Optional[str]) -> array.array:
    """The producer's sums of a write of ``n`` bytes as an array('I'), checked
    against the store: it must keep CRC32C (``sum_chunk_bytes`` not None) and
    ``crcs`` must hold one sum per chunk."""
    if sum_chunk_bytes is None:
        raise ValueError(f"write of key {key!r}: crcs given, but this store keeps "
                         f"{checksum_name} sums, not CRC32C")
    need = crc_count(n, block_size)
    crcs = _as_u32(crcs)
    if len(crcs) != need:
        raise ValueError(f"write of key {key!r}: {len(crcs)} crcs given; {n} bytes have {need} "
                         f"checksum chunks of {sum_chunk_bytes} bytes")
    return crcs


def piece_sums(piece: Piece, verify: bool, given, block_size: int):
    """Sums passed in for ``piece``: the stored ones (verified reads) or the
    producer's (writes with ``given``), else None."""
    if verify:
        return piece.crcs
    if given is None:
        return None
    c = chunk_bytes(block_size)
    # A view: the ctypes arrays of request_sums copy once.
    return memoryview(given)[piece.rel // c: piece.rel // c + crc_count(piece.nbytes, block_size)]


def request_sums(cnt: int, sums, tail: bool):
    """The ``cnt`` sums of one request: the first (body) or last (``tail``)
    ``cnt`` of ``sums`` when passed in, else room for the engine's."""
    arr = carray(ctypes.c_uint32, cnt)
    if sums is None:
        return arr()
    if tail:
        return arr.from_buffer_copy(sums, 4 * (len(sums) - cnt))
    return arr.from_buffer_copy(sums)


def keep_sums(pieces: List[Piece], arrays: list) -> None:
    """After a write: each piece keeps its requests' sums (``arrays``: body
    and tail arrays per piece, either may be None)."""
    for piece, (body, tail) in zip(pieces, arrays):
        # Raw uint32s, copied as bytes: a 1 GiB key has 4096 chunks.
        crcs = array.array("I")
        for arr in (body, tail):
            if arr is not None:
                crcs.frombytes(memoryview(arr).cast("B"))
        piece.crcs = crcs
