"""``load_checkpoint`` and ``verify_checkpoint``.

[Note: a load is all or nothing]
A load either changes nothing or, once it has begun to write, completes or
fails the engine: a run that mixes two states is never served. Before the
first byte is written into the engine, everything that can be checked
without the tensors is: the manifest's every field (manifest.py: types and
ranges, offsets inside the files), every name and shape against the model,
the param groups (their parameters, and each hyper-parameter of the kind
this optimizer's is and in range: optim.functional.group_hyper), the LR
scheduler's presence on both sides and its state's keys, this rank's RNG
states' shapes (rng.check), and each file's presence, kind and size. A
problem there raises (CorruptCheckpointError, ValueError, KeyError) and
nothing has changed. Then, under the engine's fault guard, the tensors are
read unit by unit (one unit's buffer at a time), each checked against its
CRC32C as it is read, and written into whichever tier holds the unit now (a
checkpoint loads at any world size, ZeRO stage and placement), then the
buffers, the hyper-parameters, the loss scaler, the scheduler and the RNG.
Any error from there on (a corrupt tensor, a failing disk, a scheduler that
refuses its state) fails the engine (see [Note: a run is consistent or it
says so]): later calls raise EngineFailedError; reload into a fresh
``initialize``.
"""

from __future__ import annotations

import os
import warnings
from typing import Dict, Optional, Tuple

import torch

from ..optim.functional import group_hyper
from .moment_loads import (checkpoint_master_dtype, checkpoint_moment_dtype, load_moments, restore_master_seed,
                           warn_if_converted, warn_if_master_converted)
from . import layout, owner, rng
from .plan import Plan, plan_checkpoint
from .direct_stream import DirectReader
from .manifest import check_files, finite_number, read_manifest
from .safe_files import open_member
from .safetensors_io import (CorruptCheckpointError, TensorRead, read_header, read_tensor, record_dtype, start_range,
                             start_tensor)
from .unit_loads import UnitLoads

__all__ = ["load_checkpoint", "verify_checkpoint", "read_manifest", "pick_checkpoint"]


def load_checkpoint(path, model, optimizer, *, lr_scheduler=None, strict: bool = True) -> Optional[dict]:
    """Loads the checkpoint at ``path`` (a ``step-<N>`` folder, or the newest
    complete one under a checkpoint folder) into a model and optimizer from
    ``infinity.initialize``, at any world size, stage and placement; returns
    the ``extra`` dict given to :func:`save_checkpoint`.

    Restores parameters (masters, converted to ``Config.master_dtype`` with
    a warning where the checkpoint's differs; frozen ones' compute copies), buffers,
    Adam moments and step counts, the param groups' hyper-parameters, the LR
    scheduler, the fp16 loss scaler and the RNG states: training continues
    exactly as the saved run would have. ``strict=False`` skips names one side
    lacks and says which in a RuntimeWarning (the model's names that kept
    their values, the checkpoint's that were not loaded), and loads a
    checkpoint holding scheduler state without ``lr_scheduler`` (warned).
    See [Note: a load is all or nothing].

    Raises:
        FileNotFoundError: no complete checkpoint at ``path``.
        UsageError: the checkpoint folder is not ours or others may write it.
        CorruptCheckpointError: a malformed manifest, a file missing,
            truncated or failing its CRC32C (file, field, tensor and offset named).
        KeyError / ValueError: names, shapes, param groups or scheduler
            presence that do not match (nothing was changed then).
        EngineFailedError (later calls): a failure after the first write.
    """
    from ..api import engine_of
    from .background import wait_pending
    eng = engine_of(model)
    wait_pending(eng)  # a background save finishes first (it may be the checkpoint asked for)
    if optimizer is not eng.optimizer:
        raise ValueError("load_checkpoint: optimizer is not the one infinity.initialize returned for this model")
    owner.check_root(os.fspath(path), "load_checkpoint")
    ckpt, m = pick_checkpoint(path)
    optimizer.flush()
    eng.faults.check("infinity.load_checkpoint()")
    plan = plan_checkpoint(model, eng, exclude_frozen=bool(m.get("exclude_frozen")))
    plan.check_between_steps("load_checkpoint")
    ckpt_md, ckpt_master = checkpoint_moment_dtype(ckpt, m), checkpoint_master_dtype(ckpt, m)
    _check_names_and_shapes(ckpt, m, plan, strict, ckpt_md)
    _check_groups(m, plan, optimizer, strict)
    _check_scheduler(ckpt, m, lr_scheduler, strict)
    states = m.get("rng") or {}
    own_rng = states.get(str(eng.sharding.global_rank), states.get("0"))
    rng.check(own_rng, f"{os.path.join(ckpt, layout.MANIFEST)}: rng")
    # [Note: a load is all or nothing] Nothing has changed up to here; from
    # here on, an error fails the engine.
    warn_if_converted(ckpt, ckpt_md, eng.modes.moment_dtype)
    warn_if_master_converted(ckpt, ckpt_master, eng.modes.master_dtype)
    with eng.faults.guard(f"infinity.load_checkpoint({ckpt!r})"):
        _load_tensors(eng, ckpt, m, plan, ckpt_md)
        _load_small_state(m, optimizer, lr_scheduler, own_rng)
        restore_master_seed(optimizer, m, ckpt_master, eng.modes.master_dtype)
    return m.get("extra")


def pick_checkpoint(path) -> Tuple[str, dict]:
    """The checkpoint ``path`` names, or the newest whole one under it, and
    its checked manifest. Under a checkpoint folder, a newest one whose
    manifest or file sizes are wrong is skipped with a RuntimeWarning saying
    why and which one is loaded instead; none whole: CorruptCheckpointError
    naming why each was skipped."""
    path = os.fspath(path)
    if layout.is_checkpoint(path):
        m = read_manifest(path)
        check_files(path, m)
        return path, m
    found = [p for _, p in reversed(layout.complete_checkpoints(path))]
    if not found:
        raise layout.no_checkpoint(path)
    skipped = []
    for ckpt in found:
        try:
            m = read_manifest(ckpt)
            check_files(ckpt, m)
        except CorruptCheckpointError as e:
            skipped.append(f"{os.path.basename(ckpt)}: {e}")
            continue
        if skipped:
            warnings.warn(f"load_checkpoint: loading {ckpt}, the newest whole checkpoint in {path!r}; newer ones "
                          f"were skipped: {'; '.join(skipped)}", RuntimeWarning, stacklevel=3)
        return ckpt, m
    raise CorruptCheckpointError(f"load_checkpoint: no whole checkpoint in {path!r}: {'; '.join(skipped)}; "
                                 "nothing was loaded")


def _load_tensors(eng, ckpt: str, m: dict, plan: Plan, ckpt_md: str) -> None:
    """Every unit's values, moments and step counts, then the buffers (under the engine's guard)."""
    with ManifestFiles(ckpt) as files:
        # [Note: staged unit loads]; moments other than fp32: [Note: moments in their own dtype]
        with UnitLoads(eng, plan, m, files, moments=ckpt_md == "fp32") as loads:
            for staged in loads:
                loads.scratch.reset()
                _write_unit(eng, staged, plan, m, loads.scratch,
                            None if ckpt_md == "fp32" else lambda u: load_moments(eng, u, plan, m, files, ckpt_md))
        for key, b in plan.buffers.items():
            rec = m["tensors"].get(key)
            if rec is not None:
                with torch.no_grad():
                    b.copy_(files.read(rec, record_dtype(rec), b.shape))


def _check_names_and_shapes(ckpt: str, m: dict, plan: Plan, strict: bool, ckpt_md: str) -> None:
    tensors = m.get("tensors", {})
    want = {name: shape for name, _, shape, _ in plan.model_items}
    want.update(plan.moment_shapes(ckpt_md))  # the checkpoint's moments, whatever this run keeps
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
    for gi, (g, theirs) in enumerate(zip(optimizer.param_groups, saved)):
        for k, v in theirs.items():
            if k != "params" and not _same_kind(g.get(k), v, k):
                raise ValueError(f"load_checkpoint: param_groups[{gi}][{k!r}] in the checkpoint is not of the kind "
                                 "this optimizer's is (a number, bool, string or a list of two betas); nothing was "
                                 "loaded")
        _check_hyper(gi, g, theirs)


def _merged(g: dict, theirs: dict, keys) -> dict:
    out = {k: v for k, v in g.items() if k != "params"}
    out.update((k, tuple(theirs[k]) if k == "betas" else theirs[k]) for k in keys)
    return out


def _check_hyper(gi: int, g: dict, theirs: dict) -> None:
    """The group ``g`` with the saved hyper-parameters ``theirs`` is one
    infinity runs (optim.functional.group_hyper); else ValueError naming the
    keys at fault (not their values: they come from the checkpoint)."""
    keys = [k for k in theirs if k != "params"]
    try:
        group_hyper(_merged(g, theirs, keys))
    except ValueError:
        bad = []
        for k in keys:
            try:
                group_hyper(_merged(g, theirs, [k]))
            except ValueError:
                bad.append(k)
        raise ValueError(f"load_checkpoint: param_groups[{gi}] of the checkpoint: {bad or keys} out of range or an "
                         "option infinity does not run (docs/config.md lists the keys); nothing was loaded") from None


def _same_kind(mine, theirs, key: str) -> bool:
    """Whether a saved hyper-parameter ``theirs`` (manifest-checked) may replace ``mine``."""
    if key == "betas" or isinstance(mine, (tuple, list)):
        n = len(mine) if isinstance(mine, (tuple, list)) else 2
        return isinstance(theirs, list) and len(theirs) == n
    if isinstance(mine, bool):
        return isinstance(theirs, bool)
    if isinstance(mine, (int, float, torch.Tensor)):
        return finite_number(theirs)
    if isinstance(mine, str):
        return isinstance(theirs, str)
    return mine is None or theirs is None or not isinstance(theirs, list)


def _check_scheduler(ckpt: str, m: dict, lr_scheduler, strict: bool) -> None:
    """A scheduler given iff the checkpoint holds one's state, with the same keys."""
    saved = m.get("lr_scheduler")
    if lr_scheduler is not None and saved is None:
        raise ValueError(f"load_checkpoint: an lr_scheduler was given but {ckpt!r} was saved without one (no "
                         "scheduler state); pass lr_scheduler=None, or resume from a checkpoint saved with "
                         "save_checkpoint(..., lr_scheduler=...); nothing was loaded")
    if lr_scheduler is None and saved is not None:
        msg = (f"load_checkpoint: {ckpt!r} holds an LR scheduler's state but no lr_scheduler was given, so the "
               "schedule would restart")
        if strict:
            raise ValueError(f"{msg}; pass lr_scheduler=<your scheduler> (or strict=False to drop its state); "
                             "nothing was loaded")
        warnings.warn(f"{msg} (strict=False: its state is not loaded)", RuntimeWarning, stacklevel=3)
    if lr_scheduler is not None:
        mine = set(lr_scheduler.state_dict())
        if set(saved) != mine:
            raise ValueError(f"load_checkpoint: the scheduler state in {ckpt!r} has other keys than this "
                             f"lr_scheduler's ({sorted(mine)[:8]}): another kind of scheduler; nothing was loaded")


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
            fd, _ = open_member(self.ckpt, fname)  # [Note: a checkpoint is input from someone else]
            f = self._open[fname] = DirectReader(os.path.join(self.ckpt, fname), fd)
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


def _write_unit(eng, staged, plan: Plan, m: dict, scratch, moments=None) -> None:
    """One unit's values (master or compute copy), moments and step counts
    into its tiers; ``moments(u)`` loads the moments where they are not
    staged (not fp32 in the checkpoint)."""
    u = staged.u
    if staged.values:
        eng.values.write(u, staged.values, scratch)
    if not u.place.trainable:
        return
    if moments is not None:
        moments(u)
    else:
        eng.optstate.write_moments_from(u, staged.moment)
    steps = m.get("param_steps", {})
    for s in u.layout.trainable_slots:
        s.step = int(steps.get(plan.names[id(s.param)], s.step))


def _load_small_state(m: dict, optimizer, lr_scheduler, own_rng) -> None:
    """Hyper-parameters, loss scaler, LR scheduler and this rank's RNG states (all checked before)."""
    for g, saved in zip(optimizer.param_groups, m.get("param_groups", [])):
        for k, v in saved.items():
            if k != "params":
                g[k] = tuple(v) if k == "betas" else v
    scaler = m.get("loss_scaler") or {}
    if "loss_scale" in scaler:
        optimizer.scaling.loss_scale = float(scaler["loss_scale"])
        optimizer.scaling.good_steps = int(scaler.get("good_steps", 0))
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(m["lr_scheduler"])
    rng.restore(own_rng)


def verify_checkpoint(path) -> dict:
    """Checks every tensor of the checkpoint at ``path`` (or the newest under
    it) against its CRC32C and each file's header against the manifest,
    reading one tensor at a time; returns ``{"path", "step", "tensors",
    "bytes"}`` or raises :class:`CorruptCheckpointError` naming file, tensor
    and offset."""
    ckpt = layout.resolve(path)
    m = read_manifest(ckpt)
    check_files(ckpt, m)
    headers = {f: read_header(ckpt, f) for f in m["files"]}
    total = 0
    with ManifestFiles(ckpt) as files:
        for name, rec in sorted(m["tensors"].items(), key=lambda kv: (kv[1]["file"], kv[1]["offset"])):
            header, start = headers[rec["file"]]
            if not _header_agrees(header.get(name), start, rec):
                raise CorruptCheckpointError(f"{os.path.join(ckpt, rec['file'])}: header entry of {name!r} "
                                             "disagrees with the manifest")
            files.read(rec, record_dtype(rec), rec["shape"])
            total += rec["length"]
    return {"path": ckpt, "step": m.get("step"), "tensors": len(m["tensors"]), "bytes": total}


def _header_agrees(h, start: int, rec: dict) -> bool:
    """A safetensors header entry ``h`` (from the file: any JSON) places the tensor where ``rec`` says."""
    if not isinstance(h, dict) or not isinstance(h.get("data_offsets"), list) or len(h["data_offsets"]) != 2:
        return False
    return start + h["data_offsets"][0] == rec["offset"] and h.get("shape") == rec["shape"]
