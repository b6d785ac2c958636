"""Loader and description of infinity's native library.

The library (``libinfinity_native.so``, built from ``native/`` by the package's
own CMake build) is bound with :mod:`ctypes` by raw pointers and lengths. It is
never compiled against PyTorch's headers, so one build serves every torch
version. ctypes releases the GIL for the duration of each foreign call.

Environment variables:

``INFINITY_SIMD``
    Force an ISA variant: ``scalar``, ``avx2``, ``avx512`` or ``neon``. A variant
    the CPU (or this build) lacks raises :class:`ValueError` on first use.
``INFINITY_NUM_THREADS``
    Default thread count of the CPU kernels (default: all CPUs in this
    process's affinity mask).
``INFINITY_NATIVE``
    ``0`` disables the native library; the pure-torch fallback runs instead.
``INFINITY_NATIVE_LIB``
    Path of the library to load instead of the installed one.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import threading
import warnings
from pathlib import Path
from typing import Iterator, Optional

__all__ = ["info", "available", "use_simd", "simd_levels", "default_num_threads", "NativeUnavailable"]

ISA_NAMES = ("scalar", "avx2", "avx512", "neon")
_ISA_INDEX = {n: i for i, n in enumerate(ISA_NAMES)}

DT_NONE, DT_F32, DT_BF16, DT_F16, DT_I8 = 0, 1, 2, 3, 4
QBLOCK = 256  # elements a block of 8-bit moments (INF_QBLOCK in infinity_native.h)

E_INVAL, E_ISA = -1, -2

_LIB_NAME = "libinfinity_native.so"


class NativeUnavailable(RuntimeError):
    """The native library could not be loaded (not built, or disabled)."""


class AdamHParams(ctypes.Structure):
    """Mirror of ``inf_adam_hparams`` in native/include/infinity_native.h."""

    _fields_ = [
        ("lr", ctypes.c_double),
        ("beta1", ctypes.c_double),
        ("beta2", ctypes.c_double),
        ("eps", ctypes.c_double),
        ("weight_decay", ctypes.c_double),
        ("bias_correction1", ctypes.c_double),
        ("bias_correction2", ctypes.c_double),
        ("grad_scale", ctypes.c_double),
        ("adamw_mode", ctypes.c_int32),
        ("num_threads", ctypes.c_int32),
    ]


_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_load_error: Optional[str] = None
_loaded = False
_warned = False
_forced_isa: Optional[str] = None  # set by use_simd()


def _candidates() -> Iterator[Path]:
    env = os.environ.get("INFINITY_NATIVE_LIB")
    if env:
        yield Path(env)
        return
    # The library is installed at the package's root (infinity/), one folder up.
    here = Path(__file__).resolve().parent.parent
    yield here / _LIB_NAME
    # Editable installs put the built library in site-packages/infinity while
    # the Python sources stay in the checkout.
    for entry in sys.path:
        if entry:
            yield Path(entry) / "infinity" / _LIB_NAME


def _bind(lib: ctypes.CDLL) -> None:
    c = ctypes
    lib.inf_isa_compiled.restype = c.c_uint32
    lib.inf_isa_compiled.argtypes = []
    lib.inf_isa_supported.restype = c.c_uint32
    lib.inf_isa_supported.argtypes = []
    lib.inf_isa_best.restype = c.c_int32
    lib.inf_isa_best.argtypes = []
    lib.inf_build_info.restype = c.c_char_p
    lib.inf_build_info.argtypes = []
    lib.inf_default_threads.restype = c.c_int32
    lib.inf_default_threads.argtypes = []
    lib.inf_adam_step.restype = c.c_int32
    lib.inf_adam_step.argtypes = [c.c_int32, c.c_int64, c.c_void_p, c.c_void_p, c.c_int32, c.c_int32,
                                  c.POINTER(AdamHParams)]
    lib.inf_adam_step_sums.restype = c.c_int32
    lib.inf_adam_step_sums.argtypes = [c.c_int32, c.c_int64, c.c_void_p, c.c_void_p, c.c_int32, c.c_int32,
                                       c.POINTER(AdamHParams), c.c_int64, c.c_void_p]
    lib.inf_adam_step_save.restype = c.c_int32
    lib.inf_adam_step_save.argtypes = [c.c_int32, c.c_int64, c.c_void_p, c.c_void_p, c.c_int32, c.c_int32,
                                       c.POINTER(AdamHParams), c.c_void_p]
    lib.inf_probe_step.restype = c.c_int32
    lib.inf_probe_step.argtypes = [c.c_int32, c.c_int64, c.c_void_p, c.c_void_p, c.c_int32, c.c_int32,
                                   c.c_int32]
    lib.inf_adam_step_moments.restype = c.c_int32
    lib.inf_adam_step_moments.argtypes = [c.c_int32, c.c_int64, c.c_void_p, c.c_void_p, c.c_int32, c.c_int32,
                                          c.c_int32, c.POINTER(AdamHParams)]
    lib.inf_adam_step_bf16p.restype = c.c_int32
    lib.inf_adam_step_bf16p.argtypes = [c.c_int32, c.c_int64, c.c_void_p, c.c_void_p, c.c_void_p, c.c_void_p,
                                        c.c_int32, c.c_int32, c.POINTER(AdamHParams), c.c_uint64, c.c_int64]
    lib.inf_sum_squares.restype = c.c_int32
    lib.inf_sum_squares.argtypes = [c.c_int32, c.c_int64, c.c_void_p, c.c_void_p, c.c_int32, c.c_int32,
                                    c.POINTER(c.c_double)]
    lib.inf_probe_step_moments.restype = c.c_int32
    lib.inf_probe_step_moments.argtypes = [c.c_int32, c.c_int64, c.c_void_p, c.c_void_p, c.c_int32, c.c_int32,
                                           c.c_int32, c.c_int32]


def lib() -> ctypes.CDLL:
    """The loaded native library; raises :class:`NativeUnavailable` if absent."""
    global _lib, _load_error, _loaded
    if _loaded:
        if _lib is None:
            raise NativeUnavailable(_load_error or "native library unavailable")
        return _lib
    with _lock:
        if not _loaded:
            if os.environ.get("INFINITY_NATIVE", "1") == "0":
                _load_error = "disabled by INFINITY_NATIVE=0"
            else:
                errors = []
                for path in _candidates():
                    if not path.is_file():
                        continue
                    try:
                        handle = ctypes.CDLL(str(path))
                        _bind(handle)
                    except (OSError, AttributeError) as exc:  # wrong arch, missing symbol
                        errors.append(f"{path}: {exc}")
                        continue
                    _lib = handle
                    break
                if _lib is None:
                    _load_error = ("; ".join(errors) if errors else
                                   f"{_LIB_NAME} not found next to the package; "
                                   "reinstall with `pip install .` to build it")
            _loaded = True
    if _lib is None:
        raise NativeUnavailable(_load_error)
    return _lib


def available() -> bool:
    """True when the native library is loaded; warns once (with the reason) when not."""
    global _warned
    try:
        lib()
        return True
    except NativeUnavailable as exc:
        if not _warned:
            _warned = True
            warnings.warn(f"infinity: native library unavailable ({exc}); using the pure-torch "
                          "fallback, which gives the same results more slowly", RuntimeWarning,
                          stacklevel=3)
        return False


def simd_levels() -> list[str]:
    """ISA variants this build has AND this CPU/OS supports, best last."""
    if not available():
        return []
    l = lib()
    ok = l.inf_isa_compiled() & l.inf_isa_supported()
    order = ["scalar", "neon", "avx2", "avx512"]
    return [n for n in order if ok & (1 << _ISA_INDEX[n])]


def selected_isa() -> int:
    """Index of the ISA the kernels use now (forced by use_simd/INFINITY_SIMD, else best)."""
    name = _forced_isa or os.environ.get("INFINITY_SIMD") or None
    l = lib()
    if name is None:
        return int(l.inf_isa_best())
    key = name.strip().lower()
    if key not in _ISA_INDEX:
        raise ValueError(f"INFINITY_SIMD={name!r} is not a SIMD level; choose one of {list(ISA_NAMES)}")
    levels = simd_levels()
    if key not in levels:
        raise ValueError(f"SIMD level {key!r} (INFINITY_SIMD or use_simd) is not available here: "
                         f"this CPU and build support {levels}")
    return _ISA_INDEX[key]


@contextlib.contextmanager
def use_simd(level: str) -> Iterator[None]:
    """Run the kernels with one ISA variant inside the block (tests, benchmarks).

    Raises ValueError if ``level`` is unknown or not supported here.
    """
    global _forced_isa
    prev = _forced_isa
    _forced_isa = level
    try:
        selected_isa()  # validate now, naming the level
        yield
    finally:
        _forced_isa = prev


def default_num_threads() -> int:
    """Threads the CPU kernels use by default: INFINITY_NUM_THREADS, else all CPUs
    in this process's affinity mask."""
    env = os.environ.get("INFINITY_NUM_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"INFINITY_NUM_THREADS={env!r} is not an integer") from None
        if n < 1:
            raise ValueError(f"INFINITY_NUM_THREADS={env!r} must be >= 1")
        return n
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def info() -> dict:
    """Which backend runs and how it was built.

    Returns a dict with ``backend`` ("native" or "fallback"), ``simd`` (the
    level in use: "avx512", "avx2", "neon", "scalar", or None for the
    fallback), ``simd_available`` (levels this CPU and build support),
    ``threads`` (default thread count), ``build`` (compiler and per-ISA flags),
    ``library`` (path) and, for the fallback, ``reason``.
    """
    try:
        l = lib()
    except NativeUnavailable as exc:
        return {"backend": "fallback", "simd": None, "simd_available": [], "threads": default_num_threads(),
                "build": None, "library": None, "reason": str(exc)}
    return {
        "backend": "native",
        "simd": ISA_NAMES[selected_isa()],
        "simd_available": simd_levels(),
        "threads": default_num_threads(),
        "build": l.inf_build_info().decode(),
        "library": l._name,
    }


_ARRAY_TYPES: dict = {}


def carray(ctype, n: int):
    """The ctypes array type of ``n`` ``ctype`` elements, kept for good.
    ctypes keeps these types weakly, and a type is always in a reference
    cycle: one made per call and dropped leaves garbage for the cycle
    collector every step."""
    key = (ctype, n)
    t = _ARRAY_TYPES.get(key)
    if t is None:
        t = _ARRAY_TYPES[key] = ctype * n
    return t
