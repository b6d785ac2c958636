"""Reading :class:`infinity.Config` from TOML and JSON files.

A file is either a run file (``infinity train``'s: sections ``model``,
``data``, ``runtime``, ...; the Config is its ``runtime`` table) or a flat
file whose top-level keys are Config fields. Every mistake raises
:class:`ConfigFileError` naming the file, the key path (``runtime.offload_params``)
and the valid choices, with the nearest valid key for a misspelling.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import sys
from typing import Any, Dict, Iterable, Mapping, Optional

from .runtime import Config

__all__ = ["ConfigFileError", "read_file", "config_from_file", "config_from_mapping", "nearest", "RUN_SECTIONS"]

# Top-level tables of a run file (docs/cli.md); a file with any of them is a
# run file, and its Config is the ``runtime`` table.
RUN_SECTIONS = ("model", "data", "optimizer", "schedule", "runtime", "checkpoint", "log", "train")


class ConfigFileError(ValueError):
    """A config file that cannot be read or holds a bad key or value; the
    message names the file and the key path."""


def nearest(name: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices`` to ``name``, or ""."""
    hit = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{hit[0]}'?)" if hit else ""


def _load_toml(text: str, path: str) -> Dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python < 3.11 has tomli (a dependency there)
        import tomli as tomllib
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"{path}: not valid TOML: {exc}") from None
    except RecursionError:
        raise ConfigFileError(f"{path}: nested too deeply to be a config file") from None


def read_file(path: str) -> Dict[str, Any]:
    """The table in the TOML (``.toml``) or JSON (``.json``) file ``path``;
    other suffixes are tried as JSON, then TOML. Raises ConfigFileError."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ConfigFileError(f"{path}: cannot read the config file: {exc.strerror}") from None
    ext = os.path.splitext(path)[1].lower()
    if ext == ".toml":
        data = _load_toml(text, path)
    else:
        try:
            data = json.loads(text)
        except RecursionError:
            raise ConfigFileError(f"{path}: nested too deeply to be a config file") from None
        except json.JSONDecodeError as exc:
            if ext == ".json":
                raise ConfigFileError(f"{path}: not valid JSON: {exc}") from None
            data = _load_toml(text, path)
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: the top level must be a table/object, not {type(data).__name__}")
    return data


def _fields() -> list:
    return [f.name for f in dataclasses.fields(Config)]


def config_from_mapping(table: Mapping[str, Any], source: str = "<dict>", prefix: str = "runtime") -> Config:
    """A Config from ``table`` (Config field -> value). ``source`` (the file)
    and ``prefix`` (the key path of the table) only shape the error messages."""
    where = f"{prefix}." if prefix else ""
    if not isinstance(table, Mapping):
        raise ConfigFileError(f"{source}: '{prefix}' must be a table of Config fields, not {type(table).__name__}")
    names = _fields()
    for key in table:
        if key not in names:
            raise ConfigFileError(f"{source}: unknown key '{where}{key}'{nearest(key, names)}; valid keys: "
                                  f"{names} (docs/config.md)")
    try:
        return Config(**dict(table))
    except (ValueError, TypeError) as exc:
        # Config's messages start "Config.<field>=...": name the key path
        # instead, and every other key of the table the message names (a
        # combination such as min_loss_scale above initial_loss_scale).
        msg = str(exc)
        m = re.match(r"Config\.(\w+)", msg)
        named = [m.group(1)] if m else []
        named += [k for k in table if k not in named and re.search(rf"\b{re.escape(k)}\b", msg)]
        key = ", ".join(f"'{where}{k}'" for k in named) or (f"'{prefix}'" if prefix else "the config")
        raise ConfigFileError(f"{source}: {key}: {msg}") from None


def runtime_table(data: Mapping[str, Any], source: str) -> tuple:
    """``(table, prefix)``: the ``runtime`` table of a run file, or the whole
    flat file. A run file without ``runtime`` gives an empty table (defaults)."""
    if any(k in data for k in RUN_SECTIONS):
        for key in data:
            if key not in RUN_SECTIONS:
                raise ConfigFileError(f"{source}: unknown section '{key}'{nearest(key, RUN_SECTIONS)}; valid "
                                      f"sections: {list(RUN_SECTIONS)} (docs/cli.md)")
        return data.get("runtime", {}), "runtime"
    return data, ""


def config_from_file(path: str, section: Optional[str] = None) -> Config:
    """:meth:`Config.from_file`: the Config of a TOML/JSON run file's
    ``runtime`` table (or of ``section`` when given), or of a flat file."""
    data = read_file(str(path))
    if section is not None:
        if section not in data:
            raise ConfigFileError(f"{path}: no '{section}' table{nearest(section, data)}")
        return config_from_mapping(data[section], str(path), section)
    from .deepspeed import is_deepspeed
    if is_deepspeed(data):
        raise ConfigFileError(f"{path}: this is a DeepSpeed config (it has "
                              f"{[k for k in data if k in ('zero_optimization', 'fp16', 'bf16')] or list(data)[:3]}); "
                              "read it with Config.from_deepspeed(path), which reports what each key became")
    table, prefix = runtime_table(data, str(path))
    return config_from_mapping(table, str(path), prefix)
