"""``infinity consolidate`` and ``infinity verify``: the checkpoint folder's
weights in the Hugging Face layout, and every checksum of a checkpoint
(docs/checkpoints.md)."""

from __future__ import annotations

import json
from typing import Any



def add_parser(sub: Any) -> None:
    p = sub.add_parser("consolidate", help="write a checkpoint's weights in the Hugging Face layout",
                       description="Writes the weights of the checkpoint CKPT (a step-<N> folder, or the newest "
                                   "complete one under a checkpoint folder) to OUT as model.safetensors (or "
                                   "shards with model.safetensors.index.json) and config.json for a Hugging Face "
                                   "model, one tensor in memory at a time.")
    p.add_argument("ckpt", help="checkpoint folder")
    p.add_argument("out", help="output folder")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="weights' dtype (default bf16)")
    p.add_argument("--max-shard-size", default="5GB", help="bytes per shard file (default 5GB)")
    p.set_defaults(run=_consolidate)
    p = sub.add_parser("verify", help="check a checkpoint's files and checksums",
                       description="Reads every tensor of the checkpoint CKPT (or the newest under it) and checks "
                                   "its CRC32C and header against the manifest; exit 1 naming file, tensor and "
                                   "offset on the first mismatch.")
    p.add_argument("ckpt", help="checkpoint folder")
    p.set_defaults(run=_verify)


def _consolidate(a) -> int:
    from ..checkpoint import consolidate
    files = consolidate(a.ckpt, a.out, dtype=a.dtype, max_shard_size=a.max_shard_size)
    print(f"infinity consolidate: wrote {len(files)} file(s) to {a.out}: {', '.join(files)}")
    return 0


def _verify(a) -> int:
    from ..checkpoint import CorruptCheckpointError, verify_checkpoint
    try:
        info = verify_checkpoint(a.ckpt)
    except (CorruptCheckpointError, OSError) as e:  # a missing folder, a failing disk: named, exit 1
        print(f"infinity verify: FAIL: {e}")
        return 1
    print(f"infinity verify: OK: {json.dumps(info)}")
    return 0
