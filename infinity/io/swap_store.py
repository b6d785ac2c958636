"""A tensor store over one or more swap directories (the NVMe tier).

Policy lives here: which path and file offset a key's bytes occupy
(:class:`~infinity.io.extent_allocator.ExtentAllocator`), striping, checksums,
ordering between operations on one key. Moving bytes is the engine's job
(:class:`~infinity.io.engine.NativeEngine` or
:class:`~infinity.io.fallback.PythonEngine`).

[Note: zero-copy and bounce]
O_DIRECT needs 4 KiB-aligned memory, offsets and lengths. A tensor whose data
pointer is 4 KiB-aligned (every :class:`~infinity.io.HostPool` buffer) moves
straight between its memory and the disk, except its last ``nbytes % 4096``
bytes, which go through a 4 KiB staging buffer so that nothing beyond the
tensor is read or written. Any other tensor is staged block by block through
staging buffers (pinned, from the store's own :class:`HostPool`), with the
copy of one block overlapped with the transfer of others, inside the engine.

[Note: ordering on one key]
Operations on different keys run concurrently. On the same key, a ``read``
or ``free`` waits for an earlier ``write`` to complete, and a ``write`` or
``free`` waits for earlier reads and writes: a caller never reads a
half-written extent, and extents are never reused under a transfer.
"""

from __future__ import annotations

import array
import collections
import ctypes
import errno as _errno
import fcntl
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Hashable, List, Optional, Sequence, Union

import torch

from .engine import ALIGN, READ, WRITE, NativeEngine, chunk_bytes, crc_count, native_available
from .errors import PoolExhausted, StoreLockedError, SwapFullError, SwapIOError
from .extent_allocator import ExtentAllocator
from .fallback import PythonEngine
from .host_pool import HostPool, _warn_once

__all__ = ["SwapStore", "IOHandle"]

LOCK_NAME = ".infinity-swap.lock"
MiB = 1 << 20


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


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _fs_free(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@dataclass
class _Piece:
    """The part of a key's bytes ``[rel, rel + nbytes)`` stored at ``offset`` of one path's file."""

    path_index: int
    offset: int
    rel: int
    nbytes: int
    crcs: Optional[array.array] = None  # uint32 per checksum chunk; set when the write completes


@dataclass
class _Entry:
    key: Hashable
    nbytes: int
    dtype: torch.dtype
    shape: tuple
    pieces: List[_Piece]
    pending: List["IOHandle"] = field(default_factory=list)  # transfers in flight on this key
    stored: bool = False  # True once a write completed successfully


class _SwapPath:
    """One swap directory: its lock, its data file, its allocator."""

    def __init__(self, directory: str, index: int):
        self.dir = os.path.abspath(directory)
        self.index = index
        self.created_dir = False
        self.lock_fd = -1
        self.lock_path = os.path.join(self.dir, LOCK_NAME)
        self.created_lock = False
        self.file_path = ""
        self.fd = -1
        self.file_id = -1
        self.direct = False
        self.alloc = ExtentAllocator(0, ALIGN)

    # Directory and lock -----------------------------------------------------------

    def lock(self) -> None:
        if not os.path.isdir(self.dir):
            try:
                os.makedirs(self.dir, mode=0o700)
                self.created_dir = True
                os.chmod(self.dir, 0o700)  # the umask may have narrowed or widened makedirs' mode
            except FileExistsError:
                pass
        while True:
            try:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                created = True
            except FileExistsError:
                fd = os.open(self.lock_path, os.O_RDWR | os.O_CLOEXEC)
                created = False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                try:
                    owner = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
                finally:
                    os.close(fd)
                raise StoreLockedError(
                    f"swap directory '{self.dir}' is in use by another SwapStore (pid {owner}; lock file "
                    f"'{self.lock_path}'). Give this run its own directory, or stop the other one.") from None
            # The previous owner may have unlinked the file between our open and
            # our flock: then we hold a lock on a deleted inode. Check, retry.
            try:
                same = os.stat(self.lock_path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        self.lock_fd, self.created_lock = fd, created
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    # Data file ------------------------------------------------------------------------

    def open_file(self, engine, probe_buf, want_direct: bool) -> None:
        n = 0
        while True:
            name = os.path.join(self.dir, f"swap-{os.getpid()}-{n}.bin")
            try:
                fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                break
            except FileExistsError:  # a crashed run's file, or another store's: not ours to touch
                n += 1
        self.file_path, self.fd = name, fd
        if want_direct and hasattr(os, "O_DIRECT"):
            reason = self._try_direct(probe_buf)
            if reason:
                _warn_once("odirect:" + self.dir,
                           f"infinity.io.SwapStore: O_DIRECT refused for '{self.file_path}' ({reason}); "
                           "using buffered I/O for this path, so the page cache holds a copy of swapped data")
        self.file_id = engine.register(self.fd, self.file_path)

    def _try_direct(self, probe_buf) -> str:
        try:
            dfd = os.open(self.file_path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
        except OSError as exc:
            return f"open with O_DIRECT: {exc.strerror}"
        # Some filesystems accept the flag at open and refuse the transfer (or
        # the reverse): probe one aligned 4 KiB write and read.
        try:
            view = memoryview((ctypes.c_char * ALIGN).from_address(probe_buf.ptr)).cast("B")
            os.pwrite(dfd, view, 0)
            os.preadv(dfd, [view], 0)
        except OSError as exc:
            os.close(dfd)
            return f"4 KiB O_DIRECT probe: {exc.strerror}"
        os.close(self.fd)
        self.fd = dfd
        self.direct = True
        return ""

    def grow(self, nbytes: int, what: str) -> None:
        """Preallocate ``nbytes`` more bytes at the end of the file (fallocate)."""
        old = self.alloc.capacity
        free = _fs_free(self.dir)
        if free < nbytes:
            raise SwapFullError(_errno.ENOSPC,
                                f"swap path '{self.dir}' is too small: {what} needs {nbytes} more bytes in "
                                f"'{self.file_path}', the filesystem has {free} bytes free")
        try:
            os.posix_fallocate(self.fd, old, nbytes)
        except OSError as exc:
            raise SwapFullError(exc.errno,
                                f"cannot preallocate {nbytes} bytes at offset {old} of '{self.file_path}' "
                                f"for {what}: {exc.strerror} (errno {exc.errno}); the filesystem has "
                                f"{_fs_free(self.dir)} bytes free") from None
        self.alloc.grow(old + nbytes)

    def close(self, engine) -> None:
        if self.file_id >= 0:
            engine.unregister(self.file_id)
            self.file_id = -1
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.file_path:
            try:
                os.unlink(self.file_path)
            except FileNotFoundError:
                pass
            self.file_path = ""
        if self.lock_fd >= 0:
            if self.created_lock:
                try:
                    os.unlink(self.lock_path)  # before unlocking: see the inode check in lock()
                except FileNotFoundError:
                    pass
            os.close(self.lock_fd)
            self.lock_fd = -1
        if self.created_dir:
            try:
                os.rmdir(self.dir)  # only if empty: files of others stay
            except OSError:
                pass
            self.created_dir = False


class IOHandle:
    """An asynchronous :meth:`SwapStore.write` or :meth:`SwapStore.read`.

    :meth:`wait` blocks (without holding the GIL) until every part of the
    transfer ended and raises the first error, naming the key. It may be called
    any number of times, from any thread.
    """

    def __init__(self, store: "SwapStore", key: Hashable, op: str, nbytes: int):
        self.key = key
        self.op = op
        self.nbytes = nbytes
        self._store = store
        self._tickets: List[int] = []
        self._staging: list = []
        self._keep: list = []
        self._on_done = None
        self._lock = threading.Lock()
        self._finished = False
        self._error: Optional[BaseException] = None

    def done(self) -> bool:
        """True when the transfer has ended (successfully or not); never blocks."""
        if self._finished:
            return True
        eng = self._store._engine
        return all(eng.done(t) for t in self._tickets)

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait at most ``timeout`` seconds (None: forever); returns the bytes moved.

        Raises :class:`SwapIOError` (errno set), :class:`ChecksumError`, or
        :class:`TimeoutError` if the transfer is still running at the deadline.
        """
        if not self._complete(timeout):
            raise TimeoutError(f"{self.op} of key {self.key!r} ({self.nbytes} bytes) still running after "
                               f"{timeout} s")
        if self._error is not None:
            raise self._error
        return self.nbytes

    def _complete(self, timeout: Optional[float] = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            if self._finished:
                return True
            eng = self._store._engine
            while self._tickets:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    if not eng.wait(self._tickets[0], left):
                        return False
                except SwapIOError as exc:
                    if self._error is None:
                        self._error = type(exc)(exc.errno, f"{self.op} of key {self.key!r} failed: {exc.strerror}")
                self._tickets.pop(0)
            for buf in self._staging:
                buf.release()
            self._staging.clear()
            if self._on_done is not None:
                self._on_done(self._error)
            self._keep.clear()
            self._finished = True
        self._store._handle_finished(self)
        return True

    def __repr__(self) -> str:
        state = "done" if self._finished else "pending"
        return f"IOHandle({self.op} {self.key!r}, {self.nbytes} bytes, {state})"


class SwapStore:
    """Tensors kept in swap files on one or more directories (NVMe paths).

    Args:
        paths: one directory or a list of them, ideally on different disks.
            Each is created (mode 0700) if missing and locked for the store's
            lifetime; a second store on a locked directory raises
            :class:`StoreLockedError`. The store creates one data file (mode
            0600) per path and deletes it, and only it, on :meth:`close`.
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
    """

    def __init__(self, paths: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]], *,
                 capacity_bytes: Optional[int] = None, block_size: int = 8 * MiB, queue_depth: int = 16,
                 checksum: bool = True, backend: str = "auto", direct: bool = True,
                 stripe_bytes: Optional[int] = None, staging_bytes: int = 128 * MiB,
                 host_pool: Optional[HostPool] = None, grow_bytes: int = 256 * MiB):
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
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.checksum = checksum
        self.stripe_bytes = block_size if stripe_bytes is None else stripe_bytes
        self.capacity_bytes = capacity_bytes
        self.grow_bytes = _round_up(max(grow_bytes, ALIGN))
        self._lock = threading.RLock()
        self._index: Dict[Hashable, _Entry] = {}
        self._outstanding: "collections.OrderedDict[int, IOHandle]" = collections.OrderedDict()
        self._closed = False
        self._paths: List[_SwapPath] = []
        self._engine = None
        self._own_pool = host_pool is None
        # Each bounced transfer of one path gets a share; two per path keep
        # reads and writes of consecutive keys overlapped.
        min_staging = 2 * len(paths) * block_size
        if self._own_pool:
            self._pool = HostPool(max(staging_bytes, min_staging))
        else:
            self._pool = host_pool
        self._stage_share = max(block_size, (min(staging_bytes, self._pool.capacity_bytes) //
                                             (2 * len(paths))) // block_size * block_size)
        try:
            self._engine = self._make_engine(backend)
            self.backend = self._engine.backend
            self.checksum_name = self._engine.checksum_name if checksum else None
            with self._pool.acquire(ALIGN) as probe:
                for i, p in enumerate(paths):
                    sp = _SwapPath(p, i)
                    sp.lock()
                    self._paths.append(sp)
                    sp.open_file(self._engine, probe, direct)
            if capacity_bytes is not None:
                share = _round_up(-(-capacity_bytes // len(paths)))
                for sp in self._paths:
                    sp.grow(share, f"capacity_bytes={capacity_bytes} over {len(paths)} path(s)")
        except BaseException:
            self._teardown()
            raise

    def _make_engine(self, backend: str):
        if backend == "python":
            return PythonEngine(self.queue_depth, self.block_size)
        if backend == "auto":
            if native_available():
                return NativeEngine("auto", self.queue_depth, self.block_size)
            _warn_once("io-fallback", "infinity.io: the native I/O engine is unavailable (library not built or "
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

    def write(self, key: Hashable, tensor: torch.Tensor, crcs=None) -> IOHandle:
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
            if self.sum_chunk_bytes is None:
                raise ValueError(f"write of key {key!r}: crcs given, but this store keeps "
                                 f"{self.checksum_name} sums, not CRC32C")
            need = crc_count(n, self.block_size)
            crcs = _as_u32(crcs)
            if len(crcs) != need:
                raise ValueError(f"write of key {key!r}: {len(crcs)} crcs given; {n} bytes have {need} "
                                 f"checksum chunks of {self.sum_chunk_bytes} bytes")
        else:
            crcs = None
        self._settle(key)
        with self._lock:
            old = self._index.pop(key, None)
            if old is not None and old.nbytes == n:  # same size: overwrite in place
                pieces = [_Piece(p.path_index, p.offset, p.rel, p.nbytes) for p in old.pieces]
            else:
                if old is not None:
                    self._free_pieces(old.pieces)
                pieces = self._place(key, n)
            entry = _Entry(key, n, src.dtype, tuple(src.shape), pieces)
            self._index[key] = entry
        handle = IOHandle(self, key, "write", n)
        handle._keep.append(src)
        arrays = []

        def on_done(error):
            with self._lock:
                if error is None:
                    for piece, (body, tail) in zip(entry.pieces, arrays):
                        if self.checksum:
                            # Raw uint32s, copied as bytes: a 1 GiB key has 4096 chunks.
                            crcs = array.array("I")
                            for arr in (body, tail):
                                if arr is not None:
                                    crcs.frombytes(memoryview(arr).cast("B"))
                            piece.crcs = crcs
                    entry.stored = True
                elif self._index.get(key) is entry:
                    del self._index[key]
                    self._free_pieces(entry.pieces)
                if handle in entry.pending:
                    entry.pending.remove(handle)

        handle._on_done = on_done
        entry.pending.append(handle)
        self._submit(handle, WRITE, entry, src.data_ptr(), arrays, crcs)
        return handle

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
        self._submit(handle, READ, entry, dst.data_ptr(), [])
        return handle

    def free(self, key: Hashable) -> None:
        """Remove ``key`` (after its transfers end) and release its extents for reuse."""
        self._check_open()
        self._settle(key)
        with self._lock:
            entry = self._index.pop(key)
            self._free_pieces(entry.pieces)

    def wait_all(self) -> None:
        """Wait for every transfer in flight; raises the first error met."""
        first = None
        for h in list(self._outstanding.values()):
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
        any directory it created (if empty). Idempotent."""
        if self._closed:
            return
        for h in list(self._outstanding.values()):
            h._complete()
        self._teardown()

    def __enter__(self) -> "SwapStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _inject_fault(self, op: str, nth: int, err: Union[int, str]) -> None:
        """Test hook: the ``nth`` block (1-based, counted from now) of ``op``
        ("read", "write" or "any") fails with ``err`` (an errno or its name),
        or is cut short when ``err`` is "short". Same as INFINITY_IO_FAULT."""
        from .errors import parse_fault_spec
        o, k, e = parse_fault_spec(f"{op}:{nth}:{err}")
        self._engine.set_fault(o, k, e)

    # -- internals ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("SwapStore is closed")

    def _entry(self, key: Hashable) -> _Entry:
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

    def _drop_pending(self, entry: _Entry, handle: IOHandle) -> None:
        with self._lock:
            if handle in entry.pending:
                entry.pending.remove(handle)

    def _plan(self, n: int) -> List[_Piece]:
        """Split of ``n`` bytes over paths (offsets left unset)."""
        k = len(self._paths)
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
                pieces.append(_Piece(i, -1, rel, ln))
                rel += ln
            return pieces
        # Whole on one path: the one with most free space (ties: lowest index).
        best = max(range(k), key=lambda i: (self._paths[i].alloc.free_bytes, -i))
        return [_Piece(best, -1, 0, n)]

    def _place(self, key: Hashable, n: int) -> List[_Piece]:
        pieces = self._plan(n)
        done: List[_Piece] = []
        try:
            for p in pieces:
                p.offset = self._alloc_on(self._paths[p.path_index], p.nbytes, key)
                done.append(p)
        except BaseException:
            self._free_pieces(done)
            raise
        return pieces

    def _alloc_on(self, sp: _SwapPath, nbytes: int, key: Hashable) -> int:
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

    def _free_pieces(self, pieces: List[_Piece]) -> None:
        for p in pieces:
            if p.offset >= 0:
                self._paths[p.path_index].alloc.free(p.offset)

    def _stage(self, nbytes: int, exclude: IOHandle):
        """A staging buffer; completes older transfers when the pool is spent."""
        while True:
            try:
                return self._pool.acquire(nbytes, block=False)
            except PoolExhausted:
                with self._lock:
                    older = next((h for h in self._outstanding.values() if h is not exclude), None)
                if older is None:
                    # Held by transfers of other threads (or a shared pool): wait for them.
                    return self._pool.acquire(nbytes, block=True, timeout=600)
                older._complete()

    def _submit(self, handle: IOHandle, op: int, entry: _Entry, base_ptr: int, arrays: list,
                given=None) -> None:
        """Submits ``entry``'s pieces; ``arrays`` receives each piece's checksum
        arrays (body, tail). ``given``: a write's sums for the whole key, from
        its producer."""
        eng = self._engine
        B = self.block_size
        C = chunk_bytes(B)
        with self._lock:
            self._outstanding[id(handle)] = handle
        try:
            for piece in entry.pieces:
                fid = self._paths[piece.path_index].file_id
                ptr = base_ptr + piece.rel
                n = piece.nbytes
                body = n // ALIGN * ALIGN if ptr % ALIGN == 0 else 0
                verify = op == READ and self.checksum
                # Sums passed in: the stored ones (reads) or the producer's (writes).
                sums = piece.crcs if verify else (  # a view: the ctypes arrays below copy once
                    memoryview(given)[piece.rel // C: piece.rel // C + crc_count(n, B)] if given is not None
                    else None)
                body_arr = tail_arr = None
                if body:
                    if self.checksum:
                        cnt = crc_count(body, B)
                        body_arr = ((ctypes.c_uint32 * cnt).from_buffer_copy(sums) if sums is not None
                                    else (ctypes.c_uint32 * cnt)())
                    handle._tickets.append(eng.submit(op, fid, piece.offset, ptr, body, 0, 0, body_arr,
                                                      sums is not None))
                rest = n - body
                if rest:
                    # The engine moves a staged request through slots of
                    # stage_block(op) bytes with at most queue_depth of them
                    # in flight: more would sit unused.
                    slot = min(eng.stage_block(op), _round_up(rest))
                    nslots = max(1, min(-(-rest // slot), self.queue_depth, self._stage_share // slot))
                    buf = self._stage(slot * nslots, handle)
                    handle._staging.append(buf)
                    if self.checksum:
                        cnt = crc_count(rest, B)
                        tail_arr = ((ctypes.c_uint32 * cnt).from_buffer_copy(sums, 4 * (len(sums) - cnt))
                                    if sums is not None else (ctypes.c_uint32 * cnt)())
                    handle._tickets.append(eng.submit(op, fid, piece.offset + body, ptr + body, rest, buf.ptr,
                                                      buf.capacity, tail_arr, sums is not None))
                handle._keep.append((body_arr, tail_arr))
                arrays.append((body_arr, tail_arr))
        except BaseException as exc:
            # Wait for what was submitted, release staging; a write then drops the key.
            handle._error = exc
            handle._complete()
            raise

    def _handle_finished(self, handle: IOHandle) -> None:
        with self._lock:
            self._outstanding.pop(id(handle), None)

    def _teardown(self) -> None:
        self._closed = True
        for sp in self._paths:
            try:
                sp.close(self._engine)
            except OSError:
                pass
        if self._engine is not None:
            self._engine.close()
        self._paths = []
        self._index.clear()
        if self._own_pool and self._pool is not None:
            self._pool.close()
        self._pool = None

    def __repr__(self) -> str:
        return (f"SwapStore(paths={self.paths}, backend={getattr(self, 'backend', None)!r}, "
                f"keys={len(self._index)}, block_size={self.block_size}, queue_depth={self.queue_depth})")
