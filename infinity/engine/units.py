"""Paging units: which parameters move together, and their flat layout.

Policy (which modules form units) is :func:`partition`; the layout of one
unit's parameters inside its flat buffers is :class:`Layout`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn

from .state import DeviceState, GradState

__all__ = ["Slot", "Layout", "Unit", "partition"]

# Each parameter starts on a multiple of this many elements: 128 bytes of
# fp32, so vector loads in the kernels and copies start on cache lines.
ALIGN_ELEMS = 32


def _align(n: int, a: int = ALIGN_ELEMS) -> int:
    return -(-n // a) * a


@dataclass
class Slot:
    """One parameter's place in its unit's flat buffers (offsets in elements)."""

    param: nn.Parameter
    name: str          # first qualified name in the model
    offset: int
    numel: int
    shape: torch.Size
    trainable: bool
    group: int = 0     # optimizer param-group index (trainable only)
    step: int = 0      # optimizer steps taken (torch keeps this per parameter)


class Layout:
    """Flat layout of a unit: trainable parameters first (grouped by optimizer
    param group), then frozen ones. Optimizer buffers (fp32 master, grads,
    moments) cover only ``[0, trainable_numel)``; the compute copy covers
    ``[0, numel)``. ``numel`` is padded to ``pad_to`` so a later ZeRO stage can
    split every buffer into equal shards."""

    def __init__(self, named: Sequence[Tuple[str, nn.Parameter]], group_of: Dict[int, int], pad_to: int = 1):
        trainable = [(n, p) for n, p in named if p.requires_grad]
        frozen = [(n, p) for n, p in named if not p.requires_grad]
        trainable.sort(key=lambda np_: group_of.get(id(np_[1]), 0))  # stable: registration order in a group
        self.slots: List[Slot] = []
        off = 0
        for n, p in trainable:
            self.slots.append(Slot(p, n, off, p.numel(), p.shape, True, group_of.get(id(p), 0)))
            off = _align(off + p.numel())
        self.trainable_numel = _align(off, max(pad_to, 1) * ALIGN_ELEMS) if trainable else 0
        off = self.trainable_numel
        for n, p in frozen:
            self.slots.append(Slot(p, n, off, p.numel(), p.shape, False))
            off = _align(off + p.numel())
        self.numel = _align(off, max(pad_to, 1) * ALIGN_ELEMS)
        self.trainable_slots = [s for s in self.slots if s.trainable]

    @staticmethod
    def zero_padding(buf: torch.Tensor, slots: List[Slot]) -> None:
        """Zeroes the elements of ``buf`` outside ``slots`` (the alignment gaps
        and the tail), leaving the slots' data as it is."""
        end = 0
        for s in slots:
            if s.offset > end:
                buf[end:s.offset].zero_()
            end = s.offset + s.numel
        buf[end:].zero_()


class Unit:
    """A group of parameters that moves between tiers together.

    Buffers (all flat, 1-D):
        host_compute   compute dtype, ``layout.numel``: home copy (when not on device)
        dev_compute    compute dtype, ``layout.numel``: device copy while FETCHING/RESIDENT
        master, exp_avg, exp_avg_sq, grad   fp32, ``layout.trainable_numel``, in the
                       optimizer's tier (host or device)
        next_compute, next_grad   second buffers of the delayed-update mode
    """

    def __init__(self, index: int, name: str, modules: List[nn.Module], layout: Layout, is_root: bool):
        self.index = index
        self.name = name
        self.modules = modules
        self.layout = layout
        self.is_root = is_root
        self.device_state = DeviceState.ABSENT
        self.grad_state = GradState.CLEAN
        self.pins = 0
        self.fetch_ticket = None
        self.dev_range: Optional[int] = None  # offset in the device arena (bytes)
        self.host_compute: Optional[torch.Tensor] = None
        self.dev_compute: Optional[torch.Tensor] = None
        self.master: Optional[torch.Tensor] = None
        self.exp_avg: Optional[torch.Tensor] = None
        self.exp_avg_sq: Optional[torch.Tensor] = None
        self.grad: Optional[torch.Tensor] = None
        self.next_compute: Optional[torch.Tensor] = None
        self.next_grad: Optional[torch.Tensor] = None
        # Per trainable slot: does the grad buffer hold this step's data yet?
        self.grad_written: List[bool] = [False] * len(layout.trainable_slots)
        self.grads_pending = 0          # trainable slots still waiting for this backward's gradient
        self.flush_tickets: List = []   # gradient copies in flight
        self.bwd_armed = False          # pre-backward hook registered for this backward
        self.bwd_fetched = False
        self.post_bwd_done = False
        self.opt_ticket = None          # optimizer work in flight (overlap modes)
        self.external = False           # parameters used outside this unit's forward
        self.permanent = False          # lives on the device for good (offload_params="none")
        self.last_used = 0              # LRU clock of the last fetch
        self.bwd_count = 0              # backward holds (one per pending module call; see [Note: pins])
        self.recompute = 0              # pins of recomputations in backward, kept until its backward is done
        # NVMe homes (see [Note: NVMe homes and the host cache]):
        self.host_buf = None            # pool handle of a cached compute copy (None: permanent or absent)
        self.host_busy = None           # transfer reading host_compute (fetch ticket)
        self.host_dirty = False         # host_compute is newer than its NVMe copy (written back on eviction)
        self.compute_sums = None        # CRC32C sums of host_compute from the update that made it dirty
        self.host_write = None          # write-back of an evicted compute copy in flight
        self.host_locks = 0             # optimizer writing host_compute now
        self.grad_buf = None            # pool handle of an NVMe optimizer's gradient buffer
        self.grad_on_nvme = False       # gradients of this step were spilled to NVMe
        self.grad_claimed = False       # an update during backward owns the gradient buffer
        self.moments_fresh = False      # NVMe moments not written yet: they are zero
        self.opt_bufs: list = []
        self.opt_sums: dict = {}        # kind -> CRC32C sums the update took (SwapStore.write(crcs=))
        self.opt_pending = None         # reads of an early opt_load (NVMe optimizer state)
        self.grad_shard = None          # ZeRO: the own shard of the summed gradients
        self.grad_reduced = False       # ZeRO: grad_shard holds this step's reduced gradients

    @property
    def compute_numel(self) -> int:
        return self.layout.numel

    @property
    def trainable_numel(self) -> int:
        return self.layout.trainable_numel

    def __repr__(self) -> str:
        return (f"Unit({self.index}, {self.name!r}, {self.layout.numel} elems, {self.device_state.value}, "
                f"pins={self.pins})")


def _matches(module: nn.Module, classes: Sequence[Union[str, type]]) -> bool:
    for c in classes:
        if isinstance(c, str):
            if type(module).__name__ == c or f"{type(module).__module__}.{type(module).__name__}" == c:
                return True
        elif isinstance(module, c):
            return True
    return False


def partition(model: nn.Module, unit_classes: Optional[Sequence[Union[str, type]]] = None
              ) -> List[Tuple[str, nn.Module]]:
    """The modules that form paging units, outermost first, in registration order.

    Default policy: every child of every ``nn.ModuleList`` (transformer blocks).
    With ``unit_classes``: every module whose class matches. A module nested
    inside another unit is not a unit of its own. Everything else belongs to
    the root unit. Containers that are never called (``ModuleList``,
    ``ModuleDict``) are not units: a unit's hooks must run when it computes,
    so the search goes on inside them.
    """
    found: List[Tuple[str, nn.Module]] = []

    def visit(prefix: str, mod: nn.Module) -> None:
        for name, child in mod.named_children():
            q = f"{prefix}.{name}" if prefix else name
            is_unit = _matches(child, unit_classes) if unit_classes else isinstance(mod, nn.ModuleList)
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                is_unit = False
            if is_unit and any(p is not None for p in child.parameters()):
                found.append((q, child))
            else:
                visit(q, child)

    visit("", model)
    return found
