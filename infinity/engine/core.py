"""The offload engine: placement of every unit's buffers, residency on the
device tier (fetch, prefetch, eviction), and the gradients' way out.

Policy lives in small methods (``_victim`` picks what to evict, ``_prefetch``
what to bring early); moving bytes is the mover's job (mover.py); budgets are
the tiers' (tiers.py); legal states are state.py's.
"""

from __future__ import annotations

import datetime
import functools
import threading
import time
import warnings
import weakref
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from ..config import Config, format_bytes
from ..io.errors import PoolExhausted
from .mover import DeferredTicket, Ticket, make_mover
from .nvme import NvmeTier, key as swap_key
from . import device_budget
from .saved import SavedTensorRouter
from .zero import Sharding
from .state import DeviceState, GradState, transition
from .stats import Stats
from .tiers import BudgetError, DeviceTier, HostTier
from .trace import NEVER, Trace
from .units import Layout, Unit, partition

__all__ = ["Engine"]

_POOL_ALIGN = 4096


def _nbytes(numel: int, dtype: torch.dtype) -> int:
    return numel * torch.empty((), dtype=dtype).element_size()


def _round_pool(nbytes: int) -> int:
    return max(_POOL_ALIGN, -(-nbytes // _POOL_ALIGN) * _POOL_ALIGN)


class Engine:
    """Owns the units of one model and every byte of their state."""

    def __init__(self, model: nn.Module, config: Config, group_of: Dict[int, int], process_group=None):
        self.model = model
        self.config = config
        self.device = config.resolve_device()
        self.dtype = config.torch_dtype
        self.stats = Stats()
        self.trace = Trace()
        self.mover = make_mover(self.device)
        self._fresh_h2d = functools.partial(self.mover.h2d, fresh=True)
        weakref.finalize(self, self.mover.close, False)  # worker threads end with the engine
        self.host_optimizer = config.offload_optimizer != "none"
        self.params_on_device = config.offload_params == "none"
        self.params_nvme = config.offload_params == "nvme"
        self.opt_nvme = config.offload_optimizer == "nvme"
        self.nvme = None
        self._host_lock = threading.RLock()   # host cache state: main thread and optimizer thread
        self._deferred: List[Tuple[object, object]] = []  # (I/O handle, host buffer) freed when done
        self._lru_clock = 0
        self._pass_pins: List[Unit] = []     # units pinned until the end of the current pass
        self._wanted: List[Unit] = []        # backward needs them; no room yet (see [Note: pins])
        self._protected: set = set()         # unit indexes unpacked since the last hook (see [Note: pins])
        self._relayout = False               # a unit became external: re-place the pass units
        self._in_pass = False
        self._pass_grad = False
        self._internal = 0                   # >0 while the engine itself touches parameters
        self.micro_batches = 0               # backward passes since the last step
        self._grad_bytes_outstanding: List[Tuple[Ticket, int]] = []
        self._closed = False
        self.sharding = Sharding(config.zero_stage, self.stats, group=process_group)
        self.zero = config.zero_stage
        # [Note: gradients in the compute dtype] Without accumulation over
        # micro-batches or ranks, a unit's host gradients stay in the compute
        # dtype: the upcast to fp32 is exact, so the native AdamW reading bf16
        # gives the same update, while the gradients cross to the host (and to
        # NVMe) at half the bytes, with no upcast pass on the way. Two
        # backward() calls per step with grad_accumulation_steps=1 then sum
        # in the compute dtype, as torch does for a model in that dtype.
        self.grad_dtype = (self.dtype if config.offload_optimizer != "none" and self.sharding.world == 1
                           and config.zero_stage == 0 and config.grad_accumulation_steps == 1 else torch.float32)
        if self.sharding.world > 1:
            desc = {f"config.{k}": v for k, v in config.to_dict().items() if k != "swap_paths"}
            desc.update({f"param {n}": (tuple(p.shape), p.requires_grad)
                         for n, p in model.named_parameters(remove_duplicate=False)})
            self.sharding.check_same(desc)
        self.units = self._build_units(model, config, group_of)
        self.param_slot: Dict[int, Tuple[Unit, int]] = {}
        for u in self.units:
            for i, s in enumerate(u.layout.slots):
                self.param_slot[id(s.param)] = (u, i)
        self._place(model)
        # See [Note: saved tensors follow their unit]; units that never move need no hooks.
        self.saved = None if self.params_on_device else SavedTensorRouter(self)
        self.window_closed = False           # the accumulation window's last-backward work ran
        self.stats.end_step_window()  # the first step's counters start after initialisation

    # ------------------------------------------------------------------ building

    def _build_units(self, model: nn.Module, config: Config, group_of: Dict[int, int]) -> List[Unit]:
        owners: Dict[int, List[str]] = {}
        params: Dict[int, nn.Parameter] = {}
        for mod_name, mod in model.named_modules(remove_duplicate=False):
            for pname, p in mod.named_parameters(prefix=mod_name, recurse=False):
                owners.setdefault(id(p), []).append(pname)
                params[id(p)] = p
        unit_mods = partition(model, config.unit_classes)
        assigned: Dict[int, int] = {}
        per_unit: List[List[Tuple[str, nn.Parameter]]] = [[] for _ in unit_mods]
        for ui, (uname, umod) in enumerate(unit_mods):
            for pname, p in umod.named_parameters(prefix=uname):
                if id(p) in assigned:
                    continue
                # A parameter shared with modules outside this unit (tied
                # weights) lives in the root unit, which is resident whenever
                # any unit computes.
                prefix = uname + "."
                if any(not o.startswith(prefix) for o in owners[id(p)]):
                    continue
                assigned[id(p)] = ui
                per_unit[ui].append((pname, p))
        root: List[Tuple[str, nn.Parameter]] = []
        for pid, p in params.items():
            if pid not in assigned:
                root.append((owners[pid][0], p))
        units: List[Unit] = []
        root_unit = Unit(0, "<root>", [model], Layout(root, group_of, self.sharding.shards), is_root=True)
        units.append(root_unit)
        for ui, (uname, umod) in enumerate(unit_mods):
            if not per_unit[ui]:
                continue
            units.append(Unit(len(units), uname, [umod], Layout(per_unit[ui], group_of, self.sharding.shards),
                              is_root=False))
        return units

    def _compute_bytes(self, u: Unit) -> int:
        return _nbytes(u.compute_numel, self.dtype)

    def device_need(self) -> Dict[str, int]:
        """Bytes the device tier needs: minimum (for the budget check) and everything resident."""
        depth = self.config.prefetch_depth
        root = self.units[0]
        # Units found to be used outside their forward stay resident for whole
        # passes, like the root (known after the first pass; see note_external_use).
        external = sum(self._compute_bytes(u) for u in self.units[1:] if u.external)
        others = sorted((self._compute_bytes(u) for u in self.units[1:] if not u.external), reverse=True)
        grad_reserve = max([_nbytes(u.trainable_numel, self.dtype) for u in self.units] + [0])
        opt_fixed = 0
        if not self.host_optimizer:
            opt_fixed = sum(4 * _nbytes(u.trainable_numel, torch.float32) for u in self.units)
        all_compute = sum(self._compute_bytes(u) for u in self.units)
        if self.params_on_device:
            arena_min = all_compute
        else:
            # The root and external units (at the top of the arena), the unit
            # computing and `depth` prefetched units. Enough at any moment,
            # since units held only for a pending backward give way (see [Note: pins]).
            arena_min = self._compute_bytes(root) + external + sum(others[:depth + 1])
        return {"arena_min": arena_min, "all_compute": all_compute, "grad_reserve": grad_reserve,
                "opt_fixed": opt_fixed, "largest_unit": others[0] if others else 0}

    def device_minimum(self) -> int:
        """The smallest ``device_memory`` (bytes) this model and config run
        with: the root unit, ``prefetch_depth + 1`` of the largest units, the
        gradient reserve and the device-side optimizer state."""
        need = self.device_need()
        # Ranges are 512-byte aligned: up to 511 bytes lost per unit, and the arena is rounded down.
        return need["arena_min"] + need["grad_reserve"] + need["opt_fixed"] + 512 * (len(self.units) + 1)

    def _place(self, model: nn.Module) -> None:
        cfg = self.config
        need = self.device_need()
        budget = cfg.device_memory
        minimum = self.device_minimum()
        self._auto_capacity = None  # See [Note: the default device budget]
        if budget is None:
            budget, self._auto_capacity = self._default_device_budget(minimum)
        if budget < minimum:
            biggest = max(self.units[1:], key=self._compute_bytes, default=self.units[0])
            raise BudgetError(
                f"device_memory={budget} bytes ({format_bytes(budget)}) is too small: it needs at least "
                f"{minimum} bytes ({format_bytes(minimum)}): the root unit ({self._compute_bytes(self.units[0])} "
                f"bytes), the largest unit {biggest.name!r} ({self._compute_bytes(biggest)} bytes) and "
                f"prefetch_depth={cfg.prefetch_depth} more units of up to that size, "
                f"{need['grad_reserve']} bytes for gradients in flight"
                + (f" and {need['opt_fixed']} bytes of optimizer state on the device" if need["opt_fixed"] else "")
                + ". Raise device_memory, lower prefetch_depth, or split the model into smaller units "
                  "(Config.unit_classes)")
        self._make_device_tier(budget)

        # Host buffers. Permanent: homes of host-resident state (compute copy,
        # optimizer state, the delayed mode's second buffers). With NVMe homes
        # the rest of the budget is the cache and the optimizer's pipeline
        # (see [Note: NVMe homes and the host cache] in nvme.py).
        delayed = cfg.overlap == "delayed"
        perm, cache_all, largest_c, largest_t = 0, 0, 0, 0
        nvme_need = 0
        zero_transient = 0
        for u in self.units:
            cb = _round_pool(self._compute_bytes(u))
            tb = _round_pool(_nbytes(u.trainable_numel, torch.float32)) if u.trainable_numel else 0
            largest_c, largest_t = max(largest_c, cb), max(largest_t, tb)
            if self._compute_home_host():
                perm += (_round_pool(self._compute_bytes(u) // self.sharding.world) if self.zero == 3
                         else cb * (2 if delayed else 1))
            if self.params_nvme:
                hb = _round_pool(_nbytes(self.home_compute_numel(u), self.dtype))
                cache_all += hb
                nvme_need += hb
            sb = _round_pool(tb // self.sharding.world) if self.zero else tb
            if self.host_optimizer and u.trainable_numel:
                if self.zero:
                    # Gradient shard (+ full gradients for stage 1) on the host;
                    # master and moments too unless they live on NVMe.
                    perm += sb + (tb if self.zero == 1 else 0) + (0 if self.opt_nvme else 3 * sb)
                    if self.zero >= 2:  # full gradients live from the unit's first gradient to its reduction
                        zero_transient += tb
                elif not self.opt_nvme:
                    gb = _round_pool(_nbytes(u.trainable_numel, self.grad_dtype))
                    perm += 3 * tb + gb * (2 if delayed else 1)
            if self.opt_nvme and u.trainable_numel:
                k = 3 if self.zero else 4  # ZeRO keeps its gradient shard on the host
                k -= 1 if self.master_is_compute(u) else 0
                cache_all += k * sb
                nvme_need += k * sb
        host_budget = cfg.host_memory
        if host_budget is None:
            host_budget = int(_available_ram() * 0.8)
        minimum = perm
        if self.params_nvme:
            minimum += (cfg.prefetch_depth + 2) * largest_c + _round_pool(self._compute_bytes(self.units[0]))
        if self.opt_nvme:
            # Two units' master, moments and gradients in the pipeline, and
            # the gradients of the unit whose backward is running.
            minimum += 9 * largest_t + largest_c
        if self.zero >= 2 and cfg.grad_accumulation_steps == 1:
            zero_transient = min(zero_transient, 3 * largest_t)  # a few units' gradients at a time
        minimum += min(zero_transient, 2 * largest_t)
        capacity = perm + (cache_all + 9 * largest_t + largest_c if self.nvme_used else 0) + zero_transient
        self.host_tier = HostTier(capacity, host_budget, pin=self.device.type == "cuda", need_bytes=minimum,
                                  device=self.device)
        self.host_budget = host_budget
        if self.nvme_used:
            keys = len(self.units) * 5
            slack = 2 * 4096 * keys * len(cfg.swap_paths) + 64 * 4096
            # The global rank names the folder: ranks of different groups on one node never share it.
            self.nvme = NvmeTier(cfg.swap_paths, nvme_need + slack, self.stats, rank=self.sharding.global_rank,
                                 block_size=cfg.swap_block_size,
                                 queue_depth=cfg.swap_queue_depth, backend=cfg.swap_backend,
                                 checksum=cfg.swap_checksum)
            weakref.finalize(self, self.nvme.close)

        with torch.no_grad():
            if any(p.is_meta for u in self.units for p in (s.param for s in u.layout.slots)):
                # Built under infinity.init: each unit is materialised on its
                # own, straight into its home tier (see infinity/lazy_init.py).
                from ..lazy_init import recorder_of
                rec = recorder_of(model)
                if rec is None:
                    raise ValueError("initialize: the model has parameters on the meta device but was not built "
                                     "under `with infinity.init(config):`; build it there or give real tensors")
                done = set()

                def sink(index: int, values: List[torch.Tensor]) -> None:
                    if index in done:
                        raise RuntimeError(f"lazy init: unit {self.units[index].name!r} materialised twice")
                    done.add(index)
                    self._init_unit_buffers(self.units[index], values)

                rec.materialize([[s.param for s in u.layout.slots] for u in self.units], sink)
                missing = [u.name for u in self.units if u.index not in done]
                if missing:
                    raise RuntimeError(f"lazy init: units never materialised: {missing}")
            else:
                for u in self.units:
                    self._init_unit_buffers(u, [s.param.detach().reshape(-1) for s in u.layout.slots])
            # Buffers (non-parameter state) go to the device; floating ones take
            # the compute dtype, as model.to(dtype) would do.
            for mod in model.modules():
                for name, b in list(mod._buffers.items()):
                    if b is None:
                        continue
                    nb = b.to(self.device)
                    if nb.is_floating_point():
                        nb = nb.to(self.dtype)
                    mod._buffers[name] = nb

    def _need_all(self) -> int:
        """Device bytes with every unit resident (what a budget beyond buys nothing)."""
        need = self.device_need()
        return need["all_compute"] + need["grad_reserve"] + need["opt_fixed"] + 512 * (len(self.units) + 1)

    def _make_device_tier(self, budget: int) -> None:
        need = self.device_need()
        arena = min(budget - need["grad_reserve"] - need["opt_fixed"],
                    need["all_compute"] + 512 * (len(self.units) + 1))
        self.device_tier = DeviceTier(self.device, budget, arena, need["grad_reserve"], need["opt_fixed"])
        self.device_budget = budget

    def _default_device_budget(self, minimum: int) -> Tuple[int, Optional[int]]:
        """(budget, capacity to grow into or None) for ``device_memory=None``
        (see [Note: the default device budget])."""
        need_all = self._need_all()
        if self.device.type != "cuda":
            return need_all, None  # the CPU "device" is RAM: no budget unless one is given
        free, _total = torch.cuda.mem_get_info(self.device)
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        if self.params_on_device:
            return max(minimum, int(free * 0.9)), None  # nothing pages: the arena holds every unit anyway
        torch.cuda.reset_peak_memory_stats(self.device)  # the peak read after the first step is ours
        return device_budget.initial_budget(free, need_all, minimum), free

    def _memory_peak(self) -> int:
        """The device allocator's peak bytes since initialize (CUDA)."""
        return torch.cuda.max_memory_allocated(self.device)

    def after_step(self) -> None:
        """Called at the end of every optimizer step: the first one, with the
        default budget, grows the device budget to what the pass left free
        (see [Note: the default device budget])."""
        cap, self._auto_capacity = self._auto_capacity, None
        if cap is None or any(u.device_state is not DeviceState.ABSENT for u in self.units if not u.permanent):
            return
        tier = self.device_tier
        new = device_budget.grown_budget(cap, self._memory_peak(), tier.arena_bytes + tier.fixed_bytes,
                                         self.device_budget, self._need_all())
        if new is None:
            return
        peak = tier.peak_bytes
        self.device_tier = None
        del tier  # the old arena goes before the new one is allocated
        self._make_device_tier(new)
        self.device_tier.peak_bytes = max(self.device_tier.peak_bytes, peak)
        if self.saved is not None:
            self.saved.rebind()

    def home_compute_numel(self, u: Unit) -> int:
        """Elements of ``u``'s home compute copy on this rank (its shard under ZeRO-3)."""
        return u.compute_numel // self.sharding.world if self.zero == 3 else u.compute_numel

    def state_numel(self, u: Unit) -> int:
        """Elements of ``u``'s fp32 master and moments on this rank (its shard under ZeRO)."""
        return u.trainable_numel // self.sharding.world if self.zero else u.trainable_numel

    def master_is_compute(self, u: Unit) -> bool:
        """[Note: fp32 master aliasing] With fp32 compute, every parameter of
        ``u`` trainable, no ZeRO sharding and both homes on NVMe, the compute
        copy and the fp32 master hold the same bits. They are then one buffer:
        one NVMe extent ("compute"), cached in the host like any compute copy
        and updated in place by the optimizer. That removes a third of the
        swap traffic of an fp32 step (the master's read and write) and the
        optimizer's copy-out."""
        return (self.params_nvme and self.opt_nvme and self.dtype == torch.float32 and self.zero == 0
                and self.config.overlap != "delayed" and bool(u.trainable_numel)
                and len(u.layout.trainable_slots) == len(u.layout.slots))

    @property
    def nvme_used(self) -> bool:
        return self.params_nvme or self.opt_nvme

    def _compute_home_host(self) -> bool:
        """The compute copy has a permanent host buffer: its home (params on
        the host), or the optimizer's copy-out target (params on the device,
        optimizer on the host)."""
        return self.config.offload_params == "host" or (self.params_on_device and self.host_optimizer)

    def _init_unit_buffers(self, u: Unit, originals: List[torch.Tensor]) -> None:
        """Allocates ``u``'s buffers in their tiers and fills them from
        ``originals`` (one tensor per slot, in slot order, any shape with the
        slot's numel)."""
        n, tn = u.compute_numel, u.trainable_numel
        if self._compute_home_host():
            # Stage 3: this rank's shard only (see Sharding.gather_units_params).
            u.host_compute = self._host_alloc(n // self.sharding.world if self.zero == 3 else n, self.dtype)
        if tn:
            if self.opt_nvme:
                u.moments_fresh = True  # first step starts from zero moments: nothing to read
                if self.zero:
                    u.grad_shard = self._host_alloc(tn // self.sharding.world, torch.float32)
                    if self.zero == 1:
                        u.grad = self._host_alloc(tn, torch.float32)
            elif self.host_optimizer and self.zero:
                # See [Note: ZeRO shards in infinity].
                sn = tn // self.sharding.world
                u.master = self._host_alloc(sn, torch.float32)
                u.exp_avg = self._host_alloc(sn, torch.float32)
                u.exp_avg_sq = self._host_alloc(sn, torch.float32)
                u.grad_shard = self._host_alloc(sn, torch.float32)
                if self.zero == 1:
                    u.grad = self._host_alloc(tn, torch.float32)
            elif self.host_optimizer:
                u.master = self._host_alloc(tn, torch.float32)
                u.exp_avg = self._host_alloc(tn, torch.float32)
                u.exp_avg_sq = self._host_alloc(tn, torch.float32)
                u.grad = self._host_alloc(tn, self.grad_dtype)
                if self.config.overlap == "delayed":
                    u.next_grad = self._host_alloc(tn, self.grad_dtype)
            else:
                mk = lambda: torch.zeros(tn, dtype=torch.float32, device=self.device)  # noqa: E731
                u.master, u.exp_avg, u.exp_avg_sq, u.grad = mk(), mk(), mk(), mk()
        originals = [t.detach().reshape(-1) for t in originals]
        master_full = u.master
        if (self.zero or self.opt_nvme) and tn:
            master_full = torch.zeros(tn, dtype=torch.float32)  # the own shard (or NVMe copy) is kept below
        comp = buf = None
        if self.params_nvme:
            comp, buf = self._host_acquire(self.home_compute_numel(u), self.dtype, zero=True, compute=True)
        home = u.host_compute if u.host_compute is not None else comp  # this rank's compute copy
        # Stage 3 keeps a shard: the full copy is assembled first; else the slots go straight home.
        full = torch.zeros(n, dtype=self.dtype) if self.zero == 3 and home is not None else None
        for s, src in zip(u.layout.slots, originals):
            if src.numel() != s.numel:
                raise ValueError(f"unit {u.name!r}: value for {s.name!r} has {src.numel()} elements, "
                                 f"expected {s.numel} (shape {tuple(s.shape)})")
            if s.trainable and master_full is not None:
                master_full[s.offset:s.offset + s.numel].copy_(src)
            dst = full if full is not None else home
            if dst is not None:
                dst[s.offset:s.offset + s.numel].copy_(src)
        if full is not None:
            home.copy_(self.sharding.shard_of_params(full, tn))
        if tn and master_full is not u.master:
            lo, hi = self.sharding.shard(tn)
            own = master_full[lo:hi]
            if self.opt_nvme:
                if not self.master_is_compute(u):  # else written below as the compute copy
                    self.nvme.write(swap_key(u.index, "master"), own).wait()
            else:
                u.master.copy_(own)
        if comp is not None:
            self.nvme.write(swap_key(u.index, "compute"), comp).wait()
            with self._host_lock:
                u.host_compute, u.host_buf = comp, buf  # stays cached while the budget has room
        if self.config.overlap == "delayed" and u.host_compute is not None:
            u.next_compute = self._host_alloc(n, self.dtype)
            u.next_compute.copy_(u.host_compute)
        if self.params_on_device:
            # Lives on the device for good: written once here, refreshed after
            # each optimizer step.
            off = self._alloc_range(u, allow_evict=False)
            if off is None:
                raise BudgetError(f"device tier: no room for unit {u.name!r} ({self._compute_bytes(u)} bytes) "
                                  "with offload_params='none'")
            u.device_state = transition(u.name, "device", u.device_state, DeviceState.FETCHING)
            u.dev_range = off
            u.dev_compute = self.device_tier.view(off, n, self.dtype)
            u.dev_compute.zero_()
            for s, src in zip(u.layout.slots, originals):
                u.dev_compute[s.offset:s.offset + s.numel].copy_(src)
            u.device_state = transition(u.name, "device", u.device_state, DeviceState.RESIDENT)
            u.permanent = True
            self._attach_params(u)
        else:
            # Until fetched, a NaN stand-in of the right shape (see _standin).
            self._detach_params(u)
        for s in u.layout.slots:
            s.param.requires_grad_(s.trainable)

    @torch.no_grad()
    def write_unit_values(self, u: Unit, values: Dict[int, torch.Tensor]) -> None:
        """Overwrites parameters of ``u`` (slot index -> tensor of the slot's
        numel, any dtype) in every tier that holds them: fp32 master, compute
        home, and the device copy if resident. Optimizer moments are left as
        they are. Used by ``infinity.load_pretrained``."""
        self.drain_grads()
        if not u.permanent and u.device_state is not DeviceState.ABSENT:
            if u.pins:
                raise RuntimeError(f"write_unit_values: unit {u.name!r} is in use by a forward/backward")
            self._evict(u)  # fetched again, with the new values, when next used
        # Every buffer holding these parameters: in memory they are written in
        # place; NVMe homes are read, written and stored back.
        master = self.read_kind(u, "master") if u.trainable_numel else None
        home = self.read_kind(u, "compute")
        computes = [t for t in (home, u.next_compute) if t is not None]
        if u.permanent and u.dev_compute is not None and home is not u.dev_compute:
            computes.append(u.dev_compute)
        for i, t in values.items():
            s = u.layout.slots[i]
            src = t.detach().reshape(-1)
            if src.numel() != s.numel:
                raise ValueError(f"{s.name}: {src.numel()} elements given, the parameter has {s.numel} "
                                 f"(shape {tuple(s.shape)})")
            sl = slice(s.offset, s.offset + s.numel)
            if s.trainable and master is not None:
                master[sl].copy_(src)
            for c in computes:
                c[sl].copy_(src)
        if master is not None:
            lo, hi = self.sharding.shard(u.trainable_numel)
            if self.opt_nvme and not self.master_is_compute(u):  # else written below with the compute copy
                self.nvme.write(swap_key(u.index, "master"), master[lo:hi]).wait()
            elif self.zero:
                u.master.copy_(master[lo:hi])
        if self.zero == 3:
            home = self.sharding.shard_of_params(home, u.trainable_numel)
            if u.host_compute is not None:
                u.host_compute.copy_(home)
        if self.params_nvme:
            with self._host_lock:
                if u.host_busy is not None:
                    u.host_busy.wait()
                self.nvme.write(swap_key(u.index, "compute"), home).wait()
                u.host_dirty, u.compute_sums = False, None

    # ------------------------------------------------------------------ residency

    def _standin(self, s) -> torch.Tensor:
        # Right shape and numel (user code may count parameters), one shared
        # element of storage, NaN: a parameter read while its unit is not
        # resident poisons the result instead of silently computing with zeros.
        nan = getattr(self, "_nan", None)
        if nan is None:
            nan = self._nan = torch.full((1,), float("nan"), dtype=self.dtype, device=self.device)
        return nan.expand(s.shape)

    def _attach_params(self, u: Unit) -> None:
        dev = u.dev_compute
        for s in u.layout.slots:
            s.param.data = dev[s.offset:s.offset + s.numel].view(s.shape)

    def _detach_params(self, u: Unit) -> None:
        for s in u.layout.slots:
            s.param.data = self._standin(s)

    def _alloc_range(self, u: Unit, allow_evict: bool = True, protect_before: float = NEVER,
                     soft: bool = False) -> Optional[int]:
        """An arena range for ``u`` (byte offset), evicting :meth:`_victim`'s
        choices until one fits; None if none does. Pass units (root, external)
        are placed from the top, the others from the bottom, so the pass
        units never split the space the others page through."""
        nbytes = self._compute_bytes(u)
        high = u.index == 0 or u.external
        while True:
            off = self.device_tier.try_alloc(nbytes, high=high)
            if off is not None:
                return off
            if not allow_evict:
                return None
            victim = self._victim(protect_before, soft)
            if victim is None:
                return None
            self._evict(victim)

    def _victim(self, protect_before: float = NEVER, soft: bool = False) -> Optional[Unit]:
        """Policy: the evictable unit whose next use is furthest away (Belady on
        the trace); least recently used without a trace. Units needed before
        ``protect_before`` (a trace index) are not candidates. With ``soft``,
        units held only for a pending backward are candidates too, after
        every free one (see [Note: pins])."""
        best, best_key = None, None
        for u in self.units:
            if u.device_state is DeviceState.ABSENT or u.pins > 0 or u.permanent or u.index in self._protected:
                continue
            if u.bwd_count and not soft:
                continue
            nu = self.trace.next_use(u.index)
            if nu <= protect_before and protect_before != NEVER:
                continue
            key = (u.bwd_count == 0, nu, -u.last_used)
            if best_key is None or key > best_key:
                best, best_key = u, key
        return best

    def unit_at(self, offset: int) -> Optional[Unit]:
        """The unit whose device range holds arena byte ``offset`` (None: none)."""
        for u in self.units:
            r = u.dev_range
            if r is not None and r <= offset < r + self._compute_bytes(u):
                return u
        return None

    def _begin_fetch(self, u: Unit, off: int) -> None:
        u.device_state = transition(u.name, "device", u.device_state, DeviceState.FETCHING)
        u.dev_range = off
        u.dev_compute = self.device_tier.view(off, u.compute_numel, self.dtype)
        read = self._cache_load(u) if self.params_nvme else None
        # A range just allocated holds no live data: its copy waits only for
        # the eviction that freed it (see [Note: device range reuse]).
        h2d = self._fresh_h2d
        dev, host, tn = u.dev_compute, u.host_compute, u.trainable_numel
        if self.zero == 3 and read is not None:
            # The NVMe read starts now; the gather is issued when compute needs
            # the unit, from the thread that issues every collective, so all
            # ranks issue them in the same order (see [Note: ZeRO shards in infinity]).
            u.fetch_ticket = DeferredTicket(read.wait,
                                            lambda: self.sharding.gather_units_params(dev, host, tn, h2d=h2d))
        elif self.zero == 3:
            u.fetch_ticket = self.sharding.gather_units_params(dev, host, tn, h2d=h2d)
        elif read is not None:
            u.fetch_ticket = self.mover.chain(read.wait, lambda: h2d(dev, host))
        else:
            u.fetch_ticket = h2d(dev, host)
        u.host_busy = u.fetch_ticket
        self.stats.moved("h2d", self._compute_bytes(u) // self.sharding.world if self.zero == 3
                         else self._compute_bytes(u))
        self._internal += 1
        try:
            self._attach_params(u)
        finally:
            self._internal -= 1

    def device_stall_seconds(self) -> float:
        """Seconds compute on the device waited for fetches: on CUDA from
        timing events around each stream wait (the host never blocks there),
        on the CPU the host's own waits."""
        clock = getattr(self.mover, "stall_clock", None)
        return clock.seconds() if clock is not None else self.stats.stall_seconds

    def _wait_fetch(self, u: Unit) -> None:
        if u.device_state is DeviceState.FETCHING:
            t0 = time.perf_counter()
            u.fetch_ticket.wait_compute()
            self.stats.stall_seconds += time.perf_counter() - t0
            u.fetch_ticket = None
            u.device_state = transition(u.name, "device", u.device_state, DeviceState.RESIDENT)

    def _evict(self, u: Unit) -> None:
        assert u.pins == 0 and not u.permanent, u
        if u.device_state is DeviceState.FETCHING:
            u.fetch_ticket.wait()  # the copy still writes into the range
            u.fetch_ticket = None
        self._internal += 1
        try:
            self._detach_params(u)
        finally:
            self._internal -= 1
        self.mover.release_marker()  # See [Note: device range reuse]
        self.device_tier.free(u.dev_range)
        u.dev_range, u.dev_compute = None, None
        u.device_state = transition(u.name, "device", u.device_state, DeviceState.ABSENT)
        self.stats.evictions += 1

    # ------------------------------------------------------------------ host cache (NVMe homes)

    def _release_deferred(self, block: bool) -> bool:
        """Frees host buffers whose writes finished; with ``block``, waits for
        the oldest if none has. Returns True if anything was freed."""
        freed = False
        keep = []
        for h, buf in self._deferred:
            if h.done():
                h.wait()  # raises the write's error, if any
                self.host_tier.release(buf)
                freed = True
            else:
                keep.append((h, buf))
        if not freed and block and keep:
            h, buf = keep.pop(0)
            h.wait()
            self.host_tier.release(buf)
            freed = True
        self._deferred = keep
        return freed

    def _wait_deferred(self) -> None:
        """Waits (without the host lock) for the writes of deferred releases queued so far."""
        with self._host_lock:
            handles = [h for h, _ in self._deferred]
        for h in handles:
            h.wait()

    def defer_release(self, handle, buf) -> None:
        """Frees ``buf`` once ``handle`` (a write from it) completes."""
        with self._host_lock:
            self._deferred.append((handle, buf))

    def _evict_cached(self, protect: Optional[Unit], done_only: bool = False, wait: bool = True) -> int:
        """Drops the cached compute copy whose next use is furthest away (the
        device tier's rule); never one a transfer still reads. ``done_only``:
        only copies this pass does not use again. A dirty copy is written back
        first; without ``wait`` its buffer is freed when that write finishes
        (a deferred release). Returns the bytes freed or to be freed (0: none)."""
        best, best_key = None, None
        for u in self.units:
            if u is protect or u.host_compute is None or u.host_buf is None or u.host_locks:
                continue
            if done_only and self.trace.next_use(u.index) != NEVER:
                continue
            if u.host_busy is not None and not u.host_busy.done():
                continue
            k = (self.trace.next_use(u.index), -u.last_used)
            if best_key is None or k > best_key:
                best, best_key = u, k
        if best is None:
            return 0
        nbytes = _round_pool(best.host_compute.numel() * best.host_compute.element_size())
        if best.host_dirty:
            # Write-back cache: a copy updated while cached reaches NVMe only
            # now, so a unit that stays cached costs no swap writes (nor their
            # checksums) step after step.
            h = self.nvme.write(swap_key(best.index, "compute"), best.host_compute, best.compute_sums)
            best.host_dirty, best.compute_sums = False, None
            if not wait:
                best.host_write = h  # a read of this copy waits for it (_settle_write_back)
                self._deferred.append((h, best.host_buf))
                best.host_compute, best.host_buf, best.host_busy = None, None, None
                return nbytes
            h.wait()
        self.host_tier.release(best.host_buf)
        best.host_compute, best.host_buf, best.host_busy = None, None, None
        return nbytes

    def _settle_write_back(self, u: Unit) -> None:
        """Waits for a write-back of ``u``'s evicted compute copy still in
        flight, so a read of the NVMe copy sees the new bytes."""
        if u.host_write is not None:
            u.host_write.wait()
            u.host_write = None

    def _make_host_room(self, protect: Optional[Unit]) -> bool:
        """One step of freeing host memory (call with the host lock): finished
        write-backs, else a cached compute copy other than ``protect``'s, else
        a write-back waited for. False: nothing of these was left."""
        return bool(self._release_deferred(block=False) or self._evict_cached(protect)
                    or self._release_deferred(block=True))

    def _host_alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed host buffer kept for good (placement at ``initialize``);
        evicts compute copies cached by earlier units' initialisation to make room."""
        with self._host_lock:
            while True:
                try:
                    return self.host_tier.alloc(numel, dtype)
                except PoolExhausted:
                    if self._make_host_room(None):
                        continue
                    raise BudgetError(f"host tier: {_nbytes(numel, dtype)} bytes needed for a permanent buffer, "
                                      f"{self.host_tier.free_bytes} of {self.host_tier.pool.capacity_bytes} free; "
                                      "raise host_memory") from None

    def _host_acquire(self, numel: int, dtype: torch.dtype, zero: bool = False, protect: Optional[Unit] = None,
                      compute: bool = False):
        """A transient host buffer under the host budget: frees finished
        write-backs, then cached compute copies, then waits for write-backs,
        then for the optimizer's work in flight (which frees its buffers).
        ``compute``: a compute copy, taken from the top of the pool (fp32
        state and gradients from the bottom), so neither class fragments the
        other's free space."""
        with self._host_lock:
            while True:
                try:
                    return self.host_tier.acquire(numel, dtype, zero, high=compute)
                except PoolExhausted:
                    if self._make_host_room(protect):
                        continue
                    # Any thread but the optimizer's own may wait for its
                    # work (on CUDA, backward hooks run on autograd's device
                    # thread, not the main one); that thread would wait for itself.
                    if not threading.current_thread().name.startswith("infinity-host") \
                            and self._wait_optimizer_work():
                        continue
                    if self._drop_opt_prefetch(protect):
                        continue
                    nbytes = _nbytes(numel, dtype)
                    raise BudgetError(f"host tier: {nbytes} bytes needed, {self.host_tier.free_bytes} of "
                                      f"{self.host_tier.pool.capacity_bytes} free and nothing left to evict; "
                                      "raise host_memory or lower prefetch_depth") from None

    def _drop_opt_prefetch(self, protect: Optional[Unit]) -> bool:
        """Gives back the buffers of an optimizer state read ahead by
        :meth:`opt_prefetch` and not yet claimed by its update (call with the
        host lock): a read-ahead is a cache, and memory needed now comes
        first; the update reads the state again. The root's goes first (it is
        updated last). True if one was dropped."""
        for u in self.units:
            if u is protect or u.opt_pending is None:
                continue
            for h in u.opt_pending:
                h.wait()
            u.opt_pending = None
            self.opt_store_unchanged(u)  # nothing changed: the NVMe copies stand
            return True
        return False

    def _wait_optimizer_work(self) -> bool:
        """Waits (without the host lock) for one update running on the host
        thread, which frees its buffers when done. True if one was waited for."""
        for u in self.units:
            t = u.opt_ticket
            if t is not None and not t.done():
                depth = 0
                while self._host_lock._is_owned():  # release fully: the job needs the lock to finish
                    self._host_lock.release()
                    depth += 1
                try:
                    t.wait()
                finally:
                    for _ in range(depth):
                        self._host_lock.acquire()
                return True
        return False

    def _cache_load(self, u: Unit):
        """Makes sure ``u``'s compute copy has a host buffer; returns the NVMe
        read filling it, or None if it was cached."""
        with self._host_lock:
            if u.host_compute is not None:
                return None
            comp, buf = self._host_acquire(self.home_compute_numel(u), self.dtype, protect=u, compute=True)
            u.host_compute, u.host_buf = comp, buf
            self._settle_write_back(u)
            return self.nvme.read(swap_key(u.index, "compute"), comp)

    def fetch(self, u: Unit) -> None:
        """Makes ``u``'s compute copy usable by compute now, pinning it (caller unpins)."""
        self.trace.use(u.index)
        u.pins += 1
        self._touch(u)
        if u.device_state is DeviceState.ABSENT:
            try:
                self._fetch_needed(u)
            except BudgetError:
                u.pins -= 1
                raise
        self._prefetch()
        self._wait_fetch(u)

    def _touch(self, u: Unit) -> None:
        self._lru_clock += 1
        u.last_used = self._lru_clock

    def _fetch_needed(self, u: Unit) -> None:
        """Starts fetching ``u``, needed now: anything not held by a running
        forward, a pass or a recomputation gives way."""
        off = self._alloc_range(u, soft=True)
        if off is None:
            raise BudgetError(self._no_room_message(u))
        self._begin_fetch(u, off)
        self.stats.fetches += 1

    def _no_room_message(self, u: Unit) -> str:
        held = [f"{x.name} ({self._compute_bytes(x)} B)" for x in self.units
                if x.device_state is not DeviceState.ABSENT and (x.pins > 0 or x.permanent)]
        ext = [x.name for x in self.units if x.external]
        need = self.device_minimum()
        tier = self.device_tier
        return (f"device tier: cannot fit unit {u.name!r} ({self._compute_bytes(u)} bytes): {tier.arena_free_bytes} "
                f"of {tier.arena_bytes} arena bytes free (largest free range {tier.largest_free_bytes}) and the "
                f"resident units left are in use: {held}."
                + (f" Units {ext} are used outside their own forward, so they stay on the device for whole "
                   "passes; the budget must hold them as well." if ext else "")
                + f" Raise device_memory to at least {need} bytes ({format_bytes(need)}), lower prefetch_depth, "
                  "or split the model into smaller units (Config.unit_classes)")

    def fetch_for_backward(self, u: Unit) -> None:
        """``u``'s backward is about to run: holds it for that backward and
        fetches it if there is room without displacing any unit in use;
        otherwise the fetch waits for the next hook or the first saved
        tensor ``u``'s backward unpacks (see [Note: pins])."""
        self.trace.use(u.index)
        u.bwd_count += 1
        self._touch(u)
        if u.device_state is DeviceState.ABSENT:
            off = self._alloc_range(u)
            if off is None:
                if u not in self._wanted:
                    self._wanted.append(u)
                return
            self._begin_fetch(u, off)
            self.stats.fetches += 1
        self._prefetch()
        self._wait_fetch(u)

    def ensure_for_unpack(self, u: Unit) -> None:
        """Makes ``u`` resident for a saved tensor autograd unpacks now, and
        keeps it in place until the next hook (the other saved tensors of the
        same backward node may live in other units; see [Note: pins])."""
        if u.device_state is DeviceState.ABSENT:
            self._internal += 1
            try:
                self._fetch_needed(u)
            finally:
                self._internal -= 1
        self._wait_fetch(u)
        self._protected.add(u.index)

    def settle(self) -> None:
        """Called at every hook: what was unpacked before may move again, and
        the backward fetches that found no room try again."""
        if self._protected:
            self._protected.clear()
        if self._wanted:
            keep = []
            for u in self._wanted:
                if u.device_state is not DeviceState.ABSENT or u.bwd_count == 0:
                    continue
                off = self._alloc_range(u)
                if off is None:
                    keep.append(u)
                    continue
                self._begin_fetch(u, off)
                self.stats.fetches += 1
            self._wanted = keep

    def begin_recompute(self, u: Unit) -> None:
        """``u`` is fetched for a recomputation inside backward (activation
        checkpointing): the pin of that fetch is kept until ``u``'s backward
        is done, because checkpoint holds the recomputed tensors, views of
        ``u``'s range among them, where our saved-tensor hooks cannot see them."""
        u.recompute += 1

    def end_backward_of(self, u: Unit) -> None:
        """The gradients of one call of ``u``'s inputs are complete: its
        backward hold (and any recomputation pin) is released."""
        if u.bwd_count > 0:
            u.bwd_count -= 1
        if u.recompute:
            u.pins -= u.recompute
            u.recompute = 0
        self.settle()

    def values_changed(self, u: Unit, slots=None) -> None:
        """The values of ``u``'s parameters (``slots``, default its trainable
        ones) changed in their home: bumps their autograd versions, so a
        tensor saved before and needed after raises torch's in-place error
        (see [Note: saved tensors follow their unit])."""
        params = [s.param for s in (u.layout.trainable_slots if slots is None else slots)]
        if params:
            torch.autograd.graph.increment_version(params)

    def unpin(self, u: Unit) -> None:
        u.pins -= 1
        assert u.pins >= 0, u

    def _prefetch(self) -> None:
        """Policy: bring the next units of the trace up early, never evicting a
        unit that is needed sooner than the one being prefetched."""
        depth = self.config.prefetch_depth
        if depth == 0 or not self.trace.has_trace or self.params_on_device:
            return
        cap = self.config.prefetch_bytes
        ahead_bytes = 0
        seen = set()
        for idx in self.trace.upcoming(4 * depth + 4):
            if len(seen) >= depth:
                break
            if idx in seen:
                continue
            seen.add(idx)
            u = self.units[idx]
            if u.device_state is not DeviceState.ABSENT:
                continue
            nb = self._compute_bytes(u)
            if cap is not None and ahead_bytes + nb > cap:
                break
            off = self._alloc_range(u, protect_before=self.trace.next_use(idx))
            if off is None:
                break
            self._begin_fetch(u, off)
            ahead_bytes += nb
            self.stats.prefetches += 1

    def invalidate_device_copies(self) -> None:
        """After an optimizer step changed the home copies: drop device copies
        (they are fetched again when used) or, for units that live on the
        device, copy the new values up and wait."""
        tickets = []
        for u in self.units:
            if u.permanent:
                if u.host_compute is not None:
                    tickets.append(self.mover.h2d(u.dev_compute, u.host_compute))
                    self.stats.moved("h2d", self._compute_bytes(u))
            elif u.device_state is not DeviceState.ABSENT and u.pins == 0:
                self._evict(u)
        for t in tickets:
            t.wait()

    # ------------------------------------------------------------------ passes

    def begin_pass(self, grad: bool) -> None:
        """Root forward starts: a new pass (a forward and, with grad, its backward)."""
        if self._in_pass:
            self.end_pass()
        self._in_pass = True
        self._pass_grad = grad
        self.trace.begin_pass("train" if grad else "infer")
        if self._relayout or self.units[0].device_state is DeviceState.ABSENT:
            # The pass units go to the top of an empty arena, next to each
            # other (see _alloc_range): nothing they leave between them can
            # split the room the other units page through.
            self._relayout = False
            for u in self.units:
                if u.device_state is not DeviceState.ABSENT and not u.permanent and u.pins == 0:
                    self._evict(u)
        self._pin_for_pass(self.units[0])
        for u in self.units[1:]:
            u.bwd_count = 0
            if u.external:
                self._pin_for_pass(u)
        if grad:
            for u in self.units:
                u.grads_pending = len(u.layout.trainable_slots)

    def _pin_for_pass(self, u: Unit) -> None:
        self.fetch(u)
        self._pass_pins.append(u)

    def end_pass(self) -> None:
        """The pass is over (end of backward, or of a no-grad forward): release its pins."""
        if not self._in_pass:
            return
        for u in self._pass_pins:
            self.unpin(u)
        self._pass_pins = []
        for u in self.units[1:]:
            u.bwd_count = 0
            if u.recompute:
                u.pins -= u.recompute
                u.recompute = 0
        self._wanted = []
        self._protected.clear()
        self._in_pass = False
        self.trace.end_pass()
        self.stats.trace_invalidations = self.trace.invalidations

    def note_external_use(self, u: Unit) -> None:
        """A parameter of ``u`` is used outside ``u``'s forward (found by the
        recording pass's watcher): from now on ``u`` is resident for whole
        passes, like the root unit."""
        if not u.external:
            u.external = True
            self._relayout = True
            warnings.warn(f"infinity: parameters of unit {u.name!r} are used outside its forward; the unit "
                          "will stay on the device for whole forward/backward passes", RuntimeWarning,
                          stacklevel=4)
        if u not in self._pass_pins:
            self._pin_for_pass(u)

    # ------------------------------------------------------------------ gradients

    def on_grad(self, u: Unit, ti: int, p: nn.Parameter) -> None:
        """A parameter's gradient is complete for this backward: move it out of
        the device into the unit's fp32 gradient buffer (added for gradient
        accumulation) and free the device copy. ``ti`` indexes the unit's
        trainable slots."""
        g = p.grad
        if g is None:
            return
        if self.window_closed:
            n = self.config.grad_accumulation_steps
            raise RuntimeError(
                f"backward() number {self.micro_batches + 1} before optimizer.step(), with "
                f"Config.grad_accumulation_steps={n}: the last backward of the accumulation window already "
                + ("ran the updates (overlap='backward')" if self.config.overlap == "backward"
                   else "reduced the gradients over the ranks")
                + f", so the gradients of this one would be dropped. Call optimizer.step() after every {n} "
                "backward() calls, or set grad_accumulation_steps to the number of backward() calls per step "
                "(see [Note: the accumulation window] in infinity/engine/optimizer.py)")
        p.grad = None
        s = u.layout.trainable_slots[ti]
        if u.grad is None:  # gradients of an NVMe-homed optimizer state: a host buffer until the update
            self.acquire_grad(u)
        dst = u.grad[s.offset:s.offset + s.numel]
        accumulate = u.grad_written[ti]
        u.grad_written[ti] = True
        if u.grad_state is not GradState.ACCUMULATING:
            u.grad_state = transition(u.name, "grad", u.grad_state, GradState.ACCUMULATING)
        if self.host_optimizer:
            nb = g.numel() * g.element_size()
            self._bound_transient(nb)
            self.device_tier.add_transient(nb)
            t = self.mover.grad_out(dst, g, accumulate)
            self.stats.moved("d2h", nb)
            u.flush_tickets.append(t)
            self._grad_bytes_outstanding.append((t, nb))
        else:
            if accumulate:
                dst.add_(g.reshape(-1))
            else:
                dst.copy_(g.reshape(-1))
        u.grads_pending -= 1

    def _bound_transient(self, incoming: int) -> None:
        """Backpressure: waits for the oldest gradient copies until ``incoming``
        more bytes fit the reserve the budget set aside for gradients in flight."""
        out = self._grad_bytes_outstanding
        keep = []
        for t, nb in out:
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
        self._grad_bytes_outstanding = keep

    def acquire_grad(self, u: Unit, wait: bool = True):
        """A host gradient buffer for ``u`` (NVMe optimizer state): zeroed, or
        holding the gradients accumulated so far if they were spilled. Returns
        the read in flight when ``wait`` is False."""
        g, buf = self._host_acquire(u.trainable_numel, self.grad_dtype, protect=u)
        u.grad, u.grad_buf = g, buf
        if not u.grad_on_nvme:
            # Each slot's first gradient is copied in (not added), so only the
            # padding between slots needs zeros (the update's runs span it).
            Layout.zero_padding(g, u.layout.trainable_slots)
        if u.grad_on_nvme:
            h = self.nvme.read(swap_key(u.index, "grad"), g)
            if not wait:
                return h
            h.wait()
        return None

    def spill_grads(self, u: Unit) -> None:
        """Writes ``u``'s gradients to NVMe and frees their host buffer
        (NVMe optimizer state, when the update does not run during backward)."""
        if u.grad is None or u.grad_claimed:
            return
        self.wait_grads(u)
        h = self.nvme.write(swap_key(u.index, "grad"), u.grad)
        self.defer_release(h, u.grad_buf)
        u.grad, u.grad_buf, u.grad_on_nvme = None, None, True

    def load_grad(self, u: Unit, wait: bool = True):
        """Brings spilled gradients back to a host buffer (for the update or
        the norm); returns the read in flight when ``wait`` is False."""
        if u.grad is None and u.grad_on_nvme:
            return self.acquire_grad(u, wait)
        return None

    def drop_loaded_grad(self, u: Unit) -> None:
        """Frees a host copy of spilled gradients (they stay on NVMe)."""
        if u.grad_buf is not None and u.grad_on_nvme and not u.grad_claimed:
            self.host_tier.release(u.grad_buf)
            u.grad, u.grad_buf = None, None

    def release_grad(self, u: Unit) -> None:
        """Frees ``u``'s transient host gradient buffer once every copy and
        reduction into or out of it is done. Safe from two threads (the main
        thread and the optimizer's, under ZeRO)."""
        if u.grad_buf is not None:
            self.wait_grads(u)
            with self._host_lock:
                if u.grad_buf is not None:
                    self.host_tier.release(u.grad_buf)
                    u.grad, u.grad_buf = None, None
        u.grad_on_nvme = False
        u.grad_claimed = False

    def opt_load(self, u: Unit):
        """Starts reading ``u``'s master and moments from NVMe into host
        buffers; returns the handles to wait on (those of an earlier
        :meth:`opt_prefetch`, if one ran)."""
        with self._host_lock:
            if u.opt_pending is not None:
                handles, u.opt_pending = u.opt_pending, None
                return handles
            tn = self.state_numel(u)
            handles = []
            bufs = []
            kinds = ("master", "exp_avg", "exp_avg_sq")
            if self.master_is_compute(u):
                # The master is the cached compute copy, held (host_locks) until opt_store.
                read = self._cache_load(u)
                if read is not None:
                    handles.append(read)
                elif u.host_busy is not None and not u.host_busy.done():
                    handles.append(u.host_busy)  # a fetch still copies it to the device
                u.host_locks += 1
                u.compute_sums = None  # updated in place from here on
                u.master = u.host_compute[:tn]
                kinds = kinds[1:]
            for kind in kinds:
                fresh = kind != "master" and u.moments_fresh
                t, buf = self._host_acquire(tn, torch.float32, zero=fresh, protect=u)
                setattr(u, kind, t)
                bufs.append(buf)
                if not fresh:
                    handles.append(self.nvme.read(swap_key(u.index, kind), t))
            u.opt_bufs = bufs
            return handles

    def opt_prefetch(self, u: Unit, evict_done: bool = False) -> bool:
        """Starts :meth:`opt_load` of ``u`` early if the host budget has room
        now; the update of ``u`` then finds its state read. ``evict_done``:
        make room by evicting cached compute copies this pass no longer uses
        (Belady: they are needed next forward, after this state), writing
        dirty ones back; else never waits."""
        with self._host_lock:
            if u.opt_pending is not None or u.opt_bufs or not u.trainable_numel:
                return False
            alias = self.master_is_compute(u)
            need = (2 if alias else 3) * _round_pool(_nbytes(self.state_numel(u), torch.float32))
            if alias and u.host_compute is None:
                need += _round_pool(_nbytes(u.compute_numel, self.dtype))
            need += _round_pool(_nbytes(u.trainable_numel, torch.float32))  # room for the gradients arriving meanwhile
            freeing = 0
            while evict_done and self.host_tier.free_bytes + freeing < need:
                n = self._evict_cached(u, done_only=True, wait=False)
                if not n:
                    break
                freeing += n
        if freeing:
            # The write-backs finish without the lock, which the compute
            # thread needs meanwhile for its gradient buffers.
            self._wait_deferred()
        with self._host_lock:
            if u.opt_pending is not None or u.opt_bufs:
                return False
            self._release_deferred(block=False)
            if self.host_tier.free_bytes < need:
                return False
            try:
                u.opt_pending = self.opt_load(u)
            except BudgetError:
                return False
            return True

    def opt_out(self, u: Unit, whole: bool = False) -> Optional[torch.Tensor]:
        """The host buffer the update writes the new compute copy into (None:
        the master is the compute copy, updated in place). Waits until no
        copy to the device reads it any more. ``whole``: the update writes
        every trainable parameter of ``u`` (else the old copy is needed)."""
        if not self.params_nvme:
            if u.host_busy is not None:
                u.host_busy.wait()  # a host barrier: a fetch may still read the old copy
            return u.host_compute
        if self.master_is_compute(u):
            return None
        with self._host_lock:
            if u.host_compute is None or (u.host_busy is not None and not u.host_busy.done()):
                if u.host_compute is None and whole and len(u.layout.trainable_slots) == len(u.layout.slots) \
                        and self.zero == 0:
                    # The update writes every parameter of the unit (under ZeRO
                    # only its shard): no need to read the old copy, only to
                    # zero the padding between them.
                    comp, buf = self._host_acquire(u.compute_numel, self.dtype, protect=u, compute=True)
                    Layout.zero_padding(comp, u.layout.slots)
                    u.host_compute, u.host_buf = comp, buf
                elif u.host_compute is None:
                    read = self._cache_load(u)  # frozen parameters must be there too
                    read.wait()
                else:
                    if isinstance(u.host_busy, DeferredTicket) and u.host_busy.inner is None:
                        raise RuntimeError(f"internal: unit {u.name!r} updated while its fetch is pending")
                    u.host_busy.wait()
            u.host_locks += 1
            return u.host_compute

    def compute_written(self, u: Unit) -> None:
        """Ends a write into ``u``'s host compute copy begun by :meth:`opt_out`:
        the copy is dirty (reaches NVMe when evicted) and may be evicted again."""
        if self.params_nvme and not self.master_is_compute(u):
            with self._host_lock:
                u.host_dirty, u.compute_sums = True, None
                u.host_locks -= 1

    def opt_store(self, u: Unit) -> None:
        """Writes ``u``'s updated state back to NVMe (asynchronously; buffers
        are freed when the writes finish). The new compute copy stays in the
        host cache, marked dirty: it is written when evicted."""
        # [Note: fp32 master aliasing] The master is the compute copy: when
        # the update took the master's sums over the whole copy, they go with
        # its write-back on eviction ([Note: sums from the producer]).
        aliased = self.master_is_compute(u)
        sums = u.opt_sums.get("master") if aliased and u.master is not None \
            and u.master.numel() == u.host_compute.numel() else None
        if self.opt_nvme:
            kinds = ("master", "exp_avg", "exp_avg_sq")[1 if aliased else 0:]
            for kind, buf in zip(kinds, u.opt_bufs):
                h = self.nvme.write(swap_key(u.index, kind), getattr(u, kind), u.opt_sums.get(kind))
                self.defer_release(h, buf)
                setattr(u, kind, None)
            u.opt_bufs = []
            u.opt_sums = {}
            u.master = None
            u.moments_fresh = False
        if aliased:
            with self._host_lock:
                u.host_dirty, u.compute_sums = True, sums  # updated in place as the master
                u.host_locks -= 1
        else:
            self.compute_written(u)

    def opt_store_unchanged(self, u: Unit) -> None:
        """Frees the state buffers of a unit that got no gradient (nothing changed on NVMe)."""
        with self._host_lock:
            for buf in u.opt_bufs:
                self.host_tier.release(buf)
            u.opt_bufs = []
            u.master = u.exp_avg = u.exp_avg_sq = None
            if self.master_is_compute(u):
                u.host_locks -= 1

    @torch.no_grad()
    def read_kind(self, u: Unit, kind: str) -> Optional[torch.Tensor]:
        """``u``'s buffer of ``kind`` ("master", "exp_avg", "exp_avg_sq",
        "compute") as a CPU tensor, from wherever it lives (a temporary copy
        for NVMe homes); None if the unit has no such buffer."""
        if kind == "compute":
            if self.zero == 3:  # every rank must call this
                shard = u.host_compute
                if shard is None:
                    self._settle_write_back(u)
                    shard = torch.empty(self.home_compute_numel(u), dtype=self.dtype)
                    self.nvme.read(swap_key(u.index, "compute"), shard).wait()
                full = torch.empty(u.compute_numel, dtype=self.dtype)
                self.sharding.gather_units_params(full, shard, u.trainable_numel).wait()
                return full
            t = u.host_compute if u.host_compute is not None else (u.dev_compute if u.permanent else None)
            if t is not None:
                return t
            if self.params_nvme:
                self._settle_write_back(u)
                out = torch.empty(u.compute_numel, dtype=self.dtype)
                self.nvme.read(swap_key(u.index, "compute"), out).wait()
                return out
            return None
        if kind == "master" and u.master is None and self.master_is_compute(u):
            return self.read_kind(u, "compute")[:u.trainable_numel]
        t = getattr(u, kind)
        if t is not None and self.zero and kind != "compute":
            return self.sharding.all_gather(t, u.trainable_numel)  # every rank must call this
        if t is not None:
            return t
        if self.opt_nvme and u.trainable_numel:
            if kind != "master" and u.moments_fresh:
                out = torch.zeros(self.state_numel(u))
            else:
                out = torch.empty(self.state_numel(u), dtype=torch.float32)
                self.nvme.read(swap_key(u.index, kind), out).wait()
            return self.sharding.all_gather(out, u.trainable_numel) if self.zero else out
        return None

    def wait_grads(self, u: Unit) -> None:
        """Waits for every copy and reduction of ``u``'s gradients issued so
        far. Tickets are dropped only once waited for, so a second thread
        calling meanwhile waits too instead of finding the list empty."""
        pending = list(u.flush_tickets)
        if not pending:
            return
        for t in pending:
            t.wait()
        u.flush_tickets = [t for t in u.flush_tickets if not any(t is w for w in pending)]

    def drain_grads(self) -> None:
        for u in self.units:
            self.wait_grads(u)
        for t, nb in self._grad_bytes_outstanding:
            t.wait()
            self.device_tier.sub_transient(nb)
        self._grad_bytes_outstanding = []

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Stops the worker threads and removes the swap files (the model is unusable after)."""
        if self._closed:
            return
        self._closed = True
        self._settle_collectives()
        self.mover.synchronize()  # no copy may still read or write a buffer freed below
        self.mover.close()
        if self.nvme is not None:
            with self._host_lock:
                for h, buf in self._deferred:
                    h.wait()
            self.nvme.close()
        self.host_tier.close()  # last: NVMe transfers use its buffers

    def _settle_collectives(self, timeout_s: float = 30.0) -> None:
        """Waits (at most ``timeout_s`` seconds each) for stage-3 gathers still
        in flight, e.g. prefetches nobody used. Every rank issued the same ones,
        so they complete; left pending, gloo finishes them on its own thread
        while the interpreter shuts down and the process aborts. A gather not
        issued yet (NVMe, deferred) stays unissued on every rank alike."""
        for u in self.units:
            t = u.fetch_ticket
            if isinstance(t, DeferredTicket):
                t = t.inner
            works = list(getattr(t, "works", ()))
            for ft in u.flush_tickets:  # reductions still in flight
                works += getattr(ft, "works", ())
            for w in works:
                try:
                    w.wait(datetime.timedelta(seconds=timeout_s))
                except Exception:  # a failed peer: nothing left to protect
                    pass
            # Drop the Work objects now: held by a closed engine (freed only by
            # the final garbage collection) they outlive the process group's
            # destruction and are released on gloo's thread during shutdown.
            u.fetch_ticket = u.host_busy = None


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
