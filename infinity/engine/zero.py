"""ZeRO sharding of a unit's flat buffers over the data-parallel ranks.

[Note: ZeRO shards in infinity]
Every unit's trainable range ``[0, trainable_numel)`` is padded to a multiple
of the world size (``Layout(pad_to=world)``) and cut into equal shards; rank r
owns ``[r*S, (r+1)*S)``. Stage 1 keeps the fp32 master and the Adam moments for
the own shard only; gradients accumulate in full on every rank and are
reduce-scattered once per step. Stage 2 also drops full gradients: in the last
backward of the accumulation window each unit's gradients are reduce-scattered
as soon as the unit's last gradient has left the device, and only the shard
stays (with ``overlap="backward"`` its update then runs during backward).
After the updates each rank all-gathers the new compute copies. Collectives
are issued from the thread that runs forward and backward, in program order,
so every rank issues the same sequence. The gradient sum's 1/world is folded
into the update kernel's ``grad_scale``.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.distributed as dist

from .stats import Stats

__all__ = ["Sharding"]

# torch >= 2.10 names these *_single; older releases have only *_tensor.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Sharding:
    """Mechanism: the collectives of ZeRO over one process group, with byte counters."""

    def __init__(self, stage: int, stats: Stats, group=None):
        initialised = dist.is_available() and dist.is_initialized()
        if stage > 0 and not initialised:
            raise RuntimeError(f"Config.zero_stage={stage} needs torch.distributed to be initialised "
                               "(launch with torchrun and call torch.distributed.init_process_group first)")
        self.stage = stage
        self.group = group
        # Data-parallel ranks: stage 0 over several ranks is plain data
        # parallelism (gradients all-reduced, nothing sharded).
        self.world = dist.get_world_size(group) if initialised else 1
        self.rank = dist.get_rank(group) if initialised else 0
        self.global_rank = dist.get_rank() if initialised else 0
        self.sharded = stage > 0
        self.shards = self.world if self.sharded else 1  # what buffers are padded to and split into
        self.stats = stats

    def shard(self, numel: int) -> Tuple[int, int]:
        """(lo, hi) element range of the own shard of a buffer of ``numel`` (a multiple of world)."""
        if not self.sharded:
            return 0, numel
        s = numel // self.world
        return self.rank * s, (self.rank + 1) * s

    def reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None:
        """``out`` (own shard) = sum over ranks of ``full``'s matching shard."""
        _reduce_scatter(out, full, group=self.group)
        self.stats.moved("reduce_scatter", full.numel() * full.element_size())

    def all_gather_(self, full: torch.Tensor) -> None:
        """Fills every shard of ``full`` from its owner (in place: the own shard is the input)."""
        lo, hi = self.shard(full.numel())
        _all_gather(full, full[lo:hi], group=self.group)
        self.stats.moved("all_gather", full.numel() * full.element_size())

    def all_gather(self, shard: torch.Tensor, numel: int) -> torch.Tensor:
        """A new full tensor of ``numel`` elements gathered from every rank's ``shard``."""
        full = torch.empty(numel, dtype=shard.dtype, device=shard.device)
        _all_gather(full, shard.contiguous(), group=self.group)
        return full

    def check_same(self, what: dict) -> None:
        """Raises on every rank, naming the rank and the keys that differ, unless
        ``what`` (config and model description) is equal on all ranks."""
        if self.world == 1:
            return
        everyone = [None] * self.world
        dist.all_gather_object(everyone, what, group=self.group)
        diffs = []
        for r, other in enumerate(everyone):
            keys = sorted(k for k in set(other) | set(everyone[0]) if other.get(k) != everyone[0].get(k))
            if keys:
                diffs.append(f"rank {r} differs from rank 0 in {keys[:5]}"
                             + (f" (rank 0: {everyone[0].get(keys[0])!r}, rank {r}: {other.get(keys[0])!r})"))
        if diffs:
            raise ValueError("initialize: the ranks were given different configurations or models: "
                             + "; ".join(diffs))

    def all_reduce_(self, t: torch.Tensor) -> None:
        """``t`` = sum over ranks of ``t`` (stage 0: data-parallel gradients)."""
        dist.all_reduce(t, group=self.group)
        # Counted as a reduce-scatter plus an all-gather (2x the bytes), the
        # convention of the ZeRO paper's communication volumes.
        self.stats.moved("all_reduce", 2 * t.numel() * t.element_size())

    def _param_regions(self, numel: int, trainable: int):
        """Stage 3 layout of a unit's compute copy: (start, end, per-rank
        length) of its trainable region, then its frozen one, each split
        evenly over the ranks so the trainable shard lines up with the
        optimizer's shard."""
        for a, b in ((0, trainable), (trainable, numel)):
            if b > a:
                yield a, b, (b - a) // self.world

    def gather_units_params(self, full: torch.Tensor, shard: torch.Tensor, trainable: int) -> "GatherTicket":
        """Stage 3: fills a unit's full compute copy ``full`` (device) from every
        rank's ``shard`` (host: its trainable shard, then its frozen shard),
        region by region (:meth:`_param_regions`). Asynchronous."""
        works = []
        pos = 0
        for a, b, k in self._param_regions(full.numel(), trainable):
            lo = a + self.rank * k
            full[lo:lo + k].copy_(shard[pos:pos + k], non_blocking=True)
            pos += k
            works.append(_all_gather(full[a:b], full[lo:lo + k], group=self.group, async_op=True))
            self.stats.moved("all_gather", (b - a) * full.element_size())
        return GatherTicket(works)

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
        dist.all_reduce(t, group=self.group)
        return float(t.item())


class GatherTicket:
    """Completion of asynchronous collectives (stage 3 parameter gathers)."""

    def __init__(self, works: list):
        self.works = works

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> None:
        for w in self.works:
            w.wait()

    def wait_compute(self) -> None:
        self.wait()
