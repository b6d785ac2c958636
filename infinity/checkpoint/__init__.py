"""Checkpoints: save and resume a run exactly, streamed out of the tiers,
crash-safe, loadable at any world size, stage and placement. See
docs/checkpoints.md.

Owns: state into and out of the tiers as files: save, load, verify, export,
consolidate, background saves, and streaming a pretrained model in
(pretrained.py). May import: api.py (to reach a model's engine), engine/,
io/, system/, config/; a background save installs its fence into the engine
through one call, so the engine never imports this folder.
"""

from .background import AsyncCheckpoint
from .export import consolidate, export_pretrained
from .load import load_checkpoint, verify_checkpoint
from .owner import CheckpointLockedError
from .safetensors_io import CorruptCheckpointError
from .save import CheckpointSpaceError, save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "verify_checkpoint", "export_pretrained", "consolidate",
           "CorruptCheckpointError", "CheckpointSpaceError", "CheckpointLockedError", "AsyncCheckpoint"]
