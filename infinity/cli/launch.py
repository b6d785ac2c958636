"""``infinity train`` under ``torchrun``: the process group, each rank's
share of the batch, and the per-step agreement of the ranks.

[Note: infinity train on several ranks]
Under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) ``infinity train``
initialises torch.distributed itself (gloo on the CPU device; on CUDA
``"cpu:gloo,cuda:nccl"`` with the rank's device set from ``LOCAL_RANK``
first, so NCCL and the gloo host group both exist), unless the caller did.
Every rank draws the same global micro-batch of ``micro_batch x world``
windows and keeps its own ``micro_batch`` rows, so the sampler's position
is the same on every rank (one position in the checkpoint) and the run
sees the data a single process would see with the whole batch. After each
step the ranks sum three numbers on the host group: the loss (the metrics
show the mean over ranks), Ctrl-C seen, and memory pressure seen. Stopping
and saving are collective, so every rank stops at the same step even when
only one got the signal or ran out of memory. Only rank 0 writes metrics,
draws the progress bar and prints the summary.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Tuple

import torch
import torch.distributed as dist

from .common import CLIError

__all__ = ["Ranks", "start", "agree"]


@dataclass
class Ranks:
    """This process's place: ``rank`` of ``world``; ``owned``: the command
    initialised the process group, so it destroys it at the end."""

    rank: int = 0
    world: int = 1
    owned: bool = False

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        """Destroys the process group if this command made it."""
        if self.owned and dist.is_initialized():
            dist.destroy_process_group()
            self.owned = False


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    if not raw.strip().isdigit():
        raise CLIError(f"{name}={raw!r} (environment): must be a non-negative int (torchrun sets it)")
    return int(raw)


def start(device: torch.device) -> Ranks:
    """Joins the ranks ``torchrun`` started, if any (see [Note: infinity train
    on several ranks]); ``device`` is the run's resolved device."""
    if dist.is_available() and dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size(), False)
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        return Ranks()
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise CLIError(f"WORLD_SIZE={world} but {', '.join(missing)} not set: launch with "
                       "`torchrun --nproc-per-node N -m infinity train RUN_FILE`")
    backend = "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(_env_int("LOCAL_RANK", 0))
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend)
    return Ranks(dist.get_rank(), dist.get_world_size(), True)


def agree(ranks: Ranks, loss: float, stop: bool, pressure: bool) -> Tuple[float, bool, bool]:
    """(mean loss over the ranks, any rank stopping, any rank under memory
    pressure): one sum over the ranks; the values as given on one rank."""
    if ranks.world == 1:
        return loss, stop, pressure
    t = torch.tensor([loss, float(stop), float(pressure)], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t[0]) / ranks.world, bool(t[1] > 0), bool(t[2] > 0)
