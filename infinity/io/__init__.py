"""Asynchronous storage I/O of infinity: the NVMe tier and its host staging.

- :class:`SwapStore`: tensors in swap files over one or more directories,
  striped, checksummed, O_DIRECT; ``write``/``read`` return an :class:`IOHandle`.
- :class:`HostPool`: page-locked, 4 KiB-aligned host buffers under a hard budget.
- Engines that move the bytes: the native one (io_uring or a thread pool,
  ``native/src/io_*.cpp``) and a pure-Python fallback.

See docs/io.md.

Owns: moving bytes between host buffers and files, and the host pool's pages.
May import: system/ (the native library) and config/; the swap store's parts
stay inside io/swap/.
"""

from .errors import (ChecksumError, PoolExhausted, StoreLockedError, SwapFullError, SwapIOError, SwapPathError,
                     SwapPathNotDirectoryError, SwapPathPermissionError, SwapPathReadOnlyError, SwapPathUnsafeError)
from .extent_allocator import ExtentAllocator
from .host_pool import HostPool, PoolBuffer
from .swap.store import IOHandle, SwapStore
from .engine import native_available

__all__ = ["SwapStore", "IOHandle", "HostPool", "PoolBuffer", "ExtentAllocator", "SwapIOError", "ChecksumError",
           "SwapFullError", "StoreLockedError", "PoolExhausted", "SwapPathError", "SwapPathNotDirectoryError",
           "SwapPathReadOnlyError", "SwapPathPermissionError", "SwapPathUnsafeError", "native_available"]
