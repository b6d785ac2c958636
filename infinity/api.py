"""Public entry points: ``initialize``, ``stats``, ``full_state_dict``."""

from __future__ import annotations

import atexit
import warnings
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .system import sysinfo
from .config.runtime import Config
from .engine.core import Engine
from .engine.model.hooks import install_hooks
from .engine.faults import UsageError
from .engine.step.optimizer import InfinityOptimizer
from .engine.model.param_guard import ParamGuard
from .engine.model.state_dict import install_model_methods, install_state_dict_hooks, remove_model_methods
from .engine.model.torch_guards import install_torch_guards
from .optim.functional import group_hyper
from .system.signals import install_sigterm_handler

__all__ = ["initialize", "stats", "full_state_dict", "engine_of", "close"]

# model -> its engine. Weak, so a dropped model frees its engine.
_ENGINES: "weakref.WeakKeyDictionary[nn.Module, Engine]" = weakref.WeakKeyDictionary()


@atexit.register
def _close_all() -> None:
    # While the interpreter is still whole: engines a script never closed
    # settle their collectives and remove their swap files.
    for model in list(_ENGINES.keys()):
        try:
            close(model, keep_values=False)
        except Exception:
            pass

_OPT_KEYS = ("lr", "betas", "eps", "weight_decay", "adamw_mode")


def initialize(model: nn.Module, config: Optional[Config] = None, *, param_groups: Optional[List[dict]] = None,
               process_group: Any = None, **optimizer_kwargs: Any) -> Tuple[nn.Module, InfinityOptimizer]:
    """Takes over ``model``'s parameters and returns ``(model, optimizer)``.

    The model is the same object, with hooks that page each unit's parameters
    onto the device before use; keep the training loop as it is
    (``loss.backward(); optimizer.step(); optimizer.zero_grad()``).

    Args:
        model: an ordinary ``nn.Module`` (fp32 parameters on the CPU or meta).
        config: :class:`infinity.Config` (default: ``Config()``).
        process_group: the torch.distributed group the model is data-parallel
            over (ZeRO shards, gradient reduction); default the whole world.
            A one-dimensional ``DeviceMesh`` is taken too: the data-parallel
            dimension of a larger mesh, e.g. ``mesh["dp"]``. Every rank of the
            group calls ``initialize`` with the same model and config.
        param_groups: optional torch-style groups (dicts with ``"params"``, a
            list of the model's parameters, plus any of lr, betas, eps,
            weight_decay, adamw_mode); as with torch, parameters no group
            lists are not trained (they are frozen, with a warning).
        **optimizer_kwargs: AdamW defaults: ``lr`` (1e-3), ``betas``
            ((0.9, 0.999)), ``eps`` (1e-8), ``weight_decay`` (1e-2),
            ``adamw_mode`` (True; False = Adam with L2 decay).

    Raises:
        ValueError/TypeError naming the argument at fault; ``BudgetError`` when
        a budget cannot hold what the configuration needs (bytes named).
    """
    config = config if config is not None else Config()
    _check_args(model, config, optimizer_kwargs)
    defaults = _defaults(optimizer_kwargs)
    _check_dtypes(model)
    _check_modules(model)
    groups = _build_groups(model, param_groups, defaults)
    group_of = {id(p): gi for gi, g in enumerate(groups) for p in g["params"]}
    _freeze_left_out(model, group_of)

    engine = Engine(model, config, group_of, _data_parallel_group(process_group))
    # Only non-empty groups: torch's Optimizer refuses empty ones.
    groups = [g for g in groups if g["params"]] or [dict(defaults, params=[])]
    remap = {}
    for gi, g in enumerate(groups):
        for p in g["params"]:
            remap[id(p)] = gi
    for u in engine.units:
        for s in u.layout.trainable_slots:
            s.group = remap[id(s.param)]
    if not groups[0]["params"]:
        raise ValueError("initialize: the model has no trainable parameters")
    optimizer = InfinityOptimizer(engine, groups, defaults)
    hooks = install_hooks(engine)
    guard = ParamGuard(engine)  # [Note: parameters outside forward]
    hooks.handles += install_state_dict_hooks(model, engine, guard)  # [Note: state_dict of a managed model]
    install_model_methods(model, engine, guard)
    engine.attach(optimizer, hooks, guard)
    _ENGINES[model] = engine
    install_sigterm_handler()  # [Note: SIGTERM]: the atexit close above then runs
    install_torch_guards(lambda: list(_ENGINES.values()))  # [Note: gradients torch cannot see]
    return model, optimizer


def _data_parallel_group(pg: Any):
    """``initialize``'s process_group as a ProcessGroup (or None): a 1-D
    DeviceMesh gives its group; anything else is refused by name."""
    if pg is None:
        return None
    import torch.distributed as dist
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch without device_mesh
        DeviceMesh = ()
    if DeviceMesh and isinstance(pg, DeviceMesh):
        if pg.ndim != 1:
            names = pg.mesh_dim_names or tuple(range(pg.ndim))
            raise ValueError(f"initialize: process_group is a {pg.ndim}-dimensional DeviceMesh (dimensions {names}); "
                             "infinity shards over one data-parallel dimension: pass that dimension, e.g. "
                             "process_group=mesh['dp']")
        return pg.get_group()
    if not isinstance(pg, dist.ProcessGroup):
        raise TypeError(f"initialize: process_group must be a torch.distributed ProcessGroup or a 1-D DeviceMesh, "
                        f"got {type(pg).__name__}")
    return pg


def _check_args(model: nn.Module, config: Config, optimizer_kwargs: Dict[str, Any]) -> None:
    """Raises TypeError/ValueError naming the argument of ``initialize`` at fault."""
    if not isinstance(config, Config):
        raise TypeError(f"initialize: config must be an infinity.Config, got {type(config).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize: model must be an nn.Module, got {type(model).__name__}")
    if model in _ENGINES:
        raise ValueError("initialize: this model is already managed by infinity")
    unknown = set(optimizer_kwargs) - set(_OPT_KEYS)
    if unknown:
        raise ValueError(f"initialize: unknown optimizer argument(s) {sorted(unknown)}; valid: {list(_OPT_KEYS)}")


def _defaults(optimizer_kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The default group's hyper-parameters: AdamW defaults updated by the keyword arguments, checked."""
    defaults = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, adamw_mode=True)
    defaults.update(optimizer_kwargs)
    defaults["betas"] = tuple(defaults["betas"])
    group_hyper(defaults, "initialize")
    return defaults


def _check_dtypes(model: nn.Module) -> None:
    """Raises TypeError for a real parameter that is not float32 (meta ones, from
    ``infinity.init``, are materialised as float32)."""
    for name, p in model.named_parameters():
        if p.dtype != torch.float32 and p.device.type != "meta":
            raise TypeError(f"initialize: parameter {name!r} has dtype {p.dtype}; give the model in float32 "
                            "(infinity keeps an fp32 master copy and casts the compute copy to Config.dtype)")


def _check_modules(model: nn.Module) -> None:
    """Raises UsageError for what infinity cannot page: sparse gradients, and
    buffers on the meta device in a model not built under ``infinity.init``."""
    from .lazy_init import recorder_of
    for name, mod in model.named_modules():
        if getattr(mod, "sparse", False) is True and isinstance(mod, (nn.Embedding, nn.EmbeddingBag)):
            raise UsageError(f"initialize: {name or 'the model'} ({type(mod).__name__}) has sparse=True: its "
                             "gradients would be sparse tensors, which infinity's dense gradient buffers do not "
                             "take. Build it with sparse=False")
    if recorder_of(model) is None:
        for name, b in model.named_buffers():
            if b.is_meta:
                raise UsageError(f"initialize: buffer {name!r} is on the meta device, so it has no values to "
                                 "give. Build the model under `with infinity.init(config):` (which records and "
                                 "materialises buffers too), or with real buffers")


def _build_groups(model: nn.Module, param_groups: Optional[List[dict]], defaults: Dict[str, Any]) -> List[dict]:
    """The user's groups (trainable parameters only, defaults filled in,
    checked), or without ``param_groups`` one default group of every
    trainable parameter. A parameter no group lists is not trained, as
    under torch (``initialize`` freezes it)."""
    if param_groups is None:
        return [dict(defaults, params=[p for p in model.parameters() if p.requires_grad])]
    seen: set = set()
    owned = {id(p) for p in model.parameters()}
    groups = [_build_group(gi, g, defaults, seen, owned) for gi, g in enumerate(param_groups)]
    return groups or [dict(defaults, params=[])]


def _freeze_left_out(model: nn.Module, group_of: Dict[int, Optional[int]]) -> None:
    """Trainable parameters no group lists stay as they are, as under torch:
    mapped to None (frozen), with a warning naming them (an older infinity
    trained them in a default group)."""
    left = [(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in group_of]
    group_of.update({id(p): None for _, p in left})
    left = [n for n, _ in left]
    if left:
        shown = ", ".join(repr(n) for n in left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
        warnings.warn(f"infinity.initialize: {len(left)} parameter(s) that require grad are in none of "
                      f"param_groups ({shown}): they are not trained, as with a torch optimizer over those groups "
                      "(infinity freezes them). List them in a group to train them", UserWarning, stacklevel=3)


def _build_group(gi: int, g: dict, defaults: Dict[str, Any], seen: set, owned: set) -> dict:
    """``param_groups[gi]`` checked and completed; adds its parameters to ``seen``."""
    if "params" not in g:
        raise ValueError(f"initialize: param_groups[{gi}] has no 'params'")
    bad = set(g) - set(_OPT_KEYS) - {"params"}
    if bad:
        raise ValueError(f"initialize: param_groups[{gi}] has unknown key(s) {sorted(bad)}")
    ps = [p for p in g["params"] if p.requires_grad]
    for p in ps:
        if id(p) not in owned:
            raise ValueError(f"initialize: param_groups[{gi}] lists a tensor of shape {tuple(p.shape)} that is not "
                             "a parameter of the model (groups built from another copy of it?)")
        if id(p) in seen:
            raise ValueError("initialize: a parameter appears in more than one of param_groups")
        seen.add(id(p))
    grp = dict(defaults)
    grp.update({k: v for k, v in g.items() if k != "params"})
    grp["betas"] = tuple(grp["betas"])
    group_hyper(grp, f"initialize: param_groups[{gi}]")
    grp["params"] = ps
    return grp


def engine_of(model: nn.Module) -> Engine:
    """The engine managing ``model``; raises ValueError if ``initialize`` was not called on it."""
    try:
        return _ENGINES[model]
    except KeyError:
        raise ValueError("this model is not managed by infinity: call infinity.initialize(model, config) first") \
            from None


def stats(model: nn.Module) -> Dict[str, Any]:
    """Counters of ``model``'s engine.

    Keys: ``peak_bytes`` and ``budget_bytes`` per tier ("device", "host",
    "nvme"); ``bytes_moved`` per link since initialize ("h2d", "d2h",
    "nvme_read", "nvme_write"; on several ranks "net_device" and "net_host":
    bytes this rank sent over the device and host groups as the ring
    algorithm moves them, and the ZeRO volumes "reduce_scatter",
    "all_gather", "all_reduce": [Note: bytes on the wire] in
    engine/mechanism/zero.py) and ``step_bytes_moved`` (the last step's);
    ``stall_seconds`` (the host waiting for fetches: on CUDA only where the
    host itself waits) and ``device_stall_seconds`` (compute waiting for
    fetches, on CUDA timed on the device with events); ``optimizer_seconds`` (inside
    optimizer kernels) and ``optimizer_wait_seconds`` (of that, what step()
    waited for or ran itself); ``overlap`` (share of optimizer time hidden behind
    forward/backward); ``fetches``, ``prefetches``, ``evictions``, ``steps``,
    ``skipped_steps``, ``trace_invalidations``, ``units``; ``loss_scale``;
    ``speculation`` (overlap="backward" with clipping or fp16: ``steps``
    updated speculatively, of them ``committed``, ``replayed`` with the clip
    coefficient and ``skipped`` on an overflow; ``waited`` (steps that
    waited for ``step()``: after a clipped step, or in the back-off after a
    replay), ``units_without_room`` (updates that waited: no host room for
    their undo state), ``units_without_disk`` (updates that waited: no swap
    room for a second copy of their NVMe state), ``replay_seconds``, and
    ``off``: why speculation is not available in this run, or None);
    ``pressure_events`` (what the engine gave back under memory pressure,
    and when), ``host_cache_cap`` (the host cache's cap now, or None) and
    ``optimizer_threads`` (the CPU AdamW's threads: [Note: the optimizer's
    thread budget] in engine/plan/limits.py); ``model_flops_per_token``
    (FLOPs of one token's forward and backward: [Note: model FLOPs] in
    progress.py; times tokens/s gives model FLOP/s, see ``infinity.on_steps``);
    ``comm_seconds`` (the collectives' own durations on several ranks) and
    ``comm_wait_seconds`` (of them, the exposed part: what the engine's
    threads waited for), each ``{"total": s, "step": the last step's}``, and
    ``comm_hidden`` (the share of the last step's collective time hidden
    behind compute, None without collectives): [Note: exposed communication
    time] in engine/mechanism/comm_clock.py;
    ``step_seconds`` (the last step's wall time, end of the previous
    ``step()`` to the end of this one) and ``predicted_step`` (None, or the
    prediction given to :func:`set_step_prediction`);
    ``state_bytes`` (bytes kept for good in memory per kind of optimizer
    state: master, moments, int8 moments' scales, gradients) and
    ``nvme_state_bytes`` (what the swap files hold of each kind), in
    ``moment_dtype`` (Config.moment_dtype), the master in ``master_dtype``
    (Config.master_dtype); ``state_bytes_per_parameter``: both together over
    this rank's optimizer-state elements (bytes a parameter, counted by the tiers).
    """
    eng = engine_of(model)
    s = eng.stats
    opt = eng.optimizer
    hidden = 0.0
    if s.optimizer_seconds > 0 and eng.config.overlap != "step":
        hidden = max(0.0, 1.0 - s.optimizer_wait_seconds / s.optimizer_seconds)
    return {
        "peak_bytes": {"device": eng.residency.tier.peak_bytes, "host": eng.room.tier.peak_bytes,
                       "nvme": eng.nvme.peak_bytes if eng.nvme is not None else 0},
        "budget_bytes": {"device": eng.budget.budget, "host": eng.host_budget,
                         "nvme": eng.nvme.capacity_bytes if eng.nvme is not None else None},
        "bytes_moved": dict(s.bytes_moved),
        "step_bytes_moved": dict(s.step_bytes_moved),
        "stall_seconds": s.stall_seconds,
        "device_stall_seconds": eng.residency.device_stall_seconds(),
        "optimizer_seconds": s.optimizer_seconds,
        "optimizer_wait_seconds": s.optimizer_wait_seconds,
        "overlap": hidden,
        "fetches": s.fetches,
        "prefetches": s.prefetches,
        "evictions": s.evictions,
        "steps": s.steps,
        "skipped_steps": s.skipped_steps,
        "speculation": {"steps": s.spec_steps, "committed": s.spec_committed, "replayed": s.spec_replayed,
                        "skipped": s.spec_skipped, "waited": s.spec_waited,
                        "units_without_room": s.spec_units_without_room,
                        "units_without_disk": s.spec_units_without_disk, "replay_seconds": s.spec_replay_seconds,
                        "off": s.spec_off or None},
        "trace_invalidations": s.trace_invalidations,
        "units": len(eng.units),
        "loss_scale": opt.loss_scale if opt is not None else 1.0,
        "state_bytes": eng.state_bytes(),
        "nvme_state_bytes": eng.optstate.nvme_bytes(),
        "moment_dtype": eng.modes.moment_dtype,
        "master_dtype": eng.modes.master_dtype,
        "state_bytes_per_parameter": eng.optstate.bytes_per_parameter(),
        "zero_stage": eng.modes.zero,
        "world_size": eng.sharding.world,
        "host_pinned": eng.room.tier.pinned,
        "pressure_events": list(eng.pressure.events),
        "host_cache_cap": eng.room.cap_bytes,
        "optimizer_threads": opt.threads if opt is not None else None,
        "model_flops_per_token": _flops_per_token(eng),
        "comm_seconds": {"total": s.comm_seconds, "step": s.step_comm_seconds},
        "comm_wait_seconds": {"total": s.comm_wait_seconds, "step": s.step_comm_wait_seconds},
        "comm_hidden": (max(0.0, 1.0 - s.step_comm_wait_seconds / s.step_comm_seconds)
                        if s.step_comm_seconds > 0 else None),
        "step_seconds": s.step_seconds,
        "predicted_step": _PREDICTED.get(eng),
    }


_PREDICTED: "weakref.WeakKeyDictionary[Engine, Dict[str, Any]]" = weakref.WeakKeyDictionary()


def set_step_prediction(model: nn.Module, prediction) -> None:
    """Keeps a predicted step (a ``StepPrediction`` of ``infinity estimate
    --time``'s model: infinity/engine/plan/step_time.py) for ``stats(model)``
    to show beside the measured ``step_seconds``: ``predicted_step`` is
    ``{"seconds", "bound", "exposed"}`` (seconds; exposed per part). Computed
    once, before the run, by the caller (``infinity train`` with ``[log]
    profile``): nothing in a step pays for it."""
    _PREDICTED[engine_of(model)] = {"seconds": float(prediction.seconds), "bound": prediction.bound,
                                    "exposed": {k: float(v) for k, v in prediction.exposed.items()}}


_FLOPS_PER_TOKEN: "weakref.WeakKeyDictionary[Engine, int]" = weakref.WeakKeyDictionary()


def _flops_per_token(eng: Engine) -> int:
    """See [Note: model FLOPs] in progress.py: 6 a trainable parameter, 4 a
    frozen one; counted once per engine (which parameters train is fixed at
    ``initialize``), since stats() is read every step."""
    n = _FLOPS_PER_TOKEN.get(eng)
    if n is None:
        slots = [s for u in eng.units for s in u.layout.slots]
        n = _FLOPS_PER_TOKEN[eng] = sum((6 if s.trainable else 4) * s.numel for s in slots)
    return n


@torch.no_grad()
def full_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The model's full state dict as ordinary CPU tensors, keys as in
    ``model.state_dict()``: trainable parameters from the fp32 master copy,
    frozen ones from their compute copy (as fp32), buffers as they are. In
    delayed mode the queued update is applied first."""
    eng = engine_of(model)
    eng.optimizer.flush()
    with eng.faults.guard("infinity.full_state_dict()"):
        return _full_state_dict(model, eng)


def _full_state_dict(model: nn.Module, eng: Engine) -> Dict[str, torch.Tensor]:
    eng.grads.drain()
    out: Dict[str, torch.Tensor] = {}
    cache: dict = {}
    for key, value in model.state_dict(keep_vars=True).items():
        hit = eng.param_slot.get(id(value))
        if hit is None:
            out[key] = value.detach().to("cpu", copy=True)
            continue
        u, i = hit
        s = u.layout.slots[i]
        sl = slice(s.offset, s.offset + s.numel)
        if (u.index, s.trainable) not in cache:
            cache = {(u.index, s.trainable): eng.values.read(u, "master" if s.trainable else "compute")}
        t = cache[(u.index, s.trainable)][sl]
        out[key] = t.detach().to("cpu", torch.float32, copy=True).view(s.shape)
    return out


def close(model: nn.Module, *, keep_values: bool = True) -> None:
    """Releases ``model``'s engine: stops its threads, removes its swap files
    and its lock, and gives its host pool and device arena back at once (also
    while the optimizer is still referenced). Always tears down, also after a
    fault (errors met on the way are warned about, not raised); safe to call
    again. A background checkpoint still writing is finished first.

    With ``keep_values`` (the default) the model is an ordinary model after
    this: every parameter holds its final value as an fp32 CPU tensor (the
    master copy; frozen ones their compute copy), so it can be evaluated,
    saved, merged (PEFT) or given to ``initialize`` again. Where that would
    not fit in RAM (or the engine failed, or ``keep_values=False``) the
    parameters are left on the meta device, so reading any result raises
    instead of computing with stand-ins: save first (``save_checkpoint`` /
    ``export_pretrained``). Under ZeRO every rank calls it.
    """
    eng = _ENGINES.pop(model, None)
    if eng is None:
        return
    eng.fence.before_close()  # a background save still writing finishes first: it reads the tiers
    values = _final_values(model, eng, keep_values)
    eng.hooks.remove()
    remove_model_methods(model)
    eng.guard.release()
    for u in eng.units:
        for i, s in enumerate(u.layout.slots):
            v = values.get((u.index, i)) if values is not None else None
            if v is not None:
                s.param.data = v
            else:  # a CPU parameter cannot take meta data in place: swap the whole tensor
                torch.utils.swap_tensors(s.param, nn.Parameter(torch.empty(s.shape, device="meta"),
                                                               requires_grad=s.param.requires_grad))
    eng.close()


def _final_values(model: nn.Module, eng: Engine, keep: bool) -> Optional[Dict[Tuple[int, int], torch.Tensor]]:
    """Every parameter's final fp32 value by (unit, slot), or None (with a warning) where it cannot be kept."""
    if not keep:
        return None
    need = sum(s.numel * 4 for u in eng.units for s in u.layout.slots)
    reason = None
    if eng.faults.failed:
        return None  # the fault was raised to the user already; nothing of it is served
    if need > 0.8 * sysinfo.available_ram():
        reason = f"they take {need} bytes in fp32, more than 80% of the RAM this process may still use"
    if reason is None:
        try:
            eng.optimizer.flush()
            with torch.no_grad(), eng.faults.guard("infinity.close()"):
                return _read_all(eng)
        except Exception as e:  # noqa: BLE001 - the teardown goes on; the user is told below
            reason = f"reading them failed ({type(e).__name__}: {e})"
    warnings.warn(f"infinity.close: the parameters are left on the meta device ({reason}); save with "
                  "infinity.save_checkpoint or infinity.export_pretrained before close to keep them",
                  RuntimeWarning, stacklevel=3)
    return None


def _read_all(eng: Engine) -> Dict[Tuple[int, int], torch.Tensor]:
    out = {}
    for u in eng.units:
        master = eng.values.read(u, "master") if u.place.trainable else None
        compute = eng.values.read(u, "compute") if any(not s.trainable for s in u.layout.slots) else None
        for i, s in enumerate(u.layout.slots):
            src = master if s.trainable else compute
            out[(u.index, i)] = src[s.offset:s.offset + s.numel].view(s.shape).to("cpu", torch.float32, copy=True)
    return out
