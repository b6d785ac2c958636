"""A DeepSpeed config (JSON) as an :class:`infinity.Config` plus a report.

``from_deepspeed(path_or_dict, model=None)`` returns a Config with a
``.report`` (:class:`DeepSpeedReport`): what each DeepSpeed key became
(``mapped``), the keys with no counterpart and why (``ignored``), keys
DeepSpeed does not know, with the nearest valid name (``unknown``),
``"auto"`` values (resolved from ``model`` when given), defaults that differ
between DeepSpeed versions and infinity (``defaults``), the optimizer
keyword arguments for :func:`infinity.initialize`, the lr schedule
(:class:`infinity.config.schedules.Schedule`) and the batch sizes. The mapping
table is in docs/cli.md. Every value is checked as DeepSpeed reads it
(deepspeed_values.py); a bad one raises ConfigFileError naming the key path.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Union

from . import validate as V
from .deepspeed_values import (AUTO, ZERO_ALIASES, adam_defaults, batch_sizes, betas, check_kind, ds_bool, ds_int,
                               ds_real, table)
from .deepspeed_keys import AIO_IGNORED, FP_IGNORED, OFFLOAD_IGNORED, TOP_IGNORED, ZERO_IGNORED
from .runtime import Config
from .files import ConfigFileError, nearest, read_file
from .schedules import Schedule

__all__ = ["DeepSpeedReport", "DeepSpeedConfigWarning", "from_deepspeed", "is_deepspeed"]

_OFFLOAD_DEVICE = {"none": "none", "cpu": "host", "nvme": "nvme"}
_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

_OPT_PARAMS = ("lr", "betas", "eps", "weight_decay")


class DeepSpeedConfigWarning(UserWarning):
    """Keys of a DeepSpeed config that DeepSpeed does not know (misspelled or
    from another tool): :func:`from_deepspeed` warns once per call with the
    lines ``infinity train`` prints for them."""


@dataclass
class DeepSpeedReport:
    """What :func:`from_deepspeed` did with each key (key paths as in the JSON)."""

    source: str = "<dict>"
    mapped: Dict[str, str] = field(default_factory=dict)
    ignored: Dict[str, str] = field(default_factory=dict)
    unknown: Dict[str, str] = field(default_factory=dict)
    auto: Dict[str, str] = field(default_factory=dict)
    defaults: Dict[str, str] = field(default_factory=dict)
    warnings: List[str] = field(default_factory=list)
    optimizer: Dict[str, Any] = field(default_factory=dict)
    schedule: Optional[Schedule] = None
    micro_batch: Optional[int] = None
    train_batch: Optional[int] = None
    world_size: int = 1

    def lines(self, title: str) -> List[str]:
        """The lines of one table (``"mapped"``, ``"unknown"``, ...) as :meth:`text` prints them."""
        return [f"  {title:8s} {k}: {v}" for k, v in getattr(self, title).items()]

    def text(self) -> str:
        """The report as lines for a terminal."""
        out = [f"DeepSpeed config {self.source}:"]
        for title in ("mapped", "ignored", "unknown", "auto", "defaults"):
            out += self.lines(title)
        out += [f"  warning  {w}" for w in self.warnings]
        return "\n".join(out)


def is_deepspeed(data: Dict[str, Any]) -> bool:
    """True for a table that looks like a DeepSpeed config rather than a run file."""
    marks = ("zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size", "fp16", "bf16",
             "gradient_clipping", "aio", "zero_allow_untested_optimizer")
    return any(k in data for k in marks) and not any(k in data for k in ("model", "data", "runtime"))


class _Mapper:
    """One pass over a DeepSpeed dict; ``kw`` collects Config fields.

    [Note: every DeepSpeed value is checked where it is read]
    Each handler checks its value's type and range (deepspeed_values.py)
    before using it, and :meth:`guard` turns what a check raises into a
    ConfigFileError naming the file and the key path; a key infinity ignores
    is still checked against the kind DeepSpeed takes (``KINDS``). So a
    string where a table goes, ``"train_batch_size": -1`` or ``"enabled":
    Infinity`` is refused naming the key, never an AttributeError or
    ``invalid literal for int()`` from deep inside, and never accepted.
    """

    def __init__(self, ds: Dict[str, Any], model: Any, source: str, world_size: int):
        self.ds, self.model = ds, model
        self.r = DeepSpeedReport(source=source, world_size=world_size)
        self.kw: Dict[str, Any] = {}
        self.paths: List[str] = []
        self.batch: Dict[str, Optional[int]] = {}
        self.stage = 0
        self.zero_table: Dict[str, Any] = {}

    # -- helpers -------------------------------------------------------------------

    def guard(self, path: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, with a ValueError/TypeError raised as a ConfigFileError naming ``path``."""
        try:
            return fn(*args)
        except ConfigFileError:
            raise
        except (TypeError, ValueError) as exc:
            # The checks' messages start with the key path they were given:
            # quote it; a message naming no key path gets ``path`` before it.
            msg = str(exc)
            m = re.match(r"([\w.\[\]]+)(.*)", msg, re.S)
            named = f"'{m.group(1)}'{m.group(2)}" if m and m.group(1).startswith(path) else f"'{path}': {msg}"
            raise ConfigFileError(f"{self.r.source}: {named}") from None

    def set(self, key: str, fieldname: str, value: Any) -> None:
        self.kw[fieldname] = value
        self.r.mapped[key] = f"{fieldname}={value!r}"

    def hidden(self) -> Optional[int]:
        cfg = getattr(self.model, "config", None) or getattr(self.model, "cfg", None)
        for name in ("hidden_size", "n_embd", "d_model"):
            v = getattr(cfg, name, None)
            if V.is_int(v) and v > 0:
                return int(v)
        return None

    def auto(self, key: str, resolved: Any, how: str) -> Any:
        self.r.auto[key] = f"{resolved!r} ({how})" if resolved is not None else f"unresolved: {how}"
        return resolved

    def walk(self, table_: Dict[str, Any], prefix: str, handled: Dict[str, Any], ignored: Dict[str, str]) -> None:
        """Hands each key of ``table_`` to its handler, or checks and reports it ignored, or reports it unknown."""
        for key, value in table_.items():
            path = f"{prefix}{key}"
            if key in handled:
                self.guard(path, handled[key], path, value)
            elif key in ignored:
                self.guard(path, check_kind, path, ZERO_ALIASES.get(key, key), value)
                self.r.ignored[path] = ignored[key]
            else:
                self.r.unknown[path] = "not a DeepSpeed key" + nearest(key, list(handled) + list(ignored))

    # -- sections ------------------------------------------------------------------

    def run(self) -> None:
        ds = self.ds
        handled = {
            "zero_optimization": self.zero, "aio": lambda p, v: self.aio(v, "aio"),
            "bf16": lambda p, v: None, "fp16": lambda p, v: None, "bfloat16": lambda p, v: None,
            "gradient_clipping": self.clipping, "gradient_accumulation_steps": self.batch_key,
            "train_micro_batch_size_per_gpu": self.batch_key, "train_batch_size": self.batch_key,
            "optimizer": self.optimizer, "scheduler": self.scheduler,
        }
        self.precision()
        self.walk(ds, "", handled, TOP_IGNORED)
        if "gradient_clipping" not in ds:
            self.r.defaults["gradient_clipping"] = ("absent: DeepSpeed's own default is 0 (no clipping) while the "
                                                    "Hugging Face integration's 'auto' gives 1.0; infinity: no "
                                                    "clipping (max_grad_norm=None)")
        self.batches()
        # Absent or empty zero_optimization is stage 0 without offload, as in DeepSpeed.
        self.fill_offload_defaults(self.stage, self.zero_table)
        if self.paths:
            self.set("offload_*.nvme_path", "swap_paths", list(dict.fromkeys(self.paths)))

    def precision(self) -> None:
        bf_key = "bf16" if "bf16" in self.ds else "bfloat16"
        bf = self.guard(bf_key, table, bf_key, self.ds.get(bf_key))
        fp = self.guard("fp16", table, "fp16", self.ds.get("fp16"))
        on = {k: self.guard(f"{k}.enabled", ds_bool, f"{k}.enabled", t.get("enabled", False), True)
              for k, t in (("bf16", bf), ("fp16", fp))}
        for k in ("bf16", "fp16"):
            if on[k] == AUTO:
                on[k] = self.auto(f"{k}.enabled", None, "set by the launcher's --bf16/--fp16; infinity's default "
                                  "dtype 'bf16' is kept unless the other is enabled") or False
        if on["bf16"] and on["fp16"]:
            raise ConfigFileError(f"{self.r.source}: 'bf16.enabled' and 'fp16.enabled' are both true: enable one")
        dtype = "bf16" if on["bf16"] else "fp16" if on["fp16"] else "fp32"
        if not (on["bf16"] or on["fp16"]) and ("bf16.enabled" in self.r.auto or "fp16.enabled" in self.r.auto):
            dtype = "bf16"
        self.set("bf16.enabled/fp16.enabled", "dtype", dtype)
        for name, t in (("bf16", bf), ("fp16", fp)):
            for key, value in t.items():
                self.guard(f"{name}.{key}", self.fp_key, name, key, value)

    def fp_key(self, name: str, key: str, value: Any) -> None:
        path = f"{name}.{key}"
        scale = V.MAX_LOSS_SCALE
        # Each loss-scaling key: (Config field, its value), checked under bf16 too, where it is ignored.
        loss_keys = {
            "loss_scale": lambda: ("loss_scale", ds_real(path, value, 0.0, scale) or "dynamic"),
            "initial_scale_power": lambda: ("initial_loss_scale", float(2 ** ds_int(path, value, 0, 64))),
            "loss_scale_window": lambda: ("loss_scale_growth_interval", ds_int(path, value, 1)),
            "min_loss_scale": lambda: ("min_loss_scale", ds_real(path, value, 0.0, scale, lo_open=True)),
        }
        if key == "enabled":
            return
        if key == "bf16_optimizer_states" and name == "bf16":
            self.bf16_states(path, value, "moment_dtype", "moments")
        elif key == "bf16_master_weights_and_grads" and name == "bf16":
            self.bf16_states(path, value, "master_dtype", "master")
        elif key in loss_keys:
            fieldname, v = loss_keys[key]()
            if name == "bf16":
                self.r.ignored[path] = "bf16 needs no loss scaling"
            else:
                self.set(path, fieldname, v)
        elif key in FP_IGNORED:
            check_kind(path, key, value)
            self.r.ignored[path] = FP_IGNORED[key]
        else:
            known = ["enabled", "bf16_optimizer_states", "bf16_master_weights_and_grads", *loss_keys, *FP_IGNORED]
            self.r.unknown[path] = "not a DeepSpeed key" + nearest(key, known)

    def bf16_states(self, path: str, value: Any, fieldname: str, what: str) -> None:
        """DeepSpeed's ``bf16.bf16_optimizer_states`` (Adam moments in bf16) and
        ``bf16.bf16_master_weights_and_grads`` (master weights and gradients in
        bf16; deepspeed/runtime/precision_config.py, PRs #7700 and #8010) are
        ``Config.moment_dtype="bf16"`` and ``Config.master_dtype="bf16"``
        (``fieldname``) where bf16 is enabled. infinity's gradients are in the
        compute dtype already; its bf16 master is updated with stochastic
        rounding, so its numbers are not DeepSpeed's (see docs/config.md)."""
        if not ds_bool(path, value):
            self.r.ignored[path] = f"false: the {what} stay fp32 (Config.{fieldname}='fp32')"
        elif self.kw.get("dtype") != "bf16":
            self.r.ignored[path] = f"bf16 is not enabled, so DeepSpeed keeps the {what} in fp32"
        else:
            self.set(path, fieldname, "bf16")
            if fieldname == "master_dtype":
                self.r.warnings.append("bf16.bf16_master_weights_and_grads: infinity's bf16 master is updated "
                                       "with stochastic rounding seeded by Config.seed (a resumed run is "
                                       "bit-exact), so its numbers are not DeepSpeed's")

    def zero(self, path: str, z: Any) -> None:
        if isinstance(z, bool):  # DeepSpeed's deprecated form: true is stage 1
            self.r.mapped[path] = f"deprecated boolean form: stage {int(z)}"
            z = {"stage": 1} if z else {}
        z = dict(table(path, z))
        for alias, key in ZERO_ALIASES.items():
            if alias in z and key in z:
                raise ValueError(f"both '{path}.{alias}' and '{path}.{key}' are given: they are one setting "
                                 "under two names; keep one")
        legacy = {}
        for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_params", "offload_param")):
            if old in z:
                on = self.guard(f"{path}.{old}", ds_bool, f"{path}.{old}", z[old])
                self.r.mapped[f"{path}.{old}"] = f"legacy name of {path}.{new}: device {'cpu' if on else 'none'}"
                if on and new not in z:
                    legacy[new] = {"device": "cpu"}
        z.update(legacy)
        if "stage" in z:
            self.stage = self.guard(f"{path}.stage", ds_int, f"{path}.stage", z["stage"], 0, 3, True)
        self.zero_table = z
        handled = {
            "stage": lambda p, v: self.set(p, "zero_stage", self.stage),
            "offload_param": lambda p, v: self.offload(p, v, "offload_params"),
            "offload_optimizer": lambda p, v: self.offload(p, v, "offload_optimizer"),
            "stage3_prefetch_bucket_size": self.prefetch, "prefetch_bucket_size": self.prefetch,
            "aio": self.nested_aio, "cpu_offload": lambda p, v: None, "cpu_offload_params": lambda p, v: None,
        }
        self.walk(z, f"{path}.", handled, ZERO_IGNORED)

    def fill_offload_defaults(self, stage: int, z: Dict[str, Any]) -> None:
        # DeepSpeed without offload keeps the state on the device: say so, and
        # what infinity needs instead where it cannot.
        if "offload_params" not in self.kw:
            home = "host" if stage == 3 else "none"
            self.set("zero_optimization.offload_param (absent)", "offload_params", home)
            if stage == 3:
                self.r.warnings.append("stage 3 without offload_param keeps parameter shards on the GPU in "
                                       "DeepSpeed; infinity's stage 3 homes them on the host (offload_params='host')")
        if "offload_optimizer" not in self.kw:
            home = "host" if stage > 0 or self.kw.get("offload_params") == "nvme" else "none"
            self.set("zero_optimization.offload_optimizer (absent)", "offload_optimizer", home)
            if home == "host":
                self.r.warnings.append("no offload_optimizer: DeepSpeed keeps the optimizer on the GPU; infinity "
                                       f"needs it on the host here (zero_stage={stage}): offload_optimizer='host'")

    def offload(self, path: str, value: Any, fieldname: str) -> None:
        value = table(path, value)  # null: no offload, as DeepSpeed's Optional[...] = None
        dev = value.get("device", "none")
        if dev is None:
            dev = "none"
        if not isinstance(dev, str):
            raise TypeError(f"{path}.device={dev!r}: choose one of {list(_OFFLOAD_DEVICE)}")
        dev = dev.lower()
        if dev not in _OFFLOAD_DEVICE:
            raise ConfigFileError(f"{self.r.source}: '{path}.device'={dev!r}: choose one of {list(_OFFLOAD_DEVICE)}")
        self.set(f"{path}.device", fieldname, _OFFLOAD_DEVICE[dev])
        if "pin_memory" not in value:
            self.r.defaults[f"{path}.pin_memory"] = ("absent: DeepSpeed's default is false (pageable staging); "
                                                     "infinity pins its host tier whenever the device is CUDA")
        for key, v in value.items():
            p = f"{path}.{key}"
            if key == "device":
                continue
            if key == "nvme_path":
                if self.guard(p, V.text, p, v, True):
                    self.paths.append(v)
                self.r.mapped[p] = "swap_paths (see nvme_path)"
            elif key in OFFLOAD_IGNORED:
                self.guard(p, check_kind, p, key, v)
                self.r.ignored[p] = OFFLOAD_IGNORED[key]
            else:
                self.r.unknown[p] = "not a DeepSpeed key" + nearest(key, ["device", "nvme_path", *OFFLOAD_IGNORED])

    def prefetch(self, path: str, value: Any) -> None:
        if value == AUTO:
            h = self.hidden()
            value = self.auto(path, int(0.9 * h * h) if h else None,
                              "0.9 x hidden_size^2 elements" if h else "needs the model's hidden size")
            if value is None:
                return
        elements = ds_int(path, value, 0, V.MAX_BYTES // 4)
        nbytes = elements * _DTYPE_BYTES[self.kw.get("dtype", "bf16")]
        self.set(path, "prefetch_bytes", nbytes)
        self.r.mapped[path] += f" ({elements} elements x {_DTYPE_BYTES[self.kw.get('dtype', 'bf16')]} bytes)"

    def nested_aio(self, path: str, value: Any) -> None:
        self.r.warnings.append("'zero_optimization.aio' is not where DeepSpeed reads aio settings (they belong at "
                               "the top level, 'aio'); infinity maps them anyway")
        self.aio(value, path)

    def aio(self, a: Any, path: str) -> None:
        def block(p: str, v: Any) -> None:
            b = ds_int(p, v, 1, V.MAX_BLOCK)
            self.set(p, "swap_block_size", -(-b // 4096) * 4096)

        handled = {"block_size": block,
                   "queue_depth": lambda p, v: self.set(p, "swap_queue_depth", ds_int(p, v, 1, V.MAX_QUEUE_DEPTH))}
        self.walk(table(path, a), f"{path}.", handled, AIO_IGNORED)

    def clipping(self, path: str, value: Any) -> None:
        if value == AUTO:
            value = self.auto(path, 1.0, "the Hugging Face Trainer's default max_grad_norm")
        v = ds_real(path, value, 0.0, 1e30)
        self.set(path, "max_grad_norm", v if v > 0 else None)

    def batch_key(self, path: str, value: Any) -> None:
        # Resolved together in batches(): any two of the three give the third.
        self.batch[path] = None if value == AUTO else ds_int(path, value, 1)

    def batches(self) -> None:
        """DeepSpeed's batch arithmetic over the three batch keys (see batch_sizes)."""
        tb, mb, ga = (self.batch.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                                  "gradient_accumulation_steps"))
        given = {k: self.ds[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                         "gradient_accumulation_steps") if k in self.ds}
        try:
            tb2, mb2, ga2 = batch_sizes(tb, mb, ga, self.r.world_size)
        except ValueError as exc:
            raise ConfigFileError(f"{self.r.source}: {exc} (given: {given})") from None
        self.r.train_batch, self.r.micro_batch = tb2, mb2
        for key, given_v, value, what in (
                ("train_batch_size", tb, tb2, "report.train_batch"),
                ("train_micro_batch_size_per_gpu", mb, mb2, "report.micro_batch (the data section's batch size)")):
            if given_v is not None:
                self.r.mapped[key] = f"{what}={value}"
            elif value is not None:
                self.r.mapped[f"{key} (derived)"] = f"{what}={value} (= train_batch_size / (micro x accumulation " \
                                                    f"x world size {self.r.world_size}), as DeepSpeed derives it)"
        path = "gradient_accumulation_steps" if ga is not None else "gradient_accumulation_steps (derived)"
        self.set(path, "grad_accumulation_steps", ga2)
        for key in given:
            if self.batch.get(key) is None:  # "auto"
                derived = {"train_batch_size": tb2, "train_micro_batch_size_per_gpu": mb2,
                           "gradient_accumulation_steps": ga2}[key]
                self.auto(key, derived, "derived from the other batch keys as DeepSpeed does"
                          if derived is not None else "set data.micro_batch in the run file")

    def optimizer(self, path: str, o: Any) -> None:
        o = table(path, o)
        kind = self.guard(f"{path}.type", V.text, f"{path}.type", o.get("type"), False, "an optimizer name")
        params = self.guard(f"{path}.params", table, f"{path}.params", o.get("params"))
        if kind.lower() not in ("adam", "adamw"):
            self.r.ignored[path] = f"type {kind!r}: infinity runs AdamW only; the run file's optimizer is used"
            return
        self.r.mapped[f"{path}.type"] = f"infinity AdamW ({kind})"
        flags = {k: self.guard(f"{path}.params.{k}", ds_bool, f"{path}.params.{k}", params[k])
                 for k in ("adam_w_mode", "torch_adam", "fused", "bias_correction", "amsgrad") if k in params}
        adamw = kind.lower() == "adamw" or flags.get("adam_w_mode", True)
        self.r.optimizer["adamw_mode"] = adamw
        for k, bad, why in (("amsgrad", True, "infinity's AdamW has no AMSGrad (nor has DeepSpeed's CPU Adam)"),
                            ("bias_correction", False, "infinity's AdamW always corrects the bias")):
            if flags.get(k, not bad) == bad:
                raise ConfigFileError(f"{self.r.source}: '{path}.params.{k}'={bad!r}: {why}; remove the key")
        defaults = adam_defaults(flags.get("torch_adam", False), adamw)
        checks = {"lr": lambda p, v: ds_real(p, v, 0.0, 1e3), "betas": betas,
                  "eps": lambda p, v: ds_real(p, v, 0.0, 1.0, lo_open=True),
                  "weight_decay": lambda p, v: ds_real(p, v, 0.0, 1e3)}
        for key, v in params.items():
            p = f"{path}.params.{key}"
            if key in _OPT_PARAMS:
                if v == AUTO:
                    self.auto(p, None, "the run file's [optimizer] value is used")
                    continue
                self.r.optimizer[key] = self.guard(p, checks[key], p, v)
                self.r.mapped[p] = f"report.optimizer[{key!r}]"
            elif key == "adam_w_mode":
                self.r.mapped[p] = f"report.optimizer['adamw_mode']={adamw}"
            elif key in flags:
                self.r.ignored[p] = "infinity's AdamW is native, with bias correction, without amsgrad"
            else:
                self.r.unknown[p] = "not an Adam parameter" + nearest(key, [*_OPT_PARAMS, "adam_w_mode"])
        for key in _OPT_PARAMS:
            if key not in params:
                self.r.optimizer[key] = defaults[key]
                self.r.defaults[f"{path}.params.{key}"] = (
                    f"absent: DeepSpeed's {kind} default {defaults[key]!r} is used (DeepSpeedCPUAdam/FusedAdam; "
                    "torch.optim.AdamW's with torch_adam), not the run file's")

    def scheduler(self, path: str, s: Any) -> None:
        from .deepspeed_schedule import schedule_from_deepspeed
        s = table(path, s)
        self.r.schedule, used, auto = schedule_from_deepspeed(s, self.r.optimizer.get("lr"))
        for key in ["type", *(f"params.{k}" for k in s.get("params") or {})]:
            if key in used:
                self.r.mapped[f"scheduler.{key}"] = "report.schedule" if self.r.schedule is not None else \
                    "report.schedule: None until the 'auto' values are given"
            elif key[len("params."):] in auto:
                self.auto(f"scheduler.{key}", None, auto[key[len("params."):]])
            elif key.endswith("last_batch_iteration"):
                self.r.ignored[f"scheduler.{key}"] = "a resumed run restores the scheduler from its checkpoint"
            else:
                self.r.ignored[f"scheduler.{key}"] = "momentum cycling and lr stairs are not reproduced"


def _world_size(world_size: Optional[int]) -> int:
    # torchrun sets WORLD_SIZE; DeepSpeed's batch arithmetic multiplies by it.
    if world_size is not None:
        return V.integer("world_size", world_size, 1, 1 << 20)
    env = os.environ.get("WORLD_SIZE", "1")
    if not env.strip().isdigit() or not 1 <= int(env) <= 1 << 20:
        raise ConfigFileError(f"WORLD_SIZE={env!r} (environment): must be an int >= 1 (torchrun sets it)")
    return int(env)


def from_deepspeed(config: Union[str, Dict[str, Any]], model: Any = None, world_size: Optional[int] = None) -> Config:
    """:meth:`Config.from_deepspeed`: a Config from a DeepSpeed JSON file or
    dict, with ``.report`` (:class:`DeepSpeedReport`). ``model`` (an
    ``nn.Module`` with a ``config.hidden_size``/``cfg.n_embd``) resolves
    ``"auto"`` sizes; ``world_size`` (default: the ``WORLD_SIZE`` environment
    variable, else 1) enters the batch arithmetic. Raises ConfigFileError
    naming the file and key path; warns (:class:`DeepSpeedConfigWarning`)
    once with every key DeepSpeed does not know."""
    source = "<dict>"
    if not isinstance(config, dict):
        source = str(config)
        config = read_file(source)
    try:
        ds = json.loads(json.dumps(config))
    except (TypeError, ValueError, RecursionError) as exc:
        raise ConfigFileError(f"{source}: not a JSON-like table: {exc}") from None
    m = _Mapper(ds, model, source, _world_size(world_size))
    m.run()
    try:
        cfg = Config(**m.kw)
    except (ValueError, TypeError) as exc:
        # Name every DeepSpeed key whose Config field the message names (a
        # combination, e.g. stage 3 without parameter offload, names two).
        where = [k for k, v in m.r.mapped.items() if re.search(rf"\b{re.escape(v.split('=')[0])}\b", str(exc))]
        keys = ", ".join(f"'{k}'" for k in where) or "'zero_optimization'"
        raise ConfigFileError(f"{source}: {keys}: {exc}") from None
    cfg.report = m.r
    if m.r.unknown:
        warnings.warn("\n".join([f"DeepSpeed config {source}: keys DeepSpeed does not know (ignored):",
                                 *m.r.lines("unknown")]), DeepSpeedConfigWarning, stacklevel=3)
    return cfg
