"""A sequential file writer and a file reader that bypass the page cache.

[Note: checkpoint writes without the page cache]
Buffered writes of a checkpoint went through the page cache at 0.48 GB/s on
the development machine (allocating and copying into cache pages), against
2.2 GB/s for O_DIRECT writes of the same disk. A safetensors file's tensors
sit at arbitrary offsets, so the stream is gathered into 4 KiB-aligned
staging blocks of ``BLOCK`` bytes (one filled while the others are written
by background threads) and each full block goes to the disk with
O_DIRECT. ``WRITE_DEPTH`` blocks are in flight at once (the disk needs a
queue: one at a time reached 1.5 GB/s here, 8 deep raw writes 2.2), and a
filled block waits for the first write to finish, not the oldest. Streaming
2 GiB from memory reached 0.57-0.70x the raw write bandwidth of the same
moment 4 deep waiting for the oldest, 0.71-0.78x waiting for the first, and
0.70-0.88x 8 deep (3 repeats each, the disk drifting
1.7-2.5 GB/s). The last block is padded to 4 KiB and the file cut to its true
length. Where O_DIRECT is refused (tmpfs, some network filesystems) the same
blocks are written through the page cache.

A large tensor whose address is 4 KiB-aligned, arriving where the stream's
position is too (a model whose tensor sizes are multiples of 4 KiB, as an
LLM's are, laid out from page-aligned tier buffers), is written straight
from its own memory, without the copy into a block: the copy cost the
save's thread a third of its time, and a save of host-resident state ran
0.83x the raw write bandwidth with it against 0.94x written so (the means
of three alternating runs; 1.76 of its 1.92 GB were written so). Such a write borrows the tensor's memory until
:meth:`DirectStream.settle` (or ``close``): the caller settles before that
memory may change.

[Note: reads into their destination]
A load first read every tensor through 8 MiB staging blocks, 4 ahead of
the position last read, and copied each into its place: the copy took a
third of the loading thread's time, and a load of host-resident state ran
0.63x the raw read bandwidth so. :meth:`DirectReader.submit` instead reads
straight into the destination (``READ_DEPTH`` 8 MiB pieces in flight on a
thread pool), and a loader submits all of a unit's tensors before it waits
for the first, checking each one's CRC32C while the rest are still read:
0.87x raw read in the same alternating A/B (4 runs each, the disk
1.8-2.5 GB/s). O_DIRECT needs the file offset and the memory address on
4 KiB boundaries, so only a destination at the same offset within its page
as its bytes within theirs is read straight (staging buffers are placed so:
safetensors_io.page_phase); its first and last partial pages, and all of a
destination whose page phase differs, go through bounce blocks (made on
demand, ``READ_DEPTH`` at most) and are copied. Nothing is read ahead: the
caller says what comes next by submitting it.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import queue
import threading
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Optional

import torch

from .safe_files import read_error

__all__ = ["DirectStream", "DirectReader", "BLOCK", "DEPTH", "WRITE_DEPTH", "READ_DEPTH", "aligned_empty"]

BLOCK = 8 << 20  # bytes per staging block and per write
WRITE_DEPTH = 8  # blocks being written at once (and one more being filled)
DEPTH = 4        # blocks read ahead (read_into)
READ_DEPTH = 8   # reads in flight (submit), and bounce blocks at most
_ALIGN = 4096


def aligned_empty(nbytes: int, phase: int = 0) -> torch.Tensor:
    """A new uint8 CPU tensor of ``nbytes`` whose address is ``phase`` bytes
    past a 4 KiB boundary (so that it can be read into with O_DIRECT from a
    file offset of that phase: DirectReader.submit)."""
    raw = torch.empty(nbytes + 2 * _ALIGN, dtype=torch.uint8)
    skip = (phase - raw.data_ptr()) % _ALIGN
    return raw[skip:skip + nbytes]


def _close_maps(maps) -> None:
    for m in maps:
        try:
            m.close()
        except BufferError:
            pass  # a view still alive (an aborted transfer): the mapping goes with it


class DirectStream:
    """Appends bytes to a new file at ``path`` (created 0600, never an
    existing one): :meth:`write` copies from tensors, :meth:`close` writes
    the rest, cuts the file to its length and fsyncs it."""

    def __init__(self, path: str):
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        try:
            self._fd = os.open(path, flags | os.O_DIRECT, 0o600)
            self.direct = True
        except OSError:
            self._fd = os.open(path, flags, 0o600)
            self.direct = False
        self._maps = [mmap.mmap(-1, BLOCK) for _ in range(WRITE_DEPTH + 1)]  # page-aligned
        self._bufs = [torch.frombuffer(m, dtype=torch.uint8) for m in self._maps]
        self._cur, self._fill, self._file_pos = 0, 0, 0
        self._pending: deque = deque()  # (block index, future), oldest first
        self._pool = ThreadPoolExecutor(WRITE_DEPTH, thread_name_prefix="infinity-ckpt-write")
        self.length = 0

    def write(self, t: torch.Tensor) -> None:
        """Appends the bytes of contiguous CPU tensor ``t``. Where it is
        written from its own memory (see the module's note), that memory is
        read until :meth:`settle`."""
        src = t.reshape(-1).view(torch.uint8)
        done, n = 0, src.numel()
        if self.direct and n >= BLOCK and t.data_ptr() % _ALIGN == 0 and self._fill % _ALIGN == 0:
            done = self._lend(t, n - n % _ALIGN)
        while done < n:
            k = min(BLOCK - self._fill, n - done)
            self._bufs[self._cur][self._fill:self._fill + k].copy_(src[done:done + k])
            self._fill += k
            done += k
            if self._fill == BLOCK:
                self._flush(BLOCK)
        self.length += n

    def _lend(self, t: torch.Tensor, body: int) -> int:
        """Writes the first ``body`` bytes (4 KiB-aligned) of ``t`` from its
        own memory, in ``BLOCK`` pieces; returns ``body``."""
        if self._fill:  # the partial block first: the file position stays 4 KiB-aligned
            self._flush(self._fill)
        whole = (ctypes.c_char * body).from_address(t.data_ptr())
        for off in range(0, body, BLOCK):
            self._reap(WRITE_DEPTH - 1)  # lent writes count in the depth too
            k = min(BLOCK, body - off)
            view = memoryview(whole)[off:off + k]  # released by the job when done
            self._pending.append((-1, self._pool.submit(self._pwrite_lent, view, self._file_pos, t)))
            self._file_pos += k
        return body

    def _pwrite_lent(self, view: memoryview, pos: int, owner: torch.Tensor) -> None:
        del owner  # held by the job until it is done: the memory stays alive
        self._pwrite(view, pos)

    def settle(self) -> None:
        """Waits for the writes still reading a tensor's own memory (raises their error)."""
        for item in [x for x in self._pending if x[0] < 0]:
            self._pending.remove(item)
            item[1].result()

    def _reap(self, limit: int) -> None:
        """Waits until at most ``limit`` writes are in flight; collects the finished ones (raising their errors)."""
        while True:
            for i, f in [(i, f) for i, f in self._pending if f.done()]:
                self._pending.remove((i, f))
                f.result()  # raises the write's OSError (ENOSPC, EIO)
            if len(self._pending) <= limit:
                return
            wait([f for _, f in self._pending], return_when=FIRST_COMPLETED)  # the first one done, not the oldest

    def write_bytes(self, data: bytes) -> None:
        self.write(torch.frombuffer(bytearray(data), dtype=torch.uint8))

    def _flush(self, nbytes: int) -> None:
        """Hands the current block (``nbytes`` of it, aligned) to a writer
        thread and takes a free one (waiting for the first write to finish
        when ``WRITE_DEPTH`` are in flight)."""
        buf, pos = self._maps[self._cur], self._file_pos
        self._pending.append((self._cur, self._pool.submit(self._pwrite, memoryview(buf)[:nbytes], pos)))
        self._file_pos += nbytes
        self._reap(len(self._maps) - 1)  # at most WRITE_DEPTH blocks busy: one of the WRITE_DEPTH + 1 is free
        busy = {i for i, _ in self._pending}
        self._cur, self._fill = next(i for i in range(len(self._maps)) if i not in busy), 0

    def _pwrite(self, view: memoryview, pos: int) -> None:
        try:
            done = 0
            while done < len(view):
                done += os.pwrite(self._fd, view[done:], pos + done)
        finally:
            view.release()

    def _wait_oldest(self) -> None:
        _, f = self._pending.popleft()
        f.result()  # raises the write's OSError (ENOSPC, EIO)

    def _wait(self) -> None:
        while self._pending:
            self._wait_oldest()

    def close(self) -> None:
        """Writes what is left, cuts the file to :attr:`length` bytes and fsyncs it."""
        try:
            if self._fill:
                tail = self._fill
                pad = -tail % _ALIGN
                self._bufs[self._cur][tail:tail + pad].zero_()
                self._flush(tail + pad)
            self._wait()
            os.ftruncate(self._fd, self.length)
            os.fsync(self._fd)
        finally:
            self.abort()

    def abort(self) -> None:
        """Stops and releases everything (the caller removes the partial file)."""
        _release(self)


class DirectReader:
    """Reads a file with O_DIRECT (page cache bypassed where the filesystem
    allows), two ways. :meth:`read_into` reads through ``BLOCK``-sized
    aligned blocks, ``DEPTH`` blocks ahead of the position last read: for
    reading a file front to back one tensor at a time. :meth:`submit` starts
    a read straight into the caller's memory, ``READ_DEPTH`` pieces in
    flight and nothing read ahead: for a caller that knows what it reads
    next and submits it (see [Note: reads into their destination])."""

    def __init__(self, path: str, fd: Optional[int] = None):
        """Opens ``path``, or reads ``fd`` (an fd on it, already opened and
        checked: safe_files.open_member; the reader closes it)."""
        self.path = path
        if fd is not None:
            self._fd, self.direct = fd, _set_direct(fd)
        else:
            try:
                self._fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                self.direct = True
            except OSError:
                self._fd = os.open(path, os.O_RDONLY)
                self.direct = False
        self.size = os.fstat(self._fd).st_size
        self._maps = [mmap.mmap(-1, BLOCK) for _ in range(DEPTH + 1)]
        self._bufs = [torch.frombuffer(m, dtype=torch.uint8) for m in self._maps]
        self._free = list(range(DEPTH + 1))
        self._blocks: dict = {}  # block number -> (buffer index, future of the bytes read)
        self._pool = ThreadPoolExecutor(READ_DEPTH, thread_name_prefix="infinity-ckpt-read")
        self._bounce: queue.SimpleQueue = queue.SimpleQueue()  # free bounce blocks (submit), made on demand
        self._bounces = 0
        self._lock = threading.Lock()

    def _pread(self, i: int, b: int) -> int:
        view = memoryview(self._maps[i])
        try:
            # The whole (aligned) block is asked for: O_DIRECT refuses a shorter length; the file's end stops it.
            return self._pread_view(view, b * BLOCK, min(BLOCK, self.size - b * BLOCK))
        finally:
            view.release()

    def _schedule(self, first: int) -> None:
        """Blocks ``first .. first + DEPTH`` read or being read; every other buffer recycled."""
        for b in [b for b in self._blocks if not first <= b <= first + DEPTH]:
            i, f = self._blocks.pop(b)
            f.result()
            self._free.append(i)
        b = first
        while self._free and b * BLOCK < self.size and b < first + DEPTH + 1:
            if b not in self._blocks:
                i = self._free.pop()
                self._blocks[b] = (i, self._pool.submit(self._pread, i, b))
            b += 1

    def read_into(self, offset: int, dst: torch.Tensor) -> int:
        """Fills ``dst`` (contiguous CPU tensor) from byte ``offset``; returns
        the bytes read (fewer at the end of the file)."""
        out = dst.reshape(-1).view(torch.uint8)
        done, n = 0, out.numel()
        while done < n and offset + done < self.size:
            b = (offset + done) // BLOCK
            self._schedule(b)
            i, f = self._blocks[b]
            got = f.result()
            within = offset + done - b * BLOCK
            k = min(got - within, n - done)
            if k <= 0:
                break
            out[done:done + k].copy_(self._bufs[i][within:within + k])
            done += k
        return done

    def submit(self, offset: int, dst: torch.Tensor) -> "PendingRead":
        """Starts reading ``dst``'s bytes (a contiguous CPU tensor, left alone
        until the result is taken) from byte ``offset``; the result is the
        bytes read (fewer where the file ends first)."""
        out = dst.view(-1).view(torch.uint8)
        n = max(0, min(out.numel(), self.size - offset))
        ptr, pieces = out.data_ptr(), []
        if not self.direct:
            head, body = 0, n
        elif (ptr - offset) % _ALIGN == 0:  # memory and file on the same phase: the body goes straight
            head = min(n, -offset % _ALIGN)
            body = head + (n - head) // _ALIGN * _ALIGN
        else:
            head = body = 0
        spans = [(0, head, False)] + [(a, min(a + BLOCK, body), True) for a in range(head, body, BLOCK)]
        spans += [(a, min(a + BLOCK, n), False) for a in range(body, n, BLOCK)]
        for a, b, straight in spans:
            if a < b:
                job = self._pread_at if straight else self._pread_bounced
                pieces.append((a, b - a, self._pool.submit(job, out, a, b, offset)))
        return PendingRead(pieces, n)

    def _pread_at(self, out: torch.Tensor, a: int, b: int, offset: int) -> int:
        """Bytes ``a:b`` of ``out`` from the file at ``offset + a`` (aligned), into ``out`` itself."""
        view = memoryview((ctypes.c_char * (b - a)).from_address(out.data_ptr() + a)).cast("B")
        try:
            return self._pread_view(view, offset + a)
        finally:
            view.release()

    def _pread_bounced(self, out: torch.Tensor, a: int, b: int, offset: int) -> int:
        """Bytes ``a:b`` of ``out`` read through an aligned bounce block and copied."""
        lo = (offset + a) // _ALIGN * _ALIGN
        hi = -(-(offset + b) // _ALIGN) * _ALIGN
        buf = self._take_bounce()
        try:
            view = memoryview(buf)[:hi - lo]
            try:
                got = self._pread_view(view, lo)
            finally:
                view.release()
            skip = offset + a - lo
            k = max(0, min(b - a, got - skip))
            if k:
                out[a:a + k].copy_(torch.frombuffer(buf, dtype=torch.uint8, count=k, offset=skip))
            return k
        finally:
            self._bounce.put(buf)

    def _take_bounce(self) -> mmap.mmap:
        with self._lock:
            if self._bounce.empty() and self._bounces < READ_DEPTH:
                self._bounces += 1
                self._maps.append(mmap.mmap(-1, BLOCK + 2 * _ALIGN))
                return self._maps[-1]
        return self._bounce.get()

    def _pread_view(self, view: memoryview, pos: int, want: Optional[int] = None) -> int:
        """Reads into ``view`` from byte ``pos`` until ``want`` bytes (default:
        all of it) or the file's end; an I/O error names the file and the
        offset (a failing disk is told apart from a corrupt checkpoint)."""
        got, want = 0, len(view) if want is None else want
        try:
            while got < want:
                k = os.preadv(self._fd, [view[got:]], pos + got)
                if k == 0:
                    break
                got += k
        except OSError as exc:
            raise read_error(self.path, exc, pos + got) from None
        return got

    def close(self) -> None:
        _release(self)


def _set_direct(fd: int) -> bool:
    """Turns O_DIRECT on for ``fd`` where the filesystem allows; whether it is on."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    if flags & os.O_DIRECT:
        return True
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    except OSError:
        return False
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


class PendingRead:
    """A read started by :meth:`DirectReader.submit`: :meth:`result` waits
    for all of its pieces and gives the bytes read from the start
    (short at the first short piece; raises a piece's OSError)."""

    def __init__(self, pieces: list, n: int):
        self._pieces, self.nbytes = pieces, n

    def result(self) -> int:
        got, err = self.nbytes, None
        for a, k, f in self._pieces:  # every piece waited for: none still writes the memory after
            try:
                g = f.result()
            except OSError as e:
                err = err or e
                continue
            if g < k:
                got = min(got, a + g)
        if err is not None:
            raise err
        return got


def _release(io) -> None:
    """A DirectStream's or DirectReader's teardown: its read or write thread
    joined, its fd closed, its staging mappings unmapped (idempotent)."""
    if io._fd < 0:
        return
    try:
        io._pool.shutdown(wait=True)
    finally:
        os.close(io._fd)
        io._fd = -1
        io._bufs = []
        _close_maps(io._maps)
