"""Gradients: off the device as autograd finishes them, accumulated on the
host, reduced over the ranks (ZeRO), spilled to NVMe and read back, claimed
by an update, released.

Owns ``unit.grads`` (a :class:`GradRecord`); nothing else writes it. See
[Note: gradients in the compute dtype] in placement.py, [Note: a gradient's way to
the host] in mover.py and [Note: gradient states] in state.py; the device side of the way out is in
grad_buckets.py ([Note: gradients leave the device in buckets]); the sums over the ranks are
grad_reduce.py's, and where gradients are reduced on the device, grad_device.py's ([Note: a unit's
gradients on the device]).

[Note: a backward after step() without zero_grad()]
torch adds such a backward's gradients to the last step's. That is harmless
when a ``zero_grad()`` comes before the next ``step()`` (the DCGAN loop: the
generator's backward reaches the discriminator after the discriminator's
step, and the discriminator's next ``zero_grad()`` drops them), so the
backward is taken (``stale``) with no update started during it, and only a
``step()`` that would apply the sum raises, before anything changes.

The zeros torch would keep after ``zero_grad(set_to_none=False)`` are
grad_kept.py's ([Note: zero_grad(set_to_none=False)]).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from ..faults import UsageError
from . import grad_errors, grad_written
from ..mechanism.nvme import key as swap_key
from ..plan.state import GradHome, GradState, transition
from ..plan.units import Layout
from ..plan.limits import GRAD_BUCKET_BYTES  # See [Note: limits that must agree]
from ..plan.placement import device_reduce_bytes
from .grad_buckets import Bucket, bucket_elems, land, make_buckets, open_stage, runs_of
from .grad_device import DeviceGrad, drop_full, land_slot, open_full
from .grad_kept import KeptZeros
from .grad_reduce import GradReductions
from .grad_chunks import Chunks, ChunkedGrads, GradStream
from .grad_norm import fixed_bits, sum_of_squares, unit_part

__all__ = ["GradRecord", "Gradients"]


@dataclass
class GradRecord:
    """A unit's gradients (written by grads.py only)."""

    state: GradState = GradState.CLEAN
    home: GradHome = GradHome.NONE
    grad: Optional[torch.Tensor] = None       # the buffer (host, or device with the device optimizer)
    next_grad: Optional[torch.Tensor] = None  # delayed mode: the buffer the next backward fills
    buf: object = None                        # pool handle of a transient buffer
    written: List[bool] = field(default_factory=list)  # per trainable slot: holds this step's data
    had: List[bool] = field(default_factory=list)      # per trainable slot: torch's ``.grad`` would not be None
    pending: int = 0                          # trainable slots still waiting for this backward's gradient
    tickets: list = field(default_factory=list)  # copies and reductions in flight
    shard: Optional[torch.Tensor] = None      # ZeRO: the own shard of the summed gradients
    reduced: bool = False                     # ZeRO: the reduction of this step was issued
    buckets: List[Bucket] = field(default_factory=list)  # device staging (grad_buckets.py)
    bucket_of: List[int] = field(default_factory=list)   # per trainable slot: its bucket, -1 for none
    device: DeviceGrad = field(default_factory=DeviceGrad)  # the device path (grad_device.py)
    anywhere: Optional[tuple] = None          # the flags' OR over the ranks in flight (grad_written.py)
    norm_part: Optional[tuple] = None         # (written, share of the squared norm, buffer) taken ahead of step()
    chunks: Chunks = field(default_factory=Chunks)  # streamed in chunks (grad_chunks.py)


class Gradients(KeptZeros, GradReductions):
    """The gradients of ``units``; ``room`` is the shared host pool (their host buffers)."""

    def __init__(self, units, modes, device_tier, room, nvme, mover, stats, sharding, accum_steps: int,
                 overlap: str):
        self.units, self.modes, self.device_tier, self.room = units, modes, device_tier, room
        self.nvme, self.mover, self.stats, self.sharding = nvme, mover, stats, sharding
        self.accum_steps, self.overlap = accum_steps, overlap
        self._outstanding: list = []  # (ticket, device bytes) of copies off the device
        self._reducing: list = []     # stages 2-3: units whose full gradients are being reduced
        self.window_closed = False    # See [Note: the accumulation window] in schedule.py
        self.micro_batches = 0        # backward passes since the last step
        self.need_zero_grad = False   # step() ran and zero_grad() did not since
        self.stale = False            # a backward ran while need_zero_grad: step() must refuse
        # Gradient buffers in the compute dtype have the size of compute copies,
        # not of fp32 state: they come from the same end of the pool as the
        # copies, so each size class's holes fit its own later requests.
        self._with_copies = modes.grad_dtype != torch.float32
        # See [Note: gradients leave the device in buckets] in grad_buckets.py.
        self.batched = bool(getattr(mover, "batches_grads", False)) and modes.host_optimizer \
            and not modes.reduce_on_device  # whole units gather on the device instead
        reserve = device_tier.transient_reserve if device_tier is not None else 0
        self._bucket_elems = bucket_elems(reserve, GRAD_BUCKET_BYTES, modes.dtype.itemsize)
        # See [Note: gradients streamed in chunks] in grad_chunks.py.
        self.chunked = ChunkedGrads(room, nvme, mover, modes.grad_dtype)
        self.drop_buffers()

    def drop_buffers(self) -> None:
        """After teardown: forgets every unit's gradient buffers (see Engine._drop_buffers)."""
        for u in self.units:
            u.grads = _record(u)
            if self.batched:
                u.grads.buckets, u.grads.bucket_of = make_buckets(u.layout, self._bucket_elems)

    # -- buffers kept for good ----------------------------------------------------------

    def set_permanent(self, u, grad: Optional[torch.Tensor], next_grad=None, shard=None) -> None:
        """``u``'s buffers kept for good (placement at ``initialize``)."""
        g = u.grads
        g.grad, g.next_grad, g.shard = grad, next_grad, shard
        if grad is not None:
            g.home = transition(u.name, "grad home", g.home, GradHome.PERMANENT)

    def set_device(self, device_tier) -> None:
        """The device tier whose transient reserve bounds copies in flight (None: being replaced)."""
        self.device_tier = device_tier

    def backward_counted(self, window_closed: bool) -> None:
        """A whole backward is done; ``window_closed``: it ran the window's
        last-backward work (see [Note: the accumulation window] in schedule.py)."""
        self.flush_all()
        self.micro_batches += 1
        self.window_closed = self.window_closed or window_closed

    def open_window(self, stepped: bool = False) -> None:
        """A new accumulation window: after ``step()`` (``stepped``: torch
        would keep the gradients until ``zero_grad()``) or ``zero_grad()``."""
        self.micro_batches = 0
        self.window_closed = False
        self.need_zero_grad = stepped
        self.stale = False

    def stale_error(self) -> UsageError:
        """See grad_errors.stale_backward."""
        return grad_errors.stale_backward()

    def forward_error(self) -> UsageError:
        """See grad_errors.forward_in_window."""
        return grad_errors.forward_in_window(self.accum_steps)

    # -- off the device ---------------------------------------------------------------

    def begin_backward(self) -> None:
        self.flush_all()  # what an interrupted backward staged
        for u in self.units:
            u.grads.pending = len(u.layout.trainable_slots)
            for b in u.grads.buckets:
                b.left = b.end - b.first

    def take(self, u, ti: int, p) -> bool:
        """A parameter's gradient is complete for this backward: moves it into
        ``u``'s buffer (added when accumulating) and frees the device copy.
        ``ti`` indexes the trainable slots. True on ``u``'s last one."""
        g = p.grad
        if g is None:
            return False
        if self.window_closed:
            raise grad_errors.backward_after_window(self.micro_batches, self.accum_steps, self.overlap)
        if self.need_zero_grad:
            self.stale = True  # See [Note: a backward after step() without zero_grad()]
        p.grad = None
        rec, s = u.grads, u.layout.trainable_slots[ti]
        accumulate = rec.written[ti]
        rec.written[ti] = rec.had[ti] = True
        if rec.state is GradState.CLEAN:
            rec.state = transition(u.name, "grad", rec.state, GradState.ACCUMULATING)
        if self.modes.reduce_on_device:  # See [Note: a unit's gradients on the device] in grad_device.py
            self._open_device(u)
            land_slot(rec.device, u.layout, ti, g, accumulate)
            rec.pending -= 1
            return rec.pending == 0
        if u.place.grad_chunked:  # See [Note: gradients streamed in chunks] in grad_chunks.py
            if rec.home in (GradHome.NONE, GradHome.SPILLED):
                rec.home = transition(u.name, "grad home", rec.home, GradHome.HOST)
            self.chunked.land(u, ti, g, accumulate)
            rec.pending -= 1
            return rec.pending == 0
        if rec.grad is None:  # a transient buffer until the update (NVMe state, ZeRO 2-3)
            self.acquire(u)
        dst = rec.grad[s.offset:s.offset + s.numel]
        if self.modes.host_optimizer:
            b = rec.bucket_of[ti] if rec.bucket_of else -1
            if b >= 0:
                self._stage(u, rec.buckets[b], ti, g, accumulate)
            else:
                nb = g.numel() * g.element_size()
                self._bound_transient(nb)
                self.device_tier.add_transient(nb)
                t = self.mover.grad_out(dst, g, accumulate)
                self.stats.moved("d2h", nb)
                rec.tickets.append(t)
                self._outstanding.append((t, nb))
        elif accumulate:
            dst.add_(g.reshape(-1))
        else:
            dst.copy_(g.reshape(-1))
        rec.pending -= 1
        return rec.pending == 0

    def _open_device(self, u) -> None:
        """``u``'s flat device gradient unless open, counted as transient device bytes."""
        if u.grads.device.full is not None:
            return
        nb = device_reduce_bytes(u.place.trainable_numel, self.modes)
        self._bound_transient(nb)
        self.device_tier.add_transient(nb)
        open_full(u.grads.device, u.layout, u.place.trainable_numel, self.modes.grad_dtype, self.modes.device, nb)

    def _stage(self, u, b: Bucket, ti: int, g: torch.Tensor, accumulate: bool) -> None:
        """``g`` into ``b``'s staging buffer; ``b`` to the host once full."""
        if b.stage is None:
            nb = (b.stop - b.start) * g.element_size()
            self._bound_transient(nb)
            self.device_tier.add_transient(nb)
            open_stage(b, u.layout, g)
        if land(b, u.layout, ti, g, accumulate):
            self._flush(u, b)

    def _flush(self, u, b: Bucket) -> None:
        """``b``'s landed slots to the host: one copy per run of them."""
        rec, stage, nb = u.grads, b.stage, b.nbytes
        t = None
        for lo, hi, acc in runs_of(b, u.layout):
            t = self.mover.grad_out(rec.grad[lo:hi], stage[lo - b.start:hi - b.start], acc)
            self.stats.moved("d2h", (hi - lo) * stage.element_size())
            rec.tickets.append(t)
        b.stage, b.landed = None, []
        if t is None:
            self.device_tier.sub_transient(nb)
        else:  # the copies run in issue order: the last one done frees the whole stage
            self._outstanding.append((t, nb))

    def flush_all(self) -> None:
        """Sends every bucket still being filled (some of its parameters got
        no gradient in this backward)."""
        for u in self.units:
            for b in u.grads.buckets:
                if b.stage is not None:
                    self._flush(u, b)

    def _bound_transient(self, incoming: int) -> None:
        """Backpressure: waits for the oldest copies until ``incoming`` more
        bytes fit the reserve the device budget sets aside for gradients."""
        keep = []
        for t, nb in self._outstanding:
            if t.done():
                self.device_tier.sub_transient(nb)
            else:
                keep.append((t, nb))
        while keep and self.device_tier.transient_bytes + incoming > self.device_tier.transient_reserve:
            t, nb = keep.pop(0)
            t0 = time.perf_counter()
            t.wait()
            self.stats.stall_seconds += time.perf_counter() - t0
            self.device_tier.sub_transient(nb)
        self._outstanding = keep

    def wait(self, u) -> None:
        """Waits for every copy and reduction of ``u``'s gradients issued so
        far. Tickets go only once waited for, so a second thread calling
        meanwhile waits too instead of finding the list empty."""
        pending = list(u.grads.tickets)
        if not pending:
            return
        for t in pending:
            t.wait()
        u.grads.tickets = [t for t in u.grads.tickets if not any(t is w for w in pending)]
        grad_written.settle(u.grads)

    def written_now(self, u) -> List[bool]:
        """A copy of ``u``'s written flags, with the slots written on any rank
        once their all-reduce is in (see [Note: a gradient on any rank is a
        gradient on every rank] in grad_written.py)."""
        grad_written.settle(u.grads)
        return list(u.grads.written)

    def drain(self) -> None:
        """Waits for every gradient copy in flight."""
        self.flush_all()
        for u in self.units:
            self.wait(u)
        for t, nb in self._outstanding:
            t.wait()
            self.device_tier.sub_transient(nb)
        self._outstanding = []

    # -- transient host buffers --------------------------------------------------------

    def acquire(self, u, wait: bool = True):
        """A host buffer for ``u``'s gradients: zero where slots do not cover
        it, or holding what was accumulated so far if it was spilled. Returns
        the read in flight when ``wait`` is False."""
        rec = u.grads
        g, buf = self.room.acquire(u.place.trainable_numel, self.modes.grad_dtype, protect=u,
                                    compute=self._with_copies)
        rec.grad, rec.buf = g, buf
        if rec.home is GradHome.SPILLED:
            rec.home = transition(u.name, "grad home", rec.home, GradHome.HOST)
            h = self.nvme.read(swap_key(u.index, "grad"), g)
            if not wait:
                return h
            h.wait()
            return None
        # Each slot's first gradient is copied in (not added): only the
        # padding between slots needs zeros (the update's runs span it).
        Layout.zero_padding(g, u.layout.trainable_slots)
        rec.home = transition(u.name, "grad home", rec.home, GradHome.HOST)
        return None

    def spill(self, u, claimed: bool = False) -> None:
        """Writes ``u``'s gradients to NVMe and frees their host buffer (NVMe
        optimizer state, when the update does not run during backward;
        ``claimed``: the buffer of an update that ran speculatively, on its
        thread: a replay reads them again). A share of the norm taken
        before (``take_norm_part``) is kept, so ``step()``'s norm need not
        read them back."""
        rec = u.grads
        if rec.home is not (GradHome.CLAIMED if claimed else GradHome.HOST):
            return
        if u.place.grad_chunked:
            self.chunked.close(u)
            rec.home = transition(u.name, "grad home", rec.home, GradHome.SPILLED)
            return
        self.wait(u)
        h = self.nvme.write(swap_key(u.index, "grad"), rec.grad)
        self.room.defer_release(h, rec.buf)
        rec.grad = rec.buf = None
        if rec.norm_part is not None:  # the buffer goes back to the pool
            rec.norm_part = rec.norm_part[:2] + (None,)
        rec.home = transition(u.name, "grad home", rec.home, GradHome.SPILLED)

    def take_norm_part(self, u, runs) -> None:
        """Takes ``u``'s share of the squared norm now, on this thread alone,
        from its final gradients (``runs(u, written, grad)``: the ranges the
        norm counts), so ``step()``'s norm sums it instead of reading them
        again (a speculative update's job, during backward: [Note:
        speculative updates] in step/speculate.py). Only where the share's
        bits do not depend on the thread (``grad_norm.fixed_bits``); else
        ``step()`` takes it."""
        rec = u.grads
        grad = self.update_input(u)
        if fixed_bits(grad):
            rec.norm_part = (list(rec.written), unit_part(grad, runs(u, rec.written, grad), num_threads=1), grad)

    def load(self, u, wait: bool = True):
        """Reads spilled gradients back into a host buffer (for the norm or the
        update); the read in flight when ``wait`` is False, else None."""
        rec = u.grads
        if rec.home is not GradHome.SPILLED or u.place.grad_chunked:  # streamed: read by the update's stream
            return None
        g, buf = self.room.acquire(u.place.trainable_numel, self.modes.grad_dtype, protect=u,
                                    compute=self._with_copies)
        rec.grad, rec.buf = g, buf
        rec.home = transition(u.name, "grad home", rec.home, GradHome.LOADED)
        h = self.nvme.read(swap_key(u.index, "grad"), g)
        if not wait:
            return h
        h.wait()
        return None

    def drop_loaded(self, u) -> None:
        """Frees a host copy of spilled gradients (they stay on NVMe)."""
        rec = u.grads
        if rec.home is GradHome.LOADED:
            self.room.release(rec.buf)
            rec.grad = rec.buf = None
            rec.home = transition(u.name, "grad home", rec.home, GradHome.SPILLED)

    def sum_of_squares(self, units_grads, runs) -> float:
        """See grad_norm.sum_of_squares (spilled gradients read back for it)."""
        return sum_of_squares(self, units_grads, runs)

    def claim(self, u) -> None:
        """An update during backward takes ``u``'s host buffer (it releases it)."""
        rec = u.grads
        if u.place.grad_chunked:
            self.chunked.close(u)  # every parameter landed: nothing is open
        if rec.home is GradHome.HOST:
            rec.home = transition(u.name, "grad home", rec.home, GradHome.CLAIMED)

    def release(self, u) -> None:
        """Frees ``u``'s transient buffer once every copy and reduction into or
        out of it is done. Safe from two threads (main and optimizer's)."""
        rec = u.grads
        if u.place.grad_chunked:
            with self.room.lock:
                self.chunked.drop(u)
        if rec.buf is not None:
            self.wait(u)
            with self.room.lock:
                if rec.buf is not None:
                    self.room.release(rec.buf)
                    rec.grad = rec.buf = None
        if rec.home not in (GradHome.NONE, GradHome.PERMANENT):
            with self.room.lock:
                if rec.home not in (GradHome.NONE, GradHome.PERMANENT):
                    rec.home = transition(u.name, "grad home", rec.home, GradHome.NONE)

    # -- the step ------------------------------------------------------------------------

    def update_input(self, u) -> Optional[torch.Tensor]:
        """The buffer an update reads: the own shard under ZeRO, else the full
        one; a :class:`GradStream` for gradients streamed in chunks (None: no gradient)."""
        if u.place.grad_chunked:
            return GradStream(self.chunked, u) if u.grads.home is not GradHome.NONE else None
        return u.grads.shard if self.modes.zero else u.grads.grad

    def swap_delayed(self, u) -> torch.Tensor:
        """Delayed mode: returns this step's buffer; the next backward fills the other."""
        rec = u.grads
        grad, rec.grad, rec.next_grad = rec.grad, rec.next_grad, rec.grad
        return grad

    def consume(self, u) -> None:
        """The step read ``u``'s gradients: the buffers are free for the next
        accumulation window (overwritten, not zeroed, by its first gradients)."""
        if self.modes.opt_nvme or self.modes.zero >= 2:
            self.release(u)
        rec = u.grads
        self.device_tier.sub_transient(drop_full(rec.device))  # a window discarded before its reduction
        rec.reduced, rec.norm_part = False, None
        grad_written.settle(rec)  # before the flags are reset: none may land in the next window
        if rec.state is GradState.ACCUMULATING:
            rec.state = transition(u.name, "grad", rec.state, GradState.CLEAN)
        rec.written = [False] * len(rec.written)

    def kept_bytes(self) -> int:
        """Host bytes of gradient buffers kept for good (the ZeRO 1/N share: stages 2-3 keep shards only)."""
        total = 0
        for u in self.units:
            rec = u.grads
            kept = {id(rec.shard): rec.shard} if self.modes.zero >= 2 else {id(rec.grad): rec.grad,
                                                                             id(rec.shard): rec.shard}
            total += sum(t.numel() * t.element_size() for t in kept.values() if t is not None)
        return total


def _record(u) -> GradRecord:
    n = len(u.layout.trainable_slots)
    return GradRecord(written=[False] * n, had=[False] * n)
