"""A unit's values into and out of every tier, for code outside the step:
the initial ones at ``initialize`` (from the model's tensors, or
materialised unit by unit from an ``infinity.init`` recording), values
loaded later (``infinity.load_pretrained``, ``load_checkpoint``, a write to
a managed parameter), and reads of a unit's buffers (``full_state_dict``,
checkpoints, a background save on its own thread).

Allocates each unit's buffers through their owners (host cache, gradients,
optimizer state, residency) and fills them; owns no state of its own.
"""

from __future__ import annotations

from typing import Dict, List, Optional

import torch
import torch.nn as nn

from .mechanism.nvme import key as swap_key
from .plan.opt_kinds import kind_dtype, kind_numel, state_kinds
from .plan.placement import stage1_full_grads
from .plan.state import OptState
from .plan.units import Layout

__all__ = ["Values"]


class Values:
    """Values into and out of every tier of ``parts``' units (parts.py: this
    uses ``host_cache``, ``room``, ``optstate``, ``grads``, ``residency``,
    ``sharding``, ``nvme``, ``fence``, ``values_changed``, ``units``, ``modes``)."""

    def __init__(self, parts):
        self.p = parts

    # -- at initialize -----------------------------------------------------------------

    @torch.no_grad()
    def initialize(self, model: nn.Module) -> None:
        """Places and fills every unit's buffers, then moves the model's
        buffers (non-parameter state) to the device."""
        units = self.p.units
        if any(s.param.is_meta for u in units for s in u.layout.slots):
            self._materialize(model)
        else:
            for u in units:
                self.init_unit(u, [s.param.detach().reshape(-1) for s in u.layout.slots])
        # Floating buffers take the compute dtype, as model.to(dtype) would do.
        for mod in model.modules():
            for name, b in list(mod._buffers.items()):
                if b is None:
                    continue
                nb = b.to(self.p.modes.device)
                mod._buffers[name] = nb.to(self.p.modes.dtype) if nb.is_floating_point() else nb

    def _materialize(self, model: nn.Module) -> None:
        """Built under infinity.init: each unit is materialised on its own,
        straight into its home tier (see infinity/lazy_init/)."""
        from ..lazy_init import recorder_of
        rec = recorder_of(model)
        if rec is None:
            raise ValueError("initialize: the model has parameters on the meta device but was not built "
                             "under `with infinity.init(config):`; build it there or give real tensors")
        units, done = self.p.units, set()

        def sink(index: int, values: List[torch.Tensor]) -> None:
            if index in done:
                raise RuntimeError(f"lazy init: unit {units[index].name!r} materialised twice")
            done.add(index)
            self.init_unit(units[index], values)

        rec.materialize([[s.param for s in u.layout.slots] for u in units], sink)
        missing = [u.name for u in units if u.index not in done]
        if missing:
            raise RuntimeError(f"lazy init: units never materialised: {missing}")

    def init_unit(self, u, originals: List[torch.Tensor]) -> None:
        """Allocates ``u``'s buffers in their tiers and fills them from
        ``originals`` (one tensor per slot, in slot order, any shape with the
        slot's numel)."""
        p, m = self.p, self.p.modes
        originals = [t.detach().reshape(-1) for t in originals]
        for s, src in zip(u.layout.slots, originals):
            if src.numel() != s.numel:
                raise ValueError(f"unit {u.name!r}: value for {s.name!r} has {src.numel()} elements, "
                                 f"expected {s.numel} (shape {tuple(s.shape)})")
        master = self._alloc_state(u)
        home, cached = self._alloc_home(u)
        self._fill(u, originals, master, home)
        if cached is not None:
            p.nvme.write(swap_key(u.index, "compute"), home).wait()
            p.host_cache.keep_cached(u, home, cached)
        elif home is not None:
            nxt = None
            if m.delayed:
                nxt = p.room.alloc(u.place.compute_numel, m.dtype)
                nxt.copy_(home)
            p.host_cache.set_home(u, home, nxt)
        if m.params_on_device:
            p.residency.place_permanent(u, originals)
        else:
            p.residency.detach(u)  # until fetched, a NaN stand-in of the right shape
        for s in u.layout.slots:
            s.param.requires_grad_(s.trainable)

    def _alloc_state(self, u):
        """Master, moments and gradient buffers of ``u`` in their tiers; the
        full-size tensor (the master's dtype) to fill the master from (None: no trainable)."""
        p, m, tn = self.p, self.p.modes, u.place.trainable_numel
        if not tn:
            return None
        sn, f32 = u.place.state_numel, torch.float32
        mdt = kind_dtype("master", m.moment_dtype, m.master_dtype)  # fp32, or bf16 (Config.master_dtype)
        if m.opt_nvme:
            shard = p.room.alloc(sn, f32) if m.zero else None
            p.grads.set_permanent(u, p.room.alloc(tn, f32) if stage1_full_grads(m) else None, shard=shard)
            return None  # the own shard goes to NVMe piece by piece (see _master_to_nvme)
        if m.host_optimizer:
            # [Note: low-bit moments in the engine] in opt_kinds.py: zeros are moments of zero.
            st = [p.room.alloc(kind_numel(k, sn), kind_dtype(k, m.moment_dtype, m.master_dtype))
                  for k in state_kinds(m.moment_dtype)]
            p.optstate.set_resident(u, *st)
            if m.zero:  # See [Note: ZeRO shards in infinity].
                p.grads.set_permanent(u, p.room.alloc(tn, f32) if stage1_full_grads(m) else None,
                                      shard=p.room.alloc(sn, f32))
                return torch.zeros(tn, dtype=mdt)
            p.grads.set_permanent(u, p.room.alloc(tn, m.grad_dtype),
                                  p.room.alloc(tn, m.grad_dtype) if m.delayed else None)
            return st[0]
        mk = lambda: torch.zeros(tn, dtype=f32, device=m.device)  # noqa: E731
        p.optstate.set_resident(u, mk(), mk(), mk())
        p.grads.set_permanent(u, mk())
        return u.opt.master

    def _alloc_home(self, u):
        """(this rank's home compute copy or None, pool handle when it is an NVMe copy cached)."""
        p, m = self.p, self.p.modes
        if m.compute_home_host:
            # Stage 3: this rank's shard only (see Sharding.gather_units_params).
            return p.room.alloc(u.place.home_numel, m.dtype), None
        if m.params_nvme:
            return p.room.acquire(u.place.home_numel, m.dtype, zero=True, compute=True)
        return None, None

    def _fill(self, u, originals, master, home) -> None:
        """Copies ``originals`` into the master (its shard kept) and the home copy."""
        p, m, tn = self.p, self.p.modes, u.place.trainable_numel
        # Stage 3 keeps a shard: the full copy is assembled first; else the slots go straight home.
        full = torch.zeros(u.place.compute_numel, dtype=m.dtype) if m.zero == 3 and home is not None else None
        for s, src in zip(u.layout.slots, originals):
            if s.trainable and master is not None:
                master[s.offset:s.offset + s.numel].copy_(src)
            dst = full if full is not None else home
            if dst is not None:
                dst[s.offset:s.offset + s.numel].copy_(src)
        if full is not None:
            home.copy_(p.sharding.shard_of_params(full, tn))
        if m.opt_nvme and tn:
            if not u.place.aliased:  # aliased: the master is the compute copy
                self._master_to_nvme(u, originals)
            p.optstate.set_home_nvme(u, None)
            return
        if master is None or master is u.opt.master:
            return
        lo, hi = p.sharding.shard(tn)
        u.opt.master.copy_(master[lo:hi])

    def _master_to_nvme(self, u, originals) -> None:
        """Writes ``u``'s master (this rank's shard) to its NVMe home from
        ``originals``, one swap extent at a time through a pool buffer of its
        size, and waits.

        [Note: initial masters in pieces]
        The master was once assembled whole in a temporary and then written:
        beside the pool, the unit's values being materialised and its cached
        compute copy, a 525 M-parameter vocabulary unit's master took 1 GiB
        (bf16) or 2 GiB (fp32) of RSS outside any budget at ``initialize``.
        Each extent (one per chunk of state streamed in chunks, else the
        whole master) is filled from the slots it overlaps into a host pool
        buffer, written, and the buffer freed when the write is done: the
        bytes are the whole master's, and the memory is the pool's, whose
        minimum holds a chunk (or a unit's) state buffers."""
        p = self.p
        lo, _ = p.sharding.shard(u.place.trainable_numel)
        slots = [(s, src) for s, src in zip(u.layout.slots, originals) if s.trainable]
        handles = []
        for key, a, b in p.optstate.pieces(u, "master"):
            t, buf = p.room.acquire(b - a, p.optstate.dtype_of("master"), zero=True, protect=u)
            for s, src in slots:
                x0, x1 = max(lo + a, s.offset), min(lo + b, s.offset + s.numel)
                if x0 < x1:
                    t[x0 - lo - a:x1 - lo - a].copy_(src[x0 - s.offset:x1 - s.offset])
            h = p.nvme.write(key, t)
            p.room.defer_release(h, buf)
            handles.append(h)
        for h in handles:
            h.wait()
        p.room.release_finished(block=False)  # the pieces' buffers back now, not at the next shortage

    # -- loaded later --------------------------------------------------------------------

    @torch.no_grad()
    def write(self, u, values: Dict[int, torch.Tensor], scratch=None, from_device: bool = False) -> None:
        """Overwrites parameters of ``u`` (slot index -> tensor of the slot's
        numel, any dtype) in every tier that holds them: fp32 master, compute
        home, and the device copy. Optimizer moments are left as they are.
        ``from_device``: the values were written into the device copy by
        torch (a forward's in-place call), which stays as it is."""
        p = self.p
        p.fence.wait_unit(u)
        p.grads.drain()
        if not from_device:
            p.residency.drop_copy(u)  # fetched again, with the new values, when next used
        # In memory buffers are written in place; NVMe homes are read, written and stored back
        # (not read where every slot is overwritten, as a checkpoint's load does).
        if u.host.busy is not None:
            u.host.busy.wait()  # a fetch may still read the home about to be overwritten, as in host_cache
        covers = len(values) == len(u.layout.slots)
        master = self._old_master(u, covers, scratch)
        home = self._old_home(u, covers, scratch)
        computes = [t for t in (home, u.host.next_compute) if t is not None]
        dev = p.residency.permanent_copy(u)
        if dev is not None and dev is not home:
            computes.append(dev)
        for i, t in values.items():
            s = u.layout.slots[i]
            src = t.detach().reshape(-1)
            if src.numel() != s.numel:
                raise ValueError(f"{s.name}: {src.numel()} elements given, the parameter has {s.numel} "
                                 f"(shape {tuple(s.shape)})")
            sl = slice(s.offset, s.offset + s.numel)
            if s.trainable and master is not None:
                _put(master[sl], src)
            for c in computes:
                _put(c[sl], src)
        self._store_written(u, master, home)
        p.values_changed(u, [u.layout.slots[i] for i in values], bump=not from_device)

    @torch.no_grad()
    def write_through(self, u, slots: List[int]) -> None:
        """torch wrote ``u``'s parameters ``slots`` (indices into its slots)
        in place in their device copy during forward (see [Note: writes in
        forward] in hooks.py): the elements that differ from the master
        rounded to the compute dtype (what the copy was made from) go to the
        fp32 master, the slots to every compute copy."""
        master = self.p.optstate.read(u, "master") if any(u.layout.slots[i].trainable for i in slots) else None
        values = {}
        for i in slots:
            s = u.layout.slots[i]
            dev = s.param.detach().reshape(-1)
            if not s.trainable:
                values[i] = dev
                continue
            # Unchanged elements keep their fp32 value (the compute copy may be rounded).
            new = master[s.offset:s.offset + s.numel].clone()
            dev = dev.to(new.device)
            changed = dev != new.to(dev.dtype)
            new[changed] = dev[changed].to(torch.float32)
            values[i] = new
        self.write(u, values, from_device=True)

    def _old_master(self, u, covers: bool, scratch) -> Optional[torch.Tensor]:
        """The full master to overwrite: the buffer itself where it is whole in
        memory, else a temporary (its old values read unless ``covers``)."""
        p, o = self.p, u.opt
        if not u.place.trainable:
            return None
        p.optstate.forget_read_ahead(u)  # else the next step would use the old values read ahead
        if covers and o.state is not OptState.NONE and (o.master is None or p.modes.zero):
            return _blank(scratch, u.place.trainable_numel, p.optstate.dtype_of("master"), u.layout.trainable_slots)
        return p.optstate.read(u, "master")

    def _old_home(self, u, covers: bool, scratch) -> Optional[torch.Tensor]:
        """The full home compute copy to overwrite (see :meth:`_old_master`)."""
        p = self.p
        if covers and p.modes.zero == 3:
            return _blank(scratch, u.place.compute_numel, p.modes.dtype, u.layout.slots)
        if covers and u.host.compute is None and p.host_cache.nvme_home(u):
            p.host_cache.settle_write_back(u)  # the old copy's write-back lands before the new copy's write
            return _blank(scratch, u.place.home_numel, p.modes.dtype, u.layout.slots)
        return self._home_compute(u)  # the host copy, written whole (dev, the device copy, is written beside it)

    def _store_written(self, u, master, home) -> None:
        """Writes the master shard and the home compute copy back to where they live."""
        p, m = self.p, self.p.modes
        if master is not None:
            lo, hi = p.sharding.shard(u.place.trainable_numel)
            if m.opt_nvme and not u.place.aliased:  # aliased: written below with the compute copy
                p.optstate.write_home(u, "master", master[lo:hi])
            elif m.zero and not m.opt_nvme:
                u.opt.master.copy_(master[lo:hi])
        if m.zero == 3:
            home = p.sharding.shard_of_params(home, u.place.trainable_numel)
            if u.host.compute is not None:
                u.host.compute.copy_(home)
        if p.host_cache.nvme_home(u):
            p.host_cache.store_compute(u, home)

    # -- read by code outside the step ----------------------------------------------------

    @torch.no_grad()
    def read(self, u, kind: str) -> Optional[torch.Tensor]:
        """``u``'s full buffer of ``kind`` ("master", "exp_avg", "exp_avg_sq",
        "compute") from wherever it lives (a temporary copy for NVMe homes);
        None if it has none. Collective under ZeRO: every rank calls it."""
        return self.read_compute(u) if kind == "compute" else self.p.optstate.read(u, kind)

    def read_stored(self, u, kind: str) -> Optional[torch.Tensor]:
        """:meth:`read`, with optimizer state of any kind in its stored dtype
        (bf16 moments, int8 codes and their scales: what a checkpoint keeps)."""
        return self.read_compute(u) if kind == "compute" else self.p.optstate.read_raw(u, kind)

    def read_detached(self, u, kind: str) -> Optional[torch.Tensor]:
        """:meth:`read` for a reader on another thread while training runs (a
        background save; ZeRO stage 0, one rank). Updates wait for it
        (the engine's fence), so homes hold still; but buffers of the host pool
        (cached compute copies, optimizer state read ahead) may be filled,
        evicted and reused meanwhile: a cached copy is cloned under the host
        lock, and NVMe-homed optimizer state is read from its home."""
        p = self.p
        if kind == "compute" or (kind == "master" and u.place.aliased):
            t = self._compute_detached(u)
            if t is None:
                t = p.residency.permanent_copy(u)
            return t if kind == "compute" else t[:u.place.trainable_numel]
        if p.modes.opt_nvme:
            return p.optstate.read_home(u, kind) if u.place.trainable else None
        return self.read_stored(u, kind)

    def _compute_detached(self, u) -> Optional[torch.Tensor]:
        """``u``'s host compute copy for a reader on another thread: a copy
        cached in the pool is cloned under the host room's lock (once any read
        filling it is done), an NVMe home is read into a temporary; a host
        home is returned as it is (updates wait for the reader: the fence)."""
        p, h = self.p, u.host
        with p.room.lock:
            if h.compute is not None:
                if h.buf is None:
                    return h.compute
                if h.busy is not None:
                    h.busy.wait()
                return h.compute.clone()
            if not p.host_cache.nvme_home(u):
                return None
            p.host_cache.settle_write_back(u)
        return p.host_cache.read_nvme_home(u)

    def read_compute(self, u) -> Optional[torch.Tensor]:
        """``u``'s full compute copy: a CPU tensor (gathered under ZeRO-3), or
        the device copy of a unit that lives on the device where the host
        copy has none or is current in the own shard only (see [Note: where
        the updated copies are gathered] in step/copy_gathers.py)."""
        p = self.p
        if p.modes.zero == 3:
            shard = p.host_cache.read_compute(u)
            full = torch.empty(u.place.compute_numel, dtype=p.modes.dtype)
            p.sharding.gather_units_params(full, shard, u.place.trainable_numel).wait()
            return full
        dev = p.residency.permanent_copy(u) if p.modes.gather_on_device else None
        return dev if dev is not None else self._home_compute(u)

    def _home_compute(self, u) -> Optional[torch.Tensor]:
        """Stages 0-2: the host compute copy, else the device copy of a unit that lives there."""
        t = self.p.host_cache.read_compute(u)
        return t if t is not None else self.p.residency.permanent_copy(u)


def _blank(scratch, numel: int, dtype: torch.dtype, slots) -> torch.Tensor:
    """A temporary of ``numel`` elements whose slots are about to be
    overwritten: the gaps between ``slots`` and the tail zeroed (they stay
    defined in the tiers), from ``scratch`` where given."""
    if scratch is None:
        return torch.zeros(numel, dtype=dtype)
    t = scratch(numel, dtype)
    Layout.zero_padding(t, slots)
    return t


def _put(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst`` = ``src``, unless ``src`` is ``dst`` itself (a load read into the buffer in place)."""
    if dst.data_ptr() != src.data_ptr() or dst.dtype != src.dtype:
        dst.copy_(src)
