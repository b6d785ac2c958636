"""The run's memory floor, checked against the process's memory cgroup limit
at ``initialize``.

[Note: the memory floor]
A process over its memory cgroup's limit is killed by the kernel (SIGKILL,
no message), and a run whose own floor is above the limit always is: under
a limit of 300 MiB a 3M-parameter run on a CPU died during step 1. Its host
budget does not save it: that is sized from what is left (80% of the
headroom), but the interpreter, torch, the runtime's threads and buffers
and, on a CPU "device", the device tier all live in the same RSS. So before
any tier is allocated ``initialize`` compares the cgroup's limit with the
RSS the run needs at its smallest budgets, the estimator's sum
(plan/estimator.py) with the minimums put in:

    floor = base + max(host pool minimum + NVMe staging + runtime
                         + device tier minimum (CPU only),
                       model tensors + host pool minimum)

where ``base`` is this process's RSS now less the model's tensors in RAM
(they are replaced by the tiers' copies, and while initialize copies them
both exist: the second term). Activations are left out (unknown before a
forward), so the floor is a lower bound: below it the run cannot live, and
it is refused with :class:`MemoryLimitError` naming the limit, where it was
read, the floor and its parts. Above it the pressure monitor ([Note: memory
pressure]) takes over. No limit (or none readable): no check.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch.nn as nn

from ...system import sysinfo
from ..mechanism.tiers import BudgetError
from ..plan.estimator import RUNTIME_BYTES

__all__ = ["MemoryLimitError", "memory_floor", "check_memory_floor"]


class MemoryLimitError(BudgetError):
    """The memory cgroup's limit is below the run's memory floor ([Note: the
    memory floor]); raised by ``initialize`` before anything is allocated."""


def _model_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers resident in RAM now (each storage once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_meta or t.device.type != "cpu":
            continue
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total


def memory_floor(model: nn.Module, host_min: int, device_min: int, on_cpu: bool, staging: int,
                 rss: Optional[int] = None) -> Dict[str, int]:
    """The parts of the run's memory floor (bytes; see [Note: the memory
    floor]) and their ``floor``: ``host_min`` is the host pool's minimum,
    ``device_min`` the device tier's (in RAM when ``on_cpu``), ``staging`` the
    NVMe staging buffers, ``rss`` this process's RSS now (default: read)."""
    model_bytes = _model_bytes(model)
    now = sysinfo.rss_bytes() if rss is None else rss
    base = max(0, now - model_bytes)
    dev = device_min if on_cpu else 0
    training = host_min + staging + RUNTIME_BYTES + dev
    at_init = model_bytes + host_min
    return {"base": base, "model": model_bytes, "host_pool": host_min, "staging": staging, "runtime": RUNTIME_BYTES,
            "device_tier": dev, "floor": base + max(training, at_init)}


def check_memory_floor(model: nn.Module, host_min: int, device_min: int, on_cpu: bool, staging: int) -> None:
    """Raises :class:`MemoryLimitError` when this process's memory cgroup
    limit (bytes) is below :func:`memory_floor`; does nothing without a limit."""
    lim = sysinfo.cgroup_limit()
    if lim is None:
        return
    f = memory_floor(model, host_min, device_min, on_cpu, staging)
    if lim.limit >= f["floor"]:
        return
    from ...config.runtime import format_bytes as fb
    raise MemoryLimitError(
        f"memory limit: this process's cgroup limit is {lim.limit} bytes ({fb(lim.limit)}, {lim.path}), below the "
        f"{f['floor']} bytes ({fb(f['floor'])}) this run needs at its smallest budgets: {fb(f['base'])} of "
        f"interpreter and libraries now, then the larger of training (host pool minimum {fb(f['host_pool'])}, "
        f"NVMe staging {fb(f['staging'])}, runtime {fb(f['runtime'])}"
        + (f", device tier minimum in RAM {fb(f['device_tier'])}" if on_cpu else "")
        + f") and initialize's copy (the model's tensors {fb(f['model'])} beside the host pool); activations "
          "come on top. The kernel would kill it during the first step, without a message. Raise the limit to "
          f"at least {f['floor']} bytes (docker --memory, systemd MemoryMax=, the job's memory request), or "
          "train a smaller model")
