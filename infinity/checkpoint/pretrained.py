"""``infinity.load_pretrained``: stream safetensors weights unit by unit into
a model managed by infinity, never holding more than one unit's tensors.

    model, opt = infinity.initialize(model, config)      # e.g. built under infinity.init
    infinity.load_pretrained(model, "path/to/checkpoint_dir")

Accepted layouts: one ``.safetensors`` file; a directory with
``model.safetensors.index.json`` (Hugging Face sharding: ``{"weight_map":
{key: shard file}}``); a directory of ``*.safetensors`` shards. Files are
memory-mapped (``safetensors.safe_open``) and only read, never written.

Every check (missing, unexpected and mis-shaped keys) runs on the files'
headers before any value is written, so a load that fails leaves the model
as it was.

[Note: pretrained weights are a folder the user named]
Unlike a checkpoint (see [Note: a checkpoint is input from someone else] in
safe_files.py), the folder given to ``load_pretrained`` is one the user
chose, and the Hugging Face cache builds it from symbolic links into a
sibling ``blobs/`` folder, so links are followed. What the folder's files
name is still a claim to check: an index's shard must be a relative name
with no ``..`` component, every shard must be a regular file once links are
resolved (a FIFO or device is refused at once, never opened, so a load
cannot block in open(2)), and the index is bounded in size and nesting and
its parse errors name the file, never its bytes.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch
import torch.nn as nn

from .safe_files import MAX_MANIFEST_BYTES, CorruptCheckpointError, parse_json

__all__ = ["load_pretrained", "LoadResult", "INDEX_NAME"]

INDEX_NAME = "model.safetensors.index.json"


@dataclass
class LoadResult:
    """What ``load_pretrained`` did. ``missing_keys``/``unexpected_keys`` are
    only non-empty with ``strict=False`` (strict raises instead)."""

    loaded_keys: List[str] = field(default_factory=list)
    missing_keys: List[str] = field(default_factory=list)
    unexpected_keys: List[str] = field(default_factory=list)
    files: List[str] = field(default_factory=list)


def _safe_open(path: str):
    try:
        from safetensors import safe_open
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise ImportError("infinity.load_pretrained needs the 'safetensors' package (pip install safetensors)") from e
    _regular(path, "safetensors file")
    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for bad headers
        raise ValueError(f"load_pretrained: cannot read safetensors file {path!r}: {e}") from e


def _regular(path: str, what: str) -> int:
    """The size in bytes of ``path`` once links are resolved; an error naming
    ``what`` and ``path`` unless it is a regular file (see [Note: pretrained
    weights are a folder the user named])."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"load_pretrained: {what} {path!r} does not exist") from None
    except OSError as e:
        raise OSError(e.errno, f"load_pretrained: cannot read {what} {path!r}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"load_pretrained: {what} {path!r} is not a regular file (mode {st.st_mode:06o}: a FIFO, "
                         "device or folder); weights are read from regular .safetensors files only")
    return st.st_size


def _read_index(index: str):
    size = _regular(index, "index")
    if size > MAX_MANIFEST_BYTES:
        raise ValueError(f"load_pretrained: index {index!r} is {size} bytes, over the {MAX_MANIFEST_BYTES} an index "
                         "may have")
    try:
        with open(index, "rb") as f:
            return parse_json(index, f.read(MAX_MANIFEST_BYTES + 1))
    except CorruptCheckpointError as e:
        raise ValueError(f"load_pretrained: cannot parse the index: {e}") from None
    except OSError as e:
        raise OSError(e.errno, f"load_pretrained: cannot read the index {index!r}: {e.strerror}") from None


def _key_files(path: str) -> Dict[str, str]:
    """key -> file holding it, for a file, an indexed directory or a directory of shards."""
    if os.path.isfile(path):
        return {k: path for k in _keys_of(path)}
    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_pretrained: {path!r} is neither a safetensors file nor a directory")
    index = os.path.join(path, INDEX_NAME)
    if os.path.lexists(index):  # a FIFO or link to nothing here is refused, not skipped
        return _indexed_key_files(path, index)
    return _shard_key_files(path)


def _indexed_key_files(path: str, index: str) -> Dict[str, str]:
    """key -> shard, from a Hugging Face index; every shard it names must exist inside ``path``."""
    data = _read_index(index)
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise ValueError(f"load_pretrained: index {index!r} has no 'weight_map' of key -> shard file name")
    out = {}
    for k, shard in wm.items():
        if not shard or "\0" in shard or os.path.isabs(shard) or ".." in shard.replace("\\", "/").split("/"):
            raise ValueError(f"load_pretrained: index {index!r} names shard {shard!r} for key {k!r}, outside "
                             "its directory")
        out[k] = os.path.join(path, shard)
    for shard in sorted(set(out.values())):
        _regular(shard, f"shard named in {index!r},")
    return out


def _shard_key_files(path: str) -> Dict[str, str]:
    """key -> shard, from the headers of every ``*.safetensors`` in ``path``; a key may be in one only."""
    shards = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".safetensors"))
    if not shards:
        raise FileNotFoundError(f"load_pretrained: no {INDEX_NAME} and no *.safetensors file in {path!r}")
    out: Dict[str, str] = {}
    for shard in shards:
        for k in _keys_of(shard):
            if k in out:
                raise ValueError(f"load_pretrained: key {k!r} is in both {out[k]!r} and {shard!r}")
            out[k] = shard
    return out


def _keys_of(path: str) -> List[str]:
    with _safe_open(path) as f:
        return list(f.keys())


def _expected(model: nn.Module) -> Tuple[Dict[str, nn.Parameter], Dict[str, Tuple[nn.Module, str]]]:
    """Parameter names (tied ones under each name) and persistent buffer names,
    as ``model.state_dict()`` names them."""
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for bname, b in mod._buffers.items():
            if b is not None and bname not in mod._non_persistent_buffers_set:
                buffers[f"{mname}.{bname}" if mname else bname] = (mod, bname)
    return params, buffers


def load_pretrained(model: nn.Module, path: str, *, strict: bool = True) -> LoadResult:
    """Streams the weights at ``path`` into ``model`` (already given to
    ``infinity.initialize``), one paging unit at a time: fp32 master, compute
    copy and any device copy are overwritten; optimizer moments are kept.

    Tied parameters (one parameter under several names) load from whichever
    of their names the files hold. Persistent buffers in the files are copied
    into the module buffers (cast to their dtype).

    Args:
        model: a model managed by infinity.
        path: a ``.safetensors`` file, or a directory (see the module docstring).
        strict: raise on keys the model lacks or the files lack; otherwise
            they are skipped and listed in the result.

    Raises:
        KeyError naming the missing/unexpected keys (strict), ValueError
        naming key, file and both shapes on a shape mismatch (always),
        FileNotFoundError/ValueError naming the file or index at fault.
    """
    from ..api import engine_of

    engine = engine_of(model)
    key_file = _key_files(os.fspath(path))
    params, buffers = _expected(model)
    names_of: Dict[int, List[str]] = {}
    for name, p in params.items():
        names_of.setdefault(id(p), []).append(name)
    missing, unexpected = _unmatched(path, params, buffers, names_of, key_file, strict)
    per_unit = _keys_per_unit(engine, params, names_of, key_file)
    buffer_keys = [k for k in buffers if k in key_file]
    with _opened() as handle:
        # Shapes first, from the headers: nothing is written if one is wrong.
        _check_shapes(engine, per_unit, buffers, buffer_keys, key_file, handle)
        _write(engine, per_unit, buffers, buffer_keys, key_file, handle)
    loaded = sorted(k for slots in per_unit.values() for k in slots.values()) + buffer_keys
    return LoadResult(loaded_keys=loaded, missing_keys=[] if strict else missing,
                      unexpected_keys=[] if strict else unexpected, files=sorted(set(key_file.values())))


def _unmatched(path: str, params: Dict[str, nn.Parameter], buffers: Dict[str, Tuple[nn.Module, str]],
               names_of: Dict[int, List[str]], key_file: Dict[str, str],
               strict: bool) -> Tuple[List[str], List[str]]:
    """(missing, unexpected) keys; with ``strict`` a KeyError naming them
    (a tied parameter is missing only if none of its names is in the files)."""
    missing = [n for n in params if not any(m in key_file for m in names_of[id(params[n])])]
    missing += [n for n in buffers if n not in key_file]
    unexpected = sorted(k for k in key_file if k not in params and k not in buffers)
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"missing from the files: {missing[:20]}" + (" ..." if len(missing) > 20 else ""))
        if unexpected:
            parts.append("not in the model: " + ", ".join(f"{k!r} (in {key_file[k]!r})" for k in unexpected[:20])
                         + (" ..." if len(unexpected) > 20 else ""))
        raise KeyError(f"load_pretrained({path!r}, strict=True): " + "; ".join(parts))
    return missing, unexpected


def _keys_per_unit(engine, params: Dict[str, nn.Parameter], names_of: Dict[int, List[str]],
                   key_file: Dict[str, str]) -> Dict[int, Dict[int, str]]:
    """What goes where: unit index -> {slot: key}; one key per parameter
    (a tied one from the first of its names the files hold)."""
    per_unit: Dict[int, Dict[int, str]] = {}
    done = set()
    for name, p in params.items():
        if id(p) in done:
            continue
        key = next((m for m in names_of[id(p)] if m in key_file), None)
        if key is None:
            continue
        done.add(id(p))
        hit = engine.param_slot.get(id(p))
        if hit is None:
            raise RuntimeError(f"load_pretrained: parameter {name!r} is not managed by the engine")
        unit, slot = hit
        per_unit.setdefault(unit.index, {})[slot] = key
    return per_unit


@contextlib.contextmanager
def _opened() -> Iterator[Callable[[str], Any]]:
    """Yields ``handle(fname)``: each file opened once, on first use; all
    closed on the way out, whatever happened."""
    handles: Dict[str, Any] = {}

    def handle(fname: str):
        if fname not in handles:
            handles[fname] = _safe_open(fname).__enter__()
        return handles[fname]

    try:
        yield handle
    finally:
        for h in handles.values():
            try:
                h.__exit__(None, None, None)
            except Exception:
                pass


def _check_shapes(engine, per_unit: Dict[int, Dict[int, str]], buffers: Dict[str, Tuple[nn.Module, str]],
                  buffer_keys: List[str], key_file: Dict[str, str], handle: Callable[[str], Any]) -> None:
    """Every key's shape against its slot's or buffer's, from the headers."""
    for ui, slots in per_unit.items():
        for slot, key in slots.items():
            s = engine.units[ui].layout.slots[slot]
            _check_shape(key, key_file[key], handle(key_file[key]), tuple(s.shape))
    for key in buffer_keys:
        mod, bname = buffers[key]
        _check_shape(key, key_file[key], handle(key_file[key]), tuple(mod._buffers[bname].shape))


def _write(engine, per_unit: Dict[int, Dict[int, str]], buffers: Dict[str, Tuple[nn.Module, str]],
           buffer_keys: List[str], key_file: Dict[str, str], handle: Callable[[str], Any]) -> None:
    """Writes each unit's values through the engine, one unit's tensors at a
    time, then copies the buffers."""
    opt = getattr(engine, "optimizer", None)
    if opt is not None:
        opt.flush()  # a queued delayed update would overwrite the loaded values
    for ui in sorted(per_unit):
        values = {slot: handle(key_file[key]).get_tensor(key) for slot, key in per_unit[ui].items()}
        engine.values.write(engine.units[ui], values)
        del values  # one unit's tensors at a time
    with torch.no_grad():
        for key in buffer_keys:
            mod, bname = buffers[key]
            b = mod._buffers[bname]
            b.copy_(handle(key_file[key]).get_tensor(key).to(b.device))


def _check_shape(key: str, fname: str, handle, expected: Tuple[int, ...]) -> None:
    try:
        shape = tuple(handle.get_slice(key).get_shape())
    except Exception as e:
        raise ValueError(f"load_pretrained: key {key!r} cannot be read from {fname!r}: {e}") from e
    if shape != expected:
        raise ValueError(f"load_pretrained: key {key!r} in {fname!r} has shape {shape}, the model expects "
                         f"{expected}")
