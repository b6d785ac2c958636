"""The fp32 master and Adam moments of every unit: resident in memory (host
or device) for good, or homed on NVMe and checked out to host buffers for
the unit being updated, read ahead while another is, checked in (written
back with the update's checksums) after; a unit larger than a chunk is
streamed through the host chunk by chunk.

Owns ``unit.opt`` (an :class:`OptRecord`); nothing else writes it. See
[Note: NVMe homes and the host cache] in nvme.py and [Note: optimizer-state
states] in state.py.

[Note: state streamed in chunks]
A unit whose NVMe state (this rank's shard) is larger than
``Config.state_chunk_bytes`` of fp32 (``UnitPlacement.chunked``) keeps each
kind in the swap files as one extent per chunk (``key(unit, kind, c)``,
chunk c holding state elements ``UnitPlacement.windows[c]``). Its update
(:meth:`OptimizerState.stream`) reads chunk c+1 while chunk c is updated
while chunk c-1 is written back, each chunk in its own pool buffers; the
host holds at most two chunk sets of master and moments besides the writes
in flight, whatever the unit's size, and the host budget counts
``PIPELINE_STATE_BUFFERS`` chunk buffers (limits.py) instead of buffers of
the largest unit. The bytes are those of a whole-unit update: AdamW is
elementwise, a chunk starts on a multiple of 64 Ki elements (whole int8
blocks with their scales; whole checksum chunks, so the kernel's sums of a
chunk are its extent's), and every chunk runs with the same step and
hyper-parameters. Such a unit is checked out without a read (an aliased
master, the cached compute copy, is locked whole as before) and never read
ahead. A fault mid-stream leaves the chunks before it updated on NVMe and
the rest not: the engine fails, as after any fault ([Note: a run is
consistent or it says so] in faults.py). Left whole: the unit's gradients
(one host buffer from its first gradient to its update).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from ..mechanism.nvme import key as swap_key
from ..plan.opt_kinds import MASTER_KINDS, kind_dtype, kind_numel, scale_kind, state_kinds
from .state_codec import encode_moment, to_fp32
from ..plan.placement import nbytes, round_pool
from ..plan.state import OptState, transition
from ..mechanism.tiers import BudgetError

__all__ = ["OptRecord", "OptimizerState", "KINDS", "to_fp32", "encode_moment"]

KINDS = MASTER_KINDS  # and the int8 scales: plan/opt_kinds.state_kinds


@dataclass
class OptRecord:
    """A unit's optimizer state (written by optstate.py only)."""

    state: OptState = OptState.NONE
    master: Optional[torch.Tensor] = None
    exp_avg: Optional[torch.Tensor] = None
    exp_avg_sq: Optional[torch.Tensor] = None
    exp_avg_scale: Optional[torch.Tensor] = None     # int8 moments: fp32 scale per block
    exp_avg_sq_scale: Optional[torch.Tensor] = None
    bufs: list = field(default_factory=list)  # pool handles while checked out (or read ahead)
    pending: Optional[list] = None            # reads of a read-ahead not claimed yet
    fresh: bool = False                       # NVMe moments never written: they are zeros


class OptimizerState:
    """Master and moments of ``units``, in buffers of the shared host pool
    ``room``; ``cache`` is the host cache (the master when it is the compute
    copy; compute copies to evict for a read-ahead)."""

    def __init__(self, units, modes, room, cache, nvme, sharding):
        self.units, self.modes, self.room, self.host_cache = units, modes, room, cache
        self.nvme, self.sharding = nvme, sharding
        self.moment_dtype, self.master_dtype = modes.moment_dtype, modes.master_dtype
        self.kinds = state_kinds(self.moment_dtype)  # [Note: low-bit moments in the engine] in opt_kinds.py
        for u in units:
            u.opt = OptRecord()

    def dtype_of(self, kind: str) -> torch.dtype:
        """The stored dtype of ``kind`` (Config.moment_dtype's moments, Config.master_dtype's master)."""
        return kind_dtype(kind, self.moment_dtype, self.master_dtype)

    def drop_buffers(self) -> None:
        """After teardown: forgets every unit's optimizer-state buffers (see Engine._drop_buffers)."""
        for u in self.units:
            u.opt = OptRecord()

    # -- placement ------------------------------------------------------------------------

    def set_resident(self, u, master, exp_avg, exp_avg_sq, exp_avg_scale=None, exp_avg_sq_scale=None) -> None:
        """Master and moments (and int8 moments' scales) kept in memory for good (host or device)."""
        o = u.opt
        o.master, o.exp_avg, o.exp_avg_sq = master, exp_avg, exp_avg_sq
        o.exp_avg_scale, o.exp_avg_sq_scale = exp_avg_scale, exp_avg_sq_scale
        o.state = transition(u.name, "optimizer state", o.state, OptState.RESIDENT)

    def resident_view(self, u, kind: str) -> Optional[torch.Tensor]:
        """``u``'s whole ``kind`` buffer (fp32, its trainable numel) where it
        lives in host memory unsharded, for a loader to read into in place;
        else None."""
        o = u.opt
        if o.state is not OptState.RESIDENT or self.modes.zero or not u.place.trainable:
            return None
        t = getattr(o, kind)
        if t is None or t.device.type != "cpu" or t.dtype != torch.float32:
            return None
        return t[:u.place.trainable_numel]

    def set_home_nvme(self, u, master_shard: Optional[torch.Tensor]) -> None:
        """Master (unless aliased to the compute copy) written to NVMe; the
        moments start as zeros, read from nowhere until first written."""
        o = u.opt
        if master_shard is not None:
            self.write_home(u, "master", master_shard)
        o.fresh = True
        o.state = transition(u.name, "optimizer state", o.state, OptState.HOME)

    # -- check out / in ---------------------------------------------------------------------

    def checkout(self, u) -> list:
        """Starts reading ``u``'s master and moments from NVMe into host
        buffers for its update; the handles to wait on (a read-ahead's, if
        one ran). Memory-resident state needs nothing: []."""
        o = u.opt
        if o.state is OptState.RESIDENT:
            return []
        with self.room.lock:
            if o.state is OptState.READING_AHEAD:
                handles, o.pending = o.pending, None
                o.state = transition(u.name, "optimizer state", o.state, OptState.CHECKED_OUT)
                return handles
            handles = self._read(u)
            o.state = transition(u.name, "optimizer state", o.state, OptState.CHECKED_OUT)
            return handles

    def pieces(self, u, kind: str) -> list:
        """(swap key, first, end) of each extent holding ``kind`` of ``u``'s
        NVMe state, in elements of the kind: one, or one per chunk
        (See [Note: state streamed in chunks])."""
        p = u.place
        if not p.chunked:
            return [(swap_key(u.index, kind), 0, kind_numel(kind, p.state_numel))]
        return [(swap_key(u.index, kind, c), kind_numel(kind, c0), kind_numel(kind, c1))
                for c, (c0, c1) in enumerate(p.windows)]

    def write_home(self, u, kind: str, shard: torch.Tensor) -> None:
        """Writes ``kind`` (this rank's shard, stored dtype) to its NVMe home and waits."""
        handles = [self.nvme.write(k, shard[a:b].contiguous()) for k, a, b in self.pieces(u, kind)]
        for h in handles:
            h.wait()

    def _read(self, u) -> list:
        """Host buffers for ``u``'s state and the reads filling them (with the host room's lock)."""
        o, tn = u.opt, u.place.state_numel
        handles, bufs, kinds = [], [], self.kinds
        if u.place.aliased:
            # The master is the cached compute copy, held until checkin.
            comp, read = self.host_cache.lock_master(u)
            if read is not None:
                handles.append(read)
            o.master = comp[:tn]
            kinds = kinds[1:]
        if u.place.chunked:
            return handles  # read chunk by chunk in stream()
        for kind in kinds:
            fresh = kind != "master" and o.fresh
            t, buf = self.room.acquire(kind_numel(kind, tn), self.dtype_of(kind), zero=fresh,
                                       protect=u)
            setattr(o, kind, t)
            bufs.append(buf)
            if not fresh:
                handles.append(self.nvme.read(swap_key(u.index, kind), t))
        o.bufs = bufs
        return handles

    def checkin(self, u, sums: Optional[dict], keep_old: bool = False) -> None:
        """Writes ``u``'s updated state back to NVMe (asynchronously; the
        buffers are freed when the writes are done), with the update's
        checksums ``sums`` (kind -> sums, or None). ``keep_old``: a
        speculative update's, to the extents :meth:`reserve_copy` set aside,
        the old state kept until :meth:`settle_copy`. Resident state: nothing."""
        o = u.opt
        if o.state is OptState.RESIDENT:
            return
        sums = sums or {}
        for kind, buf in zip(self._home_kinds(u), o.bufs):
            h = self.nvme.write(swap_key(u.index, kind), getattr(o, kind), sums.get(kind), keep_old)
            self.room.defer_release(h, buf)
        self._forget(u)
        o.fresh = False

    def stream(self, u, update, keep_old: bool = False, grad=None) -> None:
        """Runs ``update(window)`` (returning the kernel's checksums, kind ->
        sums, or None) once per chunk of ``u``'s checked-out state, with
        ``u.opt``'s buffers the chunk's: reads chunk c+1 meanwhile and writes
        chunk c back after (``keep_old``: copy-on-write, as :meth:`checkin`).
        ``grad``: a grad_chunks.GradStream whose chunks are read alongside
        (its ``current`` the chunk's gradients). See [Note: state streamed in
        chunks] and [Note: gradients streamed in chunks] in grad_chunks.py."""
        o, wins = u.opt, u.place.windows
        kinds = self._home_kinds(u)
        whole_master = o.master  # aliased: the cached compute copy, locked at checkout
        cur, nxt = None, self._read_chunk(u, kinds, 0, grad)
        try:
            for c, (c0, c1) in enumerate(wins):
                cur, nxt = nxt, None
                for h in cur[1]:
                    h.wait()
                if c + 1 < len(wins):
                    nxt = self._read_chunk(u, kinds, c + 1, grad)
                for kind, t in zip(kinds, cur[0]):
                    setattr(o, kind, t)
                if u.place.aliased:
                    o.master = whole_master[c0:c1]
                if grad is not None:
                    grad.current = cur[3]
                sums = update((c0, c1)) or {}
                for kind, t, buf in zip(kinds, cur[0], cur[2]):
                    self.room.defer_release(self.nvme.write(swap_key(u.index, kind, c), t, sums.get(kind), keep_old),
                                           buf)
                for buf in cur[2][len(kinds):]:  # the gradient chunk: read only
                    self.room.release(buf)
                cur = None
        finally:
            for piece in (cur, nxt):  # after a fault: the reads settle, the buffers go back
                if piece is not None:
                    _settle(piece[1])
                    for buf in piece[2]:
                        self.room.release(buf)
            for kind in kinds:
                setattr(o, kind, None)
            o.master = whole_master
            if grad is not None:
                grad.current = None

    def _read_chunk(self, u, kinds, c: int, grad=None) -> tuple:
        """(tensors, read handles, pool handles, gradient chunk or None) of
        chunk ``c`` of ``u``'s ``kinds`` (and of ``grad``'s chunk, its pool
        handle last)."""
        c0, c1 = u.place.windows[c]
        ts, handles, bufs = [], [], []
        g = grad.read(c) if grad is not None else None
        if g is not None:
            handles.append(g[1])
        for kind in kinds:
            fresh = kind != "master" and u.opt.fresh
            t, buf = self.room.acquire(kind_numel(kind, c1) - kind_numel(kind, c0),
                                       self.dtype_of(kind), zero=fresh, protect=u)
            ts.append(t)
            bufs.append(buf)
            if not fresh:
                handles.append(self.nvme.read(swap_key(u.index, kind, c), t))
        return ts, handles, bufs + ([g[2]] if g is not None else []), (g[0] if g is not None else None)

    # -- copy-on-write (speculative updates) ---------------------------------------------------

    def _home_kinds(self, u) -> tuple:
        """The kinds ``u`` keeps under its own swap keys (an aliased master is the compute copy's)."""
        return self.kinds[1:] if u.place.aliased else self.kinds

    def reserve_copy(self, u) -> bool:
        """Fresh swap extents for a speculative check-in of ``u``'s NVMe state,
        each chunk's too (see [Note: copy-on-write keys] in io/swap/store.py);
        False, nothing reserved, when the swap files cannot hold a second copy now."""
        done = []
        for kind in self._home_kinds(u):
            for k, a, b in self.pieces(u, kind):
                if not self.nvme.reserve(k, nbytes(b - a, self.dtype_of(kind))):
                    for d in done:
                        self.nvme.unreserve(d)
                    return False
                done.append(k)
        return True

    def release_copy(self, u) -> None:
        """Gives back the extents :meth:`reserve_copy` set aside and no check-in used."""
        for k in self._home_keys(u):
            self.nvme.unreserve(k)

    def settle_copy(self, u, keep: bool, fresh: bool = False) -> None:
        """After a speculative check-in: ``keep``, the new state stands and the
        old extents are freed; else ``u``'s swap keys hold the state of before
        again (``fresh``: its moments were never written, zeros). Extents
        reserved and not written are given back either way."""
        for k in self._home_keys(u):
            if keep:
                self.nvme.commit(k)
            else:
                self.nvme.rollback(k)
        if not keep:
            u.opt.fresh = fresh

    def _home_keys(self, u) -> list:
        """The swap keys of ``u``'s own NVMe state, one per kind and chunk."""
        return [k for kind in self._home_kinds(u) for k, _, _ in self.pieces(u, kind)]

    def discard(self, u) -> None:
        """Gives back the buffers of state checked out or read ahead and not
        changed (a unit with no gradient this step; the NVMe copies stand)."""
        o = u.opt
        if o.state is OptState.RESIDENT:
            return
        with self.room.lock:
            for buf in o.bufs:
                self.room.release(buf)
            if u.place.aliased and o.state is not OptState.HOME:
                self.host_cache.unlock_master(u)
            self._forget(u)

    def forget_read_ahead(self, u) -> None:
        """Drops a read-ahead of ``u``'s old state (its values are about to be replaced)."""
        o = u.opt
        if o.state is OptState.READING_AHEAD:
            for h in o.pending:
                h.wait()
            self.discard(u)

    def _forget(self, u) -> None:
        o = u.opt
        o.bufs, o.pending = [], None
        o.master = o.exp_avg = o.exp_avg_sq = o.exp_avg_scale = o.exp_avg_sq_scale = None
        if o.state is not OptState.HOME:
            o.state = transition(u.name, "optimizer state", o.state, OptState.HOME)

    # -- read-ahead ----------------------------------------------------------------------

    def read_ahead(self, u, evict_done: bool = False) -> bool:
        """Starts checking ``u`` out early if the host budget has room now; its
        update then finds the state read. ``evict_done``: make room by
        evicting cached compute copies this pass no longer uses (writing dirty
        ones back); else never waits. True if the reads started."""
        if u.opt.state is not OptState.HOME or not u.place.trainable or u.place.chunked:
            return False  # a chunked unit's state is read by its update, chunk by chunk
        need = self._read_ahead_bytes(u)
        freeing = 0
        with self.room.lock:
            while evict_done and self.room.free_bytes + freeing < need:
                n = self.host_cache.evict_one(u, done_only=True, wait=False)
                if not n:
                    break
                freeing += n
        if freeing:
            # The write-backs finish without the lock, which the compute
            # thread needs meanwhile for its gradient buffers.
            self.room.wait_deferred()
        with self.room.lock:
            if u.opt.state is not OptState.HOME:
                return False
            self.room.release_finished(block=False)
            if self.room.free_bytes < need:
                return False
            try:
                pending = self._read(u)
            except BudgetError:
                return False
            u.opt.pending = pending
            u.opt.state = transition(u.name, "optimizer state", u.opt.state, OptState.READING_AHEAD)
            return True

    def _read_ahead_bytes(self, u) -> int:
        p = u.place
        need = sum(round_pool(nbytes(kind_numel(k, p.state_numel), self.dtype_of(k)))
                   for k in (self.kinds[1:] if p.aliased else self.kinds))
        if p.aliased and u.host.compute is None:
            need += round_pool(nbytes(p.compute_numel, self.modes.dtype))
        return need + round_pool(nbytes(p.trainable_numel, torch.float32))  # the gradients arriving meanwhile

    def drop_read_ahead(self, protect) -> bool:
        """The ladder's last rung (with the host room's lock): gives back one state
        read ahead and not claimed (a read-ahead is a cache; memory needed now
        comes first; the update reads it again). True if one was dropped."""
        for u in self.units:
            if u is protect or u.opt.state is not OptState.READING_AHEAD:
                continue
            for h in u.opt.pending:
                h.wait()
            self.discard(u)
            return True
        return False

    # -- reading ---------------------------------------------------------------------------

    @torch.no_grad()
    def read(self, u, kind: str) -> Optional[torch.Tensor]:
        """``u``'s full ``kind`` ("master", "exp_avg", "exp_avg_sq") as an fp32
        CPU (or device) tensor from wherever it lives: the buffer itself, or a
        temporary (low-bit moments decoded; gathered over the ranks under
        ZeRO: every rank calls this); None if the unit has no optimizer state."""
        t = self.read_raw(u, kind)
        if t is None or kind == "master" or self.moment_dtype == "fp32":
            return t
        return to_fp32(kind, t, self.read_raw(u, scale_kind(kind)) if t.dtype == torch.uint8 else None)

    @torch.no_grad()
    def read_raw(self, u, kind: str) -> Optional[torch.Tensor]:
        """:meth:`read` of any of ``self.kinds`` in its stored dtype (int8
        codes, their scales); None if the unit has no optimizer state."""
        o, p = u.opt, u.place
        if not p.trainable:
            return None
        t = getattr(o, kind)
        if t is None and o.state is OptState.NONE:
            return None
        if t is None:
            t = self.read_home(u, kind)
        if self.modes.zero:
            return self.sharding.all_gather(t, kind_numel(kind, p.trainable_numel))
        return t

    def read_home(self, u, kind: str) -> torch.Tensor:
        """A temporary copy of ``kind`` (stored dtype) from its NVMe home (this rank's shard)."""
        p = u.place
        if kind == "master" and p.aliased:
            return self.host_cache.read_compute(u)[:p.trainable_numel]
        numel, dtype = kind_numel(kind, p.state_numel), self.dtype_of(kind)
        if kind != "master" and u.opt.fresh:
            return torch.zeros(numel, dtype=dtype)
        out = torch.empty(numel, dtype=dtype)
        for h in [self.nvme.read(k, out[a:b]) for k, a, b in self.pieces(u, kind)]:
            h.wait()
        return out

    def write_moments(self, u, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> None:
        """Replaces ``u``'s moments by the full tensors given (CPU fp32 of the
        unit's trainable numel; stored as ``moment_dtype``), this rank's shard
        of them under ZeRO, wherever they live (in place in memory, rewritten on NVMe)."""
        self.write_moments_from(u, {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}.__getitem__)

    @torch.no_grad()
    def write_moments_from(self, u, source, stored: bool = False) -> None:
        """:meth:`write_moments` with ``source(kind)`` giving each full tensor
        in turn, asked for once the one before is written (a loader may
        hand out one buffer for both). ``stored``: ``source`` gives every
        kind but the master already in the stored dtype (a checkpoint of the
        same ``moment_dtype``: int8 codes and their scales), copied as they are."""
        o, p = u.opt, u.place
        self.forget_read_ahead(u)
        lo, hi = self.sharding.shard(p.trainable_numel)
        kinds = self.kinds[1:] if stored else ("exp_avg", "exp_avg_sq")
        for kind in kinds:
            full = source(kind)
            if stored:
                a, b = kind_numel(kind, lo), kind_numel(kind, hi)  # blocks: shards start on one
                enc = {kind: full[a:b]}
            else:
                enc = encode_moment(kind, full[lo:hi], self.moment_dtype)
            for k, shard in enc.items():
                self._write_kind(u, k, shard)
        if o.state is OptState.HOME:
            o.fresh = False

    def _write_kind(self, u, kind: str, shard: torch.Tensor) -> None:
        o = u.opt
        if o.state is OptState.RESIDENT:
            dst = getattr(o, kind)
            if dst.data_ptr() != shard.data_ptr():  # else read into it in place (resident_view)
                dst.copy_(shard)
        elif o.state is OptState.HOME:
            self.write_home(u, kind, shard)
        else:
            raise RuntimeError(f"internal: unit {u.name!r}: moments written while {o.state.value}")

    def kept_bytes(self) -> dict:
        """Bytes kept for good in memory per kind (the ZeRO 1/N shares)."""
        out = {k: 0 for k in self.kinds}
        for u in self.units:
            if u.opt.state is not OptState.RESIDENT:
                continue
            for kind in self.kinds:
                t = getattr(u.opt, kind)
                out[kind] += t.numel() * t.element_size()
        return out

    def bytes_per_parameter(self) -> float:
        """Bytes of optimizer state (master, moments, scales) this rank keeps
        in memory and on NVMe, as those tiers counted them, per element of its
        state (an aliased master is the compute copy's: not counted); 0.0 without state."""
        numel = sum(u.place.state_numel for u in self.units if u.place.trainable)
        held = sum(self.kept_bytes().values()) + sum(self.nvme_bytes().values())
        return held / numel if numel else 0.0

    def nvme_bytes(self) -> dict:
        """Bytes of each kind the swap files hold (as the NVMe tier counted
        them when written; an aliased master is the compute copy's)."""
        out = {k: 0 for k in self.kinds}
        if self.nvme is not None:
            for kind in self.kinds:
                out[kind] = self.nvme.bytes_of([k for u in self.units for k, _, _ in self.pieces(u, kind)])
        return out


def _settle(handles) -> None:
    """Waits for ``handles`` ignoring their errors (cleanup after a fault: the first one is what the user sees)."""
    for h in handles:
        try:
            h.wait()
        except Exception:  # noqa: BLE001
            pass
