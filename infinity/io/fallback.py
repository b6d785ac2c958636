"""Pure-Python I/O engine: the same contract as the native engine, on a thread pool.

Serves when the native library is not built (or ``backend="python"``). Each
block runs ``os.preadv``/``os.pwrite`` on a worker thread (both release the
GIL), with the same block split, bounce staging, short-transfer retry, per-
block error checks, checksum chunks and error messages as
``native/src/io_*.cpp``. Checksums are CRC32C when the native library is
loadable, else zlib's CRC-32; the store records which (``checksum_name``).
"""

from __future__ import annotations

import ctypes
import errno as _errno
import os
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Optional

from .engine import ALIGN, E_CHECKSUM, E_EOF, READ, WRITE, chunk_bytes, native_available, raise_for
from .errors import parse_fault_spec

__all__ = ["PythonEngine"]

def _view(ptr: int, nbytes: int) -> memoryview:
    return memoryview((ctypes.c_char * nbytes).from_address(ptr)).cast("B")

class _Request:
    def __init__(self, op, path, fd, offset, buf_ptr, nbytes, bounce_ptr, bounce_bytes, crcs, crcs_in, block):
        self.op, self.path, self.fd, self.offset = op, path, fd, offset
        self.buf, self.nbytes = buf_ptr, nbytes
        self.padded = -(-nbytes // ALIGN) * ALIGN
        self.aligned = nbytes // ALIGN * ALIGN
        self.crcs = crcs
        self.verify = crcs_in and crcs is not None and op == READ
        # A write's sums came from the producer: nothing to compute.
        self.given = crcs_in and crcs is not None and op == WRITE
        self.nblocks = -(-self.padded // block)
        self.bounce = bounce_ptr
        self.slot_bytes = min(block, max(self.padded, ALIGN))
        self.slots: List[int] = []
        if bounce_ptr:
            n = max(1, min(bounce_bytes // self.slot_bytes, self.nblocks))
            self.slots = list(range(n - 1, -1, -1))
        self.slot_cv = threading.Condition()
        self.remaining = self.nblocks
        self.err = 0
        self.msg = ""
        self.done = threading.Event()
        if self.nblocks == 0:
            self.done.set()

class PythonEngine:
    """Thread-pool engine with the methods of :class:`~infinity.io.engine.NativeEngine`.

    Args:
        queue_depth: worker threads, i.e. blocks in flight.
        block_size: bytes per block, a multiple of 4096.
    """

    backend = "python"

    def __init__(self, queue_depth: int = 8, block_size: int = 8 << 20):
        if queue_depth < 1 or block_size < ALIGN or block_size % ALIGN:
            raise ValueError(f"queue_depth={queue_depth} must be >= 1 and block_size={block_size} a "
                             f"positive multiple of {ALIGN} bytes")
        self.queue_depth = queue_depth
        self.block_size = block_size
        self._pool = ThreadPoolExecutor(max_workers=queue_depth, thread_name_prefix="infinity-io")
        self._files: Dict[int, tuple] = {}
        self._tickets: Dict[int, _Request] = {}
        self._lock = threading.Lock()
        self._next_file = 0
        self._next_ticket = 1
        self._fault = None  # [op, nth, err, count]
        if native_available():
            from .engine import crc32c
            self._crc = lambda ptr, n: crc32c(ptr, n)
            self.checksum_name = "crc32c"
        else:
            self._crc = lambda ptr, n: zlib.crc32(_view(ptr, n)) if n else 0
            self.checksum_name = "crc32"
        fault = parse_fault_spec()
        if fault:
            self.set_fault(*fault)

    # -- same interface as NativeEngine ---------------------------------------

    def register(self, fd: int, path: str) -> int:
        with self._lock:
            fid = self._next_file
            self._next_file += 1
            self._files[fid] = (fd, str(path))
        return fid

    def unregister(self, file_id: int) -> None:
        with self._lock:
            self._files.pop(file_id, None)

    def set_fault(self, op: int, nth: int, err: int) -> None:
        with self._lock:
            self._fault = [op, nth, err, 0] if nth > 0 else None

    def checksum(self, ptr: int, nbytes: int) -> int:
        return self._crc(ptr, nbytes)

    def stage_block(self, op: int) -> int:
        """Bytes per block (and per bounce slot) of a staged request: whole blocks here."""
        return self.block_size

    def submit(self, op: int, file_id: int, offset: int, buf_ptr: int, nbytes: int,
               bounce_ptr: int = 0, bounce_bytes: int = 0, crcs=None, crcs_in: bool = False) -> int:
        """As :meth:`NativeEngine.submit <infinity.io.engine.NativeEngine.submit>`."""
        if op not in (READ, WRITE) or nbytes < 0 or offset < 0 or offset % ALIGN:
            raise_for(-_errno.EINVAL, f"bad request: op={op} offset={offset} nbytes={nbytes}")
        if bounce_ptr and bounce_ptr % ALIGN:
            raise_for(-_errno.EINVAL, f"bounce buffer 0x{bounce_ptr:x} is not {ALIGN}-byte aligned")
        if not bounce_ptr and nbytes and buf_ptr % ALIGN:
            raise_for(-_errno.EINVAL, f"direct-mode buffer 0x{buf_ptr:x} is not {ALIGN}-byte aligned")
        with self._lock:
            if file_id not in self._files:
                raise_for(-_errno.EBADF, f"unknown file id {file_id}")
            fd, path = self._files[file_id]
            r = _Request(op, path, fd, offset, buf_ptr, nbytes, bounce_ptr, bounce_bytes, crcs, crcs_in,
                         self.block_size)
            ticket = self._next_ticket
            self._next_ticket += 1
            self._tickets[ticket] = r
            faults = []
            for i in range(r.nblocks):
                f = self._fault
                fault = None
                if f and (f[0] < 0 or f[0] == op):
                    f[3] += 1
                    if f[3] == f[1]:
                        fault = f[2]
                        self._fault = None
                faults.append(fault)
        for i in range(r.nblocks):
            self._pool.submit(self._run_block, r, i, faults[i])
        return ticket

    def wait(self, ticket: int, timeout: Optional[float] = None) -> bool:
        with self._lock:
            r = self._tickets.get(ticket)
        if r is None:
            raise_for(-_errno.EBADF, f"unknown ticket {ticket}")
        if not r.done.wait(timeout):
            return False
        with self._lock:
            self._tickets.pop(ticket, None)
        if r.err:
            raise_for(r.err, r.msg)
        return True

    def done(self, ticket: int) -> bool:
        with self._lock:
            r = self._tickets.get(ticket)
        return r is None or r.done.is_set()

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # -- one block ---------------------------------------------------------------

    def _fmt(self, r: _Request, rel: int, length: int, done: int, err: int, what: Optional[str] = None) -> str:
        op = "write" if r.op == WRITE else "read"
        head = f"{op} of {length} bytes at offset {r.offset + rel} of '{r.path}'"
        tail = f"(request: offset {r.offset}, {r.nbytes} bytes)"
        if what:
            return f"{head} {what} {tail}"
        return f"{head} failed after {done} bytes: {os.strerror(err)} (errno {err}) {tail}"

    def _run_block(self, r: _Request, i: int, fault) -> None:
        rel = i * self.block_size
        length = min(self.block_size, r.padded - rel)
        slot = -1
        err, msg = 0, ""
        try:
            if r.err:
                return  # an earlier block failed: the request is cancelled
            if r.bounce:
                with r.slot_cv:
                    r.slot_cv.wait_for(lambda: r.slots)
                    slot = r.slots.pop()
                mem = r.bounce + slot * r.slot_bytes
            else:
                mem = r.buf + rel
            logical = max(0, min(length, r.nbytes - rel))
            if fault:
                err, msg = -fault, self._fmt(r, rel, length, 0, fault) + " [injected fault]"
                return
            if r.op == WRITE and r.bounce:
                ctypes.memmove(mem, r.buf + rel, logical)
                if logical < length:
                    ctypes.memset(mem + logical, 0, length - logical)
            err, msg = self._transfer(r, rel, mem, length, fault is not None and fault == 0)
            if err == 0:
                err, msg = self._post(r, rel, mem, length)
            if err == 0 and r.op == READ and r.bounce:
                ctypes.memmove(r.buf + rel, mem, logical)
        except Exception as exc:  # never leave a waiter hanging
            err, msg = -_errno.EIO, f"{self._fmt(r, rel, length, 0, _errno.EIO)}: {exc!r}"
        finally:
            if slot >= 0:
                with r.slot_cv:
                    r.slots.append(slot)
                    r.slot_cv.notify()
            with self._lock:
                if err and not r.err:
                    r.err, r.msg = err, msg
                r.remaining -= 1
                if r.remaining == 0:
                    r.done.set()

    def _transfer(self, r: _Request, rel: int, mem: int, length: int, short: bool):
        done = 0
        while done < length:
            want = length - done
            if short and done == 0 and want >= 2 * ALIGN:
                want = want // 2 // ALIGN * ALIGN
            off = r.offset + rel + done
            try:
                if r.op == READ:
                    k = os.preadv(r.fd, [_view(mem + done, want)], off)
                else:
                    k = os.pwrite(r.fd, _view(mem + done, want), off)
            except InterruptedError:
                continue
            except OSError as exc:
                return -exc.errno, self._fmt(r, rel, length, done, exc.errno)
            if k == 0:
                if r.op == READ:
                    return E_EOF, self._fmt(r, rel, length, done, 0, f"hit end of file after {done} bytes")
                return -_errno.EIO, self._fmt(r, rel, length, done, _errno.EIO, "wrote 0 bytes")
            done += k
        return 0, ""

    def _post(self, r: _Request, rel: int, mem: int, length: int):
        if r.crcs is None or r.given:
            return 0, ""
        cb = chunk_bytes(self.block_size)  # divides the block size: no chunk straddles blocks
        chunks = [(start // cb, start, min(start + cb, rel + length, r.aligned))
                  for start in range(rel, min(rel + length, r.aligned), cb)]
        if r.nbytes > r.aligned and rel <= r.aligned < rel + length:
            chunks.append((-(-r.aligned // cb), r.aligned, r.nbytes))
        for idx, start, end in chunks:
            c = self._crc(mem + (start - rel), end - start)
            if r.verify:
                if c != r.crcs[idx]:
                    return E_CHECKSUM, (f"checksum mismatch in '{r.path}' at offset {r.offset + start} "
                                        f"({end - start} bytes): stored {self.checksum_name} "
                                        f"0x{r.crcs[idx]:08x}, read 0x{c:08x} (request: offset {r.offset}, "
                                        f"{r.nbytes} bytes)")
            else:
                r.crcs[idx] = c
        return 0, ""
