"""The buffers of a unit's optimizer state under ``Config.moment_dtype``:
their kinds, dtypes, sizes and bytes, decided once. Pure.

[Note: low-bit moments in the engine]
With ``moment_dtype="bf16"`` the moments are bf16 buffers of the state's
numel; with ``"int8"`` they are uint8 codes (exp_avg signed, exp_avg_sq as
codes of its square root) plus an fp32 scale per QBLOCK (256) elements
(``exp_avg_scale``, ``exp_avg_sq_scale``): see infinity/optim/moments.py.
The native kernel numbers blocks from the start of each range it is given,
so every range the engine hands it must start on a block of the unit's
buffer: each trainable slot starts on a multiple of QBLOCK (``slot_align``),
and ``trainable_numel`` is padded to QBLOCK x world so every ZeRO shard
starts on a block too. Padding is zero in every buffer (code 0 is 0.0) and
stays zero under the update, so a block never mixes two parameters and the
bytes are the same whatever the placement (host, NVMe), the run of slots
updated together, or the shard a block falls in. The master is fp32, or
bf16 under ``Config.master_dtype="bf16"`` ([Note: a bf16 master in the engine]
in step/update.py); every function here takes that as ``master_dtype``.
"""

from __future__ import annotations

from typing import Tuple

import torch

from ...optim.moments import QBLOCK, num_blocks

__all__ = ["MASTER_KINDS", "state_kinds", "kind_dtype", "kind_numel", "state_bytes", "slot_align", "QBLOCK",
           "scale_kind"]

MASTER_KINDS = ("master", "exp_avg", "exp_avg_sq")  # the kinds of fp32 and bf16 moments
_SCALES = ("exp_avg_scale", "exp_avg_sq_scale")
_MOMENT = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}
_MASTER = {"fp32": torch.float32, "bf16": torch.bfloat16}


def state_kinds(moment_dtype: str) -> Tuple[str, ...]:
    """The buffers of one unit's optimizer state, master first; int8 adds the two scale buffers."""
    return MASTER_KINDS + (_SCALES if moment_dtype == "int8" else ())


def scale_kind(kind: str) -> str:
    """The scale buffer of moment ``kind`` ("exp_avg" -> "exp_avg_scale")."""
    return kind + "_scale"


def kind_dtype(kind: str, moment_dtype: str, master_dtype: str = "fp32") -> torch.dtype:
    """dtype of the ``kind`` buffer: the master's (``master_dtype``), fp32 for the scales, else the moments' own."""
    if kind == "master":
        return _MASTER[master_dtype]
    if kind in _SCALES:
        return torch.float32
    return _MOMENT[moment_dtype]


def kind_numel(kind: str, numel: int) -> int:
    """Elements of the ``kind`` buffer of a state of ``numel`` elements (a scale per block for the scales)."""
    return num_blocks(numel) if kind in _SCALES else numel


def state_bytes(numel: int, moment_dtype: str, master: bool = True, master_dtype: str = "fp32") -> int:
    """Bytes of master (unless ``master=False``; ``master_dtype``), moments and scales of a state of ``numel`` elements."""
    kinds = state_kinds(moment_dtype)[0 if master else 1:]
    return sum(kind_numel(k, numel) * torch.empty((), dtype=kind_dtype(k, moment_dtype, master_dtype)).element_size()
               for k in kinds)


def slot_align(moment_dtype: str) -> int:
    """Elements each trainable slot (and every ZeRO shard) starts on: a whole block for int8, else 0 (the default)."""
    return QBLOCK if moment_dtype == "int8" else 0
