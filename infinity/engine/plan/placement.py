"""What lives where, decided once: the engine's modes, each unit's frozen
placement, and the budget arithmetic of the device, host and NVMe tiers.

Pure: nothing here allocates or moves bytes. The owners (residency,
host_cache, grads, optstate) read the decisions; the figures are checked
against hand computations in tests/engine/test_engine_placement.py.

[Note: host budget]
The host tier holds, for good, the homes of host-resident state: compute
copies (``offload_params="host"``, or the optimizer's copy-out target with
parameters on the device), fp32 master and moments and the gradient buffer
(``offload_optimizer="host"``; the delayed mode doubles the compute copy and
the gradients), and under ZeRO the gradient shard (plus stage 1's full
gradients). What is transient comes on top:

- NVMe compute copies: a cache of at least ``prefetch_depth + 2`` copies of
  the largest unit (the prefetched ones, the one computing, one being
  written back) and the root's;
- NVMe optimizer state: ``PIPELINE_GRAD_BUFFERS`` gradient buffers (in the
  host gradients' dtype, see [Note: gradients in the compute dtype]) of
  the largest unit whose gradients are kept whole (two units' in the
  optimizer's pipeline, and the unit's whose backward runs), the chunk
  buffers of gradients streamed in chunks (``streamed_grad_bytes``, the
  largest unit's), ``PIPELINE_STATE_BUFFERS`` fp32 state buffers of one
  chunk (``Config.state_chunk_bytes``, or the largest unit's state if
  smaller: two sets of master and moments, see [Note: state streamed in
  chunks] in owners/optstate.py) and one compute copy;
- ZeRO stages 2-3 reduced on the host ([Note: where gradients are
  reduced]): full gradients from a unit's first gradient to its reduction,
  ``ZERO_REDUCING_UNITS`` of them at the minimum (reduced on the device,
  only the shard comes to the host);
- speculative updates (overlap="backward" with clipping or fp16): each
  unit's undo state (``undo_bytes``), in the capacity only: a unit that
  finds no room waits for ``step()``.

All host buffers are rounded up to ``POOL_ALIGN``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from .opt_kinds import kind_dtype, kind_numel, state_bytes, state_kinds
from .paths import (grad_streaming, host_gather_reason, host_reduction_reason, speculation_needed,  # re-exported:
                    speculation_unsupported)  # the owners read them here
from .limits import (DEVICE_ALIGN, GRAD_STAGING_BLOCK_BYTES, GRAD_STAGING_BLOCKS, PIPELINE_BUFFERS,  # [Note: limits
                     PIPELINE_GRAD_BUFFERS, PIPELINE_STATE_BUFFERS, POOL_ALIGN, STREAM_GRAD_BUFFERS,
                     ZERO_REDUCING_UNITS)  # that must agree]

__all__ = ["Modes", "UnitPlacement", "DeviceNeed", "HostNeed", "place_unit", "device_need", "host_need", "grad_staging",
           "nvme_capacity", "modes_of", "speculation_needed", "speculation_unsupported", "undo_bytes", "undo_keeps_compute", "spillable",
           "nbytes", "round_pool", "state_pool_bytes", "host_reduction_reason", "host_gather_reason", "grad_streaming", "streamed_grad_bytes", "device_reduce_bytes", "stage1_full_grads", "POOL_ALIGN",
           "DEVICE_ALIGN", "PIPELINE_BUFFERS",
           "NVME_CACHE_SPARE", "ZERO_REDUCING_UNITS", "ZERO_TRANSIENT_UNITS"]

NVME_CACHE_SPARE = 2       # NVMe compute copies cached beyond prefetch_depth
ZERO_TRANSIENT_UNITS = 3   # cap of the full-gradient room under ZeRO 2-3 without accumulation
SWAP_SLACK_PAGES = 64      # extra pages of swap file per rank
KINDS_PER_UNIT = 5         # swap keys per unit: compute, master, exp_avg, exp_avg_sq, grad (+2 scales with int8)


def nbytes(numel: int, dtype: torch.dtype) -> int:
    """Bytes of ``numel`` elements of ``dtype``."""
    return numel * torch.empty((), dtype=dtype).element_size()


def round_pool(n: int) -> int:
    """``n`` bytes rounded up to a host-pool buffer (at least one page)."""
    return max(POOL_ALIGN, -(-n // POOL_ALIGN) * POOL_ALIGN)


@dataclass(frozen=True)
class Modes:
    """The engine-wide decisions of a config, made once."""

    device: torch.device
    dtype: torch.dtype        # compute copy
    grad_dtype: torch.dtype   # host gradient buffers (see [Note: gradients in the compute dtype])
    params: str               # home of the compute copy: "none", "host", "nvme"
    optimizer: str            # home of master and moments: "none", "host", "nvme"
    zero: int                 # ZeRO stage
    world: int                # data-parallel ranks
    delayed: bool             # overlap="delayed": second compute and gradient buffers
    depth: int                # prefetch_depth
    accum_steps: int          # grad_accumulation_steps
    prefetch_bytes: Optional[int] = None  # Config.prefetch_bytes
    speculate: bool = False   # updates during backward before the clip/overflow check ([Note: speculative updates])
    reduce_on_device: bool = False  # gradients reduced on the device ([Note: where gradients are reduced] in paths.py)
    moment_dtype: str = "fp32"  # Config.moment_dtype ([Note: low-bit moments in the engine] in opt_kinds.py)
    master_dtype: str = "fp32"  # Config.master_dtype ([Note: a bf16 master in the engine] in step/update.py)
    state_chunk: int = 0      # NVMe state streamed in chunks of this many elements (Config.state_chunk_bytes / 4);
    #                           0: whole units. See [Note: state streamed in chunks]
    gather_on_device: bool = False  # stages 1-2: updated copies gathered on the device (host_gather_reason)
    stream_grads: bool = False  # a chunked unit's gradients go to NVMe chunk by chunk ([Note: gradients streamed
    #                             in chunks] in owners/grad_chunks.py; grad_streaming says when)

    @property
    def params_on_device(self) -> bool:
        return self.params == "none"

    @property
    def params_nvme(self) -> bool:
        return self.params == "nvme"

    @property
    def host_optimizer(self) -> bool:
        return self.optimizer != "none"

    @property
    def opt_nvme(self) -> bool:
        return self.optimizer == "nvme"

    @property
    def nvme_used(self) -> bool:
        return self.params_nvme or self.opt_nvme

    @property
    def compute_home_host(self) -> bool:
        """The compute copy has a permanent host buffer: its home (params on
        the host), or the optimizer's copy-out target (params on the device,
        optimizer on the host)."""
        return self.params == "host" or (self.params_on_device and self.host_optimizer)


def modes_of(config, world: int, device: torch.device) -> Modes:
    """The :class:`Modes` of an ``infinity.Config`` on ``world`` ranks, computing on ``device``.

    [Note: gradients in the compute dtype] Without accumulation over
    micro-batches or ranks, a unit's host gradients stay in the compute
    dtype: the upcast to fp32 is exact, so the native AdamW reading bf16
    gives the same update, while the gradients cross to the host (and to
    NVMe) at half the bytes, with no upcast pass on the way. Two backward()
    calls per step with grad_accumulation_steps=1 then sum in the compute
    dtype, as torch does for a model in that dtype."""
    dtype = config.torch_dtype
    grad_dtype = (dtype if config.offload_optimizer != "none" and world == 1 and config.zero_stage == 0
                  and config.grad_accumulation_steps == 1 else torch.float32)
    return Modes(device, dtype, grad_dtype, config.offload_params, config.offload_optimizer, config.zero_stage,
                 world, config.overlap == "delayed", config.prefetch_depth, config.grad_accumulation_steps,
                 config.prefetch_bytes, speculation_needed(config) and speculation_unsupported(config, world) is None,
                 host_reduction_reason(config.zero_stage, world, config.grad_accumulation_steps,
                                       config.offload_optimizer, config.overlap) is None,
                 config.moment_dtype, config.master_dtype, config.state_chunk_bytes // 4,
                 host_gather_reason(config.zero_stage, world, config.offload_params) is None,
                 grad_streaming(config, world) is None)


def device_reduce_bytes(trainable_numel: int, modes: Modes) -> int:
    """Device bytes of one unit's gradients on the device path: the full flat
    buffer and the reduce-scatter's shard (stage 0 all-reduces in place: no
    shard), in the host gradients' dtype."""
    return nbytes(trainable_numel + (trainable_numel // modes.world if modes.zero else 0), modes.grad_dtype)


@dataclass(frozen=True)
class UnitPlacement:
    """One unit's sizes and aliasing on this rank (elements unless named bytes)."""

    compute_numel: int    # the device copy
    trainable_numel: int  # master, moments, gradients (unsharded)
    home_numel: int       # the home compute copy (its shard under ZeRO-3)
    state_numel: int      # master and moments (the shard under any ZeRO stage)
    compute_bytes: int    # bytes of the device copy
    aliased: bool         # [Note: fp32 master aliasing]: the master is the compute copy
    chunk_numel: int = 0  # elements per streamed chunk of the state; 0: one piece ([Note: state streamed in chunks])
    grad_chunked: bool = False  # the gradients go to NVMe chunk by chunk ([Note: gradients streamed in chunks])
    trainable_slots: int = 0    # trainable parameters: at most this many gradient chunks are open at once

    @property
    def trainable(self) -> bool:
        return self.trainable_numel > 0

    @property
    def chunked(self) -> bool:
        """The NVMe state is updated chunk by chunk (more than one chunk)."""
        return 0 < self.chunk_numel < self.state_numel

    @property
    def windows(self) -> List[Tuple[int, int]]:
        """Element ranges [c0, c1) of the state (shard-local) the chunks hold, in order."""
        step = self.chunk_numel if self.chunked else max(self.state_numel, 1)
        return [(c0, min(c0 + step, self.state_numel)) for c0 in range(0, self.state_numel, step)]


def place_unit(layout, modes: Modes) -> UnitPlacement:
    """The placement of a unit with ``layout`` (a units.Layout) under ``modes``.

    [Note: fp32 master aliasing] With fp32 compute, every parameter of the
    unit trainable, no ZeRO sharding and both homes on NVMe, the compute copy
    and the fp32 master hold the same bits. They are then one buffer: one
    NVMe extent ("compute"), cached in the host like any compute copy and
    updated in place by the optimizer. That removes a third of the swap
    traffic of an fp32 step (the master's read and write) and the
    optimizer's copy-out.
    """
    n, tn = layout.numel, layout.trainable_numel
    aliased = (modes.params_nvme and modes.opt_nvme and modes.dtype == torch.float32 and modes.zero == 0
               and not modes.delayed and tn > 0 and len(layout.trainable_slots) == len(layout.slots))
    p = UnitPlacement(compute_numel=n, trainable_numel=tn,
                         home_numel=n // modes.world if modes.zero == 3 else n,
                         state_numel=tn // modes.world if modes.zero else tn,
                         compute_bytes=nbytes(n, modes.dtype), aliased=aliased,
                         chunk_numel=modes.state_chunk if modes.opt_nvme else 0,
                         trainable_slots=len(layout.trainable_slots))
    if p.chunked and modes.stream_grads:
        p = dataclasses.replace(p, grad_chunked=True)
    return p


@dataclass(frozen=True)
class DeviceNeed:
    """Bytes the device tier needs."""

    arena_min: int     # pass units + (prefetch_depth + 1) of the largest other units
    all_compute: int   # every unit resident
    grad_reserve: int  # gradients between autograd and their copy out
    opt_fixed: int     # optimizer state on the device (offload_optimizer="none")
    largest_unit: int  # bytes of the largest unit but the root
    units: int

    @property
    def minimum(self) -> int:
        """The smallest ``device_memory`` that runs (512 B of alignment per range, and the arena rounded down)."""
        return self.arena_min + self.grad_reserve + self.opt_fixed + DEVICE_ALIGN * (self.units + 1)

    @property
    def everything(self) -> int:
        """The budget with every unit resident: more buys nothing."""
        return self.all_compute + self.grad_reserve + self.opt_fixed + DEVICE_ALIGN * (self.units + 1)

    def arena_bytes(self, budget: int) -> int:
        """The arena a budget of ``budget`` bytes gets."""
        return min(budget - self.grad_reserve - self.opt_fixed, self.all_compute + DEVICE_ALIGN * (self.units + 1))


def device_need(places: Sequence[UnitPlacement], external: Sequence[bool], modes: Modes) -> DeviceNeed:
    """The device tier's needs for units placed ``places`` (the root first);
    ``external[i]``: unit i stays resident for whole passes (see
    ``Engine.note_external_use``)."""
    root, others = places[0], list(zip(places[1:], external[1:]))
    ext = sum(p.compute_bytes for p, e in others if e)
    paged = sorted((p.compute_bytes for p, e in others if not e), reverse=True)
    all_compute = sum(p.compute_bytes for p in places)
    if modes.params_on_device:
        arena_min = all_compute
    else:
        # Units held only for a pending backward give way (see [Note: pins]).
        arena_min = root.compute_bytes + ext + sum(paged[:modes.depth + 1])
    grad_reserve = max([nbytes(p.trainable_numel, modes.dtype) for p in places] + [0])
    if modes.reduce_on_device:  # one unit's gradients arriving, ZERO_REDUCING_UNITS - 1 being reduced
        grad_reserve = ZERO_REDUCING_UNITS * max([device_reduce_bytes(p.trainable_numel, modes) for p in places] + [0])
    opt_fixed = 0 if modes.host_optimizer else sum(4 * nbytes(p.trainable_numel, torch.float32) for p in places)
    return DeviceNeed(arena_min, all_compute, grad_reserve, opt_fixed,
                      max((p.compute_bytes for p in places[1:]), default=0), len(places))


@dataclass(frozen=True)
class HostNeed:
    """Bytes of the host tier (see [Note: host budget])."""

    permanent: int   # homes kept for good
    minimum: int     # what the placement needs at least
    capacity: int    # the pool's size (more buys nothing)
    nvme_bytes: int  # what the swap files hold
    spill_bytes: int = 0  # swap room kept for host homes spilled under memory pressure (see spillable)
    undo_bytes: int = 0   # the speculative updates' undo state, in the capacity (see undo_bytes)
    cow_bytes: int = 0    # swap room for the speculative updates' new NVMe state (the old one stays till step())
    keys_per_unit: int = KINDS_PER_UNIT  # swap keys a unit may have (int8 moments add their two scales)
    chunk_keys: int = 0   # more swap keys: the chunks of state streamed in chunks beyond each kind's first


def host_need(places: List[UnitPlacement], modes: Modes) -> HostNeed:
    """The host tier's needs for units placed ``places`` (the root first)."""
    perm = cache_all = nvme = zero_transient = chunk_keys = 0
    largest_c = largest_t = largest_g = largest_s = streamed = 0
    for p in places:
        cb = round_pool(p.compute_bytes)
        tb = round_pool(nbytes(p.trainable_numel, torch.float32)) if p.trainable else 0
        largest_c, largest_t = max(largest_c, cb), max(largest_t, tb)
        if p.trainable and not p.grad_chunked:  # whole gradient buffers, in their host dtype
            largest_g = max(largest_g, round_pool(nbytes(p.trainable_numel, modes.grad_dtype)))
        streamed = max(streamed, streamed_grad_bytes(p, modes))
        largest_s = max(largest_s, tb if not p.chunked else round_pool(nbytes(p.chunk_numel, torch.float32)))
        if modes.compute_home_host:
            perm += round_pool(p.compute_bytes // modes.world) if modes.zero == 3 else cb * (2 if modes.delayed else 1)
        if modes.params_nvme:
            hb = round_pool(nbytes(p.home_numel, modes.dtype))
            cache_all, nvme = cache_all + hb, nvme + hb
        sb = round_pool(tb // modes.world) if modes.zero else tb
        if modes.host_optimizer and p.trainable:
            perm, zero_transient = perm + _permanent_state(p, modes, tb, sb), zero_transient + _zero_full(modes, tb)
        if modes.opt_nvme and p.trainable:
            # ZeRO keeps its gradient shard on the host; an aliased master is the compute copy. The
            # gradients go in their host dtype ([Note: gradients in the compute dtype]).
            gb = round_pool(nbytes(p.trainable_numel, modes.grad_dtype))
            k = (0 if modes.zero else gb) + state_pool_bytes(p, modes, sb, master=not p.aliased)
            cache_all, nvme = cache_all + k, nvme + k
            chunk_keys += (len(p.windows) - 1) * (len(state_kinds(modes.moment_dtype)) + p.grad_chunked)
    pipeline = PIPELINE_GRAD_BUFFERS * largest_g + streamed + PIPELINE_STATE_BUFFERS * largest_s + largest_c
    minimum = perm
    if modes.params_nvme:
        minimum += (modes.depth + NVME_CACHE_SPARE) * largest_c + round_pool(places[0].compute_bytes)
    if modes.opt_nvme:
        minimum += pipeline
    if modes.zero >= 2 and modes.accum_steps == 1:
        zero_transient = min(zero_transient, ZERO_TRANSIENT_UNITS * largest_t)
    minimum += min(zero_transient, ZERO_REDUCING_UNITS * largest_t)
    blocks, block = grad_staging(places, modes)
    perm += blocks * block
    minimum += blocks * block
    undo = sum(undo_bytes(p, modes) for p in places if p.trainable) if modes.speculate else 0
    capacity = perm + (cache_all + pipeline if modes.nvme_used else 0) + zero_transient + undo
    spill = sum(round_pool(nbytes(p.home_numel, modes.dtype)) for p in places) if spillable(modes) else 0
    cow = _cow_bytes(places, modes)
    return HostNeed(perm, minimum, capacity, nvme, spill, undo, cow,
                    KINDS_PER_UNIT + len(state_kinds(modes.moment_dtype)) - len(state_kinds("fp32")), chunk_keys)


def streamed_grad_bytes(p: UnitPlacement, modes: Modes) -> int:
    """Host bytes the gradients of a unit streamed in chunks take at most
    (0 for one kept whole): its open chunks while its backward runs, one per
    trainable parameter at most (a chunk stays open while a parameter in it
    has no gradient yet), and ``STREAM_GRAD_BUFFERS`` chunks of an update's
    stream. See [Note: gradients streamed in chunks] in owners/grad_chunks.py."""
    if not p.grad_chunked:
        return 0
    chunk = round_pool(nbytes(p.chunk_numel, modes.grad_dtype))
    return (min(len(p.windows), max(1, p.trainable_slots)) + STREAM_GRAD_BUFFERS) * chunk


def _cow_bytes(places: List[UnitPlacement], modes: Modes) -> int:
    """Swap bytes of a second copy of the NVMe optimizer state, which
    speculative updates write to while the old one stays (see [Note:
    copy-on-write keys] in io/swap/store.py); 0 without them."""
    if not (modes.speculate and modes.opt_nvme):
        return 0
    return sum(state_bytes(p.state_numel, modes.moment_dtype, master=not p.aliased, master_dtype=modes.master_dtype)
               for p in places if p.trainable)


def grad_staging(places: List[UnitPlacement], modes: Modes) -> Tuple[int, int]:
    """(blocks, bytes a block) of the pinned ring gradients cross when the
    host adds or upcasts them (CUDA: accumulation, or host gradients in
    another dtype than compute's); (0, 0) where none crosses that way. A
    block holds at most the largest unit's gradients, so a small model's
    ring is small. See [Note: the gradient staging ring] in grad_staging.py."""
    staged = modes.device.type == "cuda" and modes.host_optimizer and (
        modes.accum_steps > 1 or modes.grad_dtype != modes.dtype)
    largest = max((nbytes(p.trainable_numel, modes.dtype) for p in places if p.trainable), default=0)
    if not staged or largest == 0:
        return 0, 0
    return GRAD_STAGING_BLOCKS, round_pool(min(GRAD_STAGING_BLOCK_BYTES, largest))


def undo_bytes(p: UnitPlacement, modes: Modes) -> int:
    """Host bytes of one unit's undo state for a speculative update: its
    master and moments and the part of its compute copy the update writes
    (the trainable part; under ZeRO the own shard's, as many elements as the
    state; none where :func:`undo_keeps_compute` says so), in one pool buffer. Not in the minimum: a unit without room
    waits for ``step()`` (see [Note: speculative updates] in step/speculate.py).
    NVMe optimizer state: the compute copy's part only (the old state stays
    on disk: ``HostNeed.cow_bytes``)."""
    if modes.opt_nvme:
        return round_pool(nbytes(p.state_numel, modes.dtype))
    return round_pool(state_bytes(p.state_numel, modes.moment_dtype, master_dtype=modes.master_dtype)
                      + (nbytes(p.state_numel, modes.dtype) if undo_keeps_compute(modes) else 0))


def undo_keeps_compute(modes: Modes) -> bool:
    """Whether a unit's undo state keeps its compute copy's bytes. Not where
    the copy is the fp32 master's bits (host-resident fp32 state, fp32
    compute, no ZeRO): a rollback takes them from the master's saved bytes
    (See [Note: speculative updates] in step/speculate.py)."""
    return not (modes.host_optimizer and not modes.opt_nvme and not modes.zero and modes.dtype == torch.float32
                and modes.master_dtype == "fp32")


def spillable(modes: Modes) -> bool:
    """Host homes of compute copies may move to the swap files under memory
    pressure (see [Note: memory pressure]): parameters on the host, an NVMe
    tier there for the optimizer state, one buffer per home (not delayed)."""
    return modes.params == "host" and modes.opt_nvme and not modes.delayed


def _permanent_state(p: UnitPlacement, modes: Modes, tb: int, sb: int) -> int:
    """Host bytes kept for good for a trainable unit's optimizer side."""
    if modes.zero:
        # Gradient shard (+ full gradients for stage 1 reduced on the host); master and moments unless on NVMe.
        return sb + (tb if stage1_full_grads(modes) else 0) + (0 if modes.opt_nvme else state_pool_bytes(p, modes, sb))
    if modes.opt_nvme:
        return 0
    gb = round_pool(nbytes(p.trainable_numel, modes.grad_dtype))
    return state_pool_bytes(p, modes, tb) + gb * (2 if modes.delayed else 1)


def state_pool_bytes(p: UnitPlacement, modes: Modes, fp32_buf: int, master: bool = True) -> int:
    """Host-pool bytes of a unit's master (unless ``master=False``) and
    moments, one pool buffer a kind; ``fp32_buf``: one fp32 state buffer's
    pool bytes (as the fp32 figures have always been counted). Low-bit
    moments: each kind's own bytes, rounded to the pool ([Note: low-bit
    moments in the engine] in opt_kinds.py)."""
    if modes.moment_dtype == "fp32" and modes.master_dtype == "fp32":
        return (3 if master else 2) * fp32_buf
    kinds = state_kinds(modes.moment_dtype)[0 if master else 1:]
    return sum(round_pool(nbytes(kind_numel(k, p.state_numel), kind_dtype(k, modes.moment_dtype, modes.master_dtype)))
               for k in kinds)


def stage1_full_grads(modes: Modes) -> bool:
    """Stage 1 keeps every unit's full gradients on the host for good (reduced
    on the host in ``step()``); reduced on the device it keeps the shard only."""
    return modes.zero == 1 and not modes.reduce_on_device


def _zero_full(modes: Modes, tb: int) -> int:
    """Stages 2-3 reduced on the host: full gradients live from the unit's
    first gradient to its reduction (reduced on the device: none)."""
    return tb if modes.zero >= 2 and not modes.reduce_on_device else 0


def nvme_capacity(need: HostNeed, units: int, paths: int) -> int:
    """Bytes of swap files per rank: the state and the room for spilled homes,
    the second copy of speculative updates (``cow_bytes``), plus per key
    (chunks of streamed state included) and path two pages of extent
    rounding, plus ``SWAP_SLACK_PAGES``."""
    keys = (units * need.keys_per_unit + need.chunk_keys) * (2 if need.cow_bytes else 1)  # copy-on-write: two
    return (need.nvme_bytes + need.spill_bytes + need.cow_bytes + 2 * 4096 * keys * paths
            + SWAP_SLACK_PAGES * 4096)
