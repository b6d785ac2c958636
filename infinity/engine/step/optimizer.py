"""``InfinityOptimizer``: the optimizer ``infinity.initialize`` returns.

A ``torch.optim.Optimizer`` whose ``param_groups`` hold the model's
parameters (so torch LR schedulers work) but whose state lives in the
units' flat fp32 buffers. The loss scale and the step's gradient scale
(unscaling, clipping, the fp16 overflow check) are scaling.py's; when
updates run is the schedule's ([Note: when the optimizer runs] in
schedule.py), one unit's update is update.py's.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import List

import torch
# torch.optim.Optimizer imports torch._dynamo on first use. Imported after
# init_process_group, it keeps the gloo group alive past destroy_process_group
# (torch 2.13), and gloo then releases its last work during interpreter
# shutdown, which can abort a finished run (SIGABRT). Imported with infinity,
# usually before the process group exists, it does not.
import torch._dynamo  # noqa: F401,E402

from ...optim.functional import group_hyper
from ...system import native
from ..plan.limits import optimizer_threads
from ..faults import UsageError
from ..plan.placement import host_need, speculation_needed, speculation_unsupported
from .scaling import Scaling
from .speculate import Speculation
from .state_view import StateView
from .schedule import make_schedule
from .update import Updater

__all__ = ["InfinityOptimizer"]

log = logging.getLogger("infinity")


class InfinityOptimizer(torch.optim.Optimizer):
    """AdamW over the engine's units. Use like any torch optimizer:
    ``step()``, ``zero_grad()``, LR schedulers on ``param_groups``.

    fp16: multiply the loss by :meth:`scale_loss` before ``backward()``
    (``optimizer.scale_loss(loss).backward()``); ``step()`` unscales, skips
    the step on overflow and adjusts the scale (see :attr:`loss_scale`).
    """

    # torch.amp.GradScaler hands itself to step() (grad_scaler=), which refuses it: see step().
    _step_supports_amp_scaling = True

    def __init__(self, engine, param_groups: List[dict], defaults: dict):
        self.engine = engine
        self._built = False
        super().__init__(param_groups, defaults)
        self._built = True
        self._scaled = self._warned_unscaled = False
        cfg = engine.config
        chunk = engine.nvme.sum_chunk_bytes if engine.modes.opt_nvme else None
        # See [Note: the optimizer's thread budget] in plan/limits.py.
        self.threads = optimizer_threads(cfg.num_threads, native.default_num_threads(), engine.mover.is_cuda,
                                         env_set=bool(os.environ.get("INFINITY_NUM_THREADS")))
        self.updater = Updater(engine.modes, engine.sharding, self.param_groups, engine.stats, chunk,
                               self.threads, engine.values_changed)
        self.updater.master_seed = cfg.seed % (1 << 64)  # bf16 master: [Note: a bf16 master in the engine] in update.py
        self.scaling = Scaling(cfg, engine.sharding, engine.grads, self.updater.counted_runs, engine.stats)
        self.schedule = make_schedule(engine.parts, self.updater, cfg.overlap, cfg.grad_accumulation_steps,
                                      early_ok=not self.scaling.waits_for_step,
                                      speculation=self._speculation(engine, cfg))
        self._loads = 0  # load_state_dict calls: optimizer.state reads again after one
        self.state = StateView(engine.param_slot, lambda: [p for g in self.param_groups for p in g["params"]],
                               engine.values.read, lambda: (self._loads, engine.values_version, engine.stats.steps),
                               self._state_ready, self._forget_state)

    def _speculation(self, engine, cfg):
        """The speculative updates of overlap="backward" with clipping or
        fp16 ([Note: speculative updates] in speculate.py), where available;
        else None, and ``stats()`` says why the updates wait for ``step()``."""
        if not speculation_needed(cfg):
            return None
        if engine.modes.speculate:
            # NVMe state: gradients kept on the host when the pool holds all of them ([Note: speculation with
            # NVMe optimizer state] in speculate.py).
            return Speculation(engine.parts, self.scaling,
                               keep_grads=engine.host_budget >= host_need([u.place for u in engine.units],
                                                                          engine.modes).capacity)
        why = speculation_unsupported(cfg, engine.sharding.world)
        engine.stats.spec_off = why
        log.info("infinity: overlap='backward' with clipping or fp16: the updates wait for optimizer.step(), "
                 "speculative updates are not available with %s", why)
        return None

    # The scaling's figures, where torch users and checkpoints look for them.
    fp16 = property(lambda self: self.scaling.fp16)
    last_grad_norm = property(lambda self: self.scaling.last_grad_norm,
                              doc="The global gradient norm of the last step (unscaled), or None.")

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1 unless dtype is fp16; see [Note: the step's gradient scale])."""
        return self.scaling.loss_scale

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.scaling.loss_scale = float(value)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current loss scale (1 unless dtype is fp16)."""
        self._scaled = True
        return loss * self.loss_scale if self.fp16 else loss

    def add_param_group(self, param_group: dict) -> None:
        """Refused after construction: the groups' parameters are placed at ``initialize``."""
        if not self._built:
            return super().add_param_group(param_group)
        raise UsageError("optimizer.add_param_group after infinity.initialize: each parameter's optimizer "
                         "state is placed at initialize. Pass every group to initialize(model, cfg, "
                         "param_groups=[...]); a group's lr and other hyper-parameters may change at any time")

    @property
    def closed(self) -> bool:
        """True after ``infinity.close(model)``."""
        return self.engine.closed

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise UsageError(f"optimizer.{what} after infinity.close(model): the engine is gone; initialize "
                             "the model again to go on training")

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None):
        """Updates every unit; returns when each unit's new compute copy is in
        its home tier (delayed mode: when this step's update is queued)."""
        self._check_open("step()")
        # Newer GradScalers set grad_scale/found_inf on the optimizer instead of passing themselves.
        if grad_scaler is not None or getattr(self, "grad_scale", None) is not None:
            raise UsageError(
                "torch.amp.GradScaler with infinity: the gradients go to infinity's tiers, where the scaler "
                "cannot unscale or check them. Use infinity.Config(dtype='fp16') (dynamic loss scaling by "
                "default) and optimizer.scale_loss(loss).backward() instead of scaler.scale(loss).backward()")
        self._warn_unscaled()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.check_groups()
        eng = self.engine
        self._check_not_stepped()
        had_grads = eng.grads.micro_batches > 0  # torch keeps them (p.grad) until zero_grad()
        with eng.faults.guard("optimizer.step()"):
            if eng.in_pass and eng.pass_grad:
                eng.end_pass()  # step() without a finished backward: release the pass
            self.schedule.step(self.scaling)
        eng.grads.open_window(stepped=had_grads)
        eng.after_step()
        eng.stats.end_step_window()
        return loss

    def _check_not_stepped(self) -> None:
        """A second ``step()`` with the same gradients: torch applies them
        again, infinity freed them at the first. Refused before anything changes."""
        g = self.engine.grads
        if g.stale:
            raise g.stale_error()
        if g.need_zero_grad and g.micro_batches == 0 and g.any_kept():
            raise UsageError("optimizer.step() again without backward() since the last step(): torch would apply "
                             "the same gradients a second time, but infinity frees them at step(). Call "
                             "optimizer.zero_grad() and backward() before each step() (or step() once with the "
                             "gradients summed)")

    def _state_ready(self) -> None:
        """Before ``optimizer.state`` reads moments (see [Note: optimizer.state])."""
        self._check_open("state")
        eng = self.engine
        if eng.modes.zero and eng.sharding.world > 1:
            raise UsageError(f"optimizer.state under ZeRO on {eng.sharding.world} ranks: each rank holds a shard of "
                             "the moments, so a read is a collective. Call optimizer.state_dict() on every rank")
        if eng.config.overlap == "backward" and self.schedule.updates_in_flight():
            raise UsageError("optimizer.state between backward and optimizer.step() with overlap='backward': some "
                             "units are being updated, so their moments are neither the old nor the new ones. Read "
                             "after optimizer.step()")
        while self.schedule.wait_one():  # overlap='delayed': the queued update lands in the moments first
            pass

    @torch.no_grad()
    def _forget_state(self, params) -> None:
        """The moments and step counts of ``params`` (None: all) start again
        from zero (``del optimizer.state[p]``, ``optimizer.state.clear()``)."""
        self._state_ready()
        ids = None if params is None else {id(p) for p in params}
        eng = self.engine
        self._loads += 1
        with eng.faults.guard("optimizer.state"):
            for u in eng.units:
                slots = [s for s in u.layout.trainable_slots if s.step and (ids is None or id(s.param) in ids)]
                if not slots:
                    continue
                whole = len(slots) == len(u.layout.trainable_slots)
                tn = u.place.trainable_numel
                m, v = (torch.zeros(tn), torch.zeros(tn)) if whole else \
                    (eng.values.read(u, "exp_avg").clone(), eng.values.read(u, "exp_avg_sq").clone())
                for s in slots:
                    m[s.offset:s.offset + s.numel] = 0
                    v[s.offset:s.offset + s.numel] = 0
                    s.step = 0
                eng.optstate.write_moments(u, m.cpu(), v.cpu())

    def check_groups(self) -> None:
        """Every param group's hyper-parameters, checked before anything
        changes: at ``step()`` and when a pass with gradients starts (updates
        may run during its backward). UsageError naming the group and key."""
        for gi, g in enumerate(self.param_groups):
            try:
                group_hyper(g, f"optimizer.param_groups[{gi}]")
            except ValueError as e:
                raise UsageError(str(e)) from None

    def _warn_unscaled(self) -> None:
        if self.fp16 and self.loss_scale != 1.0 and not self._scaled and not self._warned_unscaled:
            self._warned_unscaled = True
            warnings.warn("infinity: dtype='fp16' but the loss was not scaled: fp16 gradients of small values "
                          "underflow to 0, and each step is unscaled by the loss scale. Call "
                          "optimizer.scale_loss(loss).backward()", RuntimeWarning, stacklevel=3)
        self._scaled = False

    def flush(self) -> None:
        """Delayed mode: wait for the queued update and apply it now (before
        evaluation, checkpointing or the end of training). No-op otherwise."""
        with self.engine.faults.guard("optimizer.flush()"):
            self.schedule.flush()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forgets accumulated gradients (the buffers are overwritten by the
        next backward rather than zeroed). ``set_to_none=False``: as in torch,
        every parameter that had a gradient keeps a zero one, and the next
        ``step()`` updates it even if its next backward leaves it out."""
        self._check_open("zero_grad()")
        with self.engine.faults.guard("optimizer.zero_grad()"):
            self.schedule.zero_grad(set_to_none)
        for u in self.engine.units:
            for s in u.layout.slots:
                s.param.grad = None

    def state_dict(self) -> dict:
        """torch.optim.AdamW-format state (``step``, ``exp_avg``, ``exp_avg_sq``
        per parameter, CPU fp32 copies) and param groups."""
        self.flush()
        with self.engine.faults.guard("optimizer.state_dict()"):
            return self._state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Loads a state of :meth:`state_dict`'s format (torch.optim.AdamW's):
        every parameter's moments and step count, and the param groups'
        hyperparameters. The parameters themselves come from the model's own
        state. Raises naming the group or parameter whose size differs;
        nothing changes then."""
        self.flush()
        self._loads += 1
        with self.engine.faults.guard("optimizer.load_state_dict()"):
            self._load_state_dict(state_dict)

    def _load_state_dict(self, sd: dict) -> None:
        groups, saved = self.param_groups, sd.get("param_groups")
        saved = self._without_frozen(saved, sd.get("state", {}))
        if not isinstance(saved, list) or len(saved) != len(groups) or \
                any(len(g["params"]) != len(s.get("params", ())) for g, s in zip(groups, saved)):
            frozen = sum(1 for p in self.engine.model.parameters() if not p.requires_grad)
            raise ValueError(f"load_state_dict: the state has {len(saved or [])} param groups of sizes "
                             f"{[len(s.get('params', ())) for s in saved or []]}; this optimizer has {len(groups)} of "
                             f"sizes {[len(g['params']) for g in groups]}"
                             + (f". infinity's groups hold only trainable parameters (the model has {frozen} "
                                "frozen): build the torch optimizer over [p for p in model.parameters() if "
                                "p.requires_grad], in the groups given to initialize" if frozen else ""))
        order = [p for g in groups for p in g["params"]]
        saved_ids = [i for s in saved for i in s["params"]]
        per_param = {id(p): sd["state"].get(i) for p, i in zip(order, saved_ids)}
        eng = self.engine
        for u in eng.units:
            self._check_unit_state(u, per_param)
        merged = [_merged_group(g, s) for g, s in zip(groups, saved)]
        for gi, m in enumerate(merged):  # refused before anything changes
            group_hyper(m, f"load_state_dict: param_groups[{gi}]")
        for g, m in zip(groups, merged):
            g.update(m)
        for u in eng.units:
            if u.place.trainable:
                self._load_unit(u, per_param)

    def _without_frozen(self, saved, state: dict):
        """A torch state of one group over all ``model.parameters()``, frozen
        ones included (torch keeps no state for them): their entries dropped,
        so it maps onto infinity's group of the trainable ones. Else ``saved``."""
        params = list(self.engine.model.parameters())
        if not (isinstance(saved, list) and len(saved) == 1 and len(self.param_groups) == 1
                and isinstance(saved[0], dict) and len(saved[0].get("params", ())) == len(params)
                and len(params) != len(self.param_groups[0]["params"])):
            return saved
        ids = [i for p, i in zip(params, saved[0]["params"]) if p.requires_grad]
        if len(ids) != len(self.param_groups[0]["params"]) or any(
                i in state for p, i in zip(params, saved[0]["params"]) if not p.requires_grad):
            return saved
        return [dict(saved[0], params=ids)]

    @staticmethod
    def _check_unit_state(u, per_param: dict) -> None:
        for s in u.layout.trainable_slots:
            st = per_param.get(id(s.param))
            if st is None:
                continue
            for k in ("exp_avg", "exp_avg_sq"):
                if k not in st or tuple(st[k].shape) != tuple(s.shape):
                    got = tuple(st[k].shape) if k in st else "missing"
                    raise ValueError(f"load_state_dict: {k} of parameter {s.name!r} is {got}, the parameter "
                                     f"is {tuple(s.shape)}")

    def _load_unit(self, u, per_param: dict) -> None:
        """One unit's moments and step counts from ``per_param`` (param id -> torch state or None)."""
        m, v = torch.zeros(u.place.trainable_numel), torch.zeros(u.place.trainable_numel)
        for s in u.layout.trainable_slots:
            st = per_param.get(id(s.param))
            s.step = int(float(st["step"])) if st is not None else 0
            if st is not None:
                m[s.offset:s.offset + s.numel].copy_(st["exp_avg"].reshape(-1))
                v[s.offset:s.offset + s.numel].copy_(st["exp_avg_sq"].reshape(-1))
        self.engine.optstate.write_moments(u, m, v)

    def _state_dict(self) -> dict:
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        state, eng = {}, self.engine
        for u in eng.units:
            if not any(s.step for s in u.layout.trainable_slots):
                continue
            m, v = eng.values.read(u, "exp_avg"), eng.values.read(u, "exp_avg_sq")
            for s in u.layout.trainable_slots:
                if s.step == 0:
                    continue
                sl = slice(s.offset, s.offset + s.numel)
                state[index[id(s.param)]] = {
                    "step": torch.tensor(float(s.step)),
                    "exp_avg": m[sl].detach().to("cpu", copy=True).view(s.shape),
                    "exp_avg_sq": v[sl].detach().to("cpu", copy=True).view(s.shape),
                }
        groups = []
        for g in self.param_groups:
            d = {k: v for k, v in g.items() if k != "params"}
            d["params"] = [index[id(p)] for p in g["params"]]
            groups.append(d)
        return {"state": state, "param_groups": groups}


def _merged_group(group: dict, saved: dict) -> dict:
    """``group``'s hyper-parameters after loading ``saved`` (params kept).
    A torch state names the decay mode ``decoupled_weight_decay`` (an Adam
    state: False, L2 decay): ``adamw_mode`` follows it."""
    m = {k: v for k, v in group.items() if k != "params"}
    m.update({k: v for k, v in saved.items() if k != "params"})
    if "decoupled_weight_decay" in saved and "adamw_mode" not in saved:
        m["adamw_mode"] = bool(saved["decoupled_weight_decay"])
    return m
