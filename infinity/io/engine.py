"""ctypes binding of the native I/O engine (``native/include/infinity_io.h``).

:class:`NativeEngine` moves bytes between registered files and host memory;
it knows nothing of keys or extents (that is :class:`~infinity.io.SwapStore`'s
policy). The pure-Python :class:`~infinity.io.fallback.PythonEngine` has the
same methods and the same error behaviour.

ctypes releases the GIL during every foreign call, so :meth:`NativeEngine.wait`
blocks only the calling thread.
"""

from __future__ import annotations

import array
import ctypes
import errno as _errno
import threading
from typing import Optional

from ..system import native
from .errors import ChecksumError, SwapIOError, parse_fault_spec

__all__ = ["NativeEngine", "native_available", "crc32c", "crc_count", "chunk_count", "key_sums", "READ", "WRITE", "ALIGN"]

READ, WRITE = 0, 1
ALIGN = 4096
BACKENDS = {"auto": 0, "io_uring": 1, "threads": 2}
_BACKEND_NAMES = {1: "io_uring", 2: "threads"}
E_CHECKSUM, E_UNKNOWN, E_EOF, E_TIMEOUT = -10001, -10002, -10003, -10004

_bind_lock = threading.Lock()
_bound: Optional[ctypes.CDLL] = None
_bind_error: Optional[str] = None


def _lib() -> ctypes.CDLL:
    """The native library with the I/O symbols bound; raises NativeUnavailable
    (with the reason) if the library is absent or predates the I/O engine."""
    global _bound, _bind_error
    if _bound is not None:
        return _bound
    with _bind_lock:
        if _bound is not None:
            return _bound
        if _bind_error is not None:
            raise native.NativeUnavailable(_bind_error)
        lib = native.lib()
        c = ctypes
        try:
            lib.inf_io_engine_create.restype = c.c_int32
            lib.inf_io_engine_create.argtypes = [c.c_int32, c.c_int32, c.c_int64, c.POINTER(c.c_void_p)]
            lib.inf_io_engine_destroy.restype = None
            lib.inf_io_engine_destroy.argtypes = [c.c_void_p]
            lib.inf_io_engine_backend.restype = c.c_int32
            lib.inf_io_engine_backend.argtypes = [c.c_void_p]
            lib.inf_io_register.restype = c.c_int32
            lib.inf_io_register.argtypes = [c.c_void_p, c.c_int32, c.c_char_p]
            lib.inf_io_unregister.restype = c.c_int32
            lib.inf_io_unregister.argtypes = [c.c_void_p, c.c_int32]
            lib.inf_io_submit.restype = c.c_int32
            lib.inf_io_submit.argtypes = [c.c_void_p, c.c_int32, c.c_int32, c.c_int64, c.c_void_p, c.c_int64,
                                          c.c_void_p, c.c_int64, c.c_void_p, c.c_int32, c.POINTER(c.c_int64)]
            lib.inf_io_wait.restype = c.c_int32
            lib.inf_io_wait.argtypes = [c.c_void_p, c.c_int64, c.c_int64, c.c_char_p, c.c_int64]
            lib.inf_io_done.restype = c.c_int32
            lib.inf_io_done.argtypes = [c.c_void_p, c.c_int64]
            lib.inf_io_set_fault.restype = c.c_int32
            lib.inf_io_set_fault.argtypes = [c.c_void_p, c.c_int32, c.c_int64, c.c_int32]
            lib.inf_io_stage_block.restype = c.c_int64
            lib.inf_io_stage_block.argtypes = [c.c_int32, c.c_int64]
            lib.inf_io_crc_count.restype = c.c_int64
            lib.inf_io_crc_count.argtypes = [c.c_int64, c.c_int64]
            lib.inf_crc32c.restype = c.c_uint32
            lib.inf_crc32c.argtypes = [c.c_uint32, c.c_void_p, c.c_int64]
            lib.inf_crc32c_hw.restype = c.c_int32
            lib.inf_crc32c_hw.argtypes = []
            lib.inf_crc32c_force_sw.restype = None
            lib.inf_crc32c_force_sw.argtypes = [c.c_int32]
        except AttributeError as exc:  # a library built before the I/O engine existed
            _bind_error = f"native library lacks the I/O engine ({exc}); rebuild with `pip install .`"
            raise native.NativeUnavailable(_bind_error) from None
        _bound = lib
        return lib


def native_available() -> bool:
    """True when the native I/O engine can be used (library built, not disabled)."""
    try:
        _lib()
        return True
    except native.NativeUnavailable:
        return False


def crc32c(data_ptr: int, nbytes: int, crc: int = 0) -> int:
    """CRC32C of ``nbytes`` bytes at address ``data_ptr`` (continuing ``crc``)."""
    return int(_lib().inf_crc32c(crc, data_ptr, nbytes))


CHUNK_MAX = 256 << 10  # bytes: the largest checksum chunk (kStageBlock in native/src/io_request.h)


def chunk_bytes(block_size: int) -> int:
    """Bytes per checksum chunk of an engine with this block size: the largest
    power of two dividing both it and 256 KiB (``chunk_bytes_for`` in
    native/src/io_request.h), so a chunk never straddles a block. Part of the
    store's format (every engine must agree), hence a constant here, checked
    against the native rule by the tests."""
    c = CHUNK_MAX
    while block_size % c:
        c //= 2
    return c


def chunk_count(nbytes: int, chunk: int) -> int:
    """Checksum chunks of ``nbytes`` bytes in chunks of ``chunk`` bytes: one per
    ``chunk`` bytes of the 4 KiB-aligned body, plus one for an unaligned tail."""
    if nbytes <= 0:
        return 0
    aligned = nbytes // ALIGN * ALIGN
    return -(-aligned // chunk) + (1 if nbytes > aligned else 0)


def crc_count(nbytes: int, block_size: int) -> int:
    """Checksum chunks of a request of ``nbytes`` bytes on an engine with this
    block size (chunks of ``chunk_bytes(block_size)``)."""
    return chunk_count(nbytes, chunk_bytes(block_size))


def key_sums(data_ptr: int, nbytes: int, chunk: int) -> array.array:
    """CRC32C sums of ``nbytes`` bytes at ``data_ptr`` by the store's chunk
    rule: one per ``chunk`` bytes from byte 0, cut at the 4 KiB floor of the
    size, plus one for an unaligned tail (:func:`chunk_count` entries). For
    producers that have no fused kernel (the AdamW step takes its own)."""
    aligned = nbytes // ALIGN * ALIGN
    out = array.array("I", (crc32c(data_ptr + o, min(o + chunk, aligned) - o) for o in range(0, aligned, chunk)))
    if nbytes > aligned:
        out.append(crc32c(data_ptr + aligned, nbytes - aligned))
    return out


def raise_for(code: int, msg: str, context: str = "") -> None:
    """Turn an engine return code and message into the matching exception."""
    prefix = f"{context}: " if context else ""
    if code == E_CHECKSUM:
        raise ChecksumError(_errno.EIO, prefix + msg)
    if code == E_EOF:
        raise SwapIOError(_errno.EIO, prefix + msg)
    if code == E_UNKNOWN:
        raise SwapIOError(_errno.EBADF, prefix + (msg or "unknown engine, file or ticket"))
    err = -code
    raise SwapIOError(err, prefix + (msg or f"I/O failed: {_errno.errorcode.get(err, err)}"))


_local = threading.local()


def _message_buffer():
    """This thread's buffer for the engine's error text: one per thread, not
    one per wait (each new ctypes buffer type is garbage for the cycle collector)."""
    buf = getattr(_local, "msg", None)
    if buf is None:
        buf = _local.msg = native.carray(ctypes.c_char, 1024)()
    return buf


class NativeEngine:
    """The native engine: ``queue_depth`` blocks of ``block_size`` bytes in flight.

    Args:
        backend: "auto" (io_uring when the kernel allows it, else threads),
            "io_uring" (raise if unavailable) or "threads".
        queue_depth: blocks in flight over all requests (also the number of
            threads of the thread backend), 1..1024.
        block_size: bytes per block, a multiple of 4096.
    """

    checksum_name = "crc32c"

    def __init__(self, backend: str = "auto", queue_depth: int = 8, block_size: int = 8 << 20):
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: choose one of {sorted(BACKENDS)}")
        lib = _lib()
        self._lib = lib
        handle = ctypes.c_void_p()
        rc = lib.inf_io_engine_create(BACKENDS[backend], queue_depth, block_size, ctypes.byref(handle))
        if rc != 0:
            raise SwapIOError(-rc, f"cannot start the native I/O engine (backend={backend}, queue_depth="
                                   f"{queue_depth}, block_size={block_size} bytes): "
                                   f"{_errno.errorcode.get(-rc, rc)}")
        self._h = handle
        self.queue_depth = queue_depth
        self.block_size = block_size
        self.backend = _BACKEND_NAMES[lib.inf_io_engine_backend(handle)]
        fault = parse_fault_spec()
        if fault:
            self.set_fault(*fault)

    def register(self, fd: int, path: str) -> int:
        """Register an open fd (caller keeps ownership); returns the file id."""
        rc = self._lib.inf_io_register(self._h, fd, str(path).encode())
        if rc < 0:
            raise_for(rc, f"cannot register '{path}'")
        return rc

    def unregister(self, file_id: int) -> None:
        self._lib.inf_io_unregister(self._h, file_id)

    def stage_block(self, op: int) -> int:
        """Bytes per block (and per bounce slot) of a staged request of ``op``."""
        return int(self._lib.inf_io_stage_block(op, self.block_size))

    def submit(self, op: int, file_id: int, offset: int, buf_ptr: int, nbytes: int,
               bounce_ptr: int = 0, bounce_bytes: int = 0, crcs=None, crcs_in: bool = False) -> int:
        """Start one request; returns its ticket. See infinity_io.h for the
        meaning of direct and bounce mode and of the ``crcs`` array (a ctypes
        ``c_uint32`` array of :func:`crc_count` entries, or None). With
        ``crcs_in`` the array is input: a read checks the data against it, a
        write takes it as the data's sums (computed by the producer)."""
        ticket = ctypes.c_int64()
        rc = self._lib.inf_io_submit(self._h, op, file_id, offset, buf_ptr, nbytes, bounce_ptr or None,
                                     bounce_bytes, crcs, 1 if crcs_in else 0, ctypes.byref(ticket))
        if rc != 0:
            raise_for(rc, f"cannot submit {'write' if op == WRITE else 'read'} of {nbytes} bytes at offset "
                          f"{offset} (buffer 0x{buf_ptr:x}, bounce 0x{bounce_ptr or 0:x})")
        return ticket.value

    def wait(self, ticket: int, timeout: Optional[float] = None) -> bool:
        """Wait for a ticket (``timeout`` in seconds, None = forever).

        Returns True when done, False on timeout; raises the request's error
        (:class:`SwapIOError` / :class:`ChecksumError`) once done.
        """
        msg = _message_buffer()
        ms = -1 if timeout is None else max(0, int(timeout * 1000))
        rc = self._lib.inf_io_wait(self._h, ticket, ms, msg, len(msg))
        if rc == E_TIMEOUT:
            return False
        if rc != 0:
            raise_for(rc, msg.value.decode(errors="replace"))
        return True

    def done(self, ticket: int) -> bool:
        return self._lib.inf_io_done(self._h, ticket) != 0

    def set_fault(self, op: int, nth: int, err: int) -> None:
        """Test hook: the ``nth`` block of ``op`` (0 read, 1 write, -1 any)
        fails with errno ``err`` (0: a short transfer, then retried)."""
        self._lib.inf_io_set_fault(self._h, op, nth, err)

    def checksum(self, ptr: int, nbytes: int) -> int:
        return int(self._lib.inf_crc32c(0, ptr, nbytes))

    def close(self) -> None:
        """Wait for every request and stop the engine's threads."""
        if self._h:
            self._lib.inf_io_engine_destroy(self._h)
            self._h = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
