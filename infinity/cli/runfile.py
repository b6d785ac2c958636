"""The run file of ``infinity train``: its sections as checked dataclasses.

Every key of every section is checked: an unknown one raises
:class:`ConfigFileError` naming the file, the key path and the nearest valid
key. The sections and keys are described in docs/cli.md.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

from ..config import validate as V
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
    profile: Optional[str] = None  # a hardware profile: the step predicted before the run, shown beside the measured


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
    return cls(**table)


def _opt(check: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    return lambda n, v: None if v is None else check(n, v)


def _count(lo: int) -> Callable[[str, Any], int]:
    return lambda n, v: V.integer(n, v, lo, V.MAX_COUNT)


def _betas(name: str, value: Any) -> Tuple[float, float]:
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, (list, tuple)) or len(value) != 2:
        raise TypeError(f"{name}={value!r}: must be a list of two numbers in [0, 1), e.g. [0.9, 0.95]")
    return tuple(V.real(f"{name}[{i}]", b, 0.0, 1.0, hi_open=True) for i, b in enumerate(value))


def _model_size(name: str, value: Any) -> str:
    from .model import SIZES  # model.py imports this module: import at call time
    if not isinstance(value, str) or value not in SIZES:
        raise ValueError(f"{name}={value!r}: choose one of {list(SIZES)}"
                         f"{nearest(value, SIZES) if isinstance(value, str) else ''}")
    return value


_PATH = _opt(V.text)
_BOOL = V.boolean
_SEED = lambda n, v: V.integer(n, v, 0, (1 << 32) - 1, "an int (a numpy/torch seed)")  # noqa: E731
# [Note: run-file checks]
# Every key of every section has a check here, applied after the CLI's
# overrides and before any path is resolved or value used, so a wrong type
# or range is a ConfigFileError naming 'section.key' (exit 2), never a raw
# TypeError from os.path or a comparison (exit 1). _check() adds the checks
# that relate keys to each other. A new key needs a line here (test_runfile_
# validation checks that every field has one).
_CHECKS: Dict[str, Dict[str, Callable[[str, Any], Any]]] = {
    "model": {"size": _model_size, "path": _PATH, "weights": _PATH,
              **{k: _opt(lambda n, v: V.integer(n, v, 1, 1 << 20)) for k in ("n_layer", "n_head", "n_embd")},
              "vocab_size": _opt(lambda n, v: V.integer(n, v, 1, 1 << 31)),
              "block_size": _opt(lambda n, v: V.integer(n, v, 1, 1 << 24)),
              "tie_weights": _BOOL, "checkpoint": _BOOL, "lazy": _BOOL},
    "data": {"path": lambda n, v: v if v == "" else V.text(n, v),
             "format": lambda n, v: V.choice(n, v, ("auto", "text", "bin", "npy")),
             "dtype": lambda n, v: V.choice(n, v, ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32",
                                                   "int64")),
             "seq_len": lambda n, v: V.integer(n, v, 1, 1 << 24), "micro_batch": _count(1),
             "grad_accumulation": _opt(_count(1)), "seed": _SEED},
    "optimizer": {"lr": lambda n, v: V.real(n, v, 0.0, 1e3), "betas": _betas,
                  "eps": lambda n, v: V.real(n, v, 0.0, 1.0, lo_open=True),
                  "weight_decay": lambda n, v: V.real(n, v, 0.0, 1e3), "no_decay_norm_and_bias": _BOOL},
    "schedule": {"warmup_steps": _count(0), "decay": lambda n, v: V.choice(n, v, ("constant", "linear", "cosine")),
                 "min_lr_ratio": lambda n, v: V.real(n, v, 0.0, 1.0),
                 "warmup_type": lambda n, v: V.choice(n, v, ("linear", "log"))},
    "train": {"steps": _count(1), "seed": lambda n, v: V.integer(n, v, *V.SEED_RANGE),
              "torch_threads": _opt(lambda n, v: V.integer(n, v, 1, V.MAX_THREADS))},
    "checkpoint": {"dir": _PATH, "every": _count(0), "keep_last": _count(1)},
    "log": {"metrics": _PATH, "every": _count(1), "progress": _BOOL, "profile": _PATH},
}


def _check_sections(run: RunFile) -> None:
    """Type- and range-checks every key of every section (normalising it:
    numpy ints to int, betas to a tuple); raises ConfigFileError naming the key."""
    for section, checks in _CHECKS.items():
        obj = getattr(run, section)
        if obj is None:
            continue
        for key, check in checks.items():
            try:
                setattr(obj, key, check(f"{section}.{key}", getattr(obj, key)))
            except (TypeError, ValueError) as exc:
                raise ConfigFileError(f"{run.source}: '{section}.{key}': {exc}") from None


def _relative(path: Optional[str], base: str) -> Optional[str]:
    """``path`` relative to the run file's folder (absolute paths stay)."""
    return None if path is None else os.path.join(os.path.dirname(os.path.abspath(base)), os.path.expanduser(path))


def _check(run: RunFile) -> None:
    """The checks relating keys to each other (each key alone: _check_sections)."""
    src = run.source
    if not run.data.path:
        raise ConfigFileError(f"{src}: 'data.path' is required: a text file, or a .bin/.npy file of token ids")
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
    _check_sections(run)
    run.data.path = _relative(run.data.path, path) if run.data.path else ""
    run.model.path = _relative(run.model.path, path)
    if "swap_paths" in table:  # like every path of the file: relative to its folder
        run.config.swap_paths = [_relative(p, path) for p in run.config.swap_paths]
    run.model.weights = _relative(run.model.weights, path)
    if run.checkpoint.dir:
        run.checkpoint.dir = _relative(run.checkpoint.dir, path)
    if run.log.metrics:
        run.log.metrics = _relative(run.log.metrics, path)
    if run.log.profile and os.path.exists(_relative(run.log.profile, path)):  # else a shipped profile's name
        run.log.profile = _relative(run.log.profile, path)
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
    _check_sections(run)
    _check(run)
    return run
