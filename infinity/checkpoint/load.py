"""``load_checkpoint`` and ``verify_checkpoint``.

Everything that can be checked without reading the tensors is checked before
anything changes: the manifest, every name and shape against the model, the
param groups, each file's presence and size. Then the tensors are read unit
by unit (one unit's buffer at a time), each checked against its CRC32C as it
is read, and written into whichever tier holds the unit now: a checkpoint
loads at any world size, ZeRO stage and placement. A tensor that fails its
check then fails the engine (see [Note: a run is consistent or it says so]):
a half-loaded run is never served.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Dict, Optional

import torch

from . import layout, rng
from .plan import Plan, plan_checkpoint
from .direct_stream import DirectReader
from .safetensors_io import (CorruptCheckpointError, TensorRead, read_header, read_tensor, record_dtype, start_range,
                             start_tensor)
from .unit_loads import UnitLoads

__all__ = ["load_checkpoint", "verify_checkpoint", "read_manifest"]


def read_manifest(path: str) -> dict:
    """The manifest of the checkpoint at ``path`` (a checkpoint folder)."""
    mpath = os.path.join(path, layout.MANIFEST)
    try:
        with open(mpath) as f:
            m = json.load(f)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{mpath}: missing; {path!r} is not a complete checkpoint") from None
    except ValueError as e:
        raise CorruptCheckpointError(f"{mpath}: not valid JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != "infinity-checkpoint":
        raise CorruptCheckpointError(f"{mpath}: not an infinity checkpoint manifest")
    if m.get("version") != layout.FORMAT_VERSION:
        raise CorruptCheckpointError(f"{mpath}: format version {m.get('version')}; this infinity reads version "
                                     f"{layout.FORMAT_VERSION}")
    return m


def load_checkpoint(path, model, optimizer, *, lr_scheduler=None, strict: bool = True) -> Optional[dict]:
    """Loads the checkpoint at ``path`` (a ``step-<N>`` folder, or the newest
    complete one under a checkpoint folder) into a model and optimizer from
    ``infinity.initialize``, at any world size, stage and placement; returns
    the ``extra`` dict given to :func:`save_checkpoint`.

    Restores parameters (fp32 masters; frozen ones' compute copies), buffers,
    Adam moments and step counts, the param groups' hyper-parameters, the LR
    scheduler, the fp16 loss scaler and the RNG states: training continues
    exactly as the saved run would have. ``strict=False`` skips names one side
    lacks and says which in a RuntimeWarning (the model's names that kept
    their values, the checkpoint's that were not loaded).

    Raises:
        FileNotFoundError: no complete checkpoint at ``path``.
        CorruptCheckpointError: a file missing, truncated or failing its CRC32C
            (file, tensor and offset named).
        KeyError / ValueError: names or shapes that do not match the model
            (nothing was changed then).
    """
    from ..api import engine_of
    from .background import wait_pending
    eng = engine_of(model)
    wait_pending(eng)  # a background save finishes first (it may be the checkpoint asked for)
    ckpt = layout.resolve(path)
    m = read_manifest(ckpt)
    if optimizer is not eng.optimizer:
        raise ValueError("load_checkpoint: optimizer is not the one infinity.initialize returned for this model")
    optimizer.flush()
    eng.faults.check("infinity.load_checkpoint()")
    plan = plan_checkpoint(model, eng, exclude_frozen=bool(m.get("exclude_frozen")))
    plan.check_between_steps("load_checkpoint")
    _check_names_and_shapes(ckpt, m, plan, strict)
    _check_groups(m, plan, optimizer, strict)
    _check_files(ckpt, m)
    with eng.faults.guard(f"infinity.load_checkpoint({ckpt!r})"), ManifestFiles(ckpt) as files:
        with UnitLoads(eng, plan, m, files) as loads:  # [Note: staged unit loads]
            for staged in loads:
                loads.scratch.reset()
                _write_unit(eng, staged, plan, m, loads.scratch)
        for key, b in plan.buffers.items():
            rec = m["tensors"].get(key)
            if rec is not None:
                with torch.no_grad():
                    b.copy_(files.read(rec, record_dtype(rec), b.shape))
    _load_small_state(m, eng, optimizer, lr_scheduler)
    return m.get("extra")


def _check_names_and_shapes(ckpt: str, m: dict, plan: Plan, strict: bool) -> None:
    tensors = m.get("tensors", {})
    want = {name: shape for name, _, shape, _ in plan.model_items + plan.optim_items}
    missing = sorted(set(want) - set(tensors))
    unexpected = sorted(set(tensors) - set(want))
    if strict and (missing or unexpected):
        raise KeyError(f"load_checkpoint: {ckpt!r} does not match the model: {len(missing)} tensor(s) the model has "
                       f"are missing ({missing[:6]}), {len(unexpected)} the model lacks ({unexpected[:6]}); "
                       "strict=False loads the names both have")
    if missing or unexpected:
        warnings.warn(f"load_checkpoint(strict=False) from {ckpt!r}: {len(missing)} tensor(s) of the model are not "
                      f"in the checkpoint and keep their current values ({missing[:8]}"
                      f"{', ...' if len(missing) > 8 else ''}); {len(unexpected)} in the checkpoint are not in the "
                      f"model and were not loaded ({unexpected[:8]}{', ...' if len(unexpected) > 8 else ''})",
                      RuntimeWarning, stacklevel=3)
    for name, shape in want.items():
        rec = tensors.get(name)
        if rec is not None and tuple(rec["shape"]) != tuple(shape):
            raise ValueError(f"load_checkpoint: {name!r} is {tuple(rec['shape'])} in {ckpt!r}, {tuple(shape)} in the "
                             "model; nothing was loaded")


def _check_groups(m: dict, plan: Plan, optimizer, strict: bool) -> None:
    saved = m.get("param_groups", [])
    mine = plan.param_groups(optimizer)
    if strict:
        differ = any(set(a["params"]) != set(b["params"]) for a, b in zip(saved, mine))
    else:  # the names both have sit in the same group on both sides
        theirs = {n: gi for gi, g in enumerate(saved) for n in g["params"]}
        differ = any(theirs.get(n, gi) != gi for gi, g in enumerate(mine) for n in g["params"])
    if len(saved) != len(mine) or differ:
        raise ValueError(f"load_checkpoint: the checkpoint has {len(saved)} param group(s) of sizes "
                         f"{[len(g['params']) for g in saved]}, this optimizer {len(mine)} of sizes "
                         f"{[len(g['params']) for g in mine]} (or other parameters in them); nothing was loaded")


def _check_files(ckpt: str, m: dict) -> None:
    for fname, size in m.get("files", {}).items():
        p = os.path.join(ckpt, fname)
        try:
            got = os.path.getsize(p)
        except FileNotFoundError:
            raise CorruptCheckpointError(f"{p}: missing (the manifest names it); nothing was loaded") from None
        if got != size:
            raise CorruptCheckpointError(f"{p}: {got} bytes, the manifest says {size} (truncated or replaced); "
                                         "nothing was loaded")
    for name, rec in m.get("tensors", {}).items():
        if rec.get("file") not in m.get("files", {}):
            raise CorruptCheckpointError(f"{ckpt}: tensor {name!r} is in file {rec.get('file')!r}, which the manifest "
                                         "does not list; nothing was loaded")


class ManifestFiles:
    """The checkpoint's files, each opened once."""

    def __init__(self, ckpt: str):
        self.ckpt = ckpt
        self._open: Dict[str, object] = {}

    def __enter__(self) -> "ManifestFiles":
        return self

    def __exit__(self, *exc) -> None:
        for f in self._open.values():
            f.close()

    def _reader(self, fname: str) -> DirectReader:
        f = self._open.get(fname)
        if f is None:
            f = self._open[fname] = DirectReader(os.path.join(self.ckpt, fname))
        return f

    def read(self, rec: dict, dtype: torch.dtype, shape, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """A tensor, read ahead (for reading a file front to back) and checked."""
        return read_tensor(self._reader(rec["file"]), os.path.join(self.ckpt, rec["file"]), rec, dtype, shape, out)

    def start(self, rec: dict, dtype: torch.dtype, shape, out: torch.Tensor) -> TensorRead:
        """A tensor's read into ``out`` started (safetensors_io.start_tensor): ``wait()`` checks it."""
        return start_tensor(self._reader(rec["file"]), os.path.join(self.ckpt, rec["file"]), rec, dtype, shape, out)

    def start_range(self, rec: dict, dtype: torch.dtype, start: int, stop: int, out: torch.Tensor):
        """Elements ``start:stop`` of a tensor into ``out``, reading only the
        chunks they touch (safetensors_io.start_range): ``wait()`` checks them."""
        return start_range(self._reader(rec["file"]), os.path.join(self.ckpt, rec["file"]), rec, dtype, start, stop,
                           out)


def _write_unit(eng, staged, plan: Plan, m: dict, scratch) -> None:
    """One unit's values (master or compute copy), moments and step counts into its tiers."""
    u = staged.u
    if staged.values:
        eng.values.write(u, staged.values, scratch)
    if not u.place.trainable:
        return
    eng.optstate.write_moments_from(u, staged.moment)
    steps = m.get("param_steps", {})
    for s in u.layout.trainable_slots:
        s.step = int(steps.get(plan.names[id(s.param)], s.step))


def _load_small_state(m: dict, eng, optimizer, lr_scheduler) -> None:
    """Hyper-parameters, loss scaler, LR scheduler and this rank's RNG states."""
    for g, saved in zip(optimizer.param_groups, m.get("param_groups", [])):
        for k, v in saved.items():
            if k != "params":
                g[k] = tuple(v) if k == "betas" else v
    scaler = m.get("loss_scaler") or {}
    if "loss_scale" in scaler:
        optimizer.scaling.loss_scale = float(scaler["loss_scale"])
        optimizer.scaling.good_steps = int(scaler.get("good_steps", 0))
    if lr_scheduler is not None:
        if m.get("lr_scheduler") is None:
            raise ValueError("load_checkpoint: an lr_scheduler was given but the checkpoint holds no scheduler state")
        lr_scheduler.load_state_dict(m["lr_scheduler"])
    states = m.get("rng") or {}
    rng.restore(states.get(str(eng.sharding.global_rank), states.get("0")))


def verify_checkpoint(path) -> dict:
    """Checks every tensor of the checkpoint at ``path`` (or the newest under
    it) against its CRC32C and each file's header against the manifest,
    reading one tensor at a time; returns ``{"path", "step", "tensors",
    "bytes"}`` or raises :class:`CorruptCheckpointError` naming file, tensor
    and offset."""
    ckpt = layout.resolve(path)
    m = read_manifest(ckpt)
    _check_files(ckpt, m)
    headers = {f: read_header(os.path.join(ckpt, f)) for f in m.get("files", {})}
    total = 0
    with ManifestFiles(ckpt) as files:
        for name, rec in sorted(m["tensors"].items(), key=lambda kv: (kv[1]["file"], kv[1]["offset"])):
            header, start = headers[rec["file"]]
            h = header.get(name)
            if h is None or start + h["data_offsets"][0] != rec["offset"] or list(h["shape"]) != list(rec["shape"]):
                raise CorruptCheckpointError(f"{os.path.join(ckpt, rec['file'])}: header entry of {name!r} "
                                             "disagrees with the manifest")
            files.read(rec, record_dtype(rec), rec["shape"])
            total += rec["length"]
    return {"path": ckpt, "step": m.get("step"), "tensors": len(m["tensors"]), "bytes": total}
