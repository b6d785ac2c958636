"""Mechanism that moves bytes between tiers, asynchronously.

Two implementations with one interface, so the engine has a single code path:

- :class:`CpuMover` (``device="cpu"``): the "device" is RAM; copies run on two
  worker threads (one per direction). ``Tensor.copy_`` releases the GIL, so
  copies overlap with compute in the main thread.
- :class:`CudaMover`: copies run on two dedicated CUDA streams from pinned
  host memory; completion is a CUDA event. Compute waits with
  ``stream.wait_event`` (no host synchronisation on the hot path).

[Note: device range reuse]
A device range freed by eviction may still be read by kernels queued on the
compute stream. On CUDA, every eviction records an event on the compute
stream (``release_marker``), and every host-to-device copy makes the copy
stream wait on the latest such event before writing, so it cannot overwrite
bytes a queued kernel still reads. Evictions happen in compute order, so the
latest event covers all earlier ones. On the CPU, compute is synchronous:
when the hook evicts, the kernels that read the range have finished.

[Note: refreshing a live range]
The release marker covers ranges that were freed. A range that stays live,
the compute copy of a unit that lives on the device and is refreshed after
each step (``Residency.invalidate``), was never released: with
``offload_params="none"`` no marker exists at all, and kernels queued since
the last eviction (metrics, an EMA, evaluation between backward and step)
may still read it. So ``h2d`` by default also makes the copy stream wait for
everything queued so far on the device's current stream, as torchao's
offload does before its parameter copy. ``h2d(..., fresh=True)`` skips that
wait for a range handed out since its last release (a fetch into a new
range), so a prefetch overlaps the compute queued ahead of it. The current
stream is the calling thread's: a copy issued on the chain thread (after an
NVMe read) would wait on that thread's default stream, so those fetches,
always into fresh ranges, pass ``fresh=True`` too.

[Note: the mover's device]
Streams, events and the "current stream" are those of the mover's device,
never of the current device: ``torch.cuda.current_stream(self.device)``,
and tickets carry their device, so ``device="cuda:1"`` works while the
current device is 0. (An event is created on the device of the stream that
first records it.)

[Note: events the host waits on]
An event that a host thread synchronizes on (a ticket's completion: ``wait``,
the grad thread's ``finish``, ``synchronize``) is created with
``blocking=True`` (cudaEventBlockingSync), so the waiting thread sleeps
instead of spinning a core that the native AdamW needs (with the default
cudaDeviceScheduleAuto, one context and many cores, a plain event spins).
Events that only streams wait on (release markers, the "ready" mark before a
device-to-host copy) keep the default flags: the flag changes nothing for
cudaStreamWaitEvent.

[Note: a gradient's way to the host]
Gradients cross one parameter at a time, as autograd finishes them. Where
the host buffer has the gradient's dtype and nothing is accumulated (see
[Note: gradients in the compute dtype] in placement.py), the copy goes straight
from the device into the pinned host buffer on the copy stream: no staging,
no host-side pass. Otherwise it lands in pinned staging (a fixed ring of
blocks: [Note: the gradient staging ring] in grad_staging.py) and a host thread
upcasts or adds it into the fp32 buffer, large gradients split into chunks
over a few threads (``_cast_into``): a single thread upcasting a 7 B model's
14 GB of bf16 gradients per step would take seconds.

[Note: gradient copies keep their source alive]
A gradient leaves the device as soon as autograd has accumulated it. The job
holds a reference to the gradient tensor (or to any other device-to-host
source, such as a temporary downcast) until the copy is done (CPU), or
``record_stream`` tells the caching allocator the copy stream uses it (CUDA),
so the memory is not reused while the copy reads it.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Optional

import torch

from .grad_staging import AllDone, StagingRing, finish_piece

__all__ = ["Ticket", "CpuMover", "CudaMover", "make_mover", "done_ticket", "on_host_job", "WORKER_THREADS"]

_host_job_state = threading.local()


def on_host_job() -> bool:
    """True while this thread runs a host job (optimizer work): such a job must
    never wait for host jobs, which run one at a time (it would wait for itself)."""
    return getattr(_host_job_state, "active", False)


def _as_host_job(fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        _host_job_state.active = True
        try:
            fn()
        finally:
            _host_job_state.active = False
    return run


class Ticket:
    """Completion of one asynchronous transfer or job."""

    def done(self) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def wait(self) -> None:
        """Blocks the calling thread until complete; re-raises the job's error."""
        raise NotImplementedError

    def wait_compute(self, timed: bool = True) -> None:
        """Makes compute wait for completion (CUDA: the current stream; CPU:
        the host). ``timed=False``: the current stream is a side stream (a
        stage-3 gather's), whose wait is not a compute stall (StallClock)."""
        self.wait()


class _Done(Ticket):
    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


done_ticket = _Done()


class FutureTicket(Ticket):
    __slots__ = ("fut",)

    def __init__(self, fut: Future):
        self.fut = fut

    def done(self) -> bool:
        return self.fut.done()

    def wait(self) -> None:
        self.fut.result()


class StallClock:
    """GPU time the compute stream spent waiting for copies: a timing event
    just before and just after each ``wait_event`` (nothing runs between
    them but the wait). Pairs are folded into the sum as they complete, at
    every wait from the oldest (the compute stream runs them in order), so
    the pending pairs stay as few as the waits not yet executed; a pair not
    executed yet is counted by a later :meth:`seconds` or wait."""

    def __init__(self) -> None:
        self._pending: deque = deque()
        self._seconds = 0.0

    def wait(self, stream, event) -> None:
        a = torch.cuda.Event(enable_timing=True)
        a.record(stream)
        stream.wait_event(event)
        b = torch.cuda.Event(enable_timing=True)
        b.record(stream)
        self._pending.append((a, b))
        self._fold()

    def _fold(self) -> None:
        pending = self._pending
        while pending and pending[0][1].query():
            a, b = pending.popleft()
            self._seconds += a.elapsed_time(b) / 1e3

    @property
    def pending(self) -> int:
        """Wait pairs recorded and not yet folded (executed waits fold at the next wait)."""
        return len(self._pending)

    def seconds(self) -> float:
        """Seconds of stream waits that have executed so far."""
        self._fold()
        return self._seconds


class CudaTicket(Ticket):
    __slots__ = ("event", "device", "fut", "clock")

    def __init__(self, event, device: torch.device, fut: Optional[Future] = None,
                 clock: Optional[StallClock] = None):
        self.event = event    # blocking: see [Note: events the host waits on]
        self.device = device  # See [Note: the mover's device]
        self.fut = fut        # host-side follow-up job, if any
        self.clock = clock    # times compute's wait (fetches)

    def done(self) -> bool:
        return self.event.query() and (self.fut is None or self.fut.done())

    def wait(self) -> None:
        self.event.synchronize()
        if self.fut is not None:
            self.fut.result()

    def wait_compute(self, timed: bool = True) -> None:
        stream = torch.cuda.current_stream(self.device)
        if self.clock is not None and timed:
            self.clock.wait(stream, self.event)
        else:
            stream.wait_event(self.event)
        if self.fut is not None:
            self.fut.result()


class ChainTicket(Ticket):
    """A wait on the host (e.g. an NVMe read) followed by a transfer that
    starts only then; both run on the mover's chain thread."""

    __slots__ = ("fut",)

    def __init__(self, fut: Future):
        self.fut = fut  # result: the inner Ticket

    def done(self) -> bool:
        return self.fut.done() and self.fut.result().done()

    def wait(self) -> None:
        self.fut.result().wait()

    def wait_compute(self, timed: bool = True) -> None:
        self.fut.result().wait_compute(timed)


class DeferredTicket(Ticket):
    """A host-side wait whose follow-up (a collective) is issued only when
    compute asks for the data, by the thread that asks."""

    __slots__ = ("first", "then", "inner")

    def __init__(self, first: Callable[[], None], then: Callable[[], Ticket]):
        self.first, self.then, self.inner = first, then, None

    def _run(self) -> Ticket:
        if self.inner is None:
            self.first()
            self.inner = self.then()
        return self.inner

    def done(self) -> bool:
        return self.inner is not None and self.inner.done()

    def wait(self) -> None:
        self._run().wait()

    def wait_compute(self, timed: bool = True) -> None:
        self._run().wait_compute(timed)


def _chain(first: Callable[[], None], then: Callable[[], Ticket]) -> Ticket:
    first()
    return then()


def _worker_init() -> None:
    """Worker threads run torch ops single-threaded: an OpenMP team per worker
    beside compute's own would oversubscribe the cores, and OpenMP threads
    spin at barriers, so oversubscription slows compute by orders of
    magnitude. (torch.set_num_threads is per thread here: compute keeps its
    threads.)"""
    torch.set_num_threads(1)


def _executor(name: str) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(WORKER_THREADS[name], thread_name_prefix=name, initializer=_worker_init)


def _noop() -> None:
    return None


_CAST_CHUNK = 1 << 20  # elements per piece of a split upcast
_CAST_THREADS = 4

# [Note: the mover's threads]
# Every worker thread a mover may start, by name prefix, with the most of each
# that can exist at once (one mover per engine; the cast pool is shared by the
# process). The executors start their threads lazily, on the first job, so a
# run may show fewer, and a new name may appear mid-run; never more than this.
# ``_executor`` takes its worker count from here, so an executor not listed
# cannot be made, and the stress soak (infinity/stress/soak.py) bounds the
# process's threads by this table.
WORKER_THREADS = {"infinity-h2d": 1, "infinity-d2h": 1, "infinity-host": 1, "infinity-grad": 1,
                  "infinity-chain": 1, "infinity-cast": _CAST_THREADS}
_cast_pool: Optional[ThreadPoolExecutor] = None


def _cast_piece(dst: torch.Tensor, src: torch.Tensor, accumulate: bool) -> None:
    if accumulate:
        dst.add_(src)
    else:
        dst.copy_(src)


def _cast_into(dst: torch.Tensor, src: torch.Tensor, accumulate: bool) -> None:
    """``dst (+)= src`` (1-D, same numel, any dtypes), split into chunks over
    a few single-threaded workers when large (see [Note: a gradient's way to
    the host]). Called from one worker thread at a time per ``dst``."""
    global _cast_pool
    n = src.numel()
    if n < 2 * _CAST_CHUNK:
        _cast_piece(dst, src, accumulate)
        return
    if _cast_pool is None:
        _cast_pool = ThreadPoolExecutor(_CAST_THREADS, thread_name_prefix="infinity-cast",
                                        initializer=_worker_init)
    futs = [_cast_pool.submit(_cast_piece, dst[a:a + _CAST_CHUNK], src[a:a + _CAST_CHUNK], accumulate)
            for a in range(0, n, _CAST_CHUNK)]
    for f in futs:
        f.result()


def _drain(*executors: ThreadPoolExecutor) -> None:
    """Waits, executor by executor in the order given, until each has run
    everything submitted to it before (one worker each, so FIFO). Earlier
    executors' jobs may submit to later ones, so the order matters."""
    for ex in executors:
        try:
            ex.submit(_noop).result()
        except RuntimeError:  # shut down: nothing more will run on it
            pass


class CpuMover:
    """Copies between RAM regions on worker threads (device="cpu")."""

    is_cuda = False
    batches_grads = False  # a gradient's copy is a memcpy here: staging would add one (grad_buckets.py)

    def __init__(self) -> None:
        self._h2d = _executor("infinity-h2d")
        self._d2h = _executor("infinity-d2h")
        self._host = _executor("infinity-host")
        self._chain = _executor("infinity-chain")

    def chain(self, first: Callable[[], None], then: Callable[[], Ticket]) -> Ticket:
        """Runs ``first`` (a host-side wait, e.g. an NVMe read) then starts ``then``'s transfer."""
        return ChainTicket(self._chain.submit(_chain, first, then))

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, *, fresh: bool = False) -> Ticket:
        """Copies host ``src`` into device ``dst`` (same numel). ``fresh``: see
        :meth:`CudaMover.h2d`; nothing to order on the CPU (compute is synchronous)."""
        return FutureTicket(self._h2d.submit(dst.copy_, src))

    def d2h(self, dst: torch.Tensor, src: torch.Tensor) -> Ticket:
        """Copies device ``src`` into host ``dst``."""
        return FutureTicket(self._d2h.submit(dst.copy_, src))

    def grad_out(self, host_dst: torch.Tensor, dev_grad: torch.Tensor, accumulate: bool) -> Ticket:
        """Moves one gradient to the host: ``host_dst (+)= dev_grad`` (upcast to host_dst's dtype).

        See [Note: gradient copies keep their source alive].
        """
        src = dev_grad.reshape(-1)
        return FutureTicket(self._d2h.submit(_cast_into, host_dst, src, accumulate))

    def host_job(self, fn: Callable[[], None]) -> Ticket:
        """Runs ``fn`` on the host worker thread (optimizer work; see :func:`on_host_job`)."""
        return FutureTicket(self._host.submit(_as_host_job(fn)))

    def release_marker(self) -> None:
        """See [Note: device range reuse]: nothing to do on the CPU."""

    def synchronize(self) -> None:
        """Blocks until every copy and host job submitted so far has finished
        (e.g. before the host pool is closed). Errors stay with their tickets.
        Call it from the thread that submits, never from a job."""
        _drain(self._chain, self._host, self._h2d, self._d2h)  # chain -> h2d, host -> d2h

    def close(self, wait: bool = True) -> None:
        for ex in (self._chain, self._h2d, self._d2h, self._host):
            ex.shutdown(wait=wait)


class CudaMover:
    """Copies between pinned host memory and a CUDA device on dedicated streams."""

    is_cuda = True
    batches_grads = True  # See [Note: gradients leave the device in buckets] in grad_buckets.py

    def __init__(self, device: torch.device) -> None:
        index = torch.cuda.current_device() if device.index is None else device.index
        self.device = torch.device("cuda", index)  # See [Note: the mover's device]
        self._h2d_stream = torch.cuda.Stream(self.device)
        self._d2h_stream = torch.cuda.Stream(self.device)
        self._host = _executor("infinity-host")
        self._grad = _executor("infinity-grad")
        self._chain = _executor("infinity-chain")
        self._last_release = None
        self.stall_clock = StallClock()  # See Residency.device_stall_seconds
        self.staging = StagingRing()      # See [Note: the gradient staging ring] in grad_staging.py

    def chain(self, first: Callable[[], None], then: Callable[[], Ticket]) -> Ticket:
        """Runs ``first`` (a host-side wait, e.g. an NVMe read) then issues ``then``'s copy."""
        return ChainTicket(self._chain.submit(_chain, first, then))

    def release_marker(self) -> None:
        """Records an event on the compute stream at an eviction (see [Note: device range reuse])."""
        ev = torch.cuda.Event()  # only streams wait on it: see [Note: events the host waits on]
        ev.record(torch.cuda.current_stream(self.device))
        self._last_release = ev

    def h2d(self, dst: torch.Tensor, src: torch.Tensor, *, fresh: bool = False) -> Ticket:
        """Copies pinned host ``src`` into device ``dst`` on the copy stream.

        The copy waits for the last release marker and, unless ``fresh``, for
        all compute queued so far on the device's current stream. Pass
        ``fresh=True`` only for a range handed out since its last release (see
        [Note: refreshing a live range]).
        """
        compute = torch.cuda.current_stream(self.device)  # asked before the copy stream becomes current
        with torch.cuda.stream(self._h2d_stream):
            if self._last_release is not None:
                self._h2d_stream.wait_event(self._last_release)  # See [Note: device range reuse]
            if not fresh:
                self._h2d_stream.wait_stream(compute)  # See [Note: refreshing a live range]
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event(blocking=True)  # See [Note: events the host waits on]
            ev.record(self._h2d_stream)
        return CudaTicket(ev, self.device, clock=self.stall_clock)

    def _issue_d2h(self, dst: torch.Tensor, src: torch.Tensor):
        """Issues ``dst.copy_(src)`` on the d2h stream after the compute queued so far; its event."""
        ready = torch.cuda.Event()  # only the copy stream waits on it
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._d2h_stream):
            self._d2h_stream.wait_event(ready)
            dst.copy_(src, non_blocking=True)
            src.record_stream(self._d2h_stream)  # See [Note: gradient copies keep their source alive]
            ev = torch.cuda.Event(blocking=True)  # See [Note: events the host waits on]
            ev.record(self._d2h_stream)
        return ev

    def d2h(self, dst: torch.Tensor, src: torch.Tensor) -> Ticket:
        """Copies device ``src`` into pinned host ``dst`` once the compute queued so far has run."""
        return CudaTicket(self._issue_d2h(dst, src), self.device)

    def grad_out(self, host_dst: torch.Tensor, dev_grad: torch.Tensor, accumulate: bool) -> Ticket:
        """Moves one gradient to the host: ``host_dst (+)= dev_grad`` (see
        [Note: a gradient's way to the host])."""
        src = dev_grad.reshape(-1)
        if not accumulate and host_dst.dtype == src.dtype:
            return CudaTicket(self._issue_d2h(host_dst, src), self.device)  # straight into the pinned buffer
        # Device -> a pinned block of the ring on the copy stream, piece by
        # piece, then the upcast or the accumulation on the grad thread once
        # the piece's event completes ([Note: the gradient staging ring]).
        futs, ev = [], None
        for a, b in self.staging.pieces(src.numel(), src.element_size()):
            i, raw = self.staging.take()
            stage = raw[:(b - a) * src.element_size()].view(src.dtype)
            ev = self._issue_d2h(stage, src[a:b])
            futs.append(self._grad.submit(finish_piece, ev, host_dst[a:b], stage, accumulate, self.staging, i,
                                          _cast_into))
        return CudaTicket(ev, self.device, AllDone(futs))

    def host_job(self, fn: Callable[[], None]) -> Ticket:
        """Runs ``fn`` on the host worker thread (optimizer work; see :func:`on_host_job`)."""
        return FutureTicket(self._host.submit(_as_host_job(fn)))

    def synchronize(self) -> None:
        """Blocks until every copy and host job issued so far has finished (e.g.
        before the host pool is closed): the chain, host and grad threads, then
        the two copy streams and the device's current stream (copies issued
        there, such as a stage-3 gather's without an ``h2d``). Errors stay with
        their tickets. Call it from the thread that submits, never from a job."""
        _drain(self._chain, self._host, self._grad)  # their jobs issue copies on the streams below
        for stream in (self._h2d_stream, self._d2h_stream, torch.cuda.current_stream(self.device)):
            ev = torch.cuda.Event(blocking=True)  # See [Note: events the host waits on]
            ev.record(stream)
            ev.synchronize()

    def close(self, wait: bool = True) -> None:
        for ex in (self._chain, self._host, self._grad):
            ex.shutdown(wait=wait)


def make_mover(device: torch.device):
    """The mover for ``device``."""
    return CudaMover(device) if device.type == "cuda" else CpuMover()
