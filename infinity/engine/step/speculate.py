"""Speculative updates: overlap="backward" keeps the optimizer behind
backward when clipping or fp16 loss scaling is on.

[Note: speculative updates]
The clip coefficient and the fp16 overflow check need every gradient, so
without speculation each update waits for ``step()``. Speculating, each
unit's update runs during backward as if the step's gradient scale were the
one without clipping (``Scaling.base_scale``: 1 / world, times 1 / loss
scale with fp16) and no gradient overflowed:

- *Undo state.* The update's own kernel calls save the bytes they
  overwrite into one host-pool buffer of the unit (``undo_bytes`` in
  plan/placement.py, in the host budget's capacity): the fp32 master, both
  moments and the compute copy, for the ranges each call writes. An fp32
  compute copy of host-resident fp32 state without ZeRO is the master's
  bits (the update writes it from the master, ``initialize`` and every
  write of values fill both from the same values), so it is not kept: a
  rollback copies the saved master's bytes of the slots the update wrote
  (``undo_keeps_compute`` in placement.py; 4 of the 16 bytes a parameter
  the save would write)
  (``adamw_step_(saves=)``: [Note: the undo state saved in the step's pass]
  in native/src/adam.cpp), and the slots' step counts as the update
  begins. The buffer is taken on the autograd thread as the update is
  queued (the root's with the first one: its update ends backward, on the
  step's critical path, so its whole state is copied ahead while backward
  runs, and its update saves nothing more), only if the pool has room then
  (``HostRoom.try_acquire``: nothing is evicted for it); a unit that finds
  none waits for ``step()`` like before, and the run says so once (a
  warning, and ``stats()``).
- *Validation.* ``step()`` takes the norm over every unit's gradients, in
  program order, exactly as overlap="step" does (the gradients stay in their
  buffers until then), and so the same clip coefficient and overflow flag.
  The step's scale is ``base_scale * coef``; when it equals the scale the
  speculative updates ran with, bit for bit, and the norm is finite, the
  kernel calls of overlap="step" would have had the same inputs: the
  speculation is committed (the undo buffers go back to the pool). A
  speculated unit's share of the norm (``Gradients.take_norm_part``, stage
  0, host gradients) is taken in its update's job, on that thread alone,
  from the same final gradients, so ``step()`` sums it instead of reading
  them on the critical path. Its bits are those ``step()`` would get: the
  share is the native fixed-split sum, whose order depends on no thread
  count (See [Note: the norm's shares have fixed bits] in
  owners/grad_norm.py). Without the native library, ``step()`` takes
  every share.
- *Replay.* Otherwise every speculatively updated unit gets its undo state
  copied back (the same bytes as before its update: master, moments, step
  counts; the compute copy only for a skipped step, since a replay writes
  every element of it the speculative update wrote: the same slots got
  gradients), and the step continues as overlap="step"'s would from the
  same state: every unit updated with the true scale, or none on an
  overflow. The kernel is deterministic for given inputs, so the
  result is overlap="step"'s bit for bit. Device copies are refreshed in
  either case (``Residency.invalidate``).
- *Prediction.* A step speculates only where the previous one would have
  committed: no clipping and a finite norm (``observe``, called by every
  ``step()``, speculated or not). Gradient norms move little from step to
  step, so a run that clips every step (a Hugging Face run's first steps at
  ``max_grad_norm=1.0``) waits for ``step()`` instead of paying a
  speculative update and its replay each step; the first step without a
  clip turns speculation back on for the next.
- *Back-off.* Where clipping comes and goes (a norm near the threshold),
  a wrong prediction costs a replay. After a replay the next steps wait for
  ``step()``: 1, then 2, 4 and at most ``MAX_BACKOFF`` steps after replays
  in a row; a committed speculation ends the back-off.
- *Low-bit state.* Low-bit moments and a bf16 master ([Note: a bf16 master
  in the engine] in update.py) are copied into the undo buffer whole, ahead
  of the update (``begin``), as their kernels save nothing in their pass.
  The bf16 master's stochastic rounding is keyed by the step count, which
  the rollback restores, so a replay rounds as overlap="step" does.

[Note: speculation on several ranks]
Under data parallelism (stage 0) and ZeRO 1-3 each rank speculates on what
it updates: the whole unit at stage 0, its own shard at stages 1-3. The
update is queued only once that input is final, as without clipping: after
the unit's all-reduce (stage 0) or reduce-scatter (1-3; stage 1, whose
overlap="step" reduces in ``step()``, reduces in the window's last backward
when updates may start early: ``BackwardSchedule._reduces_in_backward``),
which the update's job waits for (``Gradients.wait``). The undo state
covers what this rank's update writes: the shard's master and moments, and
of the compute copy the own shard's elements (``_Undo.lo``: its offset in
the full copy at stages 1-2; at stage 3 the home copy is the shard). The decision is the same on every
rank because it reads reduced values only: the norm ``step()`` takes over
the reduced gradients (summed over the ranks' shards at 2-3, the same
all-reduced bytes on every rank at stage 0) and the loss scale, which every
rank moves alike; so are the back-off's counters. A rank whose pool had no
room for some unit's undo state updates that unit in ``step()``: the bytes
are the same, the collectives too (reductions happen whether or not the
update starts early). Stages 1-2's all-gather of the new compute copies
runs in ``step()`` after every update, committed or replayed (and not at
all for a skipped step), so it always carries overlap="step"'s bytes.

[Note: speculation with NVMe optimizer state]
With ``offload_optimizer="nvme"`` the old state is kept where it is, on
disk: a speculative update's check-in writes the new master and moments to
fresh extents, and the old ones stay mapped aside until ``step()`` decides
([Note: copy-on-write keys] in io/swap/store.py). The fresh extents are
reserved with the undo buffer, on the autograd thread
(``OptimizerState.reserve_copy``); where the swap files have no room for
them the unit waits for ``step()`` (said once; ``units_without_disk``). The
swap files are sized for the second copy (``HostNeed.cow_bytes``). The host
undo buffer holds the compute copy's part only, copied ahead in the update's
job. The unit's gradients stay in their host buffer until ``step()`` where
the host pool was sized for every unit's at once (``host_memory`` at least
the pool's capacity: nothing can wait for their room); else they are
spilled after the update, as overlap="step" spills them, after taking the
unit's share of the norm from them (so ``step()``'s norm reads none back;
a replay does). A
commit frees the old extents; a rollback maps the keys back to them (and
the moments back to "never written" where they were), so the replay's
check-out reads the state of before, bytes and checksums as written then.

[Note: speculation with NVMe parameters]
With ``offload_params="nvme"`` the compute copy's home is an NVMe extent,
cached in the host and written back in place when evicted, so a speculated
copy may reach the disk before ``step()`` decides. The undo buffer holds
the old copy's bytes all the same: a speculative update opens the copy with
its old bytes read (``open_for_update(whole=False)``) when the kernel saves
them in its pass, and ``save`` reads it through the cache
(``HostCache.copy_home``) when they are copied ahead, so the update then
finds it cached. A rollback writes the old bytes back through the cache
(dirty: written back on eviction) for a skipped step; a replay rewrites
every element the speculation wrote. Where the fp32 master is the compute
copy ([Note: fp32 master aliasing] in plan/placement.py: NVMe homes for
both, fp32, no ZeRO) the master is not in the optimizer state's
copy-on-write extents: its old bytes are the undo buffer's compute part,
and a rollback always restores them, replay or skip.

The hyper-parameters are those of the step's first early update ([Note:
hyper-parameters of early updates] in schedule.py), for the replay too.

Cost: saved in the kernel's pass, the undo state adds the writes of 12
bytes a parameter where the compute copy is the master's bits, else 16
(14 with a bf16 copy) to the update, streamed: on the 2-core development
machine that adds about 1-1.3 times the kernel's own time, against 2-3
times for copying them beforehand with torch ``copy_`` (docs/native.md).
It is the largest cost speculation adds to a step that commits: with the
saves switched off (an experiment) the gap to overlap="backward" without
clipping mostly closed.
A replay's rollback copies the saved ranges back (12 bytes a parameter, the
compute copy too for a skipped step), on the step's critical path.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from ..plan.opt_kinds import kind_dtype, kind_numel, state_kinds
from ..plan.placement import nbytes, undo_bytes, undo_keeps_compute

__all__ = ["Speculation", "MAX_BACKOFF"]

MAX_BACKOFF = 8  # steps waited at most after replays in a row


Runs = List[Tuple[int, int]]


@dataclass
class _Undo:
    """One unit's undo state: views into one pool buffer ``buf``, at the
    indices of the buffers they save (state: the master's; compute: the
    kernel's copy-out's)."""

    buf: object
    state: Dict[str, torch.Tensor]  # kind -> its copy: master, moments (int8: and scales)
    # The compute copy's elements [lo, lo + numel) the update writes; None: the master's bits (undo_keeps_compute).
    compute: Optional[torch.Tensor]
    lo: int = 0                     # ZeRO 1-2: the own shard's first element in the full copy
    steps: Optional[List[int]] = None  # the slots' step counts, once the update began
    # (state ranges, compute ranges or None) the kernel calls saved; None: the whole buffers, saved ahead.
    runs: Optional[List[Tuple[Runs, Optional[Runs]]]] = None
    cow: bool = False    # NVMe state: written copy-on-write, the old one on disk (state is {})
    fresh: bool = False  # NVMe state: its moments were never written before the update

    def take(self, state: Runs, compute: Optional[Runs]) -> tuple:
        """The save buffers of one kernel call over the master's ranges
        ``state`` and the copy-out's ``compute`` (None: no copy-out), as
        ``adamw_step_(saves=)`` takes them; recorded for the rollback."""
        self.runs.append((state, compute))
        kept = (self.state["master"], self.state["exp_avg"], self.state["exp_avg_sq"])
        return tuple([t[a:b] for a, b in state] for t in kept) + (
            [self.compute[a - self.lo:b - self.lo] for a, b in compute]
            if compute is not None and self.compute is not None else None,)


class Speculation:
    """The speculative updates of a ``BackwardSchedule`` (see [Note:
    speculative updates]). ``parts`` is the engine's record (this uses
    ``room``, ``host_cache``, ``residency``, ``fence``, ``values_changed``,
    ``stats``, ``modes``, ``units``); ``scaling`` gives the scale an update
    runs with before the check (``base_scale``)."""

    def __init__(self, parts, scaling, keep_grads: bool = False):
        self.p, self.scaling = parts, scaling
        # NVMe state: the host pool holds every unit's gradients at once, so they stay there until step().
        self.keep_grads = keep_grads
        self.scale: Optional[float] = None  # the gradient scale this step's speculative updates ran with
        self._undo: Dict[int, _Undo] = {}   # unit index -> undo state, in the order the updates were queued
        self._now: Optional[bool] = None    # this step speculates (None: not decided yet)
        self._backoff = 0                   # steps the last back-off waited
        self._wait = 0                      # steps still to wait
        self._likely = True                 # the last step would have committed (See *Prediction*)
        self._warned: set = set()           # the fallbacks said already ("host", "disk")

    # -- during backward ------------------------------------------------------------------

    def reserve(self, u) -> bool:
        """``u``'s update may start now, speculatively: its undo buffer is
        taken (autograd thread). False: it waits for ``step()`` (the step
        backs off, or the host pool has no room)."""
        if self._now is None:
            self._now = self._wait == 0 and self._likely
            self.scale = self.scaling.base_scale()
        if not self._now:
            return False
        if u.index in self._undo:
            return True  # taken ahead (the root's)
        p = self.p
        if not u.place.trainable:
            return False
        got = p.room.try_acquire(undo_bytes(u.place, p.modes), torch.uint8)
        if got is None:
            p.stats.spec_units_without_room += 1
            self._warn(u, "host")
            return False
        raw, buf = got
        cow = p.modes.opt_nvme
        if cow and not p.optstate.reserve_copy(u):  # See [Note: speculation with NVMe optimizer state]
            with p.room.lock:
                p.room.release(buf)
            p.stats.spec_units_without_disk += 1
            self._warn(u, "disk")
            return False
        sn, tn, md = u.place.state_numel, u.place.trainable_numel, p.modes.moment_dtype
        state, at = {}, 0
        for kind in () if cow else state_kinds(md):  # each starts on 4 bytes: sn is a multiple of 32
            dt = kind_dtype(kind, md, p.modes.master_dtype)
            n = nbytes(kind_numel(kind, sn), dt)
            state[kind], at = raw[at:at + n].view(dt), at + n
        # See [Note: speculation on several ranks]: the part of the compute copy this rank's update writes.
        comp = raw[at:at + nbytes(sn, p.modes.dtype)].view(p.modes.dtype) if undo_keeps_compute(p.modes) else None
        lo = p.sharding.shard(tn)[0] if p.modes.zero in (1, 2) else 0
        self._undo[u.index] = _Undo(buf, state, comp, lo, cow=cow)
        return True

    def save(self, u) -> None:
        """Copies ``u``'s whole state into its undo buffer ahead of its
        update (host thread, while backward runs)."""
        d, o = self._undo[u.index], u.opt
        for kind, t in d.state.items():
            t.copy_(getattr(o, kind))
        if d.compute is not None:
            self.p.host_cache.copy_home(u, d.compute, d.lo)
        d.steps = [s.step for s in u.layout.trainable_slots]
        d.fresh = u.opt.fresh

    def begin(self, u) -> Optional[_Undo]:
        """``u``'s update starts (host thread): its step counts are kept;
        returns the undo state its kernel calls save into in their own pass
        (``Updater.run(undo=)``), or None where :meth:`save` saved it ahead."""
        d = self._undo[u.index]
        if d.steps is not None:
            return None
        if d.cow or self.p.modes.moment_dtype != "fp32" or self.p.modes.master_dtype != "fp32":
            # NVMe state stays on disk: the compute copy is copied whole; the kernel saves fp32 state
            # only: low-bit moments and their scales, and a bf16 master, are copied whole.
            self.save(u)
            return None
        d.runs = []
        d.steps = [s.step for s in u.layout.trainable_slots]
        return d

    def _warn(self, u, where: str) -> None:
        """Says once per ``where`` ("host": no host room for the undo state;
        "disk": no swap room for a second copy of the NVMe state) that updates wait."""
        if where in self._warned:
            return
        self._warned.add(where)
        if where == "host":
            what = (f"the host pool has no room for the undo state of unit {u.name!r} "
                    f"({undo_bytes(u.place, self.p.modes)} bytes)")
            fix, stat = "Raise host_memory", "units_without_room"
        else:
            what = f"the swap files have no room for a second copy of the NVMe optimizer state of unit {u.name!r}"
            fix, stat = "Free disk space in swap_paths", "units_without_disk"
        warnings.warn(
            f"infinity: {what}, so its update waits for optimizer.step() instead of running during backward "
            "(overlap='backward' with clipping or fp16 updates speculatively: [Note: speculative updates] in "
            f"infinity/engine/step/speculate.py). {fix} to hide it. The result is the same. (Warned once; "
            f"stats()['speculation']['{stat}'] counts them.)", RuntimeWarning, stacklevel=3)

    # -- at step() -------------------------------------------------------------------------

    @property
    def units(self) -> List[int]:
        """Indices of the units updated speculatively in this step."""
        return list(self._undo)

    def check(self, skip: bool, scale: float) -> bool:
        """After the step's norm (``skip``: non-finite; ``scale``: the step's
        gradient scale): commits the speculation (True) or rolls every
        speculated unit back to its state before its update (False); the
        caller then updates every unit with ``scale`` unless ``skip``."""
        st = self.p.stats
        st.spec_steps += 1
        if not skip and scale == self.scale:
            st.spec_committed += 1
            self._backoff = 0
            for i, d in self._undo.items():
                if d.cow and d.steps is not None:
                    self.p.optstate.settle_copy(self.p.units[i], keep=True)  # the old extents are freed
            self._release()
            return True
        t0 = time.perf_counter()
        self._rollback(compute=skip)
        if skip:
            st.spec_skipped += 1
        else:
            st.spec_replayed += 1
        self._backoff = min(max(1, 2 * self._backoff), MAX_BACKOFF)
        self._wait = self._backoff
        st.spec_replay_seconds += time.perf_counter() - t0
        return False

    def observe(self, skip: bool, scale: float) -> None:
        """Every ``step()``, after its norm (``check``'s arguments): whether
        a speculation would have committed, which the next step's decision
        follows (*Prediction* in [Note: speculative updates])."""
        base = self.scale if self.scale is not None else self.scaling.base_scale()
        self._likely = not skip and scale == base

    def end_step(self) -> None:
        """The step is over (or its gradients were dropped): the next one decides afresh."""
        if self._now is False:
            self.p.stats.spec_waited += 1
            self._wait = max(0, self._wait - 1)
        self._now, self.scale = None, None
        self._release()

    def _rollback(self, compute: bool) -> None:
        """Every speculated unit back to its state before its update;
        ``compute``: its compute copy too (a replay writes every element the
        speculative update wrote, so only a skipped step needs it)."""
        p = self.p
        for i, d in self._undo.items():
            u = p.units[i]
            if d.steps is None:
                continue  # its update never started (a fault before it)
            p.fence.wait_unit(u)
            if d.cow:  # the swap keys map to the state of before again
                p.optstate.settle_copy(u, keep=False, fresh=d.fresh)
            # An aliased master is the compute copy: See [Note: speculation with NVMe parameters].
            _restore(u, d, p.host_cache, compute or u.place.aliased)
            p.values_changed(u)
        self._release()
        p.residency.invalidate()  # no device copy keeps a speculated value

    def _release(self) -> None:
        undo, self._undo = self._undo, {}
        if undo:
            with self.p.room.lock:
                for d in undo.values():
                    self.p.room.release(d.buf)
            for i, d in undo.items():
                if d.cow:  # extents reserved for an update that never ran
                    self.p.optstate.release_copy(self.p.units[i])


def _restore(u, d: _Undo, host_cache, compute: bool) -> None:
    """``u``'s master, moments and step counts (and ``compute``: its
    compute copy) as ``d`` saved them: the ranges its kernel calls wrote,
    or the whole buffers where saved ahead."""
    o = u.opt
    if d.runs is None:  # saved whole, ahead: every kind (low-bit moments' scales too)
        for kind, t in d.state.items():
            getattr(o, kind).copy_(t)
        runs = [([], [(d.lo, d.lo + d.compute.numel())] if d.compute is not None else None)]
    else:
        runs = d.runs
    for state, _ in runs:
        for a, b in state:
            for kind in ("master", "exp_avg", "exp_avg_sq"):
                getattr(o, kind)[a:b].copy_(d.state[kind][a:b])
    if compute:
        _restore_compute(u, d, host_cache, runs)
    for s, n in zip(u.layout.trainable_slots, d.steps):
        s.step = n


def _restore_compute(u, d: _Undo, host_cache, runs) -> None:
    """``u``'s compute copy as before its update: the saved ranges, or
    (``d.compute`` None: it is the master's bits, [Note: speculative
    updates]) the slots the update wrote, from the master just restored.
    Called before the step counts are."""
    if d.compute is None:  # no ZeRO: state, compute and global indices agree
        pairs = [((a, b), u.opt.master[a:b]) for a, b in ((s.offset, s.offset + s.numel) for s, n in
                                                           zip(u.layout.trainable_slots, d.steps) if s.step != n)]
    else:
        pairs = [((a, b), d.compute[a - d.lo:b - d.lo]) for _, c in runs for a, b in c or ()]
    if not pairs:
        return
    comp = host_cache.open_for_update(u)
    if comp is None:  # [Note: fp32 master aliasing]: the cached compute copy is the master
        comp, read = host_cache.lock_master(u)
        if read is not None:
            read.wait()
    try:
        for (a, b), src in pairs:
            comp[a:b].copy_(src)
    finally:
        host_cache.close_update(u)
