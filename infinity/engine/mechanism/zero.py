"""ZeRO sharding of a unit's flat buffers over the data-parallel ranks.

[Note: ZeRO shards in infinity]
Every unit's trainable range ``[0, trainable_numel)`` is padded to a multiple
of the world size (``Layout(pad_to=world)``) and cut into equal shards; rank r
owns ``[r*S, (r+1)*S)``. Stage 1 keeps the fp32 master and the Adam moments for
the own shard only; gradients accumulate in full on every rank and are
reduce-scattered once per step (in ``step()``; with ``overlap="backward"``,
or reduced on the device ([Note: where gradients are reduced] in
placement.py: then the full gradients never reach the host), each unit's in
the last backward of the window, so its update may start then). Stage 2 also drops full gradients: in the last
backward of the accumulation window each unit's gradients are reduce-scattered
as soon as the unit's last gradient has left the device, and only the shard
stays (with ``overlap="backward"`` its update then runs during backward).
After the updates each rank all-gathers the new compute copies. Collectives
are issued from the thread that runs forward and backward, in program order,
so every rank issues the same sequence. The gradient sum's 1/world is folded
into the update kernel's ``grad_scale``.

[Note: the host group]
Most collectives here run on CPU tensors: the host gradients' reduce-scatter
or all-reduce, the all-gather of host compute copies, the float sums (norms,
overflow) and the configuration check. NCCL serves only CUDA tensors, so
under a plain ``init_process_group("nccl")`` they would raise "No backend type
associated with device type cpu". ``Sharding`` therefore routes each
collective by its tensor's device: CUDA tensors to ``group`` (the device
group: the one given to ``initialize``, or the default), CPU tensors to
``host_group``. When the device group's backend serves CPU tensors too (gloo,
mpi, ucc, or a pair such as ``"cpu:gloo,cuda:nccl"``), ``host_group`` is that
same group; otherwise it is a gloo group over the same ranks, in the same
order, made once per device group and reused by later engines. Making a
group is collective: for the whole world every rank calls ``new_group``, in
the same order, which is one reason ``initialize`` is collective (every rank
calls it, for the same models, in the same order); for a subgroup only its
members call it (``use_local_synchronization``: the name is derived from the
ranks, so subgroups' host groups do not clash). A subgroup created by the
user with ``use_local_synchronization=True`` already has that name: give it a
``"cpu:gloo,cuda:nccl"`` backend instead.

[Note: the stage-3 gather's copy-in]
Stage 3 fills a unit's device copy from the host: this rank's shard goes up,
then an all-gather fills in the others. Copied on the compute stream, the
shard's copy queues behind all compute and blocks the compute after it for
its whole duration. With an ``h2d`` (the mover's copy, on its copy stream)
the copy overlaps compute instead, and the gather is issued from a side
stream that first waits for the copy: NCCL's stream waits on the stream that
is current when a collective is issued, so the gather starts after the copy
and the compute stream waits for neither. Compute waits for the gather only
in ``wait_compute``. The gather's writes into the other ranks' regions stay
ordered after queued readers of a reused range ([Note: device range reuse]
in mover.py) through the same chain: the mover's copy waits on the release
marker, the side stream on the copy, NCCL on the side stream. On the CPU the
host waits for the copy, then issues the gather; the bytes are the same.

[Note: waiting for a collective]
``Work.wait()`` under NCCL only makes the current stream wait; the host
returns at once. Callers that then write a collective's host input (the
optimizer rewriting a compute copy's shard) or read its output on the host
need a host barrier, so ``CollectiveTicket.wait`` makes the side stream wait
for the work and synchronizes a blocking event recorded there after it: the
host returns when the collective has finished, without waiting for the
compute queued meanwhile. ``wait_compute`` keeps the stream semantics. Under
gloo with CPU tensors ``Work.wait()`` is already a host wait.

[Note: the device group]
Collectives on the device tier's tensors (stage 3's parameter gathers, the
gradients reduced on the device: [Note: where gradients are reduced] in
placement.py) go to the device group, chosen by a flag on the call, not by
the tensor's device: on the CPU device the device tier's tensors are CPU
tensors too, and routed by device they would take the host group. The
device group is ``group`` on CUDA, and on the CPU device ``group`` when its
backend serves CPU tensors (gloo), else the host group. So on the CPU the
device path runs through gloo line by line as NCCL runs it on GPUs.

[Note: bytes on the wire]
``bytes_moved`` keeps two conventions. "reduce_scatter", "all_gather" and
"all_reduce" are the ZeRO paper's volumes (the full buffer per reduce-scatter
or all-gather, twice it per all-reduce). "net_device" and "net_host" are
what this rank sends over each group's links as the ring algorithm moves
them: (N-1)/N of the full buffer per reduce-scatter or all-gather, twice that
per all-reduce (a ring's reduce-scatter then all-gather); it receives as much.
"""

from __future__ import annotations

import atexit
import contextlib
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..stats import Stats
from .comm_clock import CommClock

__all__ = ["Sharding", "CollectiveTicket", "GatherTicket", "backend_serves_cpu"]

# torch >= 2.10 names these *_single; older releases have only *_tensor.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def backend_serves_cpu(backend: str) -> bool:
    """True when a process group whose backend string is ``backend`` (what
    ``dist.get_backend`` returns: ``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``,
    ...) runs collectives on CPU tensors."""
    name = str(backend).lower()
    if ":" in name:  # "device:backend" pairs
        return any(pair.split(":")[0].strip() == "cpu" for pair in name.split(","))
    if name == "undefined":  # init_process_group() without a backend: the accelerator's alone
        return torch.accelerator.current_accelerator() is None
    # torch assumes an unknown backend serves cpu and cuda (BackendConfig) and so do we.
    return "cpu" in dist.Backend.backend_capability.get(name, ["cpu", "cuda"])


_HOST_GROUPS: Dict[object, object] = {}  # device group -> the gloo group made for its CPU tensors
# Dropped while the interpreter is whole: a gloo group freed during its
# teardown (after destroy_process_group, only this cache held it) could
# abort the process ("terminate called without an active exception").
atexit.register(_HOST_GROUPS.clear)


def _live(pg) -> bool:
    try:
        dist.get_backend(pg)
        return True
    except (ValueError, RuntimeError):  # destroyed, or the default group is gone
        return False


def _host_group(group):
    """The group for ``group``'s CPU tensors (``group`` itself when its backend
    serves them). Collective when it makes one: see [Note: the host group]."""
    backend = dist.get_backend(group)
    if backend_serves_cpu(backend):
        return group
    key = group if group is not None else dist.group.WORLD
    for k in [k for k, v in _HOST_GROUPS.items() if not (_live(k) and _live(v))]:
        del _HOST_GROUPS[k]
    if key in _HOST_GROUPS:
        return _HOST_GROUPS[key]
    ranks = dist.get_process_group_ranks(key)
    if not dist.is_gloo_available():
        raise RuntimeError(f"ZeRO needs CPU collectives over ranks {ranks}: their group's backend {backend!r} "
                           "serves no CPU tensors and gloo is not available; init_process_group with a "
                           "backend pair such as 'cpu:mpi,cuda:nccl'")
    order = {} if ranks == sorted(ranks) else {"sort_ranks": False}  # group ranks must match the device group's
    try:
        pg = dist.new_group(ranks, backend="gloo", use_local_synchronization=len(ranks) < dist.get_world_size(),
                            group_desc="infinity_host", **order)
    except ValueError as exc:
        raise RuntimeError(f"ZeRO could not make the gloo group for the CPU tensors of ranks {ranks} (backend "
                           f"{backend!r}): {exc}. Create that process group with the backend "
                           "'cpu:gloo,cuda:nccl' instead") from exc
    _HOST_GROUPS[key] = pg
    return pg


class Sharding:
    """Mechanism: the collectives of ZeRO over one process group, with byte counters.

    Constructing it is collective when torch.distributed is initialised (it
    may make the host group: see [Note: the host group]). Each collective
    goes to ``group`` for CUDA tensors and to ``host_group`` for CPU tensors,
    unless the call says ``on_device`` ([Note: the device group]); ``device``
    is the engine's (None: the CPU).
    """

    def __init__(self, stage: int, stats: Stats, group=None, device: Optional[torch.device] = None):
        initialised = dist.is_available() and dist.is_initialized()
        if stage > 0 and not initialised:
            raise RuntimeError(f"Config.zero_stage={stage} needs torch.distributed to be initialised "
                               "(launch with torchrun and call torch.distributed.init_process_group first)")
        self.stage = stage
        self.group = group
        self.host_group = _host_group(group) if initialised else None
        on_cpu = device is None or torch.device(device).type == "cpu"
        serves = initialised and backend_serves_cpu(dist.get_backend(group))
        self.device_group = self.host_group if on_cpu and not serves else group  # [Note: the device group]
        # Data-parallel ranks: stage 0 over several ranks is plain data
        # parallelism (gradients all-reduced, nothing sharded).
        self.world = dist.get_world_size(group) if initialised else 1
        self.rank = dist.get_rank(group) if initialised else 0
        self.global_rank = dist.get_rank() if initialised else 0
        self.sharded = stage > 0
        self.shards = self.world if self.sharded else 1  # what buffers are padded to and split into
        self.stats = stats
        self.clock = CommClock(stats)  # See [Note: exposed communication time] in comm_clock.py
        self._side_streams: Dict[int, object] = {}  # CUDA device index -> the collectives' side stream

    def _group_of(self, t: torch.Tensor, on_device: bool = False):
        """The group for collectives on ``t``: see [Note: the host group] and [Note: the device group]."""
        if on_device:
            return self.device_group
        return self.host_group if t.device.type == "cpu" else self.group

    def _wire(self, full: torch.Tensor, on_device: bool, passes: int = 1) -> None:
        """Counts the ring's bytes this rank sends for ``passes`` reduce-scatters
        or all-gathers of ``full`` (see [Note: bytes on the wire])."""
        if self.world > 1:
            link = "net_device" if on_device or full.is_cuda else "net_host"
            self.stats.moved(link, passes * full.numel() * full.element_size() * (self.world - 1) // self.world)

    def _side_stream(self, t: torch.Tensor):
        """For a CUDA ``t``: the side stream of its device (see [Note: the stage-3
        gather's copy-in] and [Note: waiting for a collective]); else None."""
        if not t.is_cuda:
            return None
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        if index not in self._side_streams:
            self._side_streams[index] = torch.cuda.Stream(torch.device("cuda", index))
        return self._side_streams[index]

    def _ticket(self, work, t: torch.Tensor) -> "CollectiveTicket":
        return CollectiveTicket([self._timed(work, t.is_cuda)], self._side_stream(t), clock=self.clock)

    def _timed(self, work, on_cuda: bool = False):
        """``work`` (an asynchronous collective just issued), its duration measured by the clock."""
        self.clock.issued(work, on_cuda)
        return work

    @contextlib.contextmanager
    def _synchronous(self):
        """Times a synchronous collective (all of it is exposed)."""
        t0 = time.perf_counter()
        yield
        self.clock.synchronous(t0)

    def shard(self, numel: int) -> Tuple[int, int]:
        """(lo, hi) element range of the own shard of a buffer of ``numel`` (a multiple of world)."""
        if not self.sharded:
            return 0, numel
        s = numel // self.world
        return self.rank * s, (self.rank + 1) * s

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor,
                       async_op: bool = False) -> Optional["CollectiveTicket"]:
        """``out`` (own shard) = sum over ranks of ``full``'s matching shard.
        ``async_op``: returns at once with a ticket (``wait()`` before reading
        ``out`` or rewriting ``full``); else returns None when done."""
        with contextlib.nullcontext() if async_op else self._synchronous():
            work = _reduce_scatter(out, full, group=self._group_of(full), async_op=async_op)
        self.stats.moved("reduce_scatter", full.numel() * full.element_size())
        self._wire(full, False)
        return self._ticket(work, full) if async_op else None

    def reduce_to_host(self, host_out: torch.Tensor, full: torch.Tensor, dev_out: Optional[torch.Tensor],
                       mover) -> "CollectiveTicket":
        """The device path of [Note: where gradients are reduced]: with a
        ``dev_out`` (the own shard, on the device) it becomes the sum over the
        ranks of ``full``'s matching shard (a reduce-scatter), without one
        ``full`` becomes the sum itself (an all-reduce, stage 0), on the device
        group; then the result is copied into ``host_out`` by ``mover``'s
        ``d2h``. Asynchronous: the ticket's ``wait()`` returns once
        ``host_out`` holds the sum; it keeps ``full`` and ``dev_out`` alive
        until then.

        On CUDA the collective is issued from the side stream after the
        compute queued so far (which wrote ``full``), the side stream waits
        for it and the copy waits for the side stream: no host thread waits.
        On the CPU gloo runs it on its own thread and the mover's chain
        thread waits for it, then starts the copy; backward goes on meanwhile.
        """
        group, side = self.device_group, self._side_stream(full)
        result = full if dev_out is None else dev_out

        def issue():
            if dev_out is None:
                return dist.all_reduce(full, group=group, async_op=True)
            return _reduce_scatter(dev_out, full, group=group, async_op=True)

        if side is None:
            work = self._timed(issue())
            ticket = mover.chain(work.wait, lambda: mover.d2h(host_out, result))
        else:
            side.wait_stream(torch.cuda.current_stream(full.device))
            with torch.cuda.stream(side):
                work = self._timed(issue(), True)
                work.wait()  # the side stream waits for NCCL; the copy below waits for the side stream
                ticket = mover.d2h(host_out, result)
        nb = full.numel() * full.element_size()
        if dev_out is None:
            self.stats.moved("all_reduce", 2 * nb)
            self._wire(full, True, passes=2)
        else:
            self.stats.moved("reduce_scatter", nb)
            self._wire(full, True)
        return CollectiveTicket([work], None, then=ticket, keep=(full, result), clock=self.clock)

    def all_gather_(self, full: torch.Tensor, async_op: bool = False) -> Optional["CollectiveTicket"]:
        """Fills every shard of ``full`` from its owner (in place: the own
        shard is the input). ``async_op``: returns at once with a ticket
        (``wait()`` before reading ``full`` or writing the own shard)."""
        lo, hi = self.shard(full.numel())
        with contextlib.nullcontext() if async_op else self._synchronous():
            work = _all_gather(full, full[lo:hi], group=self._group_of(full), async_op=async_op)
        self.stats.moved("all_gather", full.numel() * full.element_size())
        self._wire(full, False)
        return self._ticket(work, full) if async_op else None

    def all_gather(self, shard: torch.Tensor, numel: int) -> torch.Tensor:
        """A new full tensor of ``numel`` elements gathered from every rank's ``shard``."""
        full = torch.empty(numel, dtype=shard.dtype, device=shard.device)
        with self._synchronous():
            _all_gather(full, shard.contiguous(), group=self._group_of(full))
        return full

    def check_same(self, what: dict) -> None:
        """Raises on every rank, naming the rank and the keys that differ, unless
        ``what`` (config and model description) is equal on all ranks."""
        if self.world == 1:
            return
        everyone = [None] * self.world
        dist.all_gather_object(everyone, what, group=self.host_group)  # pickles through CPU tensors
        diffs = []
        for r, other in enumerate(everyone):
            keys = sorted(k for k in set(other) | set(everyone[0]) if other.get(k) != everyone[0].get(k))
            if keys:
                diffs.append(f"rank {r} differs from rank 0 in {keys[:5]}"
                             + (f" (rank 0: {everyone[0].get(keys[0])!r}, rank {r}: {other.get(keys[0])!r})"))
        if diffs:
            raise ValueError("initialize: the ranks were given different configurations or models: "
                             + "; ".join(diffs))

    def all_reduce_(self, t: torch.Tensor, async_op: bool = False) -> Optional["CollectiveTicket"]:
        """``t`` = sum over ranks of ``t`` (stage 0: data-parallel gradients).
        ``async_op``: returns at once with a ticket (``wait()`` before reading or
        writing ``t``); else returns None when done."""
        with contextlib.nullcontext() if async_op else self._synchronous():
            work = dist.all_reduce(t, group=self._group_of(t), async_op=async_op)
        # Counted as a reduce-scatter plus an all-gather (2x the bytes), the
        # convention of the ZeRO paper's communication volumes.
        self.stats.moved("all_reduce", 2 * t.numel() * t.element_size())
        self._wire(t, False, passes=2)
        return self._ticket(work, t) if async_op else None

    def any_rank_(self, flags: torch.Tensor) -> "CollectiveTicket":
        """``flags`` (CPU int32) = their maximum over the ranks, on the host
        group, asynchronously: the ticket. A control message of 4 bytes a
        slot, not counted with the gradients' bytes (as the norm's sum is not);
        see [Note: a gradient on any rank is a gradient on every rank] in
        owners/grad_written.py."""
        work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.host_group, async_op=True)
        return CollectiveTicket([work])

    def own_param_ranges(self, numel: int, trainable: int) -> List[Tuple[int, int]]:
        """Stage 3: the element ranges of a unit's full compute copy that this
        rank's shard holds (:meth:`_param_regions`); the master shard is the first."""
        return [(a + self.rank * k, a + (self.rank + 1) * k) for a, b, k in self._param_regions(numel, trainable)]

    def _param_regions(self, numel: int, trainable: int):
        """Stage 3 layout of a unit's compute copy: (start, end, per-rank
        length) of its trainable region, then its frozen one, each split
        evenly over the ranks so the trainable shard lines up with the
        optimizer's shard."""
        for a, b in ((0, trainable), (trainable, numel)):
            if b > a:
                yield a, b, (b - a) // self.world

    def gather_units_params(self, full: torch.Tensor, shard: torch.Tensor, trainable: int,
                            h2d: Optional[Callable[[torch.Tensor, torch.Tensor], object]] = None,
                            on_device: bool = False) -> "CollectiveTicket":
        """Stage 3: fills a unit's full compute copy ``full`` (device) from every
        rank's ``shard`` (host: its trainable shard, then its frozen shard),
        region by region (:meth:`_param_regions`). Asynchronous.

        ``h2d(dst, src) -> Ticket``: copies the own shard up (the mover's
        ``h2d`` with ``fresh=True``: ``full`` is a range just handed out); each
        gather then waits for its copy. Without it the copy runs on the current
        stream. See [Note: the stage-3 gather's copy-in]. ``on_device``: ``full``
        is the device tier's ([Note: the device group]).
        """
        group, side = self._group_of(full, on_device), self._side_stream(full)
        works, pos = [], 0
        for a, b, k in self._param_regions(full.numel(), trainable):
            lo = a + self.rank * k
            own = full[lo:lo + k]
            if h2d is None:
                own.copy_(shard[pos:pos + k], non_blocking=True)
                works.append(self._timed(_all_gather(full[a:b], own, group=group, async_op=True), full.is_cuda))
            else:
                copy = h2d(own, shard[pos:pos + k])
                with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                    copy.wait_compute(timed=False)  # the side stream waits (not a compute stall); CPU: the host
                    works.append(self._timed(_all_gather(full[a:b], own, group=group, async_op=True),
                                             full.is_cuda))
            pos += k
            self.stats.moved("all_gather", (b - a) * full.element_size())
            self._wire(full[a:b], on_device)
        return CollectiveTicket(works, side, clock=self.clock)

    def shard_of_params(self, full: torch.Tensor, trainable: int) -> torch.Tensor:
        """Stage 3: this rank's shard of a full compute copy (layout of
        :meth:`gather_units_params`); a view of ``full`` when the unit has one region."""
        parts = [full[a + self.rank * k:a + (self.rank + 1) * k]
                 for a, b, k in self._param_regions(full.numel(), trainable)]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def sum_shards(self, x: float) -> float:
        """Sum over the ranks of a per-shard float (norms, overflow checks);
        unchanged when nothing is sharded (every rank holds every gradient)."""
        return self.sum(x) if self.sharded else x

    def sum(self, x: float) -> float:
        """Sum of a Python float over the ranks."""
        if self.world == 1:
            return x
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, group=self.host_group)
        return float(t.item())


class CollectiveTicket:
    """Completion of asynchronous collectives, with the mover's Ticket interface.

    ``stream``: the side stream of the collectives' CUDA device, None for CPU
    tensors. See [Note: waiting for a collective]. ``then``: a mover ticket
    that follows the collectives (a shard's copy to the host): waiting for
    it is waiting for them; ``keep``: tensors held until it is done;
    ``clock``: where the time a thread waits in :meth:`wait` and
    :meth:`wait_compute` is counted (see [Note: exposed communication time]
    in comm_clock.py), None for control messages.
    """

    __slots__ = ("works", "stream", "_waited", "then", "keep", "clock")

    def __init__(self, works: list, stream=None, then=None, keep: tuple = (), clock=None):
        self.works = works  # Work objects (Engine._settle_collectives waits on them at close)
        self.stream = stream
        self._waited = False
        self.then, self.keep, self.clock = then, keep, clock

    def wait(self) -> None:
        """A host barrier: returns once every collective has finished."""
        if self._waited or self.clock is None:
            return self._wait()
        t0 = time.perf_counter()
        self._wait()
        self.clock.waited(time.perf_counter() - t0)

    def wait_compute(self, timed: bool = True) -> None:
        """Makes compute wait: the current stream under NCCL, the host under
        gloo (counted as a wait unless ``timed`` is False)."""
        if self._waited or self.clock is None or not timed:
            return self._wait_compute()
        t0 = time.perf_counter()
        self._wait_compute()
        self.clock.waited(time.perf_counter() - t0)

    def done(self) -> bool:
        """True once finished. May say False for a finished collective not yet
        waited for: gloo's reduce-scatter Work never reports completion."""
        if self.then is not None:
            return self._waited or self.then.done()
        return self._waited or all(w.is_completed() for w in self.works)

    def _wait(self) -> None:
        if self.then is not None:
            self.then.wait()
            self.keep = ()  # the copy read them: they may go
        elif self.stream is None or not self.works:
            for w in self.works:
                w.wait()
        else:
            with torch.cuda.stream(self.stream):
                for w in self.works:
                    w.wait()  # NCCL: the side stream waits, compute does not
                ev = torch.cuda.Event(blocking=True)  # the host sleeps, does not spin
                ev.record(self.stream)
            ev.synchronize()
        self._waited = True

    def _wait_compute(self) -> None:
        if self.then is not None:
            return self._wait()
        for w in self.works:
            w.wait()
        self._waited = self._waited or self.stream is None  # CPU tensors: that was a host wait


GatherTicket = CollectiveTicket  # the stage-3 gathers' name for it
