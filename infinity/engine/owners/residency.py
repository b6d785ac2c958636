"""The device copy of every unit: arena ranges, pins and holds, fetch,
prefetch and eviction, and the parameters' ``.data``.

Owns ``unit.dev`` (a :class:`DeviceRecord`); nothing else writes it. Which
unit to evict and what to prefetch is policy.py's choice; where the bytes come
from is the host cache's (``source``); moving them is the mover's.
See [Note: where the valid copy of a unit lives] and [Note: pins] in state.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from ...config.runtime import format_bytes
from ..plan import policy
from ..faults import UsageError
from ..mechanism.mover import DeferredTicket
from ..plan.state import DeviceState, Quiet, transition
from ..mechanism.tiers import BudgetError, DeviceTier
from ..plan.trace import NEVER

__all__ = ["DeviceRecord", "Residency", "DeviceOutOfMemoryError"]


class DeviceOutOfMemoryError(torch.OutOfMemoryError):
    """A fetch met a full device twice (see [Note: device OOM in a fetch])."""


@dataclass
class DeviceRecord:
    """A unit's device copy (written by residency.py only)."""

    state: DeviceState = DeviceState.ABSENT
    pins: int = 0               # hard pins: a forward running, a pass, a recomputation (see [Note: pins])
    held: int = 0               # backward holds, one per pending module call (soft)
    recompute: int = 0          # pins of recomputations in backward, kept until that backward is done
    ticket: object = None       # the fetch in flight (FETCHING)
    range: Optional[int] = None  # byte offset in the arena
    compute: Optional[torch.Tensor] = None  # the device copy (a view of the arena)
    last_used: int = 0          # LRU clock of the last use
    external: bool = False      # parameters used outside the unit's forward: resident for whole passes
    permanent: bool = False     # lives on the device for good (offload_params="none")


class Residency:
    """Device residency of ``units`` in ``tier``.

    ``source`` is the host cache: ``for_fetch(u) -> (host copy, NVMe read or
    None)``, ``reading(u, ticket)`` (a transfer now reads the host copy) and
    ``home(u)`` (the host copy, or None). ``minimum()`` is the device budget
    the model needs now, for error messages.
    """

    def __init__(self, units, modes, tier: DeviceTier, mover, trace, stats, sharding, source,
                 minimum: Callable[[], int], quiet: Quiet):
        self.units, self.modes, self.tier = units, modes, tier
        self.mover, self.trace, self.stats, self.sharding = mover, trace, stats, sharding
        self.source, self.minimum, self.quiet = source, minimum, quiet
        self._fresh_h2d = lambda dst, src: mover.h2d(dst, src, fresh=True)
        self._nan: Optional[torch.Tensor] = None
        self._clock = 0
        self._wanted: List = []    # backward needs them; no room yet (see [Note: pins])
        self._protected: set = set()  # unit indexes unpacked since the last hook
        self.depth_limit: Optional[int] = None  # prefetch depth lowered under memory pressure (pressure.py)
        self.oom_depth: Optional[int] = None  # lowered for good by a device OOM in a fetch (see _after_oom)
        self.note: Callable[..., None] = lambda action, **kw: None  # an event for infinity.stats (the engine's)
        for u in units:
            u.dev = DeviceRecord()

    def set_tier(self, tier: Optional[DeviceTier]) -> None:
        """A new device tier (the default budget grew; every unit is absent)."""
        self.tier = tier

    # -- the device copy and .data ---------------------------------------------------

    def _standin(self, s) -> torch.Tensor:
        # Right shape and numel (user code may count parameters), one shared
        # element of storage, NaN: a parameter read while its unit is not
        # resident poisons the result instead of silently computing with zeros.
        if self._nan is None:
            self._nan = torch.full((1,), float("nan"), dtype=self.modes.dtype, device=self.modes.device)
        return self._nan.expand(s.shape)

    def _attach(self, u) -> None:
        dev = u.dev.compute
        with self.quiet:
            for s in u.layout.slots:
                s.param.data = dev[s.offset:s.offset + s.numel].view(s.shape)

    def detach(self, u) -> None:
        """Points ``u``'s parameters at the NaN stand-in (not resident)."""
        with self.quiet:
            for s in u.layout.slots:
                s.param.data = self._standin(s)

    def place_permanent(self, u, originals: List[torch.Tensor]) -> None:
        """``offload_params="none"``: ``u`` lives on the device for good,
        written once from ``originals`` (one per slot), refreshed after each step."""
        off = self.tier.try_alloc(u.place.compute_bytes)
        if off is None:
            raise BudgetError(f"device tier: no room for unit {u.name!r} ({u.place.compute_bytes} bytes) "
                              "with offload_params='none'")
        d = u.dev
        d.state = transition(u.name, "device", d.state, DeviceState.FETCHING)
        d.range, d.compute = off, self.tier.view(off, u.place.compute_numel, self.modes.dtype)
        d.compute.zero_()
        for s, src in zip(u.layout.slots, originals):
            d.compute[s.offset:s.offset + s.numel].copy_(src)
        d.state = transition(u.name, "device", d.state, DeviceState.RESIDENT)
        d.permanent = True
        self._attach(u)

    # -- room ---------------------------------------------------------------------------

    def _alloc(self, u, evict: bool = True, protect_before: float = NEVER, soft: bool = False) -> Optional[int]:
        """An arena range for ``u`` (byte offset), evicting policy's victims
        until one fits; None if none does. Pass units (root, external) come
        from the top, the others from the bottom, so the pass units never
        split the room the others page through."""
        high = u.index == 0 or u.dev.external
        while True:
            off = self.tier.try_alloc(u.place.compute_bytes, high=high)
            if off is not None:
                return off
            v = self._victim(protect_before, soft) if evict else None
            if v is None:
                return None
            self.evict(v)

    def _victim(self, protect_before: float, soft: bool):
        """Policy's victim among the units that may go now: with ``soft``,
        those held for a pending backward too, after every free one."""
        cands = [v for v in self.units
                 if v.dev.state is not DeviceState.ABSENT and v.dev.pins == 0 and not v.dev.permanent
                 and v.index not in self._protected and (soft or not v.dev.held)]
        return policy.victim(cands, self.trace, lambda v: v.index, lambda v: v.dev.last_used,
                             held=lambda v: v.dev.held > 0, protect_before=protect_before)

    def unit_at(self, offset: int):
        """The unit whose device range holds arena byte ``offset`` (None: none)."""
        for u in self.units:
            r = u.dev.range
            if r is not None and r <= offset < r + u.place.compute_bytes:
                return u
        return None

    def _no_room(self, u) -> BudgetError:
        held = [f"{x.name} ({x.place.compute_bytes} B)" for x in self.units
                if x.dev.state is not DeviceState.ABSENT and (x.dev.pins > 0 or x.dev.permanent)]
        ext = [x.name for x in self.units if x.dev.external]
        need, t = self.minimum(), self.tier
        return BudgetError(
            f"device tier: cannot fit unit {u.name!r} ({u.place.compute_bytes} bytes): {t.arena_free_bytes} of "
            f"{t.arena_bytes} arena bytes free (largest free range {t.largest_free_bytes}) and the resident "
            f"units left are in use: {held}."
            + (f" Units {ext} are used outside their own forward, so they stay on the device for whole "
               "passes; the budget must hold them as well." if ext else "")
            + f" Raise device_memory to at least {need} bytes ({format_bytes(need)}), lower prefetch_depth, "
              "or split the model into smaller units (Config.unit_classes)")

    # -- fetch -------------------------------------------------------------------------

    def _touch(self, u) -> None:
        self._clock += 1
        u.dev.last_used = self._clock

    def fetch(self, u) -> None:
        """Makes ``u``'s copy usable by compute now, pinning it (caller unpins)."""
        self.trace.use(u.index)
        u.dev.pins += 1
        self._touch(u)
        if u.dev.state is DeviceState.ABSENT:
            try:
                self._fetch_needed(u)
            except BudgetError:
                u.dev.pins -= 1
                raise
        self._prefetch()
        self._wait(u)

    def _fetch_needed(self, u) -> None:
        """Starts fetching ``u``, needed now: all but hard-pinned units give way."""
        off = self._alloc(u, soft=True)
        if off is None:
            raise self._no_room(u)
        self._begin(u, off)
        self.stats.fetches += 1

    def fetch_for_backward(self, u) -> None:
        """``u``'s backward is about to run: holds it and fetches it if there
        is room without displacing a unit in use; else the fetch waits for
        the next hook or the first unpack (see [Note: pins])."""
        self.trace.use(u.index)
        u.dev.held += 1
        self._touch(u)
        if u.dev.state is DeviceState.ABSENT:
            off = self._alloc(u)
            if off is None:
                if u not in self._wanted:
                    self._wanted.append(u)
                return
            self._begin(u, off)
            self.stats.fetches += 1
        self._prefetch()
        self._wait(u)

    def ensure_for_unpack(self, u) -> None:
        """Makes ``u`` resident for a saved tensor autograd unpacks now and
        keeps it in place until the next hook (the same backward node may
        unpack tensors of other units; see [Note: pins])."""
        if u.dev.state is DeviceState.ABSENT:
            self._fetch_needed(u)
        self._wait(u)
        self._protected.add(u.index)

    def settle(self) -> None:
        """At every hook: what was unpacked may move again, and the backward
        fetches that found no room try again."""
        if self._protected:
            self._protected.clear()
        if self._wanted:
            keep = []
            for u in self._wanted:
                if u.dev.state is not DeviceState.ABSENT or not u.dev.held:
                    continue
                off = self._alloc(u)
                if off is None:
                    keep.append(u)
                    continue
                self._begin(u, off)
                self.stats.fetches += 1
            self._wanted = keep

    def _begin(self, u, off: int) -> None:
        d, p = u.dev, u.place
        d.state = transition(u.name, "device", d.state, DeviceState.FETCHING)
        d.range, d.compute = off, self.tier.view(off, p.compute_numel, self.modes.dtype)
        host, read = self.source.for_fetch(u)
        try:
            d.ticket = self._issue(u, host, read)
        except torch.OutOfMemoryError as e:
            d.ticket = self._after_oom(u, host, read, e)
        self.source.reading(u, d.ticket)
        self.stats.moved("h2d", p.compute_bytes // self.modes.world if self.modes.zero == 3 else p.compute_bytes)
        self._attach(u)

    def _issue(self, u, host, read):
        """The ticket of ``u``'s copy up from ``host`` (after ``read``, its NVMe read, if any)."""
        # A range just allocated holds no live data: its copy waits only for
        # the eviction that freed it (see [Note: device range reuse]).
        h2d, dev, tn = self._fresh_h2d, u.dev.compute, u.place.trainable_numel
        if self.modes.zero == 3 and read is not None:
            # The NVMe read starts now; the gather is issued when compute needs
            # the unit, from the thread that issues every collective, so all
            # ranks issue them in the same order (see [Note: ZeRO shards in infinity]).
            return DeferredTicket(read.wait, lambda: self.sharding.gather_units_params(dev, host, tn, h2d=h2d,
                                                                                       on_device=True))
        if self.modes.zero == 3:
            return self.sharding.gather_units_params(dev, host, tn, h2d=h2d, on_device=True)
        if read is not None:
            return self.mover.chain(read.wait, lambda: h2d(dev, host))
        return h2d(dev, host)

    def _after_oom(self, u, host, read, err: BaseException):
        """[Note: device OOM in a fetch] The copy into the arena allocates
        nothing, but a gather's or a copy's workspace can meet a device whose
        memory the activations took: the prefetch depth drops by one (for the
        rest of the run: the activations that filled the device come back
        every step), the allocator's cached blocks go back, and the copy is
        issued once more (on several ranks the depth stays: it orders the
        collectives). A second failure ends the fetch with a named error
        (a torch.OutOfMemoryError): the unit is absent again, no update ran,
        and the engine stops serving (faults.py): resume from the last
        checkpoint with a smaller device_memory."""
        if self.sharding.world == 1:  # on several ranks the prefetch order orders collectives: it stays
            self.oom_depth = max(0, self.depth() - 1)
        self.note("device out of memory in a fetch", unit=u.name, depth=self.depth())
        if self.modes.device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            return self._issue(u, host, read)
        except torch.OutOfMemoryError as again:
            d = u.dev
            self.tier.free(d.range)
            d.range = d.compute = None
            d.state = transition(u.name, "device", d.state, DeviceState.ABSENT)
            raise DeviceOutOfMemoryError(
                f"device out of memory while fetching unit {u.name!r} ({u.place.compute_bytes} bytes), twice: "
                f"{again}. The device tier is device_memory={self.tier.budget_bytes} bytes "
                f"({format_bytes(self.tier.budget_bytes)}); the rest of the device is for activations and "
                "workspaces. Lower device_memory to leave them more room, "
                "use activation checkpointing, or a smaller batch") from err

    def _wait(self, u) -> None:
        d = u.dev
        if d.state is DeviceState.FETCHING:
            t0 = time.perf_counter()
            d.ticket.wait_compute()
            self.stats.stall_seconds += time.perf_counter() - t0
            d.ticket = None
            d.state = transition(u.name, "device", d.state, DeviceState.RESIDENT)

    def depth(self) -> int:
        """The prefetch depth now: ``prefetch_depth``, lowered under memory pressure or after a device OOM."""
        return min([self.modes.depth] + [d for d in (self.depth_limit, self.oom_depth) if d is not None])

    def _prefetch(self) -> None:
        """Brings the plan's units up early, never evicting a unit needed
        sooner than the one being brought in."""
        depth = self.depth()
        if depth == 0 or not self.trace.has_trace or self.modes.params_on_device:
            return
        plan = policy.prefetch_plan(self.trace.upcoming(4 * depth + 4), depth, self.modes.prefetch_bytes,
                                    lambda i: self.units[i].dev.state is DeviceState.ABSENT,
                                    lambda i: self.units[i].place.compute_bytes)
        for idx in plan:
            u = self.units[idx]
            off = self._alloc(u, protect_before=self.trace.next_use(idx))
            if off is None:
                break
            self._begin(u, off)
            self.stats.prefetches += 1

    def prefetch_next_pass(self) -> None:
        """After ``step()``: the next training pass's first units start coming
        up (see [Note: the trace wraps around the step]).

        [Note: the trace wraps around the step]
        A pass's trace ends with its backward, so without more the next
        forward would fetch the root and its first units on demand, each
        waiting for its copy. At the end of ``step()`` every home holds the
        new values and the device copies were dropped (``invalidate``), so
        the head of the training trace is prefetched then, into free room
        only (nothing is evicted for it), and the copies overlap whatever
        runs before the next forward (zero_grad, the data loader). A write
        to a parameter meanwhile drops the copy as it drops any. Several
        ranks skip it (a ZeRO-3 fetch is a collective, issued in compute's
        order)."""
        depth = self.depth()
        if depth == 0 or self.modes.params_on_device or self.sharding.world > 1:
            return
        plan = policy.prefetch_plan(self.trace.head("train", 4 * depth + 4), depth, self.modes.prefetch_bytes,
                                    lambda i: self.units[i].dev.state is DeviceState.ABSENT,
                                    lambda i: self.units[i].place.compute_bytes)
        for idx in plan:
            u = self.units[idx]
            off = self._alloc(u, evict=False)
            if off is None:
                break
            self._begin(u, off)
            self.stats.prefetches += 1

    # -- release -------------------------------------------------------------------------

    def unpin(self, u) -> None:
        u.dev.pins -= 1
        assert u.dev.pins >= 0, u

    def begin_recompute(self, u) -> None:
        """``u`` was fetched for a recomputation inside backward (activation
        checkpointing): that fetch's pin stays until ``u``'s backward is done,
        since checkpoint holds recomputed views of ``u``'s range where the
        saved-tensor hooks cannot see them."""
        u.dev.recompute += 1

    def end_backward_of(self, u) -> None:
        """One call of ``u`` finished its backward: its hold and any
        recomputation pin go."""
        d = u.dev
        if d.held > 0:
            d.held -= 1
        if d.recompute:
            d.pins -= d.recompute
            d.recompute = 0
        self.settle()

    def end_pass(self) -> None:
        """Drops every backward hold and recomputation pin of the pass."""
        for u in self.units[1:]:
            d = u.dev
            d.held = 0
            if d.recompute:
                d.pins -= d.recompute
                d.recompute = 0
        self._wanted = []
        self._protected.clear()

    def evict(self, u) -> None:
        """Drops ``u``'s device copy (it must be unpinned)."""
        d = u.dev
        assert d.pins == 0 and not d.permanent, u
        if d.state is DeviceState.FETCHING:
            d.ticket.wait()  # the copy still writes into the range
            d.ticket = None
        self.detach(u)
        self.mover.release_marker()  # See [Note: device range reuse]
        self.tier.free(d.range)
        d.range, d.compute = None, None
        d.state = transition(u.name, "device", d.state, DeviceState.ABSENT)
        self.stats.evictions += 1

    def drop_copy(self, u) -> None:
        """Drops ``u``'s device copy before its home is overwritten (fetched
        again, with the new values, when next used); a unit in use refuses."""
        d = u.dev
        if not d.permanent and d.state is not DeviceState.ABSENT:
            if d.pins:
                raise UsageError(f"writing the values of unit {u.name!r} is in use by a forward/backward")
            self.evict(u)

    def permanent_copy(self, u) -> Optional[torch.Tensor]:
        """The device copy of a unit that lives on the device, else None."""
        return u.dev.compute if u.dev.permanent else None

    def write_permanent(self, u, values: torch.Tensor) -> None:
        """Writes ``values`` (the trainable part) into a device-resident unit's copy."""
        u.dev.compute[:values.numel()].copy_(values)

    def mark_external(self, u) -> bool:
        """``u`` is used outside its own forward: resident for whole passes
        from now on, at the top of the arena. True the first time."""
        if u.dev.external:
            return False
        u.dev.external = True
        return True

    def evict_unpinned(self) -> None:
        """Evicts every resident unit that nothing pins or holds."""
        for u in self.units:
            d = u.dev
            if d.state is not DeviceState.ABSENT and not d.permanent and d.pins == 0:
                self.evict(u)

    def invalidate(self, done=frozenset()) -> None:
        """The homes changed (an optimizer step): drops device copies (fetched
        again when used) or, for units that live on the device, refreshes
        them (:meth:`refresh`; not those whose indices are in ``done``,
        refreshed already) and waits."""
        tickets = []
        for u in self.units:
            d = u.dev
            if d.permanent:
                t = self.refresh(u) if u.index not in done else None
                if t is not None:
                    tickets.append(t)
            elif d.state is not DeviceState.ABSENT and d.pins == 0:
                self.evict(u)
        for t in tickets:
            t.wait()

    def refresh(self, u):
        """Copies a device-resident unit's new values up from its host copy,
        asynchronously: the ticket, or None when there is nothing to copy.
        The whole copy, or with ``modes.gather_on_device`` the own shard of
        the trainable range, all-gathered on the device group (collective:
        every rank refreshes the same units in the same order). See [Note:
        where the updated copies are gathered] in step/copy_gathers.py."""
        d, home = u.dev, self.source.home(u)
        if home is None:
            return None
        if not self.modes.gather_on_device:
            self.stats.moved("h2d", u.place.compute_bytes)
            return self.mover.h2d(d.compute, home)  # a live range: see [Note: refreshing a live range]
        tn = u.place.trainable_numel
        if not tn:
            return None  # frozen values change only through Values.write, which writes the device copy
        lo, hi = self.sharding.shard(tn)
        self.stats.moved("h2d", (hi - lo) * d.compute.element_size())
        return self.sharding.gather_units_params(d.compute[:tn], home[lo:hi], tn, h2d=self.mover.h2d, on_device=True)

    def device_stall_seconds(self) -> float:
        """Seconds compute waited for fetches: on CUDA from timing events
        around each stream wait (the host never blocks there), on the CPU the
        host's own waits."""
        clock = getattr(self.mover, "stall_clock", None)
        return clock.seconds() if clock is not None else self.stats.stall_seconds

    def drop_buffers(self) -> None:
        """After teardown: forgets every unit's device copy and the arena (see Engine._drop_buffers)."""
        for u in self.units:
            u.dev = DeviceRecord()
        if self.tier is not None:
            self.tier.arena = None

    def drop_in_flight(self) -> None:
        """Teardown: forgets fetch tickets still held (see Engine.close)."""
        for u in self.units:
            u.dev.ticket = None
