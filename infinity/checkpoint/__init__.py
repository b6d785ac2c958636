"""Checkpoints: save and resume a run exactly, streamed out of the tiers,
crash-safe, loadable at any world size, stage and placement. See
docs/checkpoints.md."""

from .background import AsyncCheckpoint
from .export import consolidate, export_pretrained
from .load import load_checkpoint, verify_checkpoint
from .safetensors_io import CorruptCheckpointError
from .save import CheckpointSpaceError, save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "verify_checkpoint", "export_pretrained", "consolidate",
           "CorruptCheckpointError", "CheckpointSpaceError", "AsyncCheckpoint"]
