"""A checkpoint's manifest, read through safe_files and checked field by
field before anything uses it.

[Note: a manifest is checked before it is used]
Every field a reader uses is checked here for its type and range, so that a
load can check everything it needs without tensors before it writes the
first byte into the engine (load.py), and a malformed manifest is a
:class:`CorruptCheckpointError` naming the manifest and the field, never a
TypeError, KeyError or RecursionError from the middle of a load. The checks:
tensor records (file a listed plain name, offset and length non-negative
ints whose range lies in the file's data, a known dtype, a shape of
non-negative ints whose bytes are the length, a CRC32C of 32 bits, chunk
sums of a positive chunk size, one per chunk); ``files`` (plain names,
sizes); ``param_steps`` (non-negative ints: not bools, floats, NaN or
strings); ``param_groups`` (lists of parameter names, hyper-parameters that
are finite numbers, bools, strings or lists of numbers); the loss scaler
(a finite positive scale, a non-negative count); ``lr_scheduler`` and
``rng`` (objects). Values read are not echoed in messages (names, offsets
and lengths are): see [Note: a checkpoint is input from someone else].
"""

from __future__ import annotations

import math
import os
from typing import Dict

from . import layout
from .safe_files import MAX_MANIFEST_BYTES, CorruptCheckpointError, member_path, member_size, parse_json, read_member
from .safetensors_io import DTYPES, nbytes, record_dtype

__all__ = ["read_manifest", "check_files", "nonneg_int", "finite_number"]

_SAFETENSORS_MIN = 8  # a safetensors file's data follows its 8-byte header length


def nonneg_int(v) -> bool:
    """``v`` is an int >= 0 (not a bool)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def finite_number(v) -> bool:
    """``v`` is a finite int or float (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _name(n) -> str:
    return repr(n[:120]) if isinstance(n, str) else f"a {type(n).__name__}"


class _Check:
    """Raises CorruptCheckpointError naming the manifest and a field."""

    def __init__(self, mpath: str):
        self.mpath = mpath

    def fail(self, field: str, want: str) -> None:
        raise CorruptCheckpointError(f"{self.mpath}: {field} must be {want}; the manifest is corrupt (nothing "
                                     "was loaded)")

    def that(self, ok: bool, field: str, want: str) -> None:
        if not ok:
            self.fail(field, want)

    def mapping(self, m: dict, key: str, optional: bool = False) -> dict:
        v = m.get(key)
        if v is None and optional:
            return {}
        self.that(isinstance(v, dict), f"{key!r}", "a JSON object")
        return v


def read_manifest(path: str) -> dict:
    """The manifest of the checkpoint at ``path`` (a checkpoint folder),
    read through safe_files (bounded, regular file, not a link) and checked
    ([Note: a manifest is checked before it is used])."""
    mpath = os.path.join(path, layout.MANIFEST)
    m = parse_json(mpath, read_member(path, layout.MANIFEST, MAX_MANIFEST_BYTES))
    if not isinstance(m, dict) or m.get("format") != "infinity-checkpoint":
        raise CorruptCheckpointError(f"{mpath}: not an infinity checkpoint manifest")
    if m.get("version") != layout.FORMAT_VERSION:
        raise CorruptCheckpointError(f"{mpath}: not format version {layout.FORMAT_VERSION}, the one this infinity "
                                     "reads")
    c = _Check(mpath)
    files = _check_file_list(c, path, m)
    tensors = c.mapping(m, "tensors")
    for name, rec in tensors.items():
        _check_record(c, name, rec, files)
    _check_small_state(c, m)
    return m


def _check_file_list(c: _Check, path: str, m: dict) -> Dict[str, int]:
    files = c.mapping(m, "files")
    for fname, size in files.items():
        member_path(path, fname, "file")
        c.that(nonneg_int(size), f"files[{_name(fname)}]", "a size in bytes (an int >= 0)")
    return files


def _check_record(c: _Check, name, rec, files: Dict[str, int]) -> None:
    """One tensor record: types, ranges, and its bytes inside its file's data."""
    f = f"tensors[{_name(name)}]"
    c.that(isinstance(rec, dict), f, "a JSON object")
    c.that(isinstance(rec.get("file"), str) and rec["file"] in files, f"{f}.file",
           "one of the files the manifest lists")
    c.that(nonneg_int(rec.get("offset")) and rec["offset"] >= _SAFETENSORS_MIN, f"{f}.offset",
           f"an int >= {_SAFETENSORS_MIN}")
    c.that(nonneg_int(rec.get("length")), f"{f}.length", "an int >= 0")
    c.that(nonneg_int(rec.get("crc32c")) and rec["crc32c"] < 1 << 32, f"{f}.crc32c", "a 32-bit unsigned int")
    shape = rec.get("shape")
    c.that(isinstance(shape, list) and len(shape) <= 64 and all(nonneg_int(d) for d in shape), f"{f}.shape",
           "a list of ints >= 0")
    try:
        dtype = record_dtype(rec)
    except CorruptCheckpointError:
        c.fail(f"{f}.dtype", f"one of {sorted(str(d).replace('torch.', '') for d in DTYPES)}")
    c.that(nbytes(dtype, shape) == rec["length"], f"{f}.length", "the bytes of its shape and dtype")
    end, size = rec["offset"] + rec["length"], files[rec["file"]]
    if end > size:
        raise CorruptCheckpointError(f"{c.mpath}: tensor {_name(name)} at offset {rec['offset']} ({rec['length']} "
                                     f"bytes) ends at {end}, past the {size} bytes the manifest gives "
                                     f"{rec['file']!r}; the manifest is corrupt (nothing was loaded)")
    chunks = rec.get("chunks")
    if chunks is not None:
        c.that(isinstance(chunks, dict) and nonneg_int(chunks.get("bytes")) and chunks["bytes"] > 0
               and isinstance(chunks.get("crc32c"), list), f"{f}.chunks", "{bytes: an int > 0, crc32c: a list}")
        sums = chunks["crc32c"]
        c.that(len(sums) == -(-rec["length"] // chunks["bytes"]) and all(nonneg_int(s) and s < 1 << 32 for s in sums),
               f"{f}.chunks.crc32c", "one 32-bit unsigned int per chunk of the tensor")


def _check_small_state(c: _Check, m: dict) -> None:
    """Everything but the tensors a load uses: steps, groups, scaler, scheduler, RNG."""
    for name, v in c.mapping(m, "param_steps", optional=True).items():
        c.that(nonneg_int(v), f"param_steps[{_name(name)}]", "an int >= 0 (an Adam step count)")
    groups = m.get("param_groups", [])
    c.that(isinstance(groups, list), "'param_groups'", "a list")
    for gi, g in enumerate(groups):
        c.that(isinstance(g, dict) and isinstance(g.get("params"), list)
               and all(isinstance(p, str) for p in g["params"]), f"param_groups[{gi}]",
               "an object whose 'params' is a list of parameter names")
        for k, v in g.items():
            if k != "params":
                ok = v is None or isinstance(v, (bool, str)) or finite_number(v) or (
                    isinstance(v, list) and all(finite_number(x) for x in v))
                c.that(ok, f"param_groups[{gi}][{_name(k)}]", "a finite number, bool, string, null or list of numbers")
    scaler = c.mapping(m, "loss_scaler", optional=True)
    if "loss_scale" in scaler:
        c.that(finite_number(scaler["loss_scale"]) and scaler["loss_scale"] > 0, "loss_scaler.loss_scale",
               "a finite number > 0")
        c.that(nonneg_int(scaler.get("good_steps", 0)), "loss_scaler.good_steps", "an int >= 0")
    c.that(m.get("lr_scheduler") is None or isinstance(m["lr_scheduler"], dict), "'lr_scheduler'",
           "null or a JSON object")
    for rank, st in c.mapping(m, "rng", optional=True).items():
        c.that(isinstance(st, dict), f"rng[{_name(rank)}]", "a JSON object")
    c.that(isinstance(m.get("exclude_frozen", False), bool), "'exclude_frozen'", "true or false")
    c.that(m.get("step") is None or nonneg_int(m["step"]), "'step'", "an int >= 0")
    c.that(isinstance(m.get("aliases", {}), dict), "'aliases'", "a JSON object")


def check_files(ckpt: str, m: dict) -> None:
    """Each file the manifest lists is a regular file inside ``ckpt`` (not
    a link) of the size the manifest gives; CorruptCheckpointError naming it."""
    for fname, size in m["files"].items():
        got = member_size(ckpt, fname)
        if got != size:
            raise CorruptCheckpointError(f"{os.path.join(ckpt, fname)}: {got} bytes, the manifest says {size} "
                                         "(truncated or replaced); nothing was loaded")
