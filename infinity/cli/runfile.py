"""The run file of ``infinity train``: its sections as checked dataclasses.

Every key of every section is checked: an unknown one raises
:class:`ConfigFileError` naming the file, the key path and the nearest valid
key. The sections and keys are described in docs/cli.md.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from ..config.runtime import Config
from ..config.files import ConfigFileError, config_from_mapping, nearest, read_file, runtime_table
from ..config.deepspeed import from_deepspeed, is_deepspeed
from ..config.schedules import Schedule


@dataclass
class ModelSection:
    """``[model]``: the built-in GPT (``size`` preset, overridable) or a Hugging
    Face causal LM from a local directory holding config.json (``path``)."""

    size: str = "tiny"
    path: Optional[str] = None
    weights: Optional[str] = None
    n_layer: Optional[int] = None
    n_head: Optional[int] = None
    n_embd: Optional[int] = None
    vocab_size: Optional[int] = None
    block_size: Optional[int] = None
    tie_weights: bool = True
    checkpoint: bool = False
    lazy: bool = False


@dataclass
class DataSection:
    """``[data]``: ``path`` to a text file (bytes are tokens) or a ``.bin``
    (raw ``dtype`` ids) / ``.npy`` file of token ids, memory-mapped."""

    path: str = ""
    format: str = "auto"
    dtype: str = "uint16"
    seq_len: int = 128
    micro_batch: int = 4
    grad_accumulation: Optional[int] = None
    seed: int = 0


@dataclass
class OptimizerSection:
    """``[optimizer]``: AdamW hyper-parameters; ``no_decay_norm_and_bias``
    puts every parameter with fewer than 2 dimensions (norm weights, biases)
    in a group without weight decay."""

    lr: float = 3e-4
    betas: Tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    no_decay_norm_and_bias: bool = True


@dataclass
class ScheduleSection:
    """``[schedule]``: warmup then ``decay`` (constant, linear, cosine) to ``min_lr_ratio``."""

    warmup_steps: int = 0
    decay: str = "cosine"
    min_lr_ratio: float = 0.1
    warmup_type: str = "linear"


@dataclass
class TrainSection:
    """``[train]``: ``steps`` optimizer steps; ``seed`` seeds the model's
    initialisation; ``torch_threads`` sets torch's intra-op threads (None: torch's default)."""

    steps: int = 10
    seed: int = 0
    torch_threads: Optional[int] = None


@dataclass
class CheckpointSection:
    """``[checkpoint]``: save to ``dir`` every ``every`` steps (0: only at the end), keeping ``keep_last``."""

    dir: Optional[str] = None
    every: int = 0
    keep_last: int = 2


@dataclass
class LogSection:
    """``[log]``: one JSON line per ``every`` steps to ``metrics``; a tqdm bar when ``progress``."""

    metrics: Optional[str] = None
    every: int = 1
    progress: bool = True


_SECTIONS = {"model": ModelSection, "data": DataSection, "optimizer": OptimizerSection,
             "schedule": ScheduleSection, "train": TrainSection, "checkpoint": CheckpointSection,
             "log": LogSection}


@dataclass
class RunFile:
    """A parsed run file: its sections and the runtime :class:`Config`."""

    source: str
    config: Config
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    schedule: Optional[ScheduleSection] = None
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    log: LogSection = field(default_factory=LogSection)
    deepspeed_report: Any = None
    extra_schedule: Optional[Schedule] = None


def _section(cls, table: Any, name: str, source: str):
    if not isinstance(table, dict):
        raise ConfigFileError(f"{source}: '{name}' must be a table, not {type(table).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    for key in table:
        if key not in names:
            raise ConfigFileError(f"{source}: unknown key '{name}.{key}'{nearest(key, names)}; valid keys: {names}")
    kw = dict(table)
    if "betas" in kw:
        kw["betas"] = tuple(kw["betas"])
    return cls(**kw)


def _relative(path: Optional[str], base: str) -> Optional[str]:
    """``path`` relative to the run file's folder (absolute paths stay)."""
    return None if path is None else os.path.join(os.path.dirname(os.path.abspath(base)), os.path.expanduser(path))


def _check(run: RunFile) -> None:
    src = run.source
    checks: List[Tuple[bool, str]] = [
        (bool(run.data.path), "'data.path' is required: a text file, or a .bin/.npy file of token ids"),
        (run.data.format in ("auto", "text", "bin", "npy"), "'data.format': choose 'auto', 'text', 'bin' or 'npy'"),
        (run.data.seq_len >= 1 and run.data.micro_batch >= 1, "'data.seq_len' and 'data.micro_batch' must be >= 1"),
        (run.train.steps >= 1, "'train.steps' must be >= 1"),
        (run.log.every >= 1, "'log.every' must be >= 1"),
        (run.checkpoint.every >= 0 and run.checkpoint.keep_last >= 1,
         "'checkpoint.every' must be >= 0 and 'checkpoint.keep_last' >= 1"),
    ]
    for ok, msg in checks:
        if not ok:
            raise ConfigFileError(f"{src}: {msg}")
    if run.schedule is not None and run.schedule.decay not in ("constant", "linear", "cosine"):
        raise ConfigFileError(f"{src}: 'schedule.decay'={run.schedule.decay!r}: choose 'constant', 'linear' or "
                              "'cosine'")
    ga, rga = run.data.grad_accumulation, run.config.grad_accumulation_steps
    if ga is not None and rga != 1 and ga != rga:
        raise ConfigFileError(f"{src}: 'data.grad_accumulation'={ga} but 'runtime.grad_accumulation_steps'={rga}: "
                              "give one of them")


def load_run_file(path: str, overrides: Optional[Dict[str, Any]] = None) -> RunFile:
    """The run file at ``path`` (TOML or JSON; a DeepSpeed JSON is read as its
    runtime, optimizer and schedule, with the data given by ``overrides``)."""
    data = read_file(path)
    if is_deepspeed(data):
        return _from_deepspeed(path, overrides or {})
    table, prefix = runtime_table(data, path)
    if not prefix:
        raise ConfigFileError(f"{path}: not a run file (no [model]/[data]/[train] section) nor a DeepSpeed config; "
                              "see docs/cli.md for the sections")
    run = RunFile(source=path, config=config_from_mapping(table, path, "runtime"))
    for name, cls in _SECTIONS.items():
        if name in data:
            setattr(run, name, _section(cls, data[name], name, path))
    for key, value in (overrides or {}).items():
        section, _, attr = key.partition(".")
        setattr(getattr(run, section), attr, value)
    run.data.path = _relative(run.data.path, path) if run.data.path else ""
    run.model.path = _relative(run.model.path, path)
    if "swap_paths" in table:  # like every path of the file: relative to its folder
        run.config.swap_paths = [_relative(p, path) for p in run.config.swap_paths]
    run.model.weights = _relative(run.model.weights, path)
    if run.checkpoint.dir:
        run.checkpoint.dir = _relative(run.checkpoint.dir, path)
    if run.log.metrics:
        run.log.metrics = _relative(run.log.metrics, path)
    if run.data.grad_accumulation is None:
        run.data.grad_accumulation = run.config.grad_accumulation_steps
    _check(run)
    run.config.grad_accumulation_steps = run.data.grad_accumulation
    return run


def _from_deepspeed(path: str, overrides: Dict[str, Any]) -> RunFile:
    cfg = from_deepspeed(path)
    rep = cfg.report
    run = RunFile(source=path, config=cfg, deepspeed_report=rep, extra_schedule=rep.schedule)
    for key, value in overrides.items():
        section, _, attr = key.partition(".")
        setattr(getattr(run, section), attr, value)
    opt = rep.optimizer
    for k in ("lr", "eps", "weight_decay", "betas"):
        if k in opt:
            setattr(run.optimizer, k, opt[k])
    if rep.micro_batch:
        run.data.micro_batch = rep.micro_batch
    run.data.grad_accumulation = cfg.grad_accumulation_steps
    _check(run)
    return run
