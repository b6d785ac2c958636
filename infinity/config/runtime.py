"""``infinity.Config``: every knob of the runtime, typed and validated.

Construct it with keyword arguments; unknown fields and bad values raise
``ValueError``/``TypeError`` naming the field and the valid choices. Sizes
accept bytes (int) or strings such as ``"8GiB"``, ``"512MiB"``, ``"1.5GB"``.
See docs/config.md for a description of every field.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import torch

from . import validate as V
from .validate import parse_bytes

__all__ = ["Config", "parse_bytes", "format_bytes"]

def format_bytes(n: float) -> str:
    """``n`` bytes as a short human string (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_OFFLOAD = ("none", "host", "nvme")
_OVERLAP = ("step", "backward", "delayed")
# Config.state_chunk_bytes is a multiple of this: a chunk of fp32 state holds
# whole int8 blocks (256 elements) and whole checksum chunks (at most 256 KiB,
# io/engine.chunk_bytes), so a unit updated chunk by chunk gives the same bytes.
STATE_CHUNK_ALIGN = 256 << 10
_MOMENT_DTYPES = ("fp32", "bf16", "int8")  # infinity.optim.moments.MOMENT_DTYPES (config sits below optim)
_MASTER_DTYPES = ("fp32", "bf16")  # infinity.optim.master.MASTER_DTYPES


def _choice(name: str, value: Any, choices: Sequence[str]) -> str:
    return V.choice(f"Config.{name}", value, choices)


@dataclass
class Config:
    """Configuration of infinity. Attributes:

    device: where compute runs: ``"auto"`` (CUDA if available, else CPU),
        ``"cuda"``, ``"cuda:N"`` or ``"cpu"``. On the CPU the device tier is a
        budgeted region of RAM and every paging code path still runs.
    dtype: dtype of the compute copy of the parameters: ``"bf16"``, ``"fp16"``
        (with dynamic loss scaling) or ``"fp32"``. The optimizer always keeps
        an fp32 master copy.
    device_memory: hard budget (bytes or "8GiB") for model state on the
        device: compute copies of parameters, gradients in flight, and the
        optimizer state when ``offload_optimizer="none"``. ``None``: 90% of
        the free device memory (CUDA) or unlimited (CPU).
    host_memory: hard budget for model state in (pinned) host memory.
        ``None``: 80% of the RAM this process may use at start-up
        (the machine's, or its memory cgroup's if smaller).
    offload_params: home of the parameters' compute copy: ``"none"`` (stays
        on the device), ``"host"`` or ``"nvme"``.
    offload_optimizer: home of fp32 master weights, gradients and Adam
        moments: ``"none"`` (device), ``"host"`` (CPU AdamW) or ``"nvme"``.
    moment_dtype: how the Adam moments are stored: ``"fp32"`` (torch's, 8
        bytes a parameter), ``"bf16"`` (4 bytes) or ``"int8"`` (block-scaled
        8-bit codes, 256 elements a block with an fp32 scale: ~2.03 bytes).
        Needs ``offload_optimizer`` ``"host"`` or ``"nvme"``.
    master_dtype: the optimizer's master weights: ``"fp32"`` (4 bytes a
        parameter) or ``"bf16"`` (2 bytes: updated in fp32 and stored by
        stochastic rounding from a counter-based hash of ``seed``, each
        parameter's position and step and each element's index, so a run
        and its resume are reproducible). ``"bf16"`` needs ``dtype="bf16"``
        and ``offload_optimizer`` ``"host"`` or ``"nvme"``.
    state_chunk_bytes: with ``offload_optimizer="nvme"``, a unit whose
        optimizer state (its shard) is larger than this many fp32 bytes is
        read, updated and written back in chunks of this size (a multiple
        of 256 KiB), so the host holds a few chunks, not the whole unit.
    swap_paths: directories for NVMe swap files (one or more; bandwidth
        adds up across devices). Default ``["./infinity-swap"]``.
    swap_block_size: bytes per I/O request to the swap files (multiple of 4 KiB).
    swap_queue_depth: requests in flight over all swap paths.
    swap_backend: ``"auto"`` (io_uring where the kernel offers it, else a
        thread pool), ``"io_uring"``, ``"threads"`` or ``"python"``.
    swap_checksum: CRC32C of every block written, verified on every read
        (costs CPU: one extra read of each byte moved).
    prefetch_depth: how many units ahead of compute the prefetcher fetches.
    prefetch_bytes: optional byte bound on what is prefetched ahead.
    max_grad_norm: clip gradients to this global L2 norm (``None``: no clipping).
    overlap: when the CPU optimizer runs: ``"step"`` (in ``optimizer.step()``,
        after backward), ``"backward"`` (each unit's update starts as soon as
        its gradients are complete, during backward) or ``"delayed"`` (the
        update computed during step t+1's forward/backward is applied at
        step t+1: one-step delayed parameter update, as in ZeRO-Offload).
    grad_accumulation_steps: backward passes per optimizer step. Only
        ``overlap="backward"`` needs it (to know which backward is the last);
        other modes accumulate any number of backward passes.
    zero_stage: ZeRO stage over the default torch.distributed process group:
        0 (no sharding), 1 (optimizer state sharded), 2 (and gradients),
        3 (and the parameters, all-gathered onto the device before use).
    unit_classes: module class names (or classes) that form a paging unit.
        Default: each child of every ``nn.ModuleList``. The parameters not
        in any unit form the root unit, resident during forward and backward.
    num_threads: CPU threads of the optimizer kernel (default: all cores; on CUDA all but 2).
    loss_scale: ``"dynamic"`` or a fixed float (fp16 only).
    initial_loss_scale: first dynamic loss scale (fp16).
    loss_scale_growth_interval: steps without overflow before the scale doubles.
    min_loss_scale: the dynamic scale never falls below this.
    seed: a seed for lazy initialisation, applied only when asked:
        ``infinity.init(config, seed=config.seed)`` (an unseeded ``infinity.init``
        keeps the program's own ``torch.manual_seed``); with
        ``master_dtype="bf16"`` also the stochastic rounding's seed (a
        checkpoint keeps it and a resume takes it from there).
    """

    device: str = "auto"
    dtype: str = "bf16"
    device_memory: Optional[Union[int, str]] = None
    host_memory: Optional[Union[int, str]] = None
    offload_params: str = "host"
    offload_optimizer: str = "host"
    moment_dtype: str = "fp32"
    master_dtype: str = "fp32"
    state_chunk_bytes: Union[int, str] = "64MiB"
    swap_paths: Sequence[str] = field(default_factory=lambda: ["./infinity-swap"])
    swap_block_size: Union[int, str] = "8MiB"
    swap_queue_depth: int = 16
    swap_backend: str = "auto"
    swap_checksum: bool = True
    prefetch_depth: int = 2
    prefetch_bytes: Optional[Union[int, str]] = None
    max_grad_norm: Optional[float] = None
    overlap: str = "step"
    grad_accumulation_steps: int = 1
    zero_stage: int = 0
    unit_classes: Optional[Sequence[Union[str, type]]] = None
    num_threads: Optional[int] = None
    loss_scale: Union[str, float] = "dynamic"
    initial_loss_scale: float = 2.0**16
    loss_scale_growth_interval: int = 1000
    min_loss_scale: float = 1.0
    seed: int = 0

    def __init__(self, **kwargs: Any) -> None:
        names = [f.name for f in dataclasses.fields(self)]
        unknown = sorted(set(kwargs) - set(names))
        if unknown:
            raise ValueError(f"Config: unknown field(s) {unknown}; valid fields are {names}")
        for f in dataclasses.fields(self):
            if f.name in kwargs:
                value = kwargs[f.name]
            elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                value = f.default_factory()  # type: ignore[misc]
            else:
                value = f.default
            setattr(self, f.name, value)
        self._validate()

    def _validate(self) -> None:
        # Single fields first, in a fixed order (with several bad ones, the
        # same one is reported every time), then the combinations, which
        # rely on each field being valid and normalised.
        self._validate_device()
        self._validate_modes_and_budgets()
        self._validate_swap()
        self._validate_numbers()
        self._validate_unit_classes()
        self._validate_combinations()

    def _validate_device(self) -> None:
        dev = self.device
        if not isinstance(dev, (str, torch.device)):
            raise TypeError(f"Config.device={dev!r}: use 'auto', 'cuda', 'cuda:N' or 'cpu', not {type(dev).__name__}")
        dev = str(dev)
        # N below 2**16: a larger index is no device, and torch.device() would
        # refuse it later with an error that does not name the field.
        if not re.fullmatch(r"auto|cpu|cuda(:\d{1,5})?", dev) or int(dev.partition(":")[2] or 0) >= 1 << 16:
            raise ValueError(f"Config.device={dev!r}: choose 'auto', 'cuda', 'cuda:N' or 'cpu'")
        self.device = dev

    def _validate_modes_and_budgets(self) -> None:
        _choice("dtype", self.dtype, tuple(_DTYPES))
        _choice("offload_params", self.offload_params, _OFFLOAD)
        _choice("offload_optimizer", self.offload_optimizer, _OFFLOAD)
        _choice("overlap", self.overlap, _OVERLAP)
        _choice("moment_dtype", self.moment_dtype, _MOMENT_DTYPES)
        _choice("master_dtype", self.master_dtype, _MASTER_DTYPES)
        for name in ("device_memory", "host_memory", "prefetch_bytes"):
            v = getattr(self, name)
            if v is not None:
                setattr(self, name, parse_bytes(v, f"Config.{name}"))

    def _validate_swap(self) -> None:
        paths = self.swap_paths
        if isinstance(paths, (str, bytes, os.PathLike)) or not isinstance(paths, (list, tuple)):
            raise TypeError(f"Config.swap_paths={paths!r}: expected a list of directory paths, e.g. "
                            "['/nvme0/swap']")
        self.swap_paths = [V.text(f"Config.swap_paths[{i}]", os.fspath(p) if isinstance(p, os.PathLike) else p)
                           for i, p in enumerate(paths)]
        if not self.swap_paths:
            raise ValueError("Config.swap_paths is empty: give at least one directory")
        self.swap_block_size = parse_bytes(self.swap_block_size, "Config.swap_block_size", V.MAX_BLOCK)
        if self.swap_block_size < 4096 or self.swap_block_size % 4096:
            raise ValueError(f"Config.swap_block_size={self.swap_block_size}: must be a positive multiple of "
                             "4096 bytes, at most 1 GiB")
        self.state_chunk_bytes = parse_bytes(self.state_chunk_bytes, "Config.state_chunk_bytes", V.MAX_BLOCK)
        if self.state_chunk_bytes < STATE_CHUNK_ALIGN or self.state_chunk_bytes % STATE_CHUNK_ALIGN:
            raise ValueError(f"Config.state_chunk_bytes={self.state_chunk_bytes}: must be a positive multiple of "
                             f"{STATE_CHUNK_ALIGN} bytes (256 KiB: whole int8 blocks and checksum chunks), at most 1 GiB")
        self.swap_queue_depth = V.integer("Config.swap_queue_depth", self.swap_queue_depth, 1, V.MAX_QUEUE_DEPTH,
                                          "an int (requests in flight)")
        _choice("swap_backend", self.swap_backend, ("auto", "io_uring", "threads", "python"))
        V.boolean("Config.swap_checksum", self.swap_checksum)

    def _validate_numbers(self) -> None:
        for name, lo, hi in (("prefetch_depth", 0, V.MAX_DEPTH), ("grad_accumulation_steps", 1, V.MAX_COUNT),
                             ("loss_scale_growth_interval", 1, V.MAX_COUNT)):
            setattr(self, name, V.integer(f"Config.{name}", getattr(self, name), lo, hi))
        if not V.is_int(self.zero_stage) or self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"Config.zero_stage={self.zero_stage!r}: choose 0, 1, 2 or 3")
        self.zero_stage = int(self.zero_stage)
        if self.max_grad_norm is not None:
            self.max_grad_norm = V.real("Config.max_grad_norm", self.max_grad_norm, 0, 1e30, lo_open=True)
        if self.num_threads is not None:
            self.num_threads = V.integer("Config.num_threads", self.num_threads, 1, V.MAX_THREADS,
                                         "an int (or None: all cores)")
        if self.loss_scale != "dynamic":
            if isinstance(self.loss_scale, str):
                raise ValueError(f"Config.loss_scale={self.loss_scale!r}: 'dynamic' or a float > 0")
            self.loss_scale = V.real("Config.loss_scale", self.loss_scale, 0, V.MAX_LOSS_SCALE, lo_open=True)
        for name in ("initial_loss_scale", "min_loss_scale"):
            setattr(self, name, V.real(f"Config.{name}", getattr(self, name), 0, V.MAX_LOSS_SCALE, lo_open=True))
        if self.min_loss_scale > self.initial_loss_scale:
            raise ValueError(f"Config.min_loss_scale={self.min_loss_scale!r} is above initial_loss_scale="
                             f"{self.initial_loss_scale!r}: the dynamic scale starts at the initial one and never "
                             "falls below the minimum; lower min_loss_scale")
        self.seed = V.integer("Config.seed", self.seed, *V.SEED_RANGE, "an int (a torch.manual_seed seed)")

    def _validate_unit_classes(self) -> None:
        if self.unit_classes is not None:
            if isinstance(self.unit_classes, (str, type)):
                self.unit_classes = [self.unit_classes]
            if not isinstance(self.unit_classes, (list, tuple, set, frozenset)):
                raise TypeError(f"Config.unit_classes={self.unit_classes!r}: expected a list of classes or class "
                                "names, e.g. ['Block']")
            self.unit_classes = list(self.unit_classes)
            for c in self.unit_classes:
                if not isinstance(c, (str, type)):
                    raise TypeError(f"Config.unit_classes: {c!r} is neither a class nor a class name")
                if isinstance(c, str) and not c:
                    raise ValueError("Config.unit_classes: '' is not a class name")

    def _validate_combinations(self) -> None:
        if self.zero_stage == 3 and self.offload_params not in ("host", "nvme"):
            raise ValueError("Config.zero_stage=3 shards the parameters' home copy over the ranks' host or NVMe "
                             "tiers: it needs offload_params 'host' or 'nvme'")
        if self.zero_stage > 0 and (self.offload_optimizer == "none" or self.overlap == "delayed"):
            raise ValueError(f"Config.zero_stage={self.zero_stage} works with offload_optimizer 'host' or "
                             "'nvme' and overlap 'step' or 'backward' in this version")
        if self.overlap == "delayed" and self.offload_optimizer == "none":
            raise ValueError("Config.overlap='delayed' needs offload_optimizer='host': the delayed update is "
                             "the CPU optimizer running beside the next step's compute")
        if self.overlap == "delayed" and "nvme" in (self.offload_params, self.offload_optimizer):
            raise ValueError("Config.overlap='delayed' is not available with 'nvme' offload; use 'step' or "
                             "'backward'")
        if self.moment_dtype != "fp32" and self.offload_optimizer == "none":
            raise ValueError(f"Config.moment_dtype={self.moment_dtype!r} needs offload_optimizer 'host' or 'nvme' "
                             "(the CPU AdamW keeps low-bit moments; the device optimizer is torch's fp32 one)")
        if self.master_dtype == "bf16" and (self.offload_optimizer == "none" or self.dtype != "bf16"):
            raise ValueError(f"Config.master_dtype='bf16' needs offload_optimizer 'host' or 'nvme' and dtype='bf16' "
                             f"(got offload_optimizer={self.offload_optimizer!r}, dtype={self.dtype!r}): the CPU "
                             "AdamW's bf16-master kernel updates a bf16 master whose bits are the compute copy's; "
                             "the device optimizer is torch's fp32 one")
        if self.offload_optimizer == "none" and self.offload_params == "nvme":
            raise ValueError("Config: offload_params='nvme' needs offload_optimizer='host' or 'nvme' (the "
                             "optimizer writes the new compute copy on the host, from where it goes to NVMe)")

    # -- derived -------------------------------------------------------------------------

    @property
    def torch_dtype(self) -> torch.dtype:
        """The compute dtype as a torch.dtype."""
        return _DTYPES[self.dtype]

    def resolve_device(self) -> torch.device:
        """The torch.device compute runs on (resolves ``"auto"``)."""
        if self.device == "auto":
            return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cpu")
        d = torch.device(self.device)
        if d.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"Config.device={self.device!r} but CUDA is not available here "
                                   "(use device='cpu' or 'auto')")
            if d.index is None:
                d = torch.device("cuda", torch.cuda.current_device())
            elif d.index >= torch.cuda.device_count():
                raise ValueError(f"Config.device={self.device!r}: only {torch.cuda.device_count()} CUDA "
                                 "device(s) here")
        return d

    @classmethod
    def from_file(cls, path: str) -> "Config":
        """The Config of a TOML or JSON file: the ``runtime`` table of a run
        file (docs/cli.md) or a flat table of fields. Errors name the file, the
        key path and the valid choices (:class:`infinity.config.files.ConfigFileError`)."""
        from .files import config_from_file
        return config_from_file(path)

    @classmethod
    def from_deepspeed(cls, config: Any, model: Any = None, world_size: Optional[int] = None) -> "Config":
        """A Config from a DeepSpeed config (a JSON path or a dict); the result's
        ``.report`` (:class:`infinity.config.deepspeed.DeepSpeedReport`) holds the optimizer
        and scheduler settings, batch sizes and every key ignored, with why.
        ``model`` resolves ``"auto"`` values; ``world_size`` (default
        ``$WORLD_SIZE``, else 1) enters DeepSpeed's batch arithmetic. Keys
        DeepSpeed does not know raise one ``DeepSpeedConfigWarning``. See docs/cli.md."""
        from .deepspeed import from_deepspeed
        return from_deepspeed(config, model, world_size)

    def to_dict(self) -> dict:
        """The config as a plain dict (for logs and checkpoints); ``Config(**d)``
        gives it back."""
        d = dataclasses.asdict(self)
        if d["unit_classes"] is not None:
            d["unit_classes"] = [c if isinstance(c, str) else c.__name__ for c in d["unit_classes"]]
        return d
