"""One unit's AdamW: the runs of slots that got gradients, their ranges in
the own ZeRO shard, the kernel call (native CPU AdamW, or torch's fused one on
the device), and the checksums it returns for the NVMe write-back.

Reads the unit's buffers; writes only the master, the moments and the new
compute copy it is handed, and the slots' step counts.

[Note: a bf16 master in the engine]
With ``Config.master_dtype="bf16"`` (which needs ``dtype="bf16"``) the
master of each unit is a bf16 buffer (2 bytes a parameter, in every home:
host, NVMe, checkpoints) updated by the native bf16-master kernel
(``inf_adam_step_bf16p``): fp32 maths on the widened master, stored by
stochastic rounding keyed by (seed, stream, step, index): the native note
"stochastic rounding of the bf16 master" in native/src/adam_bf16p.inc. The
engine hands the kernel one tensor per parameter (a slot, cut to the shard
and chunk), with stream = the parameter's position over the optimizer's
param groups and index = the element's position in the parameter, and the
run's seed (``Config.seed``, a checkpoint's on resume): exactly what
``CPUAdamW(master_dtype="bf16", seed=)`` hands it for the same model, so the
bytes do not depend on the unit layout, ZeRO shards, state chunks or homes.
The compute copy is then the master's bits, copied out. The kernel takes
no checksums (the swap store sums the buffers it writes, as for low-bit
moments) and saves no undo state in its pass: a speculative update copies
the state ahead instead ([Note: speculative updates] in speculate.py). The master aliasing of NVMe homes stays fp32-only.
"""

from __future__ import annotations

import bisect
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ...optim.functional import adamw_step_, group_hyper
from ..owners.optstate import KINDS
from ..plan.opt_kinds import QBLOCK

__all__ = ["Updater", "runs", "written_runs"]


def runs(u, written: Sequence[bool], key=lambda s: None) -> Dict[object, List[Tuple[int, int]]]:
    """Element ranges of runs of consecutive trainable slots that got
    gradients and share ``key(slot)``, grouped by key. Padding between slots
    is zero in every buffer, so a run may span it."""
    out: Dict[object, List[Tuple[int, int]]] = {}
    cur_key, cur = None, None
    for ti, s in enumerate(u.layout.trainable_slots):
        k = key(s) if written[ti] else None
        if written[ti] and cur is not None and k == cur_key:
            cur[1] = s.offset + s.numel
            continue
        if cur is not None:
            out.setdefault(cur_key, []).append((cur[0], cur[1]))
        cur_key, cur = k, ([s.offset, s.offset + s.numel] if written[ti] else None)
    if cur is not None:
        out.setdefault(cur_key, []).append((cur[0], cur[1]))
    return out


def written_runs(u, written: Sequence[bool]) -> List[Tuple[int, int]]:
    """Element ranges covering runs of consecutive trainable slots that got gradients."""
    return [r for rs in runs(u, written).values() for r in rs]


class Updater:
    """AdamW over one unit at a time; ``param_groups`` are the optimizer's
    (hyperparameters are read at each call, so schedulers work)."""

    def __init__(self, modes, sharding, param_groups, stats, sum_chunk_bytes: Optional[int],
                 num_threads: Optional[int], values_changed):
        self.modes, self.sharding, self.param_groups, self.stats = modes, sharding, param_groups, stats
        self.sum_chunk_bytes = sum_chunk_bytes  # the swap store's, with NVMe optimizer state (else None)
        self.num_threads = num_threads
        self.values_changed = values_changed    # Engine.values_changed
        self._stat_lock = threading.Lock()
        self.master_seed = 0      # bf16 master: the rounding seed (set by the optimizer; a checkpoint's on resume)
        self._streams: Optional[Dict[int, int]] = None  # id(param) -> its position over the param groups

    # -- shard arithmetic ---------------------------------------------------------------

    def clip_to_shard(self, u, a: int, b: int) -> Tuple[int, int]:
        """Global range [a, b) cut to the own ZeRO shard (unchanged without ZeRO)."""
        if not self.modes.zero:
            return a, b
        lo, hi = self.sharding.shard(u.place.trainable_numel)
        return max(a, lo), min(b, hi)

    def local(self, u, a: int, b: int, buf: torch.Tensor) -> Optional[Tuple[int, int]]:
        """Indices into ``buf`` for global range [a, b): ``buf`` is the full
        buffer, or (ZeRO) the own shard, then the range is cut to it (None when empty)."""
        if buf.numel() == u.place.trainable_numel:
            return a, b
        lo = self.sharding.shard(u.place.trainable_numel)[0]
        a2, b2 = self.clip_to_shard(u, a, b)
        return (a2 - lo, b2 - lo) if a2 < b2 else None

    def counted_runs(self, u, written: List[bool], buf: torch.Tensor) -> List[Tuple[int, int]]:
        """The index ranges of ``buf`` (a unit's gradients, full or this rank's
        shard) that an update reads: the runs of slots that got gradients, cut
        to the shard. What the gradient norm sums over."""
        return [ab for ab in (self.local(u, a, b, buf) for a, b in written_runs(u, written)) if ab is not None]

    # -- the update ----------------------------------------------------------------------

    def run(self, u, grad: torch.Tensor, written: List[bool], out: Optional[torch.Tensor], grad_scale: float,
            live: bool = True, hyper: Optional[List[dict]] = None, undo=None, stream=None) -> Optional[dict]:
        """AdamW on ``u``: one kernel call per (param group, step count) run of
        consecutive slots that got gradients, writing the new compute copy into
        ``out`` (None: none, or the master is the copy). ``live``: ``out`` is the
        home now (not the delayed mode's second buffer), so the parameters'
        versions move. ``hyper``: the param groups' hyper-parameters as they
        were at ``step()`` (an update that runs later must not see an LR
        scheduler's next value). ``undo``: a speculative update's undo state
        (speculate.py), into which each kernel call saves the bytes it
        overwrites in its own pass. ``stream``: the unit's state comes in
        chunks: ``stream(fn)`` calls ``fn(window)`` for each, the state buffers
        then holding the window's elements (OptimizerState.stream). Returns the
        checksums the kernel took (kind -> sums), when one call updated the
        whole buffers and no stream took them, else None."""
        t0 = time.perf_counter()
        o = u.opt
        groups = runs(u, written, key=lambda s: (s.group, s.step))
        # NVMe optimizer state: when one call updates the whole buffers, it
        # also takes their sums for the write-back ([Note: sums from the
        # producer] in native/src/adam.cpp). Padding is zero in every buffer
        # and stays zero under the update, so the call may span all of it.
        # Low-bit moments: the swap store takes the sums itself (the kernel takes fp32 ones only).
        fp32_state = (self.modes.moment_dtype == "fp32" and self.modes.master_dtype == "fp32"
                      and (o.master is None or o.master.device.type == "cpu"))
        if self.modes.master_dtype == "bf16":  # one kernel tensor per parameter: [Note: a bf16 master in the engine]
            groups = {k: _per_slot(u, rs) for k, rs in groups.items()}
        chunk = self.sum_chunk_bytes if fp32_state else None
        whole = chunk is not None and len(groups) == 1 and all(written)

        def window(win) -> Optional[dict]:
            sums = None
            for (gi, step), global_ranges in groups.items():
                if whole:
                    global_ranges = [(0, u.place.trainable_numel)]
                got = self._run_group(u, grad, out, global_ranges, (hyper or self.param_groups)[gi], step + 1,
                                      grad_scale, chunk if whole else None, undo, win)
                sums = got if got is not None else sums
            return sums

        sums = window(None) if stream is None else stream(window)
        slots = u.layout.trainable_slots
        for ti, s in enumerate(slots):
            if written[ti]:
                s.step += 1
        if live:  # delayed: the new values become live when applied (Schedule)
            self.values_changed(u, [s for ti, s in enumerate(slots) if written[ti]])
        with self._stat_lock:
            self.stats.optimizer_seconds += time.perf_counter() - t0
        return sums

    def _shard_start(self, u) -> int:
        return self.sharding.shard(u.place.trainable_numel)[0] if self.modes.zero else 0

    def _shard_local(self, u, ranges) -> List[Tuple[int, int]]:
        lo = self._shard_start(u)
        return [(a - lo, b - lo) for a, b in ranges]

    def _in_window(self, u, global_ranges, win) -> Tuple[list, list]:
        """(global ranges, state-buffer ranges) of ``global_ranges`` cut to the
        chunk ``win`` of the own shard's state (See [Note: state streamed in
        chunks] in owners/optstate.py)."""
        g0 = self._shard_start(u) + win[0]
        g1 = g0 + win[1] - win[0]
        ranges = [(max(a, g0), min(b, g1)) for a, b in global_ranges if max(a, g0) < min(b, g1)]
        return ranges, [(a - g0, b - g0) for a, b in ranges]

    def carry_unwritten(self, u, written: Sequence[bool], src: torch.Tensor, dst: torch.Tensor) -> None:
        """Delayed mode: copies the trainable slots the update did not write
        from the live compute buffer ``src`` into ``dst`` (the one about to
        become live; see [Note: the delayed pair] in delayed.py)."""
        if all(written):
            return
        for a, b in written_runs(u, [not w for w in written]):
            dst[a:b].copy_(src[a:b])

    def _run_group(self, u, grad, out, global_ranges, g: dict, step: int, grad_scale: float,
                   chunk: Optional[int], undo=None, win=None) -> Optional[dict]:
        """One kernel call over ``global_ranges`` with group ``g``'s
        hyperparameters; ``win``: the state buffers hold only the elements
        [win[0], win[1]) of the state (a chunk; shard-local), else all."""
        o = u.opt
        if win is None:
            # ZeRO: only the part inside the own shard; state buffers are shard-local.
            ranges = [(a, b) for a, b in global_ranges if self.local(u, a, b, o.master) is not None]
            st = [self.local(u, a, b, o.master) for a, b in ranges]
            ranges = [self.clip_to_shard(u, a, b) for a, b in ranges]
        else:
            ranges, st = self._in_window(u, global_ranges, win)
        if not ranges:
            return None
        gr = [self.local(u, a, b, grad) for a, b in ranges]
        ps, gs = [o.master[a:b] for a, b in st], [grad[a:b] for a, b in gr]
        ms, vs = [o.exp_avg[a:b] for a, b in st], [o.exp_avg_sq[a:b] for a, b in st]
        # ZeRO-3: the home copy is the shard, trainable part first.
        out_ranges = (self._shard_local(u, ranges) if win is not None else st) if self.modes.zero == 3 else ranges
        outs = [out[a:b] for a, b in out_ranges] if out is not None else None
        h = group_hyper(g)  # checked by the optimizer's step() before any update
        if o.master.device.type == "cuda":
            _device_step(ps, gs, ms, vs, step, h, grad_scale)
            return None
        if o.master.dtype == torch.bfloat16:
            return self._bf16_master_step(u, ranges, st, (ps, gs, ms, vs), outs, step, h, grad_scale, undo)
        take_sums = chunk is not None and len(st) == 1 and st[0] == (0, o.master.numel())
        saves = undo.take(st, out_ranges if out is not None else None) if undo is not None else None
        got = adamw_step_(ps, gs, ms, vs, step=step, lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
                          weight_decay=h.weight_decay, adamw_mode=h.adamw_mode, grad_scale=grad_scale * h.sign,
                          outs=outs,
                          num_threads=self.num_threads, validate=False,
                          sum_chunk_bytes=chunk if take_sums else None, saves=saves, **_scales(u, st))
        return dict(zip(KINDS, got[0])) if got else None


    def _bf16_master_step(self, u, ranges, st, tensors, outs, step: int, h, grad_scale: float, undo) -> None:
        """The kernel call of a bf16 master: one tensor per parameter piece
        (``ranges``, global, each inside one slot), its stream and offset;
        then the compute copy ``outs`` from the master. See [Note: a bf16 master in the engine]."""
        if undo is not None:
            raise RuntimeError("internal: a speculative update of a bf16 master (no undo state is saved)")
        slots = u.layout.trainable_slots
        starts = [s.offset for s in slots]
        streams, offsets = [], []
        for a, _ in ranges:
            s = slots[bisect.bisect_right(starts, a) - 1]
            streams.append(self._stream_of(s.param))
            offsets.append(a - s.offset)
        ps = tensors[0]
        adamw_step_(*tensors, step=step, lr=h.lr, beta1=h.beta1, beta2=h.beta2, eps=h.eps,
                    weight_decay=h.weight_decay, adamw_mode=h.adamw_mode, grad_scale=grad_scale * h.sign,
                    num_threads=self.num_threads, validate=False, seed=self.master_seed, streams=streams,
                    offsets=offsets, **_scales(u, st))
        for out, p in zip(outs or [], ps):
            out.copy_(p)
        return None

    def _stream_of(self, param) -> int:
        """``param``'s position over the optimizer's param groups (CPUAdamW's stream of it)."""
        if self._streams is None:
            self._streams = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        return self._streams[id(param)]


def _per_slot(u, ranges: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """``ranges`` (global, runs of slots) cut at the trainable slots' edges, the padding between them left out."""
    out = []
    for s in u.layout.trainable_slots:
        a, b = s.offset, s.offset + s.numel
        for r0, r1 in ranges:
            if max(a, r0) < min(b, r1):
                out.append((max(a, r0), min(b, r1)))
    return out


def _scales(u, st: List[Tuple[int, int]]) -> dict:
    """The int8 moments' block scales of the state ranges ``st`` (each starts
    on a block: [Note: low-bit moments in the engine] in opt_kinds.py); {} for
    other moments."""
    o = u.opt
    if o.exp_avg.dtype != torch.uint8:
        return {}
    for a, _ in st:
        if a % QBLOCK:
            raise RuntimeError(f"internal: unit {u.name!r}: an int8 moment range starts at {a}, inside a block "
                               f"of {QBLOCK}")
    return {"exp_avg_scales": [o.exp_avg_scale[a // QBLOCK:-(-b // QBLOCK)] for a, b in st],
            "exp_avg_sq_scales": [o.exp_avg_sq_scale[a // QBLOCK:-(-b // QBLOCK)] for a, b in st]}


def _device_step(ps, gs, ms, vs, step: int, h, grad_scale: float) -> None:
    """The same update on CUDA buffers with torch's fused AdamW."""
    if grad_scale != 1.0:
        torch._foreach_mul_(gs, grad_scale)
    # One step tensor for all (the fused kernels only read it): no pageable
    # copy and stream sync per tensor.
    steps = [torch.full((), float(step), dtype=torch.float32, device=ps[0].device)] * len(ps)
    fused = torch._fused_adamw_ if h.adamw_mode else torch._fused_adam_
    fused(ps, gs, ms, vs, [], steps, lr=h.lr, beta1=h.beta1, beta2=h.beta2, weight_decay=h.weight_decay,
          eps=h.eps, amsgrad=False, maximize=h.sign < 0)
