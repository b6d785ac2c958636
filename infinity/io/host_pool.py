"""Page-locked host memory under a hard byte budget.

[Note: one arena, locked once]
The pool maps its whole budget once (page-aligned anonymous memory), locks it
once, and hands out 4 KiB-aligned sub-ranges. Locking per buffer would cost a
syscall (or a CUDA driver call) each time and could fail half-way through a
run; locking up front fails, if it fails, at start-up with one warning. Locked
memory cannot be paged out, so O_DIRECT transfers and CUDA copies from it never
wait on page faults, and the budget is real: nothing beyond it is allocated.

[Note: huge pages for DMA]
The arena is advised MADV_HUGEPAGE. An O_DIRECT transfer of 8 MiB into 4 KiB
pages needs 2048 scatter-gather segments; a virtio disk takes 254 per request,
so the block layer splits it into many small requests. In 2 MiB pages the same
transfer is a handful of segments. Measured here: staged reads of 1 GiB went
from 1.3-2.9 GB/s (depending on where the pages happened to land) to 2.7-3.8.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
import threading
import time
import warnings
from typing import Optional, Sequence

import torch

from .errors import PoolExhausted
from .extent_allocator import ExtentAllocator

__all__ = ["HostPool", "PoolBuffer"]

_warned: set = set()
_warn_lock = threading.Lock()


def _warn_once(key: str, text: str) -> None:
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(text, RuntimeWarning, stacklevel=4)


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    for name in ("mlock", "munlock"):
        fn = getattr(libc, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _fmt_limit(v: int) -> str:
    return "unlimited" if v == resource.RLIM_INFINITY else f"{v} bytes"


class PoolBuffer:
    """A 4 KiB-aligned range of a :class:`HostPool`.

    ``nbytes`` is the size asked for; ``capacity`` is that size rounded up to
    4 KiB (what O_DIRECT may touch). Release it with :meth:`release` or a
    ``with`` block; the memory is reused afterwards, so views must not outlive it.
    """

    __slots__ = ("pool", "offset", "nbytes", "capacity", "ptr", "tensor", "_released")

    def __init__(self, pool: "HostPool", offset: int, nbytes: int, capacity: int):
        self.pool = pool
        self.offset = offset
        self.nbytes = nbytes
        self.capacity = capacity
        self.ptr = pool.base_ptr + offset
        self.tensor = pool._arena[offset:offset + nbytes]  # uint8 view, shares the pool's memory
        self._released = False

    def view(self, dtype: torch.dtype, shape: Optional[Sequence[int]] = None) -> torch.Tensor:
        """The buffer as a contiguous tensor of ``dtype`` (and ``shape``, default 1-D).

        ``nbytes`` must be a multiple of the dtype's size.
        """
        t = self.tensor.view(dtype)
        return t if shape is None else t.view(*shape)

    def release(self) -> None:
        """Return the range to the pool (idempotent)."""
        if not self._released:
            self._released = True
            self.tensor = None
            self.pool._release(self.offset)

    def __enter__(self) -> "PoolBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"PoolBuffer(nbytes={self.nbytes}, capacity={self.capacity}, ptr=0x{self.ptr:x})"


class HostPool:
    """Aligned, reusable host buffers under a hard budget of ``capacity_bytes``.

    Args:
        capacity_bytes: the budget in bytes, rounded up to 4 KiB. All of it is
            mapped (and locked) at construction; nothing beyond it is ever allocated.
        pin: how to page-lock: ``"auto"`` (CUDA pinned memory via
            ``cudaHostRegister`` when CUDA is available, else ``mlock``),
            ``"cuda"``, ``"mlock"`` or ``"none"``. When locking is refused (the
            memlock limit, ``ulimit -l``, or the OS), the pool keeps plain
            page-aligned memory and warns once, saying why; see :attr:`pinned`
            and :attr:`pin_reason`.
        prefault: touch every page at construction (zero fill) when the memory
            is not locked, so the first transfers do not pay page faults.

    Attributes:
        pinned: True when the arena is page-locked.
        pin_method: ``"cuda"``, ``"mlock"`` or ``"none"``.
        pin_reason: why the arena is not locked ("" when it is).
    """

    ALIGN = 4096

    def __init__(self, capacity_bytes: int, *, pin: str = "auto", prefault: bool = True):
        if capacity_bytes <= 0:
            raise ValueError(f"HostPool capacity_bytes={capacity_bytes} must be > 0")
        if pin not in ("auto", "cuda", "mlock", "none"):
            raise ValueError(f"HostPool pin={pin!r}: choose 'auto', 'cuda', 'mlock' or 'none'")
        cap = -(-capacity_bytes // self.ALIGN) * self.ALIGN
        self.capacity_bytes = cap
        self._mm = mmap.mmap(-1, cap, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.huge_pages = self._advise_huge()
        self._arena = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.base_ptr = self._arena.data_ptr()
        self._alloc = ExtentAllocator(cap, self.ALIGN)
        self._cv = threading.Condition()
        self.peak_bytes = 0
        self.pinned = False
        self.pin_method = "none"
        self.pin_reason = ""
        self._lock_memory(pin)
        if not self.pinned and prefault:
            self._arena.zero_()

    def _advise_huge(self) -> bool:
        # See [Note: huge pages for DMA]: fewer, larger segments per request.
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is None or self.capacity_bytes < (2 << 20):
            return False
        try:
            self._mm.madvise(advice)
            return True
        except OSError:
            return False

    # -- locking -------------------------------------------------------------------

    def _lock_memory(self, pin: str) -> None:
        if pin == "none":
            self.pin_reason = "pin='none' was asked for"
            return
        use_cuda = pin == "cuda" or (pin == "auto" and torch.cuda.is_available())
        if use_cuda:
            reason = self._cuda_register()
            if not reason:
                self.pinned, self.pin_method = True, "cuda"
                return
        else:
            reason = self._mlock()
            if not reason:
                self.pinned, self.pin_method = True, "mlock"
                return
        self.pin_reason = reason
        _warn_once(reason.split(":")[0], f"infinity.io.HostPool: host memory is NOT page-locked: {reason}. "
                   "Using plain page-aligned memory; transfers still work, but may be slower and the "
                   "OS may page the pool out.")

    def _cuda_register(self) -> str:
        try:
            cudart = torch.cuda.cudart()
            res = cudart.cudaHostRegister(self.base_ptr, self.capacity_bytes, 0)
        except Exception as exc:  # no CUDA runtime, torch built without CUDA, ...
            return f"cudaHostRegister of {self.capacity_bytes} bytes failed: {exc!r}"
        code = int(getattr(res, "value", res))
        if code != 0:
            return f"cudaHostRegister of {self.capacity_bytes} bytes failed: CUDA error {code} ({res})"
        return ""

    def _mlock(self) -> str:
        libc = _libc()
        if libc.mlock(self.base_ptr, self.capacity_bytes) == 0:
            return ""
        err = ctypes.get_errno()
        soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        return (f"mlock of {self.capacity_bytes} bytes failed: {os.strerror(err)} (errno {err}); the "
                f"memlock limit (ulimit -l) is {_fmt_limit(soft)}. Raise it (ulimit -l unlimited, or "
                "'memlock' in /etc/security/limits.conf, or LimitMEMLOCK= for a systemd service) or grant "
                "CAP_IPC_LOCK")

    # -- buffers ---------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        """Bytes handed out now (rounded to 4 KiB per buffer)."""
        return self._alloc.used_bytes

    @property
    def free_bytes(self) -> int:
        return self._alloc.free_bytes

    def acquire(self, nbytes: int, *, block: bool = True, timeout: Optional[float] = None,
                high: bool = False) -> PoolBuffer:
        """A buffer of ``nbytes`` bytes, 4 KiB-aligned, capacity rounded up to 4 KiB.

        When the budget has no free range that fits: waits for releases if
        ``block`` (at most ``timeout`` seconds, None = forever), else raises
        :class:`PoolExhausted` at once. A request larger than the whole budget
        always raises. ``high`` places the buffer at the top of the arena (see
        :meth:`ExtentAllocator.alloc_high`).
        """
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes} must be >= 0")
        need = self._alloc.round(nbytes)
        if need > self.capacity_bytes:
            raise PoolExhausted(f"HostPool: {nbytes} bytes asked for, more than the whole budget of "
                                f"{self.capacity_bytes} bytes")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                if self._mm is None:
                    raise RuntimeError("HostPool is closed")
                off = self._alloc.alloc_high(nbytes) if high else self._alloc.alloc(nbytes)
                if off is not None:
                    self.peak_bytes = max(self.peak_bytes, self._alloc.used_bytes)
                    return PoolBuffer(self, off, nbytes, need)
                remaining = None if deadline is None else deadline - time.monotonic()
                if not block or (remaining is not None and remaining <= 0):
                    raise PoolExhausted(
                        f"HostPool: {nbytes} bytes asked for; {self._alloc.free_bytes} of "
                        f"{self.capacity_bytes} bytes free, largest free range "
                        f"{self._alloc.largest_free()} bytes" + ("" if not block else f" after {timeout} s"))
                self._cv.wait(remaining)

    def _release(self, offset: int) -> None:
        with self._cv:
            self._alloc.free(offset)
            self._cv.notify_all()

    def owns(self, ptr: int, nbytes: int = 1) -> bool:
        """True when ``[ptr, ptr + nbytes)`` lies inside this pool's memory."""
        return self.base_ptr <= ptr and ptr + nbytes <= self.base_ptr + self.capacity_bytes

    def close(self) -> None:
        """Unlock and unmap the arena. Buffers and views must no longer be used."""
        if self._mm is None:
            return
        if self.pinned:
            try:
                if self.pin_method == "cuda":
                    torch.cuda.cudart().cudaHostUnregister(self.base_ptr)
                else:
                    _libc().munlock(self.base_ptr, self.capacity_bytes)
            except Exception:
                pass
            self.pinned = False
        mm, self._mm = self._mm, None
        self._arena = None
        try:
            mm.close()
        except BufferError:
            pass  # views still alive elsewhere: the mapping goes when they do

    def __enter__(self) -> "HostPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"HostPool(capacity_bytes={self.capacity_bytes}, used_bytes={self.used_bytes}, "
                f"pin_method={self.pin_method!r})")
