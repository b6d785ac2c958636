"""A checkpoint's tensors, read unit by unit into reused staging buffers.

[Note: staged unit loads]
``load_checkpoint`` writes each unit's values and moments into whichever
tiers hold the unit now. Reading them into new tensors cost a page fault per
4 KiB of every byte loaded (fresh memory is copied into at 1-3 GB/s here,
warm memory at 8), so a unit's tensors are read into staging buffers sized
for the largest unit and reused for every unit. Where a unit's staged
tensors are at most ``AHEAD_BYTES``, a second set of buffers lets the next
unit be read (on a thread of its own: file reads and CRC checks) while the
current one is written into the tiers. Larger units are read and written in
turn, their values and then each moment through one buffer, so a load holds
the largest of one unit's three tensors beside the run's budgets (4 bytes a
trainable parameter; two small units' tensors at most: 2 x ``AHEAD_BYTES``). Where the unit's master and
moments are whole in host memory (host optimizer, no ZeRO), they are read
into in place instead: no staging copy. Units are taken in the order
their weights sit in the files (a save writes them in update order), so
each file is read front to back. Reads take no collective, so under ZeRO
the thread is safe; the writes (which may) stay on the caller's thread, in
that same order on every rank. At ZeRO-3 a rank reads only the ranges of
the weights its shards keep (moments likewise at every stage). A unit's
reads are all started before the first is waited for, each staged tensor
placed at its file offset's phase within a page, so that the bytes go
straight into it ([Note: reads into their destination]).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .direct_stream import aligned_empty
from .safetensors_io import nbytes, page_phase, record_dtype

__all__ = ["UnitLoads", "StagedUnit", "AHEAD_BYTES"]

AHEAD_BYTES = 256 << 20  # a unit's staged tensors up to this size: the next unit is read ahead
_ALIGN = 64  # bytes between staged tensors (any dtype's alignment)
_PAGE = 4096  # a staged tensor starts where its page phase is its file offset's (read straight: submit)
KINDS = ("exp_avg", "exp_avg_sq")


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _paged(n: int) -> int:
    return -(-n // _PAGE) * _PAGE


def _nbytes(rec: dict, s) -> int:
    return nbytes(record_dtype(rec), s.shape)


def _wait_all(reads: list, quiet: bool = False) -> None:
    """Waits for (and checks) every read, then raises the first error (none
    where ``quiet``): no read still writes into a buffer once the load has failed."""
    err = None
    for r in reads:
        try:
            r.wait()
        except (OSError, ValueError) as e:  # CorruptCheckpointError is a ValueError
            err = err or e
    if err is not None and not quiet:
        raise err


def _read_all(start: Callable[[list], object]):
    """``start(reads)``'s result once every read it started (added to
    ``reads``) has ended and been checked; where ``start`` fails, the reads
    already started end before its error leaves."""
    reads: list = []
    try:
        out = start(reads)
    except BaseException:
        _wait_all(reads, quiet=True)
        raise
    _wait_all(reads)
    return out


@dataclass
class StagedUnit:
    """One unit's tensors from the checkpoint (views of a staging set).
    Write its values before asking for a moment, and each moment before
    the next: one unit read in turn shares one buffer for all three."""

    u: object
    values: Dict[int, torch.Tensor] = field(default_factory=dict)  # slot index -> values
    moments: Dict[str, torch.Tensor] = field(default_factory=dict)  # read ahead: kind -> full moment
    read_later: Optional[Callable[[str], torch.Tensor]] = None    # else: kind -> full moment, read now

    def moment(self, kind: str) -> torch.Tensor:
        """The full ``kind`` moment ("exp_avg", "exp_avg_sq") of the unit."""
        return self.moments[kind] if kind in self.moments else self.read_later(kind)


class _Set:
    """Staging buffers for one unit's tensors: values and both moments apart
    (read ahead), or one buffer the values and then each moment take in turn."""

    def __init__(self, value_bytes: int, moment_numel: int, apart: bool):
        n = value_bytes if apart else max(value_bytes, 4 * moment_numel)
        self.vals = aligned_empty(_aligned(n))
        self.moments = {k: aligned_empty(4 * moment_numel).view(torch.float32) for k in KINDS} if apart else None
        self.shared = None if apart else self.vals.view(torch.float32)


class Scratch:
    """Temporaries for writing one unit's values into NVMe homes (its master
    and compute copy), carved from one buffer allocated at the first use and
    reused for every unit: call :meth:`reset` before each unit. Each starts
    on a 4 KiB boundary, so the swap store writes it without a staging copy
    (docs/io.md, "Plain tensors"): 6 bytes a parameter (bf16) not copied
    again. (On the development machine the load is bound by its disk, and
    measured no faster end to end for it.)"""

    def __init__(self, capacity: int):
        self.capacity, self._buf, self._off = capacity, None, 0

    def reset(self) -> None:
        self._off = 0

    def __call__(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        n = numel * torch.empty(0, dtype=dtype).element_size()
        if self._off + n > self.capacity:
            return torch.empty(numel, dtype=dtype)  # not planned for: correct, only slower
        if self._buf is None:
            self._buf = aligned_empty(self.capacity)
        t = self._buf[self._off:self._off + n].view(dtype)
        self._off += _paged(n)
        return t


class UnitLoads:
    """Iterates over ``eng``'s units in order, yielding each one's
    :class:`StagedUnit` read from ``files`` (load.py's ``ManifestFiles``) by the
    checkpoint names of ``plan`` and the records of manifest ``m``. A
    yielded unit's tensors stay valid until the next one is asked for. Use
    as a context manager: leaving it waits for a read still in flight."""

    def __init__(self, eng, plan, m: dict, files, moments: bool = True):
        self.eng, self.plan, self.tensors, self.files = eng, plan, m["tensors"], files
        self.moments = moments  # False: the moments are not fp32, moment_loads.py loads them
        self.value_bytes = max((self._value_bytes(u) for u in eng.units), default=0)
        self.moment_numel = max((u.place.trainable_numel for u in eng.units), default=0)
        self.ahead = len(eng.units) > 1 and self.value_bytes + 8 * self.moment_numel <= AHEAD_BYTES
        es = torch.empty(0, dtype=eng.modes.dtype).element_size()
        self.scratch = Scratch(max((_paged(4 * u.place.trainable_numel) +
                                    _paged(es * max(u.place.compute_numel, u.place.home_numel))
                                    for u in eng.units), default=0))
        self._pool: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Future] = None

    def _rec(self, s, kind: Optional[str] = None) -> Optional[dict]:
        name = self.plan.names[id(s.param)]
        return self.tensors.get(name if kind is None else f"{kind}.{name}")

    def _value_bytes(self, u) -> int:
        return sum(_PAGE + _aligned(_nbytes(r, s)) for s, r in ((s, self._rec(s)) for s in u.layout.slots)
                   if r is not None)

    def __enter__(self) -> "UnitLoads":
        return self

    def __exit__(self, *exc) -> None:
        if self._pending is not None:
            self._pending.exception()  # its error, if any, was or will not be raised: the load failed first
            self._pending = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _file_order(self) -> list:
        """The units in the order their weights sit in the checkpoint's files
        (a save writes them in update order: reading them so streams each file front to back)."""
        def first(u):
            recs = [r for r in (self._rec(s) for s in u.layout.slots) if r is not None]
            return min(((r["file"], r["offset"]) for r in recs), default=("\uffff", 0))
        return sorted(self.eng.units, key=first)

    def __iter__(self):
        units = self._file_order()
        sets: List[_Set] = [_Set(self.value_bytes, self.moment_numel, self.ahead) for _ in range(2 if self.ahead else 1)]
        if self.ahead:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="infinity-ckpt-load")
            self._pending = self._pool.submit(self._read, units[0], sets[0])
        for k, u in enumerate(units):
            if not self.ahead:
                yield self._read(u, sets[0])
                continue
            staged = self._pending.result()  # a read's error is raised here, on the caller's thread
            self._pending = None
            if k + 1 < len(units):
                self._pending = self._pool.submit(self._read, units[k + 1], sets[(k + 1) % 2])
            yield staged

    def _read(self, u, st: _Set) -> StagedUnit:
        """``u``'s values and (this rank's range of) its moments into ``st``:
        every read started, then each waited for and checked in turn."""
        out = StagedUnit(u)
        _read_all(lambda reads: self._start(u, st, out, reads))
        return out

    def _start(self, u, st: _Set, out: StagedUnit, reads: list) -> None:
        """Starts the reads of ``u``'s tensors into ``st`` (or in place), adding them to ``reads``."""
        off, ranges = 0, self._own_ranges(u)
        direct = {k: self.eng.optstate.resident_view(u, k) for k in ("master",) + KINDS}
        for i, s in enumerate(u.layout.slots):
            rec = self._rec(s)
            if rec is not None:
                dtype = record_dtype(rec)
                n = nbytes(dtype, s.shape)  # the model's shape: a record's wrong length is named by read_tensor
                if s.trainable and direct["master"] is not None and dtype is torch.float32:
                    view = direct["master"][s.offset:s.offset + s.numel].view(s.shape)  # in place
                else:
                    es = torch.empty(0, dtype=dtype).element_size()
                    off += (page_phase(rec["offset"], es) - off) % _PAGE
                    view = st.vals[off:off + n].view(dtype).view(s.shape)
                    off += _aligned(n)
                if ranges is None:
                    reads.append(self.files.start(rec, dtype, s.shape, view))
                else:
                    reads += self._read_ranges(rec, s, ranges, view.view(-1))
                out.values[i] = view
        tn = u.place.trainable_numel if self.moments else 0
        for kind in KINDS if tn else ():
            if direct[kind] is not None:
                out.moments[kind] = self._start_moments(u, kind, direct[kind], reads)
            elif st.moments is not None:
                out.moments[kind] = self._start_moments(u, kind, st.moments[kind][:tn], reads)
        if tn and len(out.moments) < len(KINDS):
            out.read_later = lambda kind: self._read_moments(u, kind, st.shared[:tn])

    def _own_ranges(self, u) -> Optional[List[Tuple[int, int]]]:
        """ZeRO-3 on several ranks: the element ranges of ``u``'s buffers this
        rank keeps (its master and compute shards; only those of the values it
        is given are stored: Values.write), where no full copy of the unit
        lives on this rank; None: the whole unit."""
        eng = self.eng
        if eng.modes.zero != 3 or eng.sharding.world == 1 or eng.residency.permanent_copy(u) is not None:
            return None
        return eng.sharding.own_param_ranges(u.place.compute_numel, u.place.trainable_numel)

    def _read_ranges(self, rec: dict, s, ranges, flat: torch.Tensor) -> list:
        """Starts reading the parts of slot ``s``'s tensor inside ``ranges``
        (unit elements) into ``flat`` (the slot's staged values; the rest is
        left as it is); returns the reads to wait for."""
        reads = []
        for a, b in ranges:
            x, y = max(a, s.offset), min(b, s.offset + s.numel)
            if x < y:
                reads.append(self.files.start_range(rec, record_dtype(rec), x - s.offset, y - s.offset,
                                                    flat[x - s.offset:y - s.offset]))
        return reads

    def _read_moments(self, u, kind: str, full: torch.Tensor) -> torch.Tensor:
        """The ``kind`` moment of ``u`` into ``full``, read and checked now (see _start_moments)."""
        return _read_all(lambda reads: self._start_moments(u, kind, full, reads))

    def _start_moments(self, u, kind: str, full: torch.Tensor, reads: list) -> torch.Tensor:
        """Each rank keeps only its shard of the moments: starts reading only
        that range of each tensor (checked chunk by chunk; see read_range)
        into ``full``, adding the reads to wait for to ``reads``; a tensor the
        checkpoint lacks (strict=False) and the gaps between slots are zeros."""
        lo, hi = self.eng.sharding.shard(u.place.trainable_numel)
        u.layout.zero_padding(full, u.layout.trainable_slots)
        for s in u.layout.trainable_slots:
            rec = self._rec(s, kind)
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a >= b:
                continue
            if rec is None:
                full[a:b].zero_()
            else:
                reads.append(self.files.start_range(rec, torch.float32, a - s.offset, b - s.offset, full[a:b]))
        return full
