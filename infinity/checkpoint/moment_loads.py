"""A checkpoint's Adam moments in another dtype than fp32, or into a run of
another ``moment_dtype``.

[Note: moments in their own dtype]
A checkpoint keeps the moments as the run stored them (the manifest's
``moment_dtype``; save.py says what each holds), so a resumed run of the same
``moment_dtype`` continues bit for bit: bf16 moments and int8 codes with
their scales are copied into the tiers as they are, never decoded and
encoded again. A checkpoint loaded into a run of another ``moment_dtype`` is
converted through fp32 (int8 decoded as ``CPUAdamW.state_dict`` does, then
stored as the run keeps them), with one warning naming both. fp32 moments go
through the staged loads of unit_loads.py, as before.

The master is kept in the run's ``master_dtype`` (the manifest's) with the
bf16 master's rounding seed (``master_seed``): a resumed run of the same
``master_dtype`` takes the checkpoint's seed and continues bit for bit (the
rounding's other inputs, the step counts, are in the checkpoint too). A
checkpoint loaded into a run of the other ``master_dtype`` is converted
(bf16 to fp32 exactly; fp32 to bf16 rounded to nearest even), with one
warning naming both; the run keeps its own seed then.
"""

from __future__ import annotations

import os
import warnings

import torch

from ..engine.plan.opt_kinds import QBLOCK, kind_dtype, kind_numel
from ..optim import moments as qmoments
from .safe_files import CorruptCheckpointError
from .safetensors_io import record_dtype

__all__ = ["checkpoint_moment_dtype", "warn_if_converted", "load_moments", "checkpoint_master_dtype",
           "warn_if_master_converted", "restore_master_seed"]

_MASTER_DTYPES = ("fp32", "bf16")


def checkpoint_master_dtype(ckpt: str, m: dict) -> str:
    """The manifest's ``master_dtype`` ("fp32" for checkpoints from before it was recorded)."""
    md = m.get("master_dtype", "fp32")
    seed = m.get("master_seed", 0)
    if md not in _MASTER_DTYPES or isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 1 << 64:
        raise CorruptCheckpointError(f"{os.path.join(ckpt, 'manifest.json')}: master_dtype={md!r} (one of "
                                     f"{list(_MASTER_DTYPES)}) or master_seed={seed!r} (an int in [0, 2**64)) "
                                     "is wrong; nothing was loaded")
    return md


def warn_if_master_converted(ckpt: str, ckpt_md: str, run_md: str) -> None:
    """One warning where the checkpoint's master is converted to the run's Config.master_dtype."""
    if ckpt_md != run_md:
        warnings.warn(f"load_checkpoint({ckpt!r}): the checkpoint's master weights are master_dtype={ckpt_md!r}, "
                      f"this run keeps Config.master_dtype={run_md!r}: they are converted as they load "
                      f"({'exactly' if run_md == 'fp32' else 'rounded to nearest even'}), and the run keeps its "
                      "own rounding seed", RuntimeWarning, stacklevel=3)


def restore_master_seed(optimizer, m: dict, ckpt_md: str, run_md: str) -> None:
    """A bf16 master's rounding seed from a checkpoint of a bf16 master (a resume draws the same rounding)."""
    if ckpt_md == run_md == "bf16":
        optimizer.updater.master_seed = int(m.get("master_seed", 0))


def checkpoint_moment_dtype(ckpt: str, m: dict) -> str:
    """The manifest's ``moment_dtype`` ("fp32" for checkpoints from before it was recorded)."""
    md = m.get("moment_dtype", "fp32")
    if md not in qmoments.MOMENT_DTYPES:
        raise CorruptCheckpointError(f"{os.path.join(ckpt, 'manifest.json')}: moment_dtype={md!r} is not one of "
                                     f"{list(qmoments.MOMENT_DTYPES)}; nothing was loaded")
    return md


def warn_if_converted(ckpt: str, ckpt_md: str, run_md: str) -> None:
    """One warning where the checkpoint's moments are converted to the run's dtype."""
    if ckpt_md != run_md:
        warnings.warn(f"load_checkpoint({ckpt!r}): the checkpoint's Adam moments are moment_dtype={ckpt_md!r}, this "
                      f"run keeps moment_dtype={run_md!r}: they are converted (through fp32) as they load",
                      RuntimeWarning, stacklevel=3)


def load_moments(eng, u, plan, m: dict, files, ckpt_md: str) -> None:
    """``u``'s moments from a checkpoint of ``ckpt_md`` moments (not fp32) into its
    tiers: as stored when the run's dtype is the same, else converted (see
    [Note: moments in their own dtype]). A tensor the checkpoint lacks
    (strict=False) loads as zeros."""
    tensors, run_md, tn = m["tensors"], eng.modes.moment_dtype, u.place.trainable_numel
    slots = u.layout.trainable_slots

    def rec_of(kind, s):
        rec = tensors.get(f"{kind}.{plan.names[id(s.param)]}")
        if rec is not None and record_dtype(rec) != kind_dtype(kind, ckpt_md):
            raise CorruptCheckpointError(f"{files.ckpt}: {kind}.{plan.names[id(s.param)]} is "
                                         f"{record_dtype(rec)}, but the manifest's moment_dtype={ckpt_md!r} keeps it "
                                         f"as {kind_dtype(kind, ckpt_md)}")
        return rec

    def read(kind, s) -> torch.Tensor:
        rec = rec_of(kind, s)
        n = kind_numel(kind, s.numel)
        if rec is None:
            return torch.zeros(n, dtype=kind_dtype(kind, ckpt_md))
        return files.read(rec, record_dtype(rec), rec["shape"]).reshape(-1)

    def stored(kind) -> torch.Tensor:
        full = torch.zeros(kind_numel(kind, tn), dtype=kind_dtype(kind, run_md))
        for s in slots:
            a = s.offset // QBLOCK if kind.endswith("_scale") else s.offset  # slots start on a block
            x = read(kind, s)
            full[a:a + x.numel()] = x
        return full

    def converted(kind) -> torch.Tensor:
        full = torch.zeros(tn, dtype=torch.float32)
        for s in slots:
            x = read(kind, s)
            if ckpt_md == "int8":
                w = qmoments.dequantize(x, read(kind + "_scale", s), signed=kind == "exp_avg")
                x = w if kind == "exp_avg" else w * w  # exp_avg_sq is kept as codes of its square root
            full[s.offset:s.offset + s.numel] = x.float()
        return full

    if run_md == ckpt_md:
        eng.optstate.write_moments_from(u, stored, stored=True)
    else:
        eng.optstate.write_moments_from(u, converted)
