"""Which path a run's bytes take, decided from its Config and world size:
gradients streamed in chunks or kept whole, reduced on the device or the
host, updated copies gathered on the device or the host, updates
speculative or not. Each answer is None (the path applies) or the reason it
does not. Pure: reads the Config, allocates nothing. placement.py builds
the engine's Modes from these answers.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["grad_streaming", "host_reduction_reason", "host_gather_reason", "speculation_needed",
           "speculation_unsupported"]


def grad_streaming(config, world: int) -> Optional[str]:
    """None when the gradients of a unit whose NVMe state is streamed in
    chunks go to NVMe chunk by chunk as they arrive (``Config`` ``config`` on
    ``world`` ranks), else why they stay in one host buffer a unit: they are
    summed over ranks there, or ``step()`` reads them whole for the norm
    (clipping, fp16's overflow check). See [Note: gradients streamed in chunks] in owners/grad_chunks.py."""
    if config.offload_optimizer != "nvme":
        return "offload_optimizer is not 'nvme'"
    if world > 1 or config.zero_stage:
        return "several ranks or ZeRO: the gradients are reduced in one buffer"
    if config.max_grad_norm is not None or config.dtype == "fp16":
        return "clipping or fp16: step() reads each unit's gradients whole for the norm"
    return None


def host_reduction_reason(stage: int, world: int, accum_steps: int, optimizer: str = "host",
                          overlap: str = "step") -> Optional[str]:
    """None when a unit's gradients are reduced on the device (ZeRO stage
    ``stage`` on ``world`` ranks, ``accum_steps`` micro-batches a step,
    Config's ``offload_optimizer`` and ``overlap``), else why they go to the
    host first.

    [Note: where gradients are reduced]
    This is the one place that decides it. On the device path a unit's
    gradients land in one flat device buffer (in the host buffers' dtype, so
    the sums are the host path's bit for bit), which is reduced over the
    device group when the unit's last gradient arrives, asynchronously, while
    backward goes on with the next unit: reduce-scattered at stages 1-3, after
    which only the own shard crosses to the host (1/N of the unit's bytes per
    rank); all-reduced at stage 0, after which the whole sum crosses (each
    rank's optimizer updates the whole unit), so no gradient is summed over
    the host group. Stage 1 then reduces in the last backward under every
    overlap, as stage 2 does (its full gradients are never kept on the host).
    The host path copies every gradient to the host as autograd finishes it
    and reduces the host buffers over the host group. It stays where the
    device path would cost more than it saves or cannot hold the sums:
    - accumulation windows: earlier micro-batches sum on the host; on the
      device every unit's full gradients would have to stay between
      micro-batches (a model's worth of device memory);
    - stage 0 with the optimizer state on NVMe: each unit's gradients spill
      to NVMe as they arrive (bounded host memory until ``step()``), so the
      host buffer is where they are summed;
    - stage 0 with ``offload_optimizer="none"``: the gradients stay on the
      device and are all-reduced there already;
    - stage 0 with ``overlap="delayed"``: two host buffers alternate under
      the update of the previous step;
    - one rank: nothing to reduce, the gradients go straight to the host.
    """
    if world < 2:
        return "one rank: nothing to reduce"
    if accum_steps > 1:
        return f"grad_accumulation_steps={accum_steps}: the window's sums accumulate on the host"
    if stage == 0 and optimizer == "nvme":
        return "zero_stage=0 with offload_optimizer='nvme': the gradients spill to NVMe from the host before step()"
    if stage == 0 and optimizer == "none":
        return "zero_stage=0 with offload_optimizer='none': the gradients stay on the device"
    if stage == 0 and overlap == "delayed":
        return "zero_stage=0 with overlap='delayed': the next backward fills the second host buffer"
    return None


def host_gather_reason(stage: int, world: int, params: str) -> Optional[str]:
    """None when, at ZeRO stage ``stage`` on ``world`` ranks with Config's
    ``offload_params``, each unit's updated compute copy is all-gathered on
    the device group, else why it is gathered on the host group (or not at all).

    This is the one place that decides it; see [Note: where the updated
    copies are gathered] in step/copy_gathers.py.
    """
    if stage not in (1, 2):
        return (f"zero_stage={stage}: no updated compute copies to gather" if stage == 0 else
                "zero_stage=3: the parameters are gathered on the device at each fetch")
    if world < 2:
        return "one rank: nothing to gather"
    if params != "none":
        return (f"offload_params={params!r}: the host copy is the source of every page-in, so it is "
                "gathered whole on the host group")
    return None


def speculation_needed(config) -> bool:
    """overlap="backward" with clipping or fp16: updates during backward
    must be speculative (see [Note: speculative updates] in step/speculate.py)."""
    return config.overlap == "backward" and (config.max_grad_norm is not None or config.dtype == "fp16")


def speculation_unsupported(config, world: int) -> Optional[str]:
    """Why speculative updates are not available under ``config`` on
    ``world`` ranks (the updates then wait for ``step()``), or None."""
    if config.offload_optimizer == "none":
        return "offload_optimizer='none' (speculation needs 'host' or 'nvme')"
    return None
