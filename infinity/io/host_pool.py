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

[Note: releasing the pool]
Locked memory must be unlocked before it is unmapped: unmapping memory that is
still registered with CUDA leaks the pinned pages in the driver, and a later
pool mapped at the same address then fails to register
(cudaErrorHostMemoryAlreadyRegistered) and runs unpinned. A
``weakref.finalize`` owns the release (unregister or munlock, then unmap) and
runs it once: at :meth:`HostPool.close`, at garbage collection or at
interpreter exit, whichever comes first. It holds the mapping (``_Mapping``),
never the pool, so the pool can still be collected. A tensor that still
views the pool keeps it mapped, unlocked, until the tensor goes (the arena is
made through a memoryview, whose buffer export makes ``mmap.close`` refuse):
unmapping under a live view would turn its next use into a segfault.
Unlocking while a copy still reads or writes the memory is the caller's
error: the engine waits for the mover's streams before it closes the host
tier. The release runs only in
the process that created the pool; see [Note: the pool is not inherited by fork].

[Note: the pool is not inherited by fork]
DataLoader workers fork the training process. Since Linux 5.9, anonymous pages
pinned for DMA are copied into the child at fork, so every worker would copy
the whole pool (under the older FOLL_GET pinning the parent instead lost the
pages the GPU writes to). The arena is advised MADV_DONTFORK before it is
locked: a child does not get the range at all, and touching it there faults.
In a child the finalizer therefore neither unlocks (locks are not inherited)
nor unmaps (the child may have mapped something else at that address since);
it keeps the mmap object alive so its own deallocation does not unmap either.

[Note: a failed registration leaves the CUDA error set]
cudaHostRegister sets the CUDA runtime's per-thread last error when it fails,
and torch's binding (``torch.cuda.cudart().cudaHostRegister``) returns the
code without clearing it. The next ``C10_CUDA_KERNEL_LAUNCH_CHECK`` on that
thread would then raise it as if some kernel had failed. torch 2.13 binds no
``cudaGetLastError``, so after a failure the pool calls it through ctypes, on
the libcudart this process already loaded (found in /proc/self/maps, opened
with RTLD_NOLOAD: a second copy of the runtime would clear its own error, not
torch's), on the thread that made the failed call.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
import threading
import time
import warnings
import weakref
from typing import Callable, Optional, Sequence, Union

import torch

from .errors import PoolExhausted
from .extent_allocator import ExtentAllocator

__all__ = ["HostPool", "PoolBuffer"]

_warned: set = set()
_warn_lock = threading.Lock()


def warn_once(key: str, text: str) -> None:
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


def _loaded_library(prefix: str) -> Optional[str]:
    """Path of a shared library already mapped into this process whose file
    name starts with ``prefix`` (e.g. ``"libcudart.so"``), or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and os.path.basename(parts[5].strip()).startswith(prefix):
                    return parts[5].strip()
    except OSError:
        pass
    return None


def _runtime_function(prefix: str, name: str) -> Optional[Callable[[], int]]:
    """``name`` (no arguments, returns int) from the already loaded library
    ``prefix``; None when no such library is loaded or it lacks the symbol.
    RTLD_NOLOAD: never loads a second copy."""
    path = _loaded_library(prefix)
    if path is None:
        return None
    try:
        fn = getattr(ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_NOLOAD), name)
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = ctypes.c_int, []
    return fn


_last_error_fn: Optional[Callable[[], int]] = None


def _cuda_clear_last_error() -> Optional[int]:
    """Clears the CUDA runtime's last error on the calling thread; returns the
    code it held, or None when no loaded runtime was found. See [Note: a failed
    registration leaves the CUDA error set]."""
    global _last_error_fn
    if _last_error_fn is None:  # found once; not cached while absent (the runtime may load later)
        lib, sym = ("libamdhip64.so", "hipGetLastError") if torch.version.hip else ("libcudart.so", "cudaGetLastError")
        _last_error_fn = _runtime_function(lib, sym)
    return None if _last_error_fn is None else int(_last_error_fn())


def _cuda_device(index: int):
    """Context in which CUDA runtime calls use device ``index``'s context (tests replace it)."""
    return torch.cuda.device(index)


def _code(res) -> int:
    """A cudaError_t from torch's binding (a pybind enum) as an int."""
    return int(getattr(res, "value", res))


def _error_name(cudart, code: int) -> str:
    try:
        return str(cudart.cudaGetErrorString(cudart.cudaError(code)))
    except Exception:  # noqa: BLE001 - only for the message
        return "unknown error"


def _as_cuda_device(device) -> torch.device:
    """``device`` (None, an index, "cuda:N" or a torch.device) as a CUDA torch.device; None: the current one."""
    if device is None:
        return torch.device("cuda")
    d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"HostPool device={device!r}: give a CUDA device (or its index), or None")
    return d


def _cuda_unregister(ptr: int, device: int) -> int:
    """cudaHostUnregister under ``device``'s context; the CUDA error code (0: done)."""
    with _cuda_device(device):
        code = _code(torch.cuda.cudart().cudaHostUnregister(ptr))
        if code != 0:
            _cuda_clear_last_error()  # See [Note: a failed registration leaves the CUDA error set]
    return code


_forked_away: list = []  # mmap objects of pools a forked child inherited; kept, never unmapped there


class _Mapping:
    """The pool's memory and how it is locked: what the finalizer releases.
    Holds no reference to the pool. See [Note: releasing the pool]."""

    __slots__ = ("mm", "arena", "ptr", "nbytes", "locked", "device", "pid")

    def __init__(self, mm: mmap.mmap, nbytes: int):
        self.mm = mm
        self.arena: Optional[torch.Tensor] = None
        self.ptr = 0
        self.nbytes = nbytes
        self.locked = "none"  # "cuda" or "mlock" while locked
        self.device = -1      # the CUDA device whose context registered it
        self.pid = os.getpid()

    def unlock(self) -> None:
        locked, self.locked = self.locked, "none"
        try:
            if locked == "cuda":
                _cuda_unregister(self.ptr, self.device)
            elif locked == "mlock":
                _libc().munlock(self.ptr, self.nbytes)
        except Exception:  # noqa: BLE001 - at exit the runtime may be gone; unmapping still frees the pages
            pass

    def release(self) -> None:
        """Unlock, then unmap (in the creating process only)."""
        mm, self.mm, self.arena = self.mm, None, None
        if os.getpid() != self.pid:  # See [Note: the pool is not inherited by fork]
            _forked_away.append(mm)
            return
        self.unlock()
        try:
            mm.close()
        except BufferError:
            pass  # views still alive: the memoryview unmaps when the last goes (already unlocked)


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
        device: the CUDA device (or its index) whose context registers the
            memory; default the current device. Registering under the wrong
            device would create a context (about 500 MB) on it.

    Attributes:
        pinned: True when the arena is page-locked.
        pin_method: ``"cuda"``, ``"mlock"`` or ``"none"``.
        pin_reason: why the arena is not locked ("" when it is).
        fork_excluded: True when forked children do not inherit the arena
            (see [Note: the pool is not inherited by fork]).
    """

    ALIGN = 4096

    def __init__(self, capacity_bytes: int, *, pin: str = "auto", prefault: bool = True,
                 device: Union[None, int, str, torch.device] = None):
        if capacity_bytes <= 0:
            raise ValueError(f"HostPool capacity_bytes={capacity_bytes} must be > 0")
        if pin not in ("auto", "cuda", "mlock", "none"):
            raise ValueError(f"HostPool pin={pin!r}: choose 'auto', 'cuda', 'mlock' or 'none'")
        self.device = _as_cuda_device(device)
        cap = -(-capacity_bytes // self.ALIGN) * self.ALIGN
        self.capacity_bytes = cap
        self._map = _Mapping(mmap.mmap(-1, cap, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), cap)
        self._finalize = weakref.finalize(self, self._map.release)  # See [Note: releasing the pool]
        self.fork_excluded = self._advise("MADV_DONTFORK")  # See [Note: the pool is not inherited by fork]
        # See [Note: huge pages for DMA]: fewer, larger segments per request.
        self.huge_pages = cap >= (2 << 20) and self._advise("MADV_HUGEPAGE")
        # Through a memoryview: it holds the mapping's buffer export while any
        # view of the arena lives (torch.frombuffer alone releases it at once).
        self._map.arena = torch.frombuffer(memoryview(self._map.mm), dtype=torch.uint8)
        self._map.ptr = self.base_ptr = self._map.arena.data_ptr()
        self._alloc = ExtentAllocator(cap, self.ALIGN)
        self._cv = threading.Condition()
        self.peak_bytes = 0
        self.pinned = False
        self.pin_method = "none"
        self.pin_reason = ""
        self._lock_memory(pin)
        if not self.pinned and prefault:
            self._map.arena.zero_()

    @property
    def _arena(self) -> torch.Tensor:
        return self._map.arena

    def _advise(self, name: str) -> bool:
        """madvise(``mmap.<name>``) on the whole arena; False where the platform lacks it or refuses."""
        advice = getattr(mmap, name, None)
        if advice is None:
            return False
        try:
            self._map.mm.madvise(advice)
            return True
        except OSError:
            return False

    # -- locking -------------------------------------------------------------------

    def _lock_memory(self, pin: str) -> None:
        if pin == "none":
            self.pin_reason = "pin='none' was asked for"
            return
        use_cuda = pin == "cuda" or (pin == "auto" and torch.cuda.is_available())
        reason = self._cuda_register() if use_cuda else self._mlock()
        if not reason:
            self.pinned, self.pin_method = True, "cuda" if use_cuda else "mlock"
            self._map.locked = self.pin_method
            return
        self.pin_reason = reason
        warn_once(reason.split(":")[0], f"infinity.io.HostPool: host memory is NOT page-locked: {reason}. "
                   "Using plain page-aligned memory; transfers still work, but may be slower and the "
                   "OS may page the pool out.")

    def _cuda_register(self) -> str:
        """Registers the arena with CUDA under :attr:`device`'s context; "" or why it failed."""
        what = f"cudaHostRegister of {self.capacity_bytes} bytes"
        try:
            cudart = torch.cuda.cudart()
            index = torch.cuda.current_device() if self.device.index is None else self.device.index
            with _cuda_device(index):
                code = _code(cudart.cudaHostRegister(self.base_ptr, self.capacity_bytes, 0))
                if code == 0:
                    self._map.device = index
                    return ""
                cleared = _cuda_clear_last_error()  # See [Note: a failed registration leaves the CUDA error set]
        except Exception as exc:  # no CUDA runtime, torch built without CUDA, ...
            return f"{what} failed: {exc!r}"
        why = f"{what} on cuda:{index} failed: CUDA error {code} ({_error_name(cudart, code)})"
        if cleared is None:
            why += ("; the CUDA runtime's last error could not be cleared (no loaded libcudart found), "
                    "so the next kernel launch check on this thread may report it")
        return why

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
                if self.closed:
                    raise RuntimeError(f"HostPool of {self.capacity_bytes} bytes is closed")
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

    def release_free_pages(self) -> int:
        """Gives the pages of every free range back to the OS (madvise
        MADV_DONTNEED: they read as zeros when next touched), so the resident
        set shrinks with what is in use. Not for page-locked pools, whose pages
        stay. Returns the bytes advised (0 where the platform refuses)."""
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if advice is None or self.pinned:
            return 0
        done = 0
        with self._cv:
            if self.closed:
                return 0
            for off, size in self._alloc.free_ranges():
                try:
                    self._map.mm.madvise(advice, off, size)
                    done += size
                except (OSError, ValueError):
                    pass
        return done

    def _release(self, offset: int) -> None:
        with self._cv:
            self._alloc.free(offset)
            self._cv.notify_all()

    def owns(self, ptr: int, nbytes: int = 1) -> bool:
        """True when ``[ptr, ptr + nbytes)`` lies inside this pool's memory."""
        return self.base_ptr <= ptr and ptr + nbytes <= self.base_ptr + self.capacity_bytes

    @property
    def closed(self) -> bool:
        return not self._finalize.alive

    def close(self) -> None:
        """Unlocks, then unmaps the arena (idempotent; see [Note: releasing the
        pool]). Buffers and views must no longer be used, and no copy may still
        read or write them."""
        self._finalize()
        self.pinned = False

    def __enter__(self) -> "HostPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"HostPool(capacity_bytes={self.capacity_bytes}, used_bytes={self.used_bytes}, "
                f"pin_method={self.pin_method!r})")
