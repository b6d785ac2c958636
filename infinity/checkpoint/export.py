"""Weights in the Hugging Face layout: ``model-0000x-of-0000y.safetensors``
shards and ``model.safetensors.index.json`` (plus ``config.json`` for a
Hugging Face model or the built-in GPT), so ``from_pretrained(out_dir)`` loads a model trained
through infinity.

``export_pretrained`` streams a live model's weights out of the tiers unit by
unit; ``consolidate`` converts a checkpoint's weights one tensor at a time.
Either holds at most one unit's buffer (one tensor for ``consolidate``) plus
the writer's buffer. Files are written into ``out_dir/.export.partial`` and
moved into ``out_dir`` once all are complete, the index last.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch

from ..config.runtime import parse_bytes
from ..models.gpt import GPTConfig
from . import layout
from .load import ManifestFiles
from .manifest import check_files, read_manifest
from .safe_files import CorruptCheckpointError
from .safetensors_io import ShardWriter, record_dtype, split_shards

__all__ = ["export_pretrained", "consolidate", "INDEX_NAME"]

INDEX_NAME = "model.safetensors.index.json"
# The optimizer's tensors in a checkpoint (moments; int8 moments' scales): not weights.
OPTIMIZER_PREFIXES = ("exp_avg.", "exp_avg_sq.", "exp_avg_scale.", "exp_avg_sq_scale.")
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _target(dtype: Union[str, torch.dtype]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t


Source = Tuple[str, torch.dtype, Tuple[int, ...], Callable[[], torch.Tensor]]


def _write_hf(out_dir: str, items: Sequence[Source], dtype: torch.dtype, max_shard_size, config_json) -> List[str]:
    """Writes ``items`` (name, stored dtype, shape, source) as HF shards; returns the files."""
    limit = parse_bytes(max_shard_size, "max_shard_size")
    entries = [(n, dtype if d.is_floating_point else d, s, src) for n, d, s, src in items]
    shards = split_shards(entries, limit)
    os.makedirs(out_dir, exist_ok=True)
    part = os.path.join(out_dir, ".export.partial")
    shutil.rmtree(part, ignore_errors=True)
    os.mkdir(part, 0o755)
    try:
        names, weight_map, total = [], {}, 0
        for k, shard in enumerate(shards):
            fname = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            w = ShardWriter(os.path.join(part, fname), [(n, d, s) for n, d, s, _ in shard], {"format": "pt"})
            try:
                for n, d, _, src in shard:
                    w.write(n, _cast(src(), d))
                    weight_map[n] = fname
                w.close()
            finally:
                w.abort()
            total += w.nbytes - w.data_start
            names.append(fname)
        if config_json is not None:
            with open(os.path.join(part, "config.json"), "w") as f:
                f.write(config_json)
        mode = _shared_mode()
        for fname in names + (["config.json"] if config_json is not None else []):
            os.chmod(os.path.join(part, fname), mode)
            os.replace(os.path.join(part, fname), os.path.join(out_dir, fname))
        if len(names) > 1:
            layout.write_json_atomic(os.path.join(out_dir, INDEX_NAME),
                                     {"metadata": {"total_size": total}, "weight_map": weight_map})
            os.chmod(os.path.join(out_dir, INDEX_NAME), mode)
        layout.fsync_dir(out_dir)
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return names


def _shared_mode() -> int:
    """The mode of a file made for sharing: 0666 less the umask, as any tool
    writes one (the writers make theirs 0600, right for checkpoints, which
    are private, but not for an export meant to be handed on)."""
    try:
        with open("/proc/self/status") as f:
            umask = next(int(line.split()[1], 8) for line in f if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        umask = os.umask(0o022)
        os.umask(umask)
    return 0o666 & ~umask


def _hf_config(model) -> Optional[str]:
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "to_json_string"):
        return cfg.to_json_string()
    gpt = getattr(model, "cfg", None)
    return json.dumps(gpt.to_json_dict(), indent=2) if isinstance(gpt, GPTConfig) else None


def _model_config(m: dict, ckpt: str) -> Optional[str]:
    """``config.json`` of a checkpoint's manifest: a Hugging Face model's as
    saved, the built-in GPT's checked field by field (the manifest is input
    from someone else, [Note: a checkpoint is input from someone else])."""
    if m.get("hf_config") is not None:
        return json.dumps(m["hf_config"], indent=2)
    if m.get("model_config") is None:
        return None
    try:
        return json.dumps(GPTConfig.from_json_dict(m["model_config"]).to_json_dict(), indent=2)
    except (TypeError, ValueError) as e:
        raise CorruptCheckpointError(f"{ckpt}: manifest field 'model_config': {e}") from None


def export_pretrained(model, out_dir, *, dtype: Union[str, torch.dtype] = "bf16",
                      max_shard_size: Union[int, str] = "5GB") -> List[str]:
    """Writes ``model``'s weights (from infinity.initialize; the fp32 masters
    cast to ``dtype``, frozen parameters from their compute copies, persistent
    buffers as they are) to ``out_dir`` in the Hugging Face layout, with
    ``config.json`` when the model has a Hugging Face config; shards of at
    most ``max_shard_size`` bytes. Every rank calls it under ZeRO; rank 0
    writes. Returns the shard file names."""
    from ..api import engine_of
    from .plan import plan_checkpoint
    eng = engine_of(model)
    eng.optimizer.flush()
    eng.faults.check("infinity.export_pretrained()")
    plan = plan_checkpoint(model, eng)
    target = _target(dtype)
    plan.reader.expect(plan.model_items)
    if eng.sharding.rank != 0:  # the reads are collectives: take part, write nothing
        for _, _, _, src in plan.model_items:
            src()
        plan.reader.done()
        return []
    try:
        return _write_hf(os.fspath(out_dir), plan.model_items, target, max_shard_size, _hf_config(model))
    finally:
        plan.reader.done()


def consolidate(checkpoint, out_dir, *, dtype: Union[str, torch.dtype] = "bf16",
                max_shard_size: Union[int, str] = "5GB") -> List[str]:
    """Converts the weights of the checkpoint at ``checkpoint`` (or the newest
    under it) to the Hugging Face layout in ``out_dir``, one tensor in memory
    at a time (no model, no engine); ``config.json`` too when the checkpoint
    was saved from a Hugging Face model or the built-in GPT
    (``GPTConfig.from_json_dict`` reads it back). Files get the umask's
    normal mode (0644 under umask 022). Returns the shard file names."""
    ckpt = layout.resolve(checkpoint)
    m = read_manifest(ckpt)  # every name, offset and length checked; then the files' sizes, before any read
    check_files(ckpt, m)
    recs = sorted(((n, r) for n, r in m["tensors"].items() if not n.startswith(OPTIMIZER_PREFIXES)),
                  key=lambda nr: (nr[1]["file"], nr[1]["offset"]))
    with ManifestFiles(ckpt) as files:
        items = [(n, record_dtype(r), tuple(r["shape"]),
                  lambda r=r: files.read(r, record_dtype(r), r["shape"])) for n, r in recs]
        return _write_hf(os.fspath(out_dir), items, _target(dtype), max_shard_size, _model_config(m, ckpt))
