"""A DeepSpeed config (JSON) as an :class:`infinity.Config` plus a report.

``from_deepspeed(path_or_dict, model=None)`` returns a Config with a
``.report`` (:class:`DeepSpeedReport`): what each DeepSpeed key became
(``mapped``), the keys with no counterpart and why (``ignored``), keys
DeepSpeed does not know, with the nearest valid name (``unknown``),
``"auto"`` values (resolved from ``model`` when given), defaults that differ
between DeepSpeed versions and infinity (``defaults``), the optimizer
keyword arguments for :func:`infinity.initialize`, the lr schedule
(:class:`infinity.config.schedules.Schedule`) and the batch sizes. The mapping
table is in docs/cli.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union

from .runtime import Config
from .files import ConfigFileError, nearest, read_file
from .schedules import Schedule

__all__ = ["DeepSpeedReport", "from_deepspeed", "is_deepspeed"]

_OFFLOAD_DEVICE = {"none": "none", "cpu": "host", "nvme": "nvme"}
_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

# Why each DeepSpeed key with no infinity counterpart is ignored.
_TOP_IGNORED = {
    "steps_per_print": "progress is logged by `infinity train`'s [log] section",
    "wall_clock_breakdown": "timings are in infinity.stats() and the metrics file",
    "zero_allow_untested_optimizer": "infinity always runs its own AdamW",
    "zero_force_ds_cpu_optimizer": "infinity always runs its own CPU AdamW",
    "activation_checkpointing": "use the model's own checkpointing (GPTConfig.checkpoint)",
    "flops_profiler": "no profiler in infinity", "tensorboard": "metrics go to a JSONL file ([log])",
    "wandb": "metrics go to a JSONL file ([log])", "csv_monitor": "metrics go to a JSONL file ([log])",
    "comms_logger": "no communication logger", "memory_breakdown": "peak bytes per tier are in infinity.stats()",
    "communication_data_type": "collectives run in the gradients' dtype",
    "prescale_gradients": "gradients are averaged once after reduction",
    "gradient_predivide_factor": "gradients are averaged once after reduction",
    "sparse_gradients": "no sparse gradients", "amp": "use bf16/fp16 (Config.dtype)",
    "checkpoint": "checkpoints: `infinity train`'s [checkpoint] section", "dump_state": "no state dump",
    "data_types": "gradient accumulation runs in the compute dtype or fp32 (docs/config.md)",
    "elasticity": "no elastic training", "compression_training": "no compression",
    "seed": "set runtime.seed / the run file", "dataloader_drop_last": "the sampler drops no batch",
}
_ZERO_IGNORED = {
    "contiguous_gradients": "units keep gradients in flat buffers always",
    "reduce_scatter": "stage 2/3 always reduce-scatter", "allgather_partitions": "stage 3 always all-gathers",
    "allgather_bucket_size": "collectives move one paging unit at a time",
    "reduce_bucket_size": "collectives move one paging unit at a time",
    "overlap_comm": "gradient transfers and reductions always overlap backward; set runtime.overlap='backward' "
                    "to overlap the CPU optimizer too",
    "stage3_max_live_parameters": "the device budget (runtime.device_memory) bounds what is resident",
    "stage3_max_reuse_distance": "eviction follows the recorded trace (furthest next use)",
    "stage3_param_persistence_threshold": "parameters outside units (the root unit) stay resident",
    "stage3_gather_16bit_weights_on_model_save": "infinity.full_state_dict() gathers the weights",
    "gather_16bit_weights_on_model_save": "infinity.full_state_dict() gathers the weights",
    "sub_group_size": "the optimizer steps one paging unit at a time",
    "round_robin_gradients": "gradients move unit by unit", "elastic_checkpoint": "no elastic checkpoints",
    "load_from_fp32_weights": "checkpoints hold the fp32 master", "ignore_unused_parameters": "always",
    "memory_efficient_linear": "no effect in infinity", "zero_hpz_partition_size": "no hierarchical partitions",
    "zero_quantized_weights": "no quantized collectives", "zero_quantized_gradients": "no quantized collectives",
    "mics_shard_size": "no MiCS", "stage3_module_granularity_threshold": "units: runtime.unit_classes",
    "legacy_stage1": "no legacy stage 1",
    "cpu_offload_use_pin_memory": "legacy name of offload_*.pin_memory: the host tier is pinned on CUDA",
    "stage3_gather_fp16_weights_on_model_save": "legacy name of stage3_gather_16bit_weights_on_model_save: "
                                                "infinity.full_state_dict() gathers the weights",
}
_OFFLOAD_IGNORED = {
    "pin_memory": "the host tier is always pinned when the device is CUDA (HostPool)",
    "buffer_count": "staging is sized from swap_block_size and swap_queue_depth",
    "buffer_size": "staging is sized from swap_block_size and swap_queue_depth",
    "max_in_cpu": "the host tier caches what fits runtime.host_memory",
    "pipeline_read": "the NVMe optimizer always pipelines reads", "pipeline_write": "it always pipelines writes",
    "pipeline": "the NVMe optimizer always pipelines", "fast_init": "swap files are preallocated at initialize",
    "ratio": "the whole optimizer runs on the CPU (no partial offload)",
}
_AIO_IGNORED = {
    "intra_op_parallelism": "the native engine's thread pool is sized by infinity",
    "thread_count": "old name of intra_op_parallelism; the engine's thread pool is sized by infinity",
    "single_submit": "requests are always submitted in batches",
    "overlap_events": "completions are always reaped while others are in flight",
    "use_gds": "no GPUDirect Storage (I/O goes through pinned host staging)",
}
_FP_IGNORED = {
    "hysteresis": "the scale halves on every overflow (no hysteresis)",
    "consecutive_hysteresis": "the scale halves on every overflow (no hysteresis)",
    "auto_cast": "the model runs in Config.dtype", "fp16_master_weights_and_grads": "the master is fp32",
    "immediate_grad_update": "no effect", "check_grad_overflow": "overflow is checked in fp16 only",
}
_OPT_PARAMS = {"lr": "lr", "betas": "betas", "eps": "eps", "weight_decay": "weight_decay"}


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

    def text(self) -> str:
        """The report as lines for a terminal."""
        out = [f"DeepSpeed config {self.source}:"]
        for title, table in (("mapped", self.mapped), ("ignored", self.ignored), ("unknown", self.unknown),
                             ("auto", self.auto), ("defaults", self.defaults)):
            out += [f"  {title:8s} {k}: {v}" for k, v in table.items()]
        out += [f"  warning  {w}" for w in self.warnings]
        return "\n".join(out)


def is_deepspeed(data: Dict[str, Any]) -> bool:
    """True for a table that looks like a DeepSpeed config rather than a run file."""
    marks = ("zero_optimization", "train_micro_batch_size_per_gpu", "train_batch_size", "fp16", "bf16",
             "gradient_clipping", "aio", "zero_allow_untested_optimizer")
    return any(k in data for k in marks) and not any(k in data for k in ("model", "data", "runtime"))


class _Mapper:
    """One pass over a DeepSpeed dict; ``kw`` collects Config fields."""

    def __init__(self, ds: Dict[str, Any], model: Any, source: str):
        self.ds, self.model = ds, model
        self.r = DeepSpeedReport(source=source)
        self.kw: Dict[str, Any] = {}
        self.paths: List[str] = []

    # -- helpers -------------------------------------------------------------------

    def set(self, key: str, fieldname: str, value: Any) -> None:
        self.kw[fieldname] = value
        self.r.mapped[key] = f"{fieldname}={value!r}"

    def hidden(self) -> Optional[int]:
        cfg = getattr(self.model, "config", None) or getattr(self.model, "cfg", None)
        for name in ("hidden_size", "n_embd", "d_model"):
            v = getattr(cfg, name, None)
            if isinstance(v, int):
                return v
        return None

    def auto(self, key: str, resolved: Any, how: str) -> Any:
        self.r.auto[key] = f"{resolved!r} ({how})" if resolved is not None else f"unresolved: {how}"
        return resolved

    def walk(self, table: Dict[str, Any], prefix: str, handled: Dict[str, Any], ignored: Dict[str, str]) -> None:
        """Hands each key of ``table`` to its handler, or reports it ignored or unknown."""
        for key, value in table.items():
            path = f"{prefix}{key}"
            if key in handled:
                handled[key](path, value)
            elif key in ignored:
                self.r.ignored[path] = ignored[key]
            else:
                self.r.unknown[path] = "not a DeepSpeed key" + nearest(key, list(handled) + list(ignored))

    # -- sections ------------------------------------------------------------------

    def run(self) -> None:
        ds = self.ds
        handled = {
            "zero_optimization": lambda p, v: self.zero(v), "aio": lambda p, v: self.aio(v, "aio."),
            "bf16": lambda p, v: None, "fp16": lambda p, v: None, "bfloat16": lambda p, v: None,
            "gradient_clipping": self.clipping, "gradient_accumulation_steps": self.accumulation,
            "train_micro_batch_size_per_gpu": self.batch, "train_batch_size": self.batch,
            "optimizer": lambda p, v: self.optimizer(v), "scheduler": lambda p, v: self.scheduler(v),
        }
        self.precision()
        self.walk(ds, "", handled, _TOP_IGNORED)
        if "gradient_clipping" not in ds:
            self.r.defaults["gradient_clipping"] = ("absent: DeepSpeed's own default is 0 (no clipping) while the "
                                                    "Hugging Face integration's 'auto' gives 1.0; infinity: no "
                                                    "clipping (max_grad_norm=None)")
        if self.paths:
            self.set("offload_*.nvme_path", "swap_paths", list(dict.fromkeys(self.paths)))

    def precision(self) -> None:
        bf = self.ds.get("bf16", self.ds.get("bfloat16", {})) or {}
        fp = self.ds.get("fp16", {}) or {}
        on = {k: t.get("enabled", False) for k, t in (("bf16", bf), ("fp16", fp))}
        for k in ("bf16", "fp16"):
            if on[k] == "auto":
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
                self.fp_key(name, key, value)

    def fp_key(self, name: str, key: str, value: Any) -> None:
        path = f"{name}.{key}"
        if key == "enabled":
            return
        if name == "bf16" and key in ("loss_scale", "initial_scale_power", "loss_scale_window", "min_loss_scale"):
            self.r.ignored[path] = "bf16 needs no loss scaling"
        elif key == "loss_scale":
            self.set(path, "loss_scale", "dynamic" if value == 0 else float(value))
        elif key == "initial_scale_power":
            self.set(path, "initial_loss_scale", float(2 ** int(value)))
        elif key == "loss_scale_window":
            self.set(path, "loss_scale_growth_interval", int(value))
        elif key == "min_loss_scale":
            self.set(path, "min_loss_scale", float(value))
        elif key in _FP_IGNORED:
            self.r.ignored[path] = _FP_IGNORED[key]
        else:
            self.r.unknown[path] = "not a DeepSpeed key" + nearest(
                key, ["enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "min_loss_scale",
                      *_FP_IGNORED])

    def zero(self, z: Dict[str, Any]) -> None:
        z = dict(z)
        legacy = {}
        if z.get("cpu_offload") is True and "offload_optimizer" not in z:
            legacy["offload_optimizer"] = {"device": "cpu"}
        if z.get("cpu_offload_params") is True and "offload_param" not in z:
            legacy["offload_param"] = {"device": "cpu"}
        for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_params", "offload_param")):
            if old in z:
                self.r.mapped[f"zero_optimization.{old}"] = (f"legacy name of zero_optimization.{new}: device "
                                                              f"{'cpu' if z[old] else 'none'}")
        z.update(legacy)
        stage = z.get("stage", 0)
        handled = {
            "stage": lambda p, v: self.set(p, "zero_stage", int(v)),
            "offload_param": lambda p, v: self.offload(p, v, "offload_params"),
            "offload_optimizer": lambda p, v: self.offload(p, v, "offload_optimizer"),
            "stage3_prefetch_bucket_size": self.prefetch,
            "aio": self.nested_aio, "cpu_offload": lambda p, v: None, "cpu_offload_params": lambda p, v: None,
        }
        self.walk(z, "zero_optimization.", handled, _ZERO_IGNORED)
        self.fill_offload_defaults(stage, z)

    def fill_offload_defaults(self, stage: int, z: Dict[str, Any]) -> None:
        # DeepSpeed without offload keeps the state on the device: say so, and
        # what infinity needs instead where it cannot.
        if "offload_param" not in z:
            home = "host" if stage == 3 else "none"
            self.set("zero_optimization.offload_param (absent)", "offload_params", home)
            if stage == 3:
                self.r.warnings.append("stage 3 without offload_param keeps parameter shards on the GPU in "
                                       "DeepSpeed; infinity's stage 3 homes them on the host (offload_params='host')")
        if "offload_optimizer" not in z:
            home = "host" if stage > 0 or self.kw.get("offload_params") == "nvme" else "none"
            self.set("zero_optimization.offload_optimizer (absent)", "offload_optimizer", home)
            if home == "host":
                self.r.warnings.append("no offload_optimizer: DeepSpeed keeps the optimizer on the GPU; infinity "
                                       f"needs it on the host here (zero_stage={stage}): offload_optimizer='host'")

    def offload(self, path: str, value: Dict[str, Any], fieldname: str) -> None:
        dev = str(value.get("device", "none")).lower()
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
                if v:
                    self.paths.append(str(v))
                self.r.mapped[p] = "swap_paths (see nvme_path)"
            elif key in _OFFLOAD_IGNORED:
                self.r.ignored[p] = _OFFLOAD_IGNORED[key]
            else:
                self.r.unknown[p] = "not a DeepSpeed key" + nearest(key, ["device", "nvme_path", *_OFFLOAD_IGNORED])

    def prefetch(self, path: str, value: Any) -> None:
        if value == "auto":
            h = self.hidden()
            value = self.auto(path, int(0.9 * h * h) if h else None,
                              "0.9 x hidden_size^2 elements" if h else "needs the model's hidden size")
            if value is None:
                return
        dtype = self.kw.get("dtype", "bf16")
        self.set(path, "prefetch_bytes", int(float(value)) * _DTYPE_BYTES[dtype])
        self.r.mapped[path] += f" ({int(float(value))} elements x {_DTYPE_BYTES[dtype]} bytes)"

    def nested_aio(self, path: str, value: Dict[str, Any]) -> None:
        self.r.warnings.append("'zero_optimization.aio' is not where DeepSpeed reads aio settings (they belong at "
                               "the top level, 'aio'); infinity maps them anyway")
        self.aio(value, path + ".")

    def aio(self, a: Dict[str, Any], prefix: str) -> None:
        def block(p: str, v: Any) -> None:
            b = -(-int(float(v)) // 4096) * 4096
            self.set(p, "swap_block_size", b)

        handled = {"block_size": block, "queue_depth": lambda p, v: self.set(p, "swap_queue_depth", int(float(v)))}
        self.walk(a, prefix, handled, _AIO_IGNORED)

    def clipping(self, path: str, value: Any) -> None:
        if value == "auto":
            value = self.auto(path, 1.0, "the Hugging Face Trainer's default max_grad_norm")
        self.set(path, "max_grad_norm", float(value) if float(value) > 0 else None)

    def accumulation(self, path: str, value: Any) -> None:
        if value == "auto":
            value = self.auto(path, 1, "no launcher here to give it; 1")
        self.set(path, "grad_accumulation_steps", int(value))

    def batch(self, path: str, value: Any) -> None:
        if value == "auto":
            self.auto(path, None, "set data.micro_batch in the run file")
            return
        if path == "train_micro_batch_size_per_gpu":
            self.r.micro_batch = int(value)
        else:
            self.r.train_batch = int(value)
        self.r.mapped[path] = f"report.{'micro_batch' if path.startswith('train_micro') else 'train_batch'}=" \
                              f"{int(value)} (the data section's batch size)"

    def optimizer(self, o: Dict[str, Any]) -> None:
        kind = str(o.get("type", ""))
        if kind.lower() not in ("adam", "adamw"):
            self.r.ignored["optimizer"] = f"type {kind!r}: infinity runs AdamW only; its defaults are used"
            return
        self.r.mapped["optimizer.type"] = f"infinity AdamW ({kind})"
        params = o.get("params", {})
        self.r.optimizer["adamw_mode"] = kind.lower() == "adamw" or bool(params.get("adam_w_mode", True))
        for key, v in params.items():
            p = f"optimizer.params.{key}"
            if key in _OPT_PARAMS:
                if v == "auto":
                    self.auto(p, None, "infinity's default is used")
                    continue
                self.r.optimizer[_OPT_PARAMS[key]] = tuple(v) if key == "betas" else float(v)
                self.r.mapped[p] = f"report.optimizer[{_OPT_PARAMS[key]!r}]"
            elif key == "adam_w_mode":
                self.r.mapped[p] = f"report.optimizer['adamw_mode']={self.r.optimizer['adamw_mode']}"
            elif key in ("torch_adam", "fused", "bias_correction", "amsgrad"):
                self.r.ignored[p] = "infinity's AdamW is native, with bias correction, without amsgrad"
            else:
                self.r.unknown[p] = "not an Adam parameter" + nearest(key, [*_OPT_PARAMS, "adam_w_mode"])

    def scheduler(self, s: Dict[str, Any]) -> None:
        from .deepspeed_schedule import schedule_from_deepspeed
        try:
            self.r.schedule, used, auto = schedule_from_deepspeed(s, self.r.optimizer.get("lr"))
        except ValueError as exc:
            raise ConfigFileError(f"{self.r.source}: 'scheduler': {exc}") from None
        for key in ["type", *(f"params.{k}" for k in s.get("params", {}))]:
            if key in used:
                self.r.mapped[f"scheduler.{key}"] = "report.schedule" if self.r.schedule is not None else \
                    "report.schedule: None until the 'auto' values are given"
            elif key[len("params."):] in auto:
                self.auto(f"scheduler.{key}", None, auto[key[len("params."):]])
            elif key.endswith("last_batch_iteration"):
                self.r.ignored[f"scheduler.{key}"] = "a resumed run restores the scheduler from its checkpoint"
            else:
                self.r.ignored[f"scheduler.{key}"] = "momentum cycling and lr stairs are not reproduced"


def from_deepspeed(config: Union[str, Dict[str, Any]], model: Any = None) -> Config:
    """:meth:`Config.from_deepspeed`: a Config from a DeepSpeed JSON file or
    dict, with ``.report`` (:class:`DeepSpeedReport`). ``model`` (an
    ``nn.Module`` with a ``config.hidden_size``/``cfg.n_embd``) resolves
    ``"auto"`` sizes. Raises ConfigFileError naming the file and key path."""
    source = "<dict>"
    if not isinstance(config, dict):
        source = str(config)
        config = read_file(source)
    m = _Mapper(json.loads(json.dumps(config)), model, source)
    m.run()
    try:
        cfg = Config(**m.kw)
    except (ValueError, TypeError) as exc:
        keys = {f: k for k, f in ((k, v.split("=")[0]) for k, v in m.r.mapped.items())}
        where = next((keys[f] for f in keys if f"Config.{f}" in str(exc)), "zero_optimization")
        raise ConfigFileError(f"{source}: '{where}': {exc}") from None
    cfg.report = m.r
    return cfg
