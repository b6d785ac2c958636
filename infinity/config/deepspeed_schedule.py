"""DeepSpeed's ``scheduler`` section (WarmupLR, WarmupDecayLR,
WarmupCosineLR, OneCycle) as an :class:`infinity.config.schedules.Schedule`."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from . import validate as V
from .files import nearest
from .schedules import Schedule

# The parameters each type takes (DeepSpeed runtime/lr_schedules.py) and their defaults.
_PARAMS = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000, "warmup_type": "log",
                 "last_batch_iteration": -1},
    "WarmupDecayLR": {"total_num_steps": None, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                      "warmup_num_steps": 1000, "warmup_type": "log", "last_batch_iteration": -1},
    "WarmupCosineLR": {"total_num_steps": None, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log", "last_batch_iteration": -1},
    "OneCycle": {"cycle_min_lr": None, "cycle_max_lr": None, "decay_lr_rate": 0.0, "cycle_first_step_size": 2000,
                 "cycle_second_step_size": None, "cycle_first_stair_count": 0, "cycle_second_stair_count": None,
                 "decay_step_size": 0, "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
                 "decay_mom_rate": 0.0, "last_batch_iteration": -1},
}
_LR = ("warmup_min_lr", "warmup_max_lr", "cycle_min_lr", "cycle_max_lr")
_RATIO = ("warmup_min_ratio", "cos_min_ratio", "decay_lr_rate", "cycle_min_mom", "cycle_max_mom", "decay_mom_rate")
_STEPS = ("warmup_num_steps", "total_num_steps", "cycle_first_step_size", "cycle_second_step_size",
          "cycle_first_stair_count", "cycle_second_stair_count", "decay_step_size")
_UNUSED = ("last_batch_iteration", "cycle_first_stair_count", "cycle_second_stair_count", "cycle_momentum",
           "cycle_min_mom", "cycle_max_mom", "decay_mom_rate")


def schedule_from_deepspeed(s: Dict[str, Any], lr: Optional[float]) -> Tuple[Optional[Schedule], List[str],
                                                                            Dict[str, str]]:
    """``(schedule, keys used, auto keys with why)`` for a DeepSpeed scheduler
    table; ``lr`` is the optimizer's lr (WarmupCosineLR's peak). Raises
    ValueError naming the type or parameter at fault. A schedule with
    ``"auto"`` values needs them from the run: None is returned for it."""
    kind = s.get("type")
    if not isinstance(kind, str) or kind not in _PARAMS:
        raise ValueError(f"scheduler.type={kind!r}: choose one of {list(_PARAMS)}{nearest(str(kind), _PARAMS)}")
    params = s.get("params") or {}
    if not isinstance(params, dict):
        raise TypeError(f"scheduler.params={params!r}: must be a JSON object of {kind}'s parameters")
    params = dict(params)
    bad = sorted(set(params) - set(_PARAMS[kind]))
    if bad:
        raise ValueError(f"unknown parameter 'scheduler.params.{bad[0]}' of {kind}{nearest(bad[0], _PARAMS[kind])}; valid: "
                         f"{list(_PARAMS[kind])}")
    auto = {k: "set it from the run (total steps, lr)" for k, v in params.items() if v == "auto"}
    for k, v in params.items():
        if k not in auto:
            params[k] = _check(f"scheduler.params.{k}", k, v)
    used = ["type"] + [f"params.{k}" for k in params if k not in auto]
    if auto:
        return None, used, auto
    p = {**_PARAMS[kind], **params}
    for k in _UNUSED:
        if k in params:
            used.remove(f"params.{k}")  # momentum cycling, stairs, resume position: not reproduced
    _check_required(kind, p)
    if kind in ("WarmupLR", "WarmupDecayLR"):
        peak = float(p["warmup_max_lr"])
        start = float(p["warmup_min_lr"]) / peak if peak else 0.0
        if kind == "WarmupLR":
            return Schedule("constant", int(p["warmup_num_steps"]), p["warmup_type"], start, peak_lr=peak), used, {}
        return Schedule("linear", int(p["warmup_num_steps"]), p["warmup_type"], start, int(p["total_num_steps"]),
                        0.0, peak_lr=peak), used, {}
    if kind == "WarmupCosineLR":
        return Schedule("cosine", int(p["warmup_num_steps"]), p["warmup_type"], float(p["warmup_min_ratio"]),
                        int(p["total_num_steps"]), float(p["cos_min_ratio"]), peak_lr=lr), used, {}
    peak = float(p["cycle_max_lr"])
    up = int(p["cycle_first_step_size"])
    down = int(p["cycle_second_step_size"] if p["cycle_second_step_size"] is not None else up)
    return Schedule("onecycle", up, "linear", float(p["cycle_min_lr"]) / peak, None, float(p["cycle_min_lr"]) / peak,
                    peak_lr=peak, down_steps=down, decay_rate=float(p["decay_lr_rate"]),
                    decay_steps=int(p["decay_step_size"])), used, {}


def _check(name: str, key: str, value: Any) -> Any:
    """One parameter's value, type- and range-checked (ValueError/TypeError naming ``name``)."""
    if key in _LR:
        return V.real(name, value, 0.0, 1e3)
    if key in _RATIO:
        return V.real(name, value, 0.0, 1.0)
    if key in _STEPS:
        return V.whole(name, value, 0, V.MAX_COUNT)
    if key == "warmup_type":
        return V.choice(name, value, ("log", "linear"))
    if key == "cycle_momentum":
        return V.boolean(name, value)
    return V.whole(name, value, -1, V.MAX_COUNT)  # last_batch_iteration


def _check_required(kind: str, p: Dict[str, Any]) -> None:
    """The parameters a type needs (no default) and the relations between them."""
    for key, default in _PARAMS[kind].items():
        if default is None and p[key] is None and key != "cycle_second_step_size":
            raise ValueError(f"scheduler.params.{key} is required by {kind} (DeepSpeed has no default for it)")
    if kind in ("WarmupLR", "WarmupDecayLR") and not 0 <= p["warmup_min_lr"] <= p["warmup_max_lr"]:
        raise ValueError(f"scheduler.params.warmup_min_lr={p['warmup_min_lr']} must be <= warmup_max_lr="
                         f"{p['warmup_max_lr']}")
    if kind == "OneCycle" and not 0 <= p["cycle_min_lr"] <= p["cycle_max_lr"] > 0:
        raise ValueError(f"scheduler.params.cycle_min_lr={p['cycle_min_lr']} must be <= cycle_max_lr="
                         f"{p['cycle_max_lr']}, and cycle_max_lr > 0")
    if kind in ("WarmupDecayLR", "WarmupCosineLR") and p["total_num_steps"] <= p["warmup_num_steps"]:
        raise ValueError(f"scheduler.params.total_num_steps={p['total_num_steps']} must be above "
                         f"warmup_num_steps={p['warmup_num_steps']}")
