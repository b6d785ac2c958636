"""Checks of single values shared by :class:`infinity.Config`, the run file
sections (infinity/cli/runfile.py) and the DeepSpeed import: each takes the
name to put in the message (``Config.swap_queue_depth``, ``data.seq_len``)
and returns the value normalised or raises naming it, the value and the fix.

[Note: which error type]
A value of the wrong type raises ``TypeError``, a value of the right type out
of range ``ValueError``: what ``Config`` has always raised, so callers that
catch either keep working. Both messages start ``<name>=<value>:``; run files
and the DeepSpeed import wrap them in ``ConfigFileError`` (a ValueError)
naming the file and key path. No check lets a bare Python error through
(OverflowError from ``int(inf)``, TypeError from iterating an int): a value
that would raise one is refused first.

[Note: the bounds]
Every number has an upper bound as well as a lower one, because what lies
above it is not a bigger setting but a wrong one: an int that wraps where it
crosses into the native library (``swap_queue_depth=2**64+1`` became 1 in
its int32), a float that is not finite (``initial_loss_scale=nan`` makes
every fp16 step overflow), a size no machine has. The bounds are the
native library's own (queue depth 1024), Linux's (one read or write moves
at most 2 GiB - 4 KiB, so a block is at most 1 GiB) or far beyond any real
run (1 EiB of memory, 2^31 - 1 steps).
"""

from __future__ import annotations

import math
import numbers
import re
from decimal import Decimal, InvalidOperation
from typing import Any, Optional, Sequence, Union

__all__ = ["parse_bytes", "is_int", "is_real", "integer", "whole", "real", "boolean", "choice", "text", "MAX_BYTES", "MAX_BLOCK",
           "MAX_QUEUE_DEPTH", "MAX_DEPTH", "MAX_THREADS", "MAX_COUNT", "MAX_LOSS_SCALE", "SEED_RANGE"]

MAX_BYTES = 1 << 60          # 1 EiB: beyond any memory or disk budget
MAX_BLOCK = 1 << 30          # 1 GiB: one pread/pwrite moves at most 2 GiB - 4 KiB on Linux
MAX_QUEUE_DEPTH = 1024       # the native I/O engine's limit (inf_io_engine_create)
MAX_DEPTH = 1024             # units prefetched ahead: more than any model's units
MAX_THREADS = 4096           # optimizer threads: the native kernel takes an int32; no machine has more cores
MAX_COUNT = (1 << 31) - 1    # steps, intervals, batch sizes: int32, as DeepSpeed and torch hold them
MAX_LOSS_SCALE = 2.0 ** 64   # a scale above this overflows fp32 gradients of any ordinary loss
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.manual_seed takes

# One grammar: decimal "8GB" (10**9), binary "8GiB" (2**30). A bare "8G" is
# refused: tools disagree on what it means (DeepSpeed and `ls -h` read 2**30).
_UNITS = {
    "": 1, "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*")


def is_int(value: Any) -> bool:
    """True for an integer that is not a bool (numpy integers included)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """True for a real number that is not a bool (ints, floats, numpy scalars)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def parse_bytes(value: Union[int, float, str], name: str = "value", hi: int = MAX_BYTES) -> int:
    """Bytes from an int or a string like ``"8GiB"``, ``"512 MiB"``, ``"1.5GB"``.

    Raises TypeError (not a number or string) or ValueError (negative, not
    finite, not a whole number of bytes, above ``hi``, unparsable) naming ``name``.
    """
    if is_int(value):
        n = Decimal(int(value))
    elif is_real(value):
        if not math.isfinite(value):
            raise ValueError(f"{name}={value!r}: not a size (must be a finite number of bytes, at most {hi})")
        n = Decimal(float(value))
    elif isinstance(value, str):
        n = _parse_size_string(value, name)
    else:
        raise TypeError(f"{name}={value!r}: expected bytes (int) or a size string like '8GiB', not "
                        f"{type(value).__name__}")
    if n < 0:
        raise ValueError(f"{name}={value!r}: must be >= 0 bytes")
    if n > hi:
        raise ValueError(f"{name}={value!r}: {n:.4g} bytes is above the largest accepted, {hi} bytes; give a "
                         "smaller size")
    if n != n.to_integral_value():
        raise ValueError(f"{name}={value!r}: not a whole number of bytes ({n}); round it")
    return int(n)


def _parse_size_string(value: str, name: str) -> Decimal:
    m = _SIZE.fullmatch(value)
    if m and m.group(2).lower() in ("k", "m", "g", "t"):
        u = m.group(2).upper()
        raise ValueError(f"{name}={value!r}: ambiguous unit {m.group(2)!r}; write '{m.group(1)}{u}B' "
                         f"(decimal, 10^{3 * 'KMGT'.index(u) + 3}) or '{m.group(1)}{u}iB' (binary, "
                         f"2^{10 * 'KMGT'.index(u) + 10})")
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{name}={value!r}: not a size; use bytes or e.g. '512MiB', '8GiB', '1.5GB', '1e9'")
    try:
        # Decimal, not float: "1.1GB" is exactly 1100000000 bytes, and "1e400"
        # stays a (too large) number instead of becoming inf.
        number = Decimal(m.group(1))
    except InvalidOperation:  # pragma: no cover - the pattern admits only numbers
        raise ValueError(f"{name}={value!r}: not a size") from None
    # An exponent beyond Decimal's context would raise decimal.Overflow (or
    # round to 0) in the product: far outside any size either way.
    if number and number.adjusted() > 60:
        raise ValueError(f"{name}={value!r}: above the largest accepted size, {MAX_BYTES} bytes")
    if number and number.adjusted() < -60:
        raise ValueError(f"{name}={value!r}: not a whole number of bytes")
    return number * _UNITS[m.group(2).lower()]


def integer(name: str, value: Any, lo: int, hi: int, what: str = "an int") -> int:
    """``value`` as an int in ``[lo, hi]``; bools and non-integers are refused
    (a whole float such as DeepSpeed's ``5e8`` is not: see :func:`whole`)."""
    if not is_int(value):
        raise TypeError(f"{name}={value!r}: must be {what} in [{lo}, {hi}], not {type(value).__name__}")
    v = int(value)
    if not lo <= v <= hi:
        raise ValueError(f"{name}={value!r}: must be {what} in [{lo}, {hi}]")
    return v


def whole(name: str, value: Any, lo: int, hi: int) -> int:
    """Like :func:`integer`, but also takes a float with a whole value
    (``5e8``: JSON writers and DeepSpeed configs spell counts that way)."""
    if is_real(value) and not is_int(value) and math.isfinite(value) and float(value).is_integer():
        if not lo <= value <= hi:
            raise ValueError(f"{name}={value!r}: must be an int in [{lo}, {hi}]")
        return int(value)
    return integer(name, value, lo, hi)


def real(name: str, value: Any, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> float:
    """``value`` as a finite float in the interval ``lo..hi`` (each end closed
    unless ``*_open``); bools, strings, NaN and infinities are refused."""
    span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    if not is_real(value):
        raise TypeError(f"{name}={value!r}: must be a number in {span}, not {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name}={value!r}: must be a finite number in {span}")
    if v < lo or v > hi or (lo_open and v == lo) or (hi_open and v == hi):
        raise ValueError(f"{name}={value!r}: must be in {span}")
    return v


def boolean(name: str, value: Any) -> bool:
    """``value`` if it is True or False (1, 0 and "yes" are refused)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r}: must be true or false, not {type(value).__name__}")
    return value


def choice(name: str, value: Any, choices: Sequence[str]) -> str:
    """``value`` if it is one of ``choices`` (strings), else ValueError listing them."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}={value!r}: choose one of {list(choices)}")
    return value


def text(name: str, value: Any, optional: bool = False, what: str = "a path") -> Optional[str]:
    """``value`` if it is a non-empty string without NUL bytes (or None when ``optional``)."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{name}={value!r}: must be {what} (a string){' or absent' if optional else ''}, not "
                        f"{type(value).__name__}")
    if not value or "\x00" in value:
        raise ValueError(f"{name}={value!r}: must be a non-empty {what} without NUL bytes")
    return value
