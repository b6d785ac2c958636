"""``save_checkpoint``: the state of a run, streamed unit by unit out of
whichever tier holds it into safetensors shards and a JSON manifest.

[Note: what a checkpoint holds]
- ``model-*.safetensors``: every parameter once, under its first name in
  ``model.named_parameters()`` (tied names are aliases in the manifest):
  trainable ones as their master (exact: the compute copy is the master
  rounded) in the run's ``master_dtype`` (the manifest's: fp32, or bf16,
  with the rounding seed as ``master_seed``), frozen ones as their compute
  copy; then the persistent buffers.
  Readable with plain ``safetensors``.
- ``optimizer-*.safetensors``: ``exp_avg.<name>`` and ``exp_avg_sq.<name>``
  of every trainable parameter in the run's ``moment_dtype`` (the manifest's
  ``moment_dtype``): fp32, bf16, or int8 codes (uint8; exp_avg_sq as codes
  of its square root) with ``exp_avg_scale.<name>`` and
  ``exp_avg_sq_scale.<name>`` (fp32, a scale per 256 elements).
- ``manifest.json``: format version; per tensor its file, dtype, shape,
  offset, length and CRC32C; each parameter's Adam step count; the param
  groups' hyper-parameters by parameter name; the LR scheduler's and the fp16
  loss scaler's states; every rank's RNG states; the user's ``extra``; world
  size, ZeRO stage and the config at save time.
Tensors are full (not sharded), so a checkpoint loads at any world size,
stage and placement. Under ZeRO every rank takes part in the gathers and
rank 0 writes; each rank adds its own RNG state.
"""

from __future__ import annotations

import errno
import functools
import os
import shutil
import stat
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, Optional

import torch

from ..models.gpt import GPTConfig
from ..config.runtime import format_bytes
from ..engine.faults import UsageError
from . import layout, owner, rng
from .plan import Plan, SlotSource, plan_checkpoint
from .safetensors_io import ShardWriter, split_shards

__all__ = ["save_checkpoint", "CheckpointSpaceError", "MAX_SHARD_BYTES"]

MAX_SHARD_BYTES = 4 << 30  # per safetensors file

# Tests: called with the name of each point of a save (crash-safety tests kill the process there).
test_hook: Optional[Callable[[str], None]] = None


def _at(point: str) -> None:
    if test_hook is not None:
        test_hook(point)
SPACE_MARGIN_BYTES = 16 << 20  # headers, the manifest and the filesystem's own blocks


class CheckpointSpaceError(OSError):
    """The checkpoint folder's filesystem has no room for the checkpoint (names
    the path, the bytes needed and free); the partial checkpoint was removed
    and the run goes on."""


def save_checkpoint(path, model, optimizer, *, lr_scheduler=None, extra: Optional[dict] = None,
                    step: Optional[int] = None, keep_last: Optional[int] = None,
                    exclude_frozen: bool = False, blocking: bool = True):
    """Writes the run's state to ``path/step-<N>/`` and returns that path.

    Call between steps (after ``optimizer.step()``), on every rank under
    ZeRO. ``step`` defaults to the optimizer's step count; ``extra`` is any
    JSON-able dict returned by :func:`load_checkpoint` (data position,
    epoch); ``keep_last`` removes older checkpoints once this one is
    complete; ``exclude_frozen`` leaves frozen parameters out (an adapter on
    a frozen base). See [Note: what a checkpoint holds] and [Note: a
    checkpoint is complete or invisible].

    ``blocking=False`` returns at once an :class:`AsyncCheckpoint` (its
    ``wait()`` returns the path or raises the save's error) and writes while
    training goes on; each unit's update waits until that unit's state is
    written, so the checkpoint is exactly the state at this call (see
    [Note: a background save] in background.py). One rank, ZeRO stage 0.

    Raises:
        CheckpointSpaceError: the filesystem lacks room (bytes named); nothing
            is left behind and training can go on.
        UsageError: called in the middle of an accumulation window, or
            ``blocking=False`` under ZeRO.
        EngineFailedError: the engine failed earlier (nothing is saved).
    """
    from ..api import engine_of
    from .background import AsyncCheckpoint, check_background_ok, wait_pending
    eng = engine_of(model)
    if optimizer is not eng.optimizer:
        raise ValueError("save_checkpoint: optimizer is not the one infinity.initialize returned for this model")
    wait_pending(eng)
    if not blocking:
        check_background_ok(eng)
    optimizer.flush()
    eng.faults.check("infinity.save_checkpoint()")
    plan = plan_checkpoint(model, eng, exclude_frozen)
    plan.check_between_steps("save_checkpoint")
    step = plan.step if step is None else int(step)
    root = os.path.abspath(os.fspath(path))
    meta = _manifest_head(eng, optimizer, plan, lr_scheduler, extra, step, exclude_frozen)
    hf = getattr(model, "config", None)
    if hf is not None and hasattr(hf, "to_json_string"):  # a Hugging Face model: consolidate writes config.json
        import json
        meta["hf_config"] = json.loads(hf.to_json_string())
    elif isinstance(getattr(model, "cfg", None), GPTConfig):  # the built-in GPT: so does its config
        meta["model_config"] = model.cfg.to_json_dict()
    own_rng = rng.capture()  # now: training goes on drawing numbers while a background save writes
    partial = layout.partial_dir(root, step)
    lock = _prepare_on_rank0(eng, root, partial, plan)
    job = functools.partial(_finish, eng, plan, root, partial, step, meta, own_rng, keep_last, lock)
    if not blocking:
        try:
            return AsyncCheckpoint.start(eng, plan, job, Path(root) / layout.step_dir_name(step))
        except BaseException:
            if lock is not None:
                lock.release()
            raise
    return job()


def _prepare_on_rank0(eng, root: str, partial: str, plan: Plan) -> Optional[owner.SaveLock]:
    """Rank 0 prepares the folder and takes its lock; under ZeRO every rank
    then learns whether it could, so a refused save (another saver holds the
    lock, a foreign folder) raises on every rank instead of leaving the
    others waiting in the gathers. Returns rank 0's lock (None elsewhere)."""
    lock, failed = None, None
    if eng.sharding.rank == 0:
        try:
            lock = _prepare_folder(root, partial, plan)
        except BaseException as e:  # noqa: BLE001 - told to every rank, then raised
            failed = e
    if eng.sharding.world > 1 and eng.sharding.sum(0.0 if failed is None else 1.0):
        if failed is None:
            raise RuntimeError(f"save_checkpoint: rank 0 could not prepare the checkpoint folder {root!r} (its "
                               "error says why); nothing was saved")
    if failed is not None:
        raise failed
    return lock


def _prepare_folder(root: str, partial: str, plan: Plan) -> owner.SaveLock:
    """The checkpoint folder made (0700) or checked as ours, its saver's lock
    taken, and an empty ``partial`` folder in it ([Note: a checkpoint folder
    is owned like a swap folder]); returns the lock, held."""
    owner.make_root(root, "save_checkpoint")
    lock = owner.SaveLock(root)
    try:
        layout.wait_removals(root)  # the last save's pruned checkpoints: their space counts
        try:
            st = os.lstat(partial)
        except FileNotFoundError:
            st = None
        if st is not None and not (stat.S_ISDIR(st.st_mode) and owner.owned_by_us(st)):
            raise UsageError(f"save_checkpoint: {partial!r} is in the way and is not a folder an earlier save of "
                             "this user left (a file, a link or another user's); remove it or choose another "
                             "checkpoint folder")
        if st is not None:  # we hold the lock: its saver is gone
            shutil.rmtree(partial)
        _check_space(root, plan)
        os.mkdir(partial, 0o700)
        return lock
    except BaseException:
        lock.release()
        raise


def _finish(eng, plan: Plan, root: str, partial: str, step: int, meta: dict, own_rng: dict,
            keep_last: Optional[int], lock: Optional[owner.SaveLock], on_item: Optional[Callable] = None) -> Path:
    """The tensors, the RNG states, then the commit; ``on_item(source)``
    after each tensor; the folder's lock (rank 0's) released at the end."""
    try:
        return _write_and_commit(eng, plan, root, partial, step, meta, own_rng, keep_last, on_item)
    finally:
        if lock is not None:
            lock.release()


def _write_and_commit(eng, plan: Plan, root: str, partial: str, step: int, meta: dict, own_rng: dict,
                      keep_last: Optional[int], on_item: Optional[Callable]) -> Path:
    writer = eng.sharding.rank == 0
    try:
        tensors = _write_all(eng, plan, partial if writer else None, on_item)
    except BaseException:
        if writer:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    _barrier(eng)  # the folder exists: every rank adds its RNG state
    meta.update(tensors=tensors, rng=_exchange_rng(eng, partial, own_rng))
    if not writer:
        _barrier(eng)
        return Path(root) / layout.step_dir_name(step)
    try:
        return Path(_commit(root, partial, step, meta, keep_last, plan))
    finally:
        _barrier(eng)


def _commit(root: str, partial: str, step: int, meta: dict, keep_last: Optional[int], plan: Plan) -> str:
    """Manifest last, then the rename ([Note: a checkpoint is complete or invisible])."""
    try:
        meta["files"] = _file_sizes(partial)
        _at("manifest")
        layout.write_json_atomic(os.path.join(partial, layout.MANIFEST), meta)
        _at("commit")
        final = layout.commit(root, partial, step)
    except OSError as e:
        shutil.rmtree(partial, ignore_errors=True)
        raise _space_error(root, plan, e) from e
    _at("prune")
    try:
        layout.prune(root, keep_last, keep=final)
    except Exception as e:  # noqa: BLE001 - the checkpoint is committed: a failed cleanup must not undo that
        warnings.warn(f"save_checkpoint: {final} is saved, but removing older checkpoints failed "
                      f"({type(e).__name__}: {e}); remove them by hand if space is short", RuntimeWarning,
                      stacklevel=4)
    return final


def _write_all(eng, plan: Plan, folder: Optional[str], on_item: Optional[Callable] = None) -> Dict[str, dict]:
    """Streams the model and optimizer tensors into ``folder`` (None: this
    rank only takes part in the gathers); the manifest's tensor records. A
    write error stops the writing, not the reading: under ZeRO the reads are
    collectives every rank must finish; then every rank raises."""
    records: Dict[str, dict] = {}
    stream = plan.stream()
    plan.reader.expect([item for _, item in stream])
    try:
        failed = _write_files(eng, stream, folder, records, on_item)
    finally:
        plan.reader.done()
    if eng.sharding.world > 1 and eng.sharding.sum(1.0 if failed is not None else 0.0) and failed is None:
        raise RuntimeError("save_checkpoint: rank 0 could not write the checkpoint (its error says why); "
                           "nothing was saved")
    if failed is not None:
        raise _space_error(os.path.dirname(folder), plan, failed) from failed
    for name, dtype, shape, _ in plan.model_items + plan.optim_items:
        if name in records:
            records[name].update(dtype=str(dtype).replace("torch.", ""), shape=list(shape))
    return records


class _Shards:
    """The shard files of one prefix ("model", "optimizer"), written in turn
    as their tensors come; the first write error is kept in ``failure``
    (shared by both prefixes: after it nothing more is written)."""

    def __init__(self, prefix: str, items, folder: Optional[str], records: Dict[str, dict], failure: list):
        self.shards = split_shards([(n, d, s) for n, d, s, _ in items], MAX_SHARD_BYTES)
        self.prefix, self.folder, self.records, self.failure = prefix, folder, records, failure
        self.k, self.left, self.w = -1, 0, None

    def _io(self, fn, *args):
        if self.failure[0] is None:
            try:
                return fn(*args)
            except OSError as e:
                self.failure[0] = e
        return None

    def _next_shard(self) -> None:
        self._close()
        self.k += 1
        self.left = len(self.shards[self.k])
        fname = f"{self.prefix}-{self.k + 1:05d}-of-{len(self.shards):05d}.safetensors"
        if self.folder is not None:
            self.w = self._io(ShardWriter, os.path.join(self.folder, fname), self.shards[self.k], {"format": "pt"})
            self.fname = fname

    def _close(self) -> None:
        w, self.w = self.w, None
        if w is None:
            return
        try:
            self._io(w.close)
            if self.failure[0] is None:
                self.records.update((r["name"], dict(r, file=self.fname)) for r in w.records)
        finally:
            w.abort()

    def write(self, name: str, t) -> None:
        while self.left == 0:
            self._next_shard()
        if self.w is not None:
            self._io(self._write_one, name, t)
        self.left -= 1

    def _write_one(self, name: str, t) -> None:
        self.w.write(name, t)
        _at("tensor")

    def settle(self) -> None:
        """No write reads a tensor already written after this (its memory may change)."""
        if self.w is not None:
            self._io(self.w.settle)

    def finish(self) -> None:
        """Writes the shards still unopened (empty ones) and closes the last."""
        while self.k + 1 < len(self.shards):
            self._next_shard()
        self._close()

    def abort(self) -> None:
        if self.w is not None:
            self.w.abort()
            self.w = None


def _write_files(eng, stream, folder: Optional[str], records: Dict[str, dict],
                 on_item: Optional[Callable] = None) -> Optional[OSError]:
    """The writing loop of :func:`_write_all` over ``stream`` (Plan.stream);
    the first write error, or None."""
    failure: list = [None]
    by_prefix = {p: [it for q, it in stream if q == p] for p in ("model", "optimizer")}
    files = {p: _Shards(p, items, folder, records, failure) for p, items in by_prefix.items()}
    held, resident = None, False  # the unit buffer the last tensors came from (writes may still read it)
    try:
        for prefix, (name, _, _, source) in stream:
            key = (source.u.index, source.kind) if isinstance(source, SlotSource) else None
            if (key is None or key != held) and not resident:  # the reader drops (or recycles) that buffer now
                for f in files.values():
                    f.settle()
            held = key
            t = eng_guarded(eng, source)
            resident = key is not None and source.reader.resident  # held still: nothing to wait for
            files[prefix].write(name, t)
            if on_item is not None:  # the unit's state may change after this (a background save's fence)
                files[prefix].settle()
                on_item(source)
        for f in files.values():
            f.finish()
    finally:
        for f in files.values():
            f.abort()
    return failure[0]


def eng_guarded(eng, source):
    """A tensor from the engine's tiers (``source()``); a fault reading it fails the engine."""
    with eng.faults.guard("infinity.save_checkpoint() (reading the state)"):
        return source()


def _manifest_head(eng, optimizer, plan: Plan, lr_scheduler, extra, step: int, exclude_frozen: bool) -> dict:
    import json
    if extra is not None:
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as e:
            raise TypeError(f"save_checkpoint: extra must be JSON-able (numbers, strings, lists, dicts): {e}") from None
    sched = lr_scheduler.state_dict() if lr_scheduler is not None else None
    if sched is not None:
        try:
            json.dumps(sched)
        except (TypeError, ValueError) as e:
            raise TypeError(f"save_checkpoint: the LR scheduler's state_dict is not JSON-able ({e}); "
                            "use a scheduler whose state is plain numbers (LambdaLR keeps no lambdas in it)") from None
    return {
        "format": "infinity-checkpoint", "version": layout.FORMAT_VERSION, "step": step, "saved_at": time.time(),
        "world_size": eng.sharding.world, "zero_stage": eng.modes.zero, "config": eng.config.to_dict(),
        "moment_dtype": plan.moment_dtype, "master_dtype": eng.modes.master_dtype,
        "master_seed": optimizer.updater.master_seed,
        "exclude_frozen": exclude_frozen, "aliases": plan.aliases, "param_steps": plan.param_steps(),
        "param_groups": plan.param_groups(optimizer), "lr_scheduler": sched, "extra": extra,
        "loss_scaler": {"loss_scale": optimizer.scaling.loss_scale, "good_steps": optimizer.scaling.good_steps},
        "torch_version": torch.__version__,
    }


def _exchange_rng(eng, partial: str, own: dict) -> dict:
    """Every rank writes its RNG state (``own``) into the folder; rank 0 collects them all."""
    import json
    r = eng.sharding.global_rank
    if eng.sharding.world == 1:
        return {str(r): own}
    path = os.path.join(partial, f"rng-rank{r}.json")
    if eng.sharding.rank != 0:
        layout.write_json_atomic(path, own)
    _barrier(eng)
    if eng.sharding.rank != 0:
        return {}
    out = {str(r): own}
    for name in sorted(os.listdir(partial)):
        if name.startswith("rng-rank") and name.endswith(".json"):
            with open(os.path.join(partial, name)) as f:
                out[name[len("rng-rank"):-len(".json")]] = json.load(f)
            os.unlink(os.path.join(partial, name))
    return out


def _barrier(eng) -> None:
    if eng.sharding.world > 1:
        eng.sharding.sum(0.0)


def _file_sizes(folder: str) -> Dict[str, int]:
    return {n: os.path.getsize(os.path.join(folder, n)) for n in sorted(os.listdir(folder))
            if n.endswith(".safetensors")}


def _check_space(root: str, plan: Plan) -> None:
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    need = plan.total_bytes + SPACE_MARGIN_BYTES
    if free < need:
        raise CheckpointSpaceError(errno.ENOSPC, f"save_checkpoint: {root!r} has {free} bytes ({format_bytes(free)}) "
                                   f"free, the checkpoint needs {need} ({format_bytes(need)}); nothing was written. "
                                   "Free space, choose another folder, or pass keep_last to drop old checkpoints")


def _space_error(root: str, plan: Plan, e: OSError) -> OSError:
    if e.errno != errno.ENOSPC:
        return e
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    return CheckpointSpaceError(errno.ENOSPC, f"save_checkpoint: the disk of {root!r} filled up while writing "
                                f"({e}); the checkpoint needs {plan.total_bytes} bytes, {free} are free now. "
                                "The partial checkpoint was removed; earlier ones and the run are intact")
