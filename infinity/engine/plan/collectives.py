"""ZeRO's collectives in the step model (step_time.py): which group's link
carries each one and how many bytes this rank sends on it.

[Note: collectives in the step model]
On N > 1 ranks the engine adds, per unit (docs/distributed.md, "What each
rank moves"; the bytes as ``stats()["step_bytes_moved"]`` counts them,
[Note: bytes on the wire] in mechanism/zero.py: what this rank sends as a
ring moves it, (N-1)/N of the buffer per reduce-scatter or all-gather,
twice that per all-reduce):

- after the unit's last backward, its gradients' reduction: stage 0 an
  all-reduce, stages 1-3 a reduce-scatter. Reduced on the device
  (placement's ``reduce_on_device``) the reduction runs first and then only
  the own shard crosses D2H (stage 0: the whole sum, each rank's optimizer
  updates the whole unit); else the full gradients cross first and are
  reduced on the host. The update waits for it;
- stages 1-2, after the unit's update: the all-gather of the updated
  compute copy's trainable range (the next fetch, or the refresh of a
  resident copy, waits); with the parameters on the device (placement's
  ``gather_on_device``) the own shard crosses H2D and the device group
  gathers the rest into the resident copy;
- stage 3, each fetch: the own shard crosses H2D and the unit is
  all-gathered on the device.

Which group carries a collective is :data:`LINK`, one table: a change in the
engine's routing (e.g. stages 0-1 reducing on the device group) is a change
of one row. A collective on a link takes ``latency + bytes sent / bandwidth``
(the profile's ``net_latency_s`` and ``net_bw`` of that link: ``infinity
doctor --profile`` measures a gloo all-reduce between two local processes;
the shipped GPU profiles give data-sheet values). Left out: the gradient
norm's and overflow check's all-reduce of a few bytes, and contention
between the two groups when they share one wire.
"""

from __future__ import annotations

from typing import Dict, Tuple

__all__ = ["LINK", "NET_LINKS", "grad_reduction", "wire_bytes"]

NET_LINKS = ("net_device", "net_host")

# What each collective travels on: "net_device" is the device group (NCCL on
# CUDA; the gloo group itself on the CPU device), "net_host" the host (gloo)
# group ([Note: the host group], [Note: the device group] in mechanism/zero.py).
# Keys: the collective, and for the gradients' reduction whether placement
# reduces them on the device.
LINK: Dict[Tuple[str, bool], str] = {
    ("grad_reduce", True): "net_device",    # several ranks without accumulation: reduced on the device
    ("grad_reduce", False): "net_host",     # accumulation windows, stage 0's host cases: on the host gradients
    ("copy_gather", False): "net_host",     # stages 1-2: the updated host compute copies all-gathered
    ("copy_gather", True): "net_device",    # stages 1-2, parameters on the device: gathered there
    ("param_gather", True): "net_device",   # stage 3: each fetched unit all-gathered on the device
}


def wire_bytes(nbytes: int, world: int, passes: int = 1) -> int:
    """Bytes this rank sends for ``passes`` ring reduce-scatters or all-gathers of an ``nbytes`` buffer."""
    return passes * nbytes * (world - 1) // world


def grad_reduction(stage: int, world: int, on_device: bool, grad_bytes: int) -> Tuple[str, int, int]:
    """``(link, bytes sent, bytes crossing D2H)`` of one unit's gradient
    reduction (``grad_bytes``: its full gradients in the host dtype)."""
    sent = wire_bytes(grad_bytes, world, passes=2 if stage == 0 else 1)  # stage 0: an all-reduce
    down = grad_bytes // world if on_device and stage > 0 else grad_bytes  # stage 0 brings the whole sum down
    return LINK[("grad_reduce", on_device)], sent, down
