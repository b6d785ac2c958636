"""A tensor store over one or more swap directories (the NVMe tier).

Policy lives here: which path and file offset a key's bytes occupy
(:class:`~infinity.io.extent_allocator.ExtentAllocator`), striping, checksums,
ordering between operations on one key. Moving bytes is the engine's job
(:class:`~infinity.io.engine.NativeEngine` or
:class:`~infinity.io.fallback.PythonEngine`).

This module is the public façade, the keys' index and the ordering of
operations on one key; its parts: ``swap_path`` (one directory: lock, data
file, O_DIRECT), ``swap_dir`` (who owns what in a directory: [Note: ownership
of swap files]), ``swap_layout`` (entries, striping, extents),
``swap_transfer`` (requests, staging: [Note: zero-copy and bounce]),
``swap_sums`` (checksums) and ``swap_handle`` (:class:`IOHandle`).

[Note: ordering on one key]
Operations on different keys run concurrently. On the same key, a ``read``
or ``free`` waits for an earlier ``write`` to complete, and a ``write`` or
``free`` waits for earlier reads and writes: a caller never reads a
half-written extent, and extents are never reused under a transfer.

[Note: copy-on-write keys]
A caller that may have to take a write back (a speculative optimizer update:
[Note: speculative updates] in engine/step/speculate.py) reserves fresh
extents for the key first (:meth:`SwapStore.reserve`: False when the store
has no room for a second copy) and writes with ``keep_old=True``: the new
bytes go to the fresh extents and the key's old entry (extents and
checksums) is kept aside, untouched. :meth:`SwapStore.commit` then frees the
old extents; :meth:`SwapStore.rollback` frees the new ones and makes the old
entry the key's again (a key new in the write is removed), so a later read
returns the old bytes, checked against their old sums.
"""

from __future__ import annotations

import os
import threading
from typing import Dict, Hashable, List, Optional, Sequence, Union

import torch

from ..engine import ALIGN, READ, WRITE, NativeEngine, chunk_bytes, native_available
# The error classes the store raises, importable from here as before.
from ..errors import (PoolExhausted, StoreLockedError, SwapFullError, SwapIOError, SwapPathError,  # noqa: F401
                      SwapPathNotDirectoryError, SwapPathPermissionError, SwapPathReadOnlyError, SwapPathUnsafeError)
from ..fallback import PythonEngine
from ..host_pool import HostPool, warn_once
from .handle import IOHandle
from .layout import SwapEntry, SwapLayout
from .path import LOCK_NAME, SwapPath, log  # noqa: F401  (LOCK_NAME: as before)
from .sums import given_sums, keep_sums
from .transfer import round_up, Transfers, staging_pool

__all__ = ["SwapStore", "IOHandle"]

MiB = 1 << 20


class SwapStore:
    """Tensors kept in swap files on one or more directories (NVMe paths).

    Args:
        paths: one directory or a list of them, ideally on different disks.
            Each is created (mode 0700) if missing, or must be a directory of
            this uid not accessible to group or others, on a writable
            filesystem (else a :class:`SwapPathError` subclass names the fix),
            and is locked for the store's lifetime; a second store on a locked
            directory raises :class:`StoreLockedError`. Files that dead runs
            left there are removed at open (logged on ``infinity.io``). The
            store creates one data file (mode 0600) per path and deletes it,
            and only it, on :meth:`close`. See docs/io.md, "Swap directories".
        capacity_bytes: total swap budget in bytes, split evenly over the paths
            and preallocated (fallocate) at open, so a disk too small fails at
            once naming the path, bytes needed and bytes free. None: files grow
            on demand (``grow_bytes`` at a time) and the disk is the limit.
        block_size: bytes per I/O block (a multiple of 4096). Larger blocks mean
            fewer syscalls; 1-8 MiB reach the disk's bandwidth (docs/io.md).
        queue_depth: blocks in flight over all transfers of this store
            (staged transfers, of tensors not 4 KiB-aligned, use blocks of at
            most 256 KiB for writes and 1 MiB for reads).
        checksum: keep a CRC32C per checksum chunk (256 KiB for 1-16 MiB
            blocks; docs/io.md) and per unaligned tail of each write, and
            verify it on every read (:class:`ChecksumError`).
        backend: ``"auto"`` (native io_uring, else native threads, else the
            pure-Python engine with one warning), ``"io_uring"``,
            ``"threads"`` or ``"python"``.
        direct: use O_DIRECT (the page cache is not a hidden tier). A path whose
            filesystem refuses it (tmpfs) falls back to buffered I/O with one warning.
        stripe_bytes: a tensor larger than this is split evenly over all paths,
            so their bandwidth adds up; smaller ones go whole to the emptiest path.
            Default: ``block_size``.
        staging_bytes: pinned staging memory (bytes) for tensors that are not
            4 KiB-aligned; at least two blocks per path are kept. One transfer
            holds at most ``queue_depth`` slots of it (on the native engines
            ``min(block_size, 256 KiB)`` bytes each for writes and
            ``min(block_size, 1 MiB)`` for reads).
        host_pool: take staging buffers from this :class:`HostPool` instead of
            creating one (then ``staging_bytes`` only bounds one transfer's share).
        grow_bytes: growth step of the files when ``capacity_bytes`` is None.
        roots: for each path, the configured swap path it lies below (the
            engine's ``swap_paths`` entry above its ``rank<r>`` folder): no
            component below the root is followed if a symbolic link
            (:class:`SwapPathUnsafeError` names it). None: each path is its
            own root (given by the caller, so followed as given).
    """

    def __init__(self, paths: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]], *,
                 capacity_bytes: Optional[int] = None, block_size: int = 8 * MiB, queue_depth: int = 16,
                 checksum: bool = True, backend: str = "auto", direct: bool = True,
                 stripe_bytes: Optional[int] = None, staging_bytes: int = 128 * MiB,
                 host_pool: Optional[HostPool] = None, grow_bytes: int = 256 * MiB,
                 roots: Optional[Sequence[str]] = None):
        paths = self._check_args(paths, block_size, backend)
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.checksum = checksum
        self.stripe_bytes = block_size if stripe_bytes is None else stripe_bytes
        self.capacity_bytes = capacity_bytes
        self.grow_bytes = round_up(max(grow_bytes, ALIGN))
        self._lock = threading.RLock()
        self._index: Dict[Hashable, SwapEntry] = {}
        # See [Note: copy-on-write keys]: fresh extents reserved (key -> (bytes, pieces)), old entries kept
        # aside (key -> entry, or None where the key was new).
        self._spare: Dict[Hashable, tuple] = {}
        self._kept: Dict[Hashable, Optional[SwapEntry]] = {}
        self._closed = False
        self._paths: List[SwapPath] = []
        self._layout = SwapLayout(self._paths, block_size, self.stripe_bytes, capacity_bytes, self.grow_bytes)
        self._engine = None
        self._transfers: Optional[Transfers] = None
        self._own_pool = host_pool is None
        self._pool, stage_share = staging_pool(len(paths), block_size, staging_bytes, host_pool)
        try:
            self._engine = self._make_engine(backend)
            self.backend = self._engine.backend
            self.checksum_name = self._engine.checksum_name if checksum else None
            self._transfers = Transfers(self._lock, self._engine, self._paths, self._pool, stage_share,
                                         block_size, queue_depth, checksum)
            self._open_paths(paths, direct, roots)
            if capacity_bytes is not None:
                share = round_up(-(-capacity_bytes // len(paths)))
                for sp in self._paths:
                    sp.grow(share, f"capacity_bytes={capacity_bytes} over {len(paths)} path(s)")
        except BaseException:
            self._teardown()
            raise

    @staticmethod
    def _check_args(paths, block_size: int, backend: str) -> List[str]:
        """The paths as a list of strings, once the arguments are checked."""
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        paths = [os.fspath(p) for p in paths]
        if not paths:
            raise ValueError("SwapStore needs at least one path")
        if len({os.path.abspath(p) for p in paths}) != len(paths):
            raise ValueError(f"SwapStore paths must be distinct directories: {paths}")
        if block_size < ALIGN or block_size % ALIGN:
            raise ValueError(f"block_size={block_size} must be a positive multiple of {ALIGN} bytes")
        if backend not in ("auto", "io_uring", "threads", "python"):
            raise ValueError(f"backend={backend!r}: choose 'auto', 'io_uring', 'threads' or 'python'")
        return paths

    def _open_paths(self, paths: List[str], direct: bool, roots: Optional[Sequence[str]]) -> None:
        """Locks each directory and opens its data file (O_DIRECT probed with
        one staging buffer)."""
        with self._pool.acquire(ALIGN) as probe:
            for i, p in enumerate(paths):
                sp = SwapPath(p, i, os.fspath(roots[i]) if roots else None)
                self._paths.append(sp)  # first: a failure below is torn down with the rest
                sp.lock()
                sp.open_file(self._engine, probe, direct)

    def _make_engine(self, backend: str):
        if backend == "python":
            return PythonEngine(self.queue_depth, self.block_size)
        if backend == "auto":
            if native_available():
                return NativeEngine("auto", self.queue_depth, self.block_size)
            warn_once("io-fallback", "infinity.io: the native I/O engine is unavailable (library not built or "
                       "INFINITY_NATIVE=0); SwapStore uses the pure-Python thread-pool engine")
            return PythonEngine(self.queue_depth, self.block_size)
        return NativeEngine(backend, self.queue_depth, self.block_size)

    # -- public API ---------------------------------------------------------------------

    @property
    def paths(self) -> List[str]:
        return [p.dir for p in self._paths]

    @property
    def direct(self) -> List[bool]:
        """Per path: True when it uses O_DIRECT, False when it fell back to buffered I/O."""
        return [p.direct for p in self._paths]

    def __contains__(self, key: Hashable) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def keys(self) -> list:
        return list(self._index)

    def meta(self, key: Hashable) -> tuple:
        """``(nbytes, dtype, shape)`` of a stored key (raises KeyError)."""
        e = self._entry(key)
        return e.nbytes, e.dtype, e.shape

    @property
    def sum_chunk_bytes(self) -> Optional[int]:
        """Bytes per checksum chunk when producers may pass the sums of what
        they write (``write(..., crcs=)``): the store keeps CRC32C. None when
        it keeps no checksums or zlib's CRC-32 (no native library)."""
        return chunk_bytes(self.block_size) if self.checksum_name == "crc32c" else None

    def write(self, key: Hashable, tensor: torch.Tensor, crcs=None, keep_old: bool = False) -> IOHandle:
        """Start writing ``tensor``'s bytes under ``key``; returns a handle to wait on.

        ``tensor`` is a CPU tensor; it must not be modified until the handle's
        ``wait()`` returns. Writing an existing key replaces it (reusing its
        extents when the size is unchanged). If the write fails, the key is
        removed: its old contents are not kept.

        A 4 KiB-aligned tensor (a :class:`HostPool` buffer, or a tensor of 2 MiB
        or more from torch's allocator in a process started with
        ``THP_MEM_ALLOC_ENABLE=1``) goes to the disk without a copy; others are
        copied through staging buffers (docs/io.md, "Plain tensors").

        ``crcs``: the CRC32C sums of the tensor's bytes, taken by whoever
        produced them while they were in cache (the AdamW step does:
        ``adamw_step_(..., sum_chunk_bytes=)``), so the store does not read the buffer a
        second time for them (docs/io.md, "Sums from the producer"). One
        uint32 per chunk of :attr:`sum_chunk_bytes` bytes from byte 0, cut
        at the 4 KiB floor of the size, plus one for an unaligned tail
        (:func:`~infinity.io.engine.crc_count` entries). Wrong sums are
        stored as given and fail the key's next read with
        :class:`ChecksumError`. Ignored by a store without checksums.
        """
        self._check_open()
        src = self._source(tensor, "write")
        n = src.numel() * src.element_size()
        if crcs is not None and self.checksum:
            crcs = given_sums(key, crcs, n, self.block_size, self.sum_chunk_bytes, self.checksum_name)
        else:
            crcs = None
        self._settle(key)
        with self._lock:
            pieces = self._pieces_for(key, n, keep_old)
            entry = SwapEntry(key, n, src.dtype, tuple(src.shape), pieces)
            self._index[key] = entry
        handle = IOHandle(self, key, "write", n)
        handle._keep.append(src)
        arrays: list = []
        handle._on_done = lambda error: self._write_done(entry, handle, arrays, error)
        entry.pending.append(handle)
        self._transfers.submit(handle, WRITE, entry, src.data_ptr(), arrays, crcs)
        return handle

    def _pieces_for(self, key: Hashable, n: int, keep_old: bool) -> list:
        """Extents for a write of ``n`` bytes under ``key`` (with the lock)."""
        old = self._index.pop(key, None)
        if not keep_old:
            return self._layout.replace(old, key, n)
        spare = self._spare.pop(key, None)
        if spare is not None and spare[0] != n:
            self._layout.free_pieces(spare[1])
            spare = None
        pieces = spare[1] if spare is not None else self._layout.place(key, n)
        if key in self._kept:  # written again in one window: the copy written before goes
            if old is not None:
                self._layout.free_pieces(old.pieces)
        else:
            self._kept[key] = old
        return pieces

    def reserve(self, key: Hashable, nbytes: int) -> bool:
        """Sets aside fresh extents for the next ``write(key, ..., keep_old=True)``
        of ``nbytes`` bytes; False (nothing reserved) when the store has no
        room for them. See [Note: copy-on-write keys]."""
        self._check_open()
        with self._lock:
            if key in self._spare:
                return True
            try:
                self._spare[key] = (nbytes, self._layout.place(key, nbytes))
            except SwapFullError:
                return False
            return True

    def unreserve(self, key: Hashable) -> None:
        """Gives back extents :meth:`reserve` set aside and no write used."""
        with self._lock:
            spare = self._spare.pop(key, None)
            if spare is not None:
                self._layout.free_pieces(spare[1])

    def commit(self, key: Hashable) -> None:
        """The last ``keep_old`` write of ``key`` stands: its old extents are
        freed (no transfer uses them: the write waited for their reads)."""
        self.unreserve(key)
        with self._lock:
            if key in self._kept:
                old = self._kept.pop(key)
                if old is not None:
                    self._layout.free_pieces(old.pieces)

    def rollback(self, key: Hashable) -> None:
        """Takes back the ``keep_old`` writes of ``key``: once they ended,
        the key's entry is the one they replaced again (or the key is gone,
        if they made it); their extents are freed."""
        self.unreserve(key)
        self._settle(key)
        with self._lock:
            if key not in self._kept:
                return
            old, new = self._kept.pop(key), self._index.pop(key, None)
            if new is not None:
                self._layout.free_pieces(new.pieces)
            if old is not None:
                self._index[key] = old

    def _write_done(self, entry: SwapEntry, handle: IOHandle, arrays: list, error) -> None:
        """A write ended: its pieces keep their sums (``arrays``), or, if it
        failed, the key is dropped (unless a later write replaced it)."""
        with self._lock:
            if error is None:
                if self.checksum:
                    keep_sums(entry.pieces, arrays)
                entry.stored = True
            elif self._index.get(entry.key) is entry:
                del self._index[entry.key]
                self._layout.free_pieces(entry.pieces)
            if handle in entry.pending:
                entry.pending.remove(handle)

    def read(self, key: Hashable, out: torch.Tensor) -> IOHandle:
        """Start reading ``key`` into ``out``; returns a handle to wait on.

        ``out`` is a contiguous CPU tensor of exactly the stored byte count
        (its dtype is not checked: bytes are copied). A 4 KiB-aligned ``out``
        (e.g. a :class:`HostPool` buffer) is filled in place, without a copy.
        Raises KeyError for an unknown key; a failed earlier write of the key
        removed it.
        """
        self._check_open()
        dst = self._source(out, "read into", need_contiguous=True)
        n = dst.numel() * dst.element_size()
        while True:
            self._settle(key, writes_only=True)
            with self._lock:
                entry = self._entry(key)
                if any(h.op == "write" for h in entry.pending):
                    continue  # another thread started a write meanwhile
                if n != entry.nbytes:
                    raise ValueError(f"read of key {key!r}: out has {n} bytes ({tuple(dst.shape)} {dst.dtype}) "
                                     f"but the store holds {entry.nbytes} bytes ({entry.shape} {entry.dtype})")
                handle = IOHandle(self, key, "read", n)
                handle._keep.append(dst)
                handle._on_done = lambda error: self._drop_pending(entry, handle)
                entry.pending.append(handle)
                break
        self._transfers.submit(handle, READ, entry, dst.data_ptr(), [])
        return handle

    def free(self, key: Hashable) -> None:
        """Remove ``key`` (after its transfers end) and release its extents for reuse."""
        self._check_open()
        self._settle(key)
        with self._lock:
            entry = self._index.pop(key)
            self._layout.free_pieces(entry.pieces)

    def wait_all(self) -> None:
        """Wait for every transfer in flight; raises the first error met."""
        first = None
        for h in self._transfers.pending():
            try:
                h.wait()
            except (SwapIOError, TimeoutError) as exc:
                first = first or exc
        if first is not None:
            raise first

    def stats(self) -> dict:
        """Bytes used, free and preallocated per path, and the engine in use."""
        with self._lock:
            return {
                "backend": self.backend,
                "checksum": self.checksum_name,
                "keys": len(self._index),
                "paths": [{"dir": p.dir, "file": p.file_path, "direct": p.direct,
                           "capacity_bytes": p.alloc.capacity, "used_bytes": p.alloc.used_bytes,
                           "free_bytes": p.alloc.free_bytes} for p in self._paths],
            }

    def close(self) -> None:
        """Wait for transfers, then delete the store's files, its lock files and
        any directory it created (if empty), but only while they still are the
        ones it made. Idempotent; tears everything down even when a step fails
        (what could not be removed is logged; the next store on the directory
        reclaims it)."""
        if self._closed:
            return
        try:
            for h in self._transfers.pending():
                h._complete()
        finally:
            self._teardown()

    def __enter__(self) -> "SwapStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _inject_fault(self, op: str, nth: int, err: Union[int, str]) -> None:
        """Test hook: the ``nth`` block (1-based, counted from now) of ``op``
        ("read", "write" or "any") fails with ``err`` (an errno or its name),
        or is cut short when ``err`` is "short"; ``op`` "ring" makes every
        ``io_uring_enter`` fail with ``err`` from that block on (io_uring
        only). Same as INFINITY_IO_FAULT."""
        from ..errors import parse_fault_spec
        o, k, e = parse_fault_spec(f"{op}:{nth}:{err}")
        self._engine.set_fault(o, k, e)

    # -- internals ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SwapStore is closed")

    def _entry(self, key: Hashable) -> SwapEntry:
        try:
            return self._index[key]
        except KeyError:
            raise KeyError(f"key {key!r} is not in the swap store") from None

    @staticmethod
    def _source(t: torch.Tensor, what: str, need_contiguous: bool = False) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"SwapStore {what}: expected a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"SwapStore {what}: tensor is on {t.device}; copy it to host memory first "
                             "(a HostPool buffer avoids a staging copy)")
        if not t.is_contiguous():
            if need_contiguous:
                raise ValueError(f"SwapStore {what}: out must be contiguous (shape {tuple(t.shape)}, "
                                 f"stride {t.stride()})")
            t = t.contiguous()
        return t

    def _settle(self, key: Hashable, writes_only: bool = False) -> None:
        """Wait for transfers on ``key`` that must finish first (see [Note: ordering on one key])."""
        while True:
            with self._lock:
                e = self._index.get(key)
                if e is None:
                    return
                todo = [h for h in e.pending if not writes_only or h.op == "write"]
            if not todo:
                return
            for h in todo:
                h._complete()

    def _drop_pending(self, entry: SwapEntry, handle: IOHandle) -> None:
        with self._lock:
            if handle in entry.pending:
                entry.pending.remove(handle)

    def _handle_finished(self, handle: IOHandle) -> None:
        self._transfers.finished(handle)

    def _teardown(self) -> None:
        """Releases paths, engine and pool, each even if an earlier one failed."""
        self._closed = True
        problems: List[str] = []
        try:
            for sp in self._paths:
                problems += sp.close(self._engine)
        finally:
            self._paths = []
            self._index.clear()
            self._spare.clear()
            self._kept.clear()
            try:
                if self._engine is not None:
                    self._engine.close()
            finally:
                if self._own_pool and self._pool is not None:
                    self._pool.close()
                self._pool = None
        if problems:
            log.warning("infinity.io.SwapStore.close: %s; what is left is reclaimed by the next store on its "
                        "directory", "; ".join(problems))

    def __repr__(self) -> str:
        return (f"SwapStore(paths={self.paths}, backend={getattr(self, 'backend', None)!r}, "
                f"keys={len(self._index)}, block_size={self.block_size}, queue_depth={self.queue_depth})")
