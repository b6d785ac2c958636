"""``infinity consolidate`` and ``infinity verify``: thin front ends of the
checkpoint functions of issue 19 (``infinity.consolidate_checkpoint``,
``infinity.verify_checkpoint``), which fail clearly while those are absent."""

from __future__ import annotations

from typing import Any

from .common import checkpoint_api


def add_parser(sub: Any) -> None:
    p = sub.add_parser("consolidate", help="write a checkpoint's weights as one safetensors file",
                       description="Consolidates the checkpoint in DIR into plain weights "
                                   "(calls infinity.consolidate_checkpoint(DIR, OUT)).")
    p.add_argument("dir", help="checkpoint directory")
    p.add_argument("-o", "--output", required=True, help="output file (e.g. model.safetensors)")
    p.set_defaults(run=lambda a: _call("consolidate_checkpoint", a.dir, a.output))
    p = sub.add_parser("verify", help="check a checkpoint's files and checksums",
                       description="Verifies the checkpoint in DIR (calls infinity.verify_checkpoint(DIR)).")
    p.add_argument("dir", help="checkpoint directory")
    p.set_defaults(run=lambda a: _call("verify_checkpoint", a.dir))


def _call(name: str, *args: Any) -> int:
    result = checkpoint_api(name)(*args)
    if result not in (None, True):
        print(result)
    return 0 if result is not False else 1
