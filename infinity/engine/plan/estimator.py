"""The peak bytes a run will take per tier, before any memory is touched.

The model (on the meta device) is split into paging units and placed exactly
as ``infinity.initialize`` does; the tier figures then follow from the
engine's own placement arithmetic (``infinity.engine.plan.placement``):

- device: the arena fills with the pass units and as many paged units as fit
  (the arena is what the budget leaves after the gradient reserve and any
  device-side optimizer state), plus the gradients between autograd and their
  copy out (about the largest parameter's), plus on CUDA the activations
  (``device_memory`` budgets the model state; the activations come beside it
  in the same memory, so the device's peak holds both);
- host: the pool's permanent homes and, under ZeRO, the full gradients
  being reduced, the undo state of speculative updates; with NVMe homes
  the pool caches up to its budget;
- nvme: the bytes the swap files hold (compute copies, master, moments);
- process RSS: the interpreter and libraries as they are now (measured in
  this process), the host pool, on a CPU "device" the device tier, the
  activations and the fp32 workspace of a 16-bit weight gradient
  (``MM_WORKSPACE_FP32``, where torch's CPU gemm takes one), the NVMe staging buffers and a fixed runtime
  overhead (``RUNTIME_BYTES``, measured: autograd, kernels' workspace and
  allocator caches, the optimizer's threads); or, if larger, what
  ``initialize`` holds: the pool and the model's tensors as built (all of
  them, or under ``infinity.init`` the largest unit's, materialised one unit
  at a time: [Note: initialise's peak]).

[Note: initialise's peak]
``initialize`` of a model built under ``infinity.init`` materialises one
unit's values at a time, in the dtype they were built in (fp32), and hands
them to the tiers: the compute copy into a pool buffer, the master to NVMe
through pool buffers of one chunk ([Note: initial masters in pieces] in
values.py). The replay's scratch for discarded random draws is freed after
each large draw ([Note: the replay's scratch is not kept] in
lazy_init/replay.py). So beside the pool (prefaulted whole where it is not
locked) and the staging, RSS holds the largest unit's built values: on the
Llama-3-8B shape (1 layer, a 3.5 GiB pool, measured) the peak went from
8.76 GiB (a 2 GiB scratch, the 2 GiB unit and its 1 GiB master temporary
beside the pool) to 5.85 GiB (the pool and the unit; estimated 5.82).

Activations are measured by running the model's forward on meta tensors and
summing what autograd saves for backward (parameters excluded: they are the
tiers'). Without checkpointing the peak is that plus one block's worth
(``BACKWARD_UNITS``: the gradients of the block whose backward runs), since
backward frees each block's saved tensors as it makes their gradients. With activation
checkpointing only the checkpoints are saved, and a recomputed block's
activations, their gradients and temporaries come on top during its backward:
``RECOMPUTE_UNITS`` blocks' worth (the most one unit's call saves, measured
with checkpointing off).
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, Optional

import torch
import torch.nn as nn

from ...system import sysinfo
from ...config.runtime import Config
from .placement import Modes, device_need, device_reduce_bytes, host_need, modes_of, nbytes, nvme_capacity, place_unit
from .units import build_units
from .opt_kinds import slot_align
from .limits import STAGING_PER_PATH
from .activations import activation_bytes

__all__ = ["estimate_peaks", "measure_activations", "activation_bytes", "placed", "compute_device", "RUNTIME_BYTES"]

RUNTIME_BYTES = 48 << 20    # measured: RSS a step adds beyond the parts counted here (docs/cli.md)
# Measured (torch 2.13, CPU): the gradient of an nn.Linear weight in bf16 or
# fp16, ``grad_out.t().mm(input)``, takes an fp32 buffer of the weight's shape
# beside its 16-bit result (a transposed 16-bit operand goes through an fp32
# gemm); 3x the gradient's bytes at its peak, 1x in fp32 or for an embedding.
# On the Llama-3-8B shape its head (525 M) made this 1.96 GiB of RSS. Where
# torch hands the dtype's matmul to oneDNN (bf16 on a CPU with AVX-512, fp16
# with AVX512-FP16 or AMX: ``torch.ops.mkldnn._is_mkldnn_*_supported``) there
# is no such buffer: 1.05x the bf16 gradient on an AVX-512 EPYC.
MM_WORKSPACE_FP32 = 4       # bytes an element of that buffer
_ONEDNN_16BIT = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}
RECOMPUTE_UNITS = 3         # blocks' worth of activations a checkpointed block's backward holds (measured)
BACKWARD_UNITS = 1          # blocks' worth of activation gradients beside what was saved, without checkpointing


def compute_device(config: Config) -> torch.device:
    """Where the run computes: ``Config.device``, with ``"auto"`` as the run
    would resolve it here; a ``cuda`` config is estimated as CUDA even on a
    machine without it (planning a GPU run)."""
    gpu = config.device.startswith("cuda") or (config.device == "auto" and torch.cuda.is_available())
    return torch.device("cuda" if gpu else "cpu")


def placed(model: nn.Module, config: Config, world: int = 1):
    """``(units, modes, places)``: ``model`` split into paging units and placed
    as ``initialize`` would on each of ``world`` ranks (no memory touched)."""
    modes = modes_of(config, world, compute_device(config))
    units = _units(model, config, world)
    return units, modes, [place_unit(u.layout, modes) for u in units]


# Planning splits one model many times over (each placement, overlap mode and
# check of `infinity estimate --time`): the units are kept per model, keyed by
# what they depend on, its parameters' identities and trainability included.
_SPLITS: "weakref.WeakKeyDictionary[nn.Module, Dict]" = weakref.WeakKeyDictionary()


def _units(model: nn.Module, config: Config, world: int):
    classes = tuple(config.unit_classes) if config.unit_classes is not None else None
    key = (classes, world if config.zero_stage else 1, slot_align(config.moment_dtype),
           tuple((id(p), p.requires_grad) for p in model.parameters()))
    memo = _SPLITS.setdefault(model, {})
    if key not in memo:
        memo.clear()  # one split a model at a time: the key changes when the model does
        memo[key] = build_units(model, config.unit_classes, {}, key[1], key[2])
    return memo[key]


def _act_peak(saved: int, unit: int, checkpointing) -> int:
    return saved + (RECOMPUTE_UNITS if checkpointing else BACKWARD_UNITS) * unit


def _device_peak(places, modes: Modes, budget: Optional[int], largest_param_grad: int) -> Dict[str, int]:
    need = device_need(places, [False] * len(places), modes)
    budget = budget if budget is not None else need.everything
    arena = need.arena_bytes(budget)
    if modes.params_on_device:
        fill = need.all_compute
    else:
        room = arena - places[0].compute_bytes
        fill = places[0].compute_bytes
        for p in sorted((p.compute_bytes for p in places[1:]), reverse=True):
            if p <= room:
                fill, room = fill + p, room - p
    grads = min(need.grad_reserve, largest_param_grad) if modes.host_optimizer else 0
    if modes.reduce_on_device:
        # A unit's flat gradient and its shard ([Note: where gradients are reduced]) beside autograd's
        # gradient of one parameter before it is copied in. The reserve holds two units, but the peak
        # measured on 2 ranks (bench_estimate.py) is one: the previous reduction is done by then.
        grads = max(device_reduce_bytes(p.trainable_numel, modes) for p in places) + largest_param_grad
    return {"model_state": fill + need.opt_fixed, "gradients_in_flight": grads,
            "peak": fill + need.opt_fixed + grads, "budget": budget, "minimum": need.minimum}


def _host_peak(places, modes: Modes, config: Config) -> Dict[str, int]:
    h = host_need(places, modes)
    budget = config.host_memory
    # With NVMe homes the pool caches up to its budget (never below the
    # placement's minimum: a smaller budget is refused, so the need is the
    # minimum); else the homes plus the ZeRO reductions' full gradients in
    # flight (the minimum) and the speculative updates' undo state, as far as
    # the budget holds it.
    cached = min(h.capacity, budget) if budget else h.capacity
    undo = (min(h.undo_bytes, max(0, budget - h.minimum)) if budget else h.undo_bytes)
    extra = max(cached, h.minimum) - h.permanent if modes.nvme_used else h.minimum - h.permanent + undo
    return {"model_state": h.permanent, "cache_and_transients": max(0, extra), "peak": h.permanent + max(0, extra),
            "minimum": h.minimum, "capacity": h.capacity, "budget": budget, "nvme_bytes": h.nvme_bytes}


def _mm_workspace(model: nn.Module, modes: Modes) -> int:
    """RSS of the fp32 buffer torch's CPU gemm takes for the largest trainable
    nn.Linear weight's 16-bit gradient (0 in fp32); see MM_WORKSPACE_FP32."""
    if modes.dtype == torch.float32 or _onednn_matmul(modes.dtype):
        return 0
    return MM_WORKSPACE_FP32 * max((m.weight.numel() for m in model.modules()
                                    if isinstance(m, nn.Linear) and m.weight.requires_grad), default=0)


def _onednn_matmul(dtype: torch.dtype) -> bool:
    """Whether torch's CPU matmul of this 16-bit dtype runs in oneDNN
    (without the fp32 buffer of MM_WORKSPACE_FP32)."""
    check = getattr(torch.ops.mkldnn, _ONEDNN_16BIT.get(dtype, ""), None)
    try:
        return bool(check is not None and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
                    and check())
    except RuntimeError:  # an op this build does not have
        return False


def measure_activations(model: nn.Module, units, run: Optional[Callable[[nn.Module], torch.Tensor]]) -> Dict:
    """activation_bytes of ``run(model)`` over the paging ``units``' modules
    (zeros when ``run`` is None; an ``error`` entry when the forward does not
    run on meta tensors)."""
    act = {"saved": 0, "unit": 0, "checkpointing": 0, "saved_other": -1}
    if run is not None:
        try:
            act = activation_bytes(model, run, [m for u in units[1:] for m in u.modules])
        except Exception as e:  # noqa: BLE001 - said in the result, not silently zero
            act["error"] = f"the forward does not run on meta tensors ({type(e).__name__}: {e})"
    return act


def estimate_peaks(model: nn.Module, config: Config, run: Optional[Callable[[nn.Module], torch.Tensor]] = None,
                   *, world: int = 1, lazy: bool = False, baseline_rss: Optional[int] = None,
                   activations: Optional[Dict] = None) -> Dict[str, Dict]:
    """Peak bytes per tier for ``model`` (build it on the meta device) under
    ``config`` on each of ``world`` ranks, split into parts; see the module
    docstring. ``run(model)`` is one forward returning the loss on meta inputs
    of the run's micro-batch (None: activations not counted). ``lazy``: the
    model is built under ``infinity.init`` (its fp32 tensors never exist at
    once). ``baseline_rss``: the process's RSS before the model is built
    (default: this process's now). ``activations``: :func:`measure_activations`'s
    result for this model and ``run`` when measured already (the placement
    does not change it), else it is measured."""
    units, modes, places = placed(model, config, world)
    largest_grad = max((nbytes(p.numel(), modes.dtype) for p in model.parameters() if p.requires_grad), default=0)
    dev = _device_peak(places, modes, config.device_memory, largest_grad)
    host = _host_peak(places, modes, config)
    nvme = {"peak": host["nvme_bytes"] if modes.nvme_used else 0,
            "capacity": nvme_capacity(host_need(places, modes), len(units), len(config.swap_paths))
            if modes.nvme_used else 0}
    act = dict(activations) if activations is not None else measure_activations(model, units, run)
    # Without checkpointing the backward frees each block's saved tensors as it
    # makes their gradients: the peak is what was saved plus the gradients of
    # the last block's activations, one block's worth (measured: a Llama at
    # sequence 2048 peaks 76 MiB above its 225 MiB saved, one block 55 MiB).
    # With checkpointing, a recomputed block's activations, their gradients and
    # temporaries come on top during its backward: about three blocks' worth.
    act_peak = _act_peak(act["saved"], act["unit"], act["checkpointing"])
    if act["saved_other"] >= 0:  # the other way, for the user to compare
        act["peak_" + ("without" if act["checkpointing"] else "with") + "_checkpointing"] = \
            _act_peak(act["saved_other"], act["unit"], not act["checkpointing"])
    act["peak_" + ("with" if act["checkpointing"] else "without") + "_checkpointing"] = act_peak
    on_cpu = modes.device.type == "cpu"
    staging = STAGING_PER_PATH * config.swap_block_size * len(config.swap_paths) if modes.nvme_used else 0
    # See [Note: initialise's peak]: the model's tensors as built, or the largest unit's under infinity.init.
    built = max((sum(s.numel * s.param.element_size() for s in u.layout.slots) for u in units), default=0) \
        if lazy else sum(p.numel() * p.element_size() for p in model.parameters())
    base = baseline_rss if baseline_rss is not None else sysinfo.rss_bytes()
    workspace = _mm_workspace(model, modes) if on_cpu else 0
    training = host["peak"] + staging + RUNTIME_BYTES + ((dev["peak"] + act_peak + workspace) if on_cpu else 0)
    at_init = built + host["peak"] + staging
    rss = {"baseline": base, "model_fp32_at_initialize": built, "host_pool": host["peak"],
           "device_tier_in_ram": dev["peak"] if on_cpu else 0, "activations": act_peak if on_cpu else 0,
           "weight_grad_workspace": workspace, "staging": staging, "runtime": RUNTIME_BYTES,
           "peak": base + max(training, at_init)}
    # On CUDA the activations sit beside the tier in the device's memory: the
    # device needs both (device_memory budgets the model state alone).
    dev["activations"] = 0 if on_cpu else act_peak
    dev["model_state_peak"], dev["peak"] = dev["peak"], dev["peak"] + dev["activations"]
    return {"device": dev, "host": host, "nvme": nvme, "rss": rss, "activations": act,
            "units": {"count": len(units), "parameters": sum(p.numel() for p in model.parameters())}}
