"""The transfers of a :class:`~infinity.io.SwapStore`: each piece of a key
goes to the engine as a direct request for its 4 KiB-aligned body and a
staged one for the rest, the staging buffers from the store's pool.

[Note: zero-copy and bounce]
O_DIRECT needs 4 KiB-aligned memory, offsets and lengths. A tensor whose data
pointer is 4 KiB-aligned (every :class:`~infinity.io.HostPool` buffer) moves
straight between its memory and the disk, except its last ``nbytes % 4096``
bytes, which go through a 4 KiB staging buffer so that nothing beyond the
tensor is read or written. Any other tensor is staged block by block through
staging buffers (pinned, from the store's own :class:`HostPool`), with the
copy of one block overlapped with the transfer of others, inside the engine.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import List, Optional, Tuple

from ..engine import ALIGN, READ, crc_count
from ..errors import PoolExhausted
from ..host_pool import HostPool
from .handle import IOHandle
from .layout import SwapEntry, Piece
from .path import SwapPath
from .sums import piece_sums, request_sums


STAGE_TIMEOUT_S = 600.0  # a staging buffer not free this long: a bug, not a slow disk
STAGE_POLL_S = 0.05      # how often a waiter looks again for a transfer it can complete


def round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def staging_pool(npaths: int, block_size: int, staging_bytes: int,
                 host_pool: Optional[HostPool]) -> Tuple[HostPool, int]:
    """The store's staging pool (``host_pool``, or a new one) and the share of
    it one staged transfer may hold."""
    # Each bounced transfer of one path gets a share; two per path keep
    # reads and writes of consecutive keys overlapped.
    min_staging = 2 * npaths * block_size
    pool = HostPool(max(staging_bytes, min_staging)) if host_pool is None else host_pool
    share = max(block_size, (min(staging_bytes, pool.capacity_bytes) // (2 * npaths)) // block_size * block_size)
    return pool, share


class Transfers:
    """The transfers in flight of one store (``lock`` is the store's) and how
    they are submitted; ``paths`` is the store's list, shared."""

    def __init__(self, lock: threading.RLock, engine, paths: List[SwapPath], pool: HostPool,
                 stage_share: int, block_size: int, queue_depth: int, checksum: bool):
        self._lock = lock
        self._engine = engine
        self._paths = paths
        self._pool = pool
        self._stage_share = stage_share
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.checksum = checksum
        self._outstanding: "collections.OrderedDict[int, IOHandle]" = collections.OrderedDict()

    def pending(self) -> List[IOHandle]:
        """The transfers in flight now, oldest first."""
        return list(self._outstanding.values())

    def finished(self, handle: IOHandle) -> None:
        with self._lock:
            self._outstanding.pop(id(handle), None)

    def submit(self, handle: IOHandle, op: int, entry: SwapEntry, base_ptr: int, arrays: list,
               given=None) -> None:
        """Submits ``entry``'s pieces; ``arrays`` receives each piece's checksum
        arrays (body, tail). ``given``: a write's sums for the whole key, from
        its producer."""
        # [Note: a handle under submission]: the handle is visible to other
        # threads from here (the store's in-flight list, its entry's pending
        # list), but it is only a transfer once every piece is submitted. Its
        # lock is held until then, so a _complete() from another thread (a
        # settle of the same key, a staging reclaim) waits instead of
        # finishing it with tickets still to come, which would return before
        # the bytes moved and leak the staging taken after.
        handle._submitting = True
        with self._lock:
            self._outstanding[id(handle)] = handle
        try:
            with handle._lock:
                for piece in entry.pieces:
                    pair = self._submit_piece(handle, op, piece, base_ptr + piece.rel, given)
                    handle._keep.append(pair)
                    arrays.append(pair)
        except BaseException as exc:
            # Wait for what was submitted, release staging; a write then drops the key.
            handle._error = exc
            handle._submitting = False
            handle._complete()
            raise
        handle._submitting = False

    def _submit_piece(self, handle: IOHandle, op: int, piece: Piece, ptr: int, given) -> tuple:
        """Submits one piece whose bytes are at ``ptr``: its aligned body in
        place when ``ptr`` is aligned, the rest staged. Returns its checksum
        arrays (body, tail), None where there is no such request or no sums."""
        eng = self._engine
        B = self.block_size
        fid = self._paths[piece.path_index].file_id
        n = piece.nbytes
        body = n // ALIGN * ALIGN if ptr % ALIGN == 0 else 0
        verify = op == READ and self.checksum
        # Sums passed in: the stored ones (reads) or the producer's (writes).
        sums = piece_sums(piece, verify, given, B)
        body_arr = tail_arr = None
        if body:
            if self.checksum:
                body_arr = request_sums(crc_count(body, B), sums, tail=False)
            handle._tickets.append(eng.submit(op, fid, piece.offset, ptr, body, 0, 0, body_arr,
                                              sums is not None))
        rest = n - body
        if rest:
            # The engine moves a staged request through slots of
            # stage_block(op) bytes with at most queue_depth of them
            # in flight: more would sit unused.
            slot = min(eng.stage_block(op), round_up(rest))
            nslots = max(1, min(-(-rest // slot), self.queue_depth, self._stage_share // slot))
            buf = self._stage(slot * nslots, handle)
            handle._staging.append(buf)
            if self.checksum:
                tail_arr = request_sums(crc_count(rest, B), sums, tail=True)
            handle._tickets.append(eng.submit(op, fid, piece.offset + body, ptr + body, rest, buf.ptr,
                                              buf.capacity, tail_arr, sums is not None))
        return body_arr, tail_arr

    def _stage(self, nbytes: int, exclude: IOHandle):
        """A staging buffer; completes older transfers when the pool is spent
        (never one still being submitted: see [Note: a handle under submission])."""
        deadline = time.monotonic() + STAGE_TIMEOUT_S
        while True:
            try:
                return self._pool.acquire(nbytes, block=False)
            except PoolExhausted:
                pass
            with self._lock:
                older = next((h for h in self._outstanding.values()
                              if h is not exclude and not h._submitting), None)
            if older is not None:
                older._complete()
                continue
            # Held by transfers other threads are submitting (or by a shared
            # pool's other users): they release it without us. Look again
            # often: one of them may finish submitting and become completable.
            left = deadline - time.monotonic()
            if left <= 0:
                raise PoolExhausted(f"SwapStore staging: {nbytes} bytes not free after {STAGE_TIMEOUT_S} s; "
                                    f"{self._pool.free_bytes} of {self._pool.capacity_bytes} bytes free")
            try:
                return self._pool.acquire(nbytes, block=True, timeout=min(STAGE_POLL_S, left))
            except PoolExhausted:
                continue
