"""The random number generators' states, as JSON (no pickle on the load path):
Python's ``random``, numpy's global generator when numpy is imported, torch's
CPU generator and every CUDA device's."""

from __future__ import annotations

import base64
import random
import sys
from typing import Optional

import torch

__all__ = ["capture", "restore"]


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.contiguous().numpy().tobytes()).decode()


def _bytes_tensor(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def capture() -> dict:
    """This process's generator states."""
    version, state, gauss = random.getstate()
    out = {"python": [version, list(state), gauss], "torch_cpu": _b64(torch.get_rng_state())}
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = [kind, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["torch_cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return out


def restore(saved: Optional[dict]) -> None:
    """Sets the generators to ``saved`` (from :func:`capture`); generators it
    does not name are left alone."""
    if not saved:
        return
    if "python" in saved:
        version, state, gauss = saved["python"]
        random.setstate((version, tuple(state), gauss))
    if "torch_cpu" in saved:
        torch.set_rng_state(_bytes_tensor(saved["torch_cpu"]))
    if "numpy" in saved:
        import numpy as np
        kind, keys, pos, has_gauss, cached = saved["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "torch_cuda" in saved and torch.cuda.is_available():
        states = [_bytes_tensor(s) for s in saved["torch_cuda"]]
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)


def check(saved, where: str) -> None:
    """Raises CorruptCheckpointError naming ``where`` unless ``saved`` (one
    rank's states from a manifest) has the shapes :func:`restore` sets:
    checked before a load changes anything."""
    from .safe_files import CorruptCheckpointError
    if not saved:
        return

    def bad(field: str, want: str) -> None:
        raise CorruptCheckpointError(f"{where}.{field} must be {want}; the manifest is corrupt (nothing was loaded)")

    if not isinstance(saved, dict):
        bad("", "a JSON object")
    if "python" in saved and not _python_ok(saved["python"]):
        bad("python", "[version, 625 ints of 32 bits, null or a number] (random.getstate())")
    if "torch_cpu" in saved and _decoded_len(saved["torch_cpu"]) != torch.get_rng_state().numel():
        bad("torch_cpu", f"base64 of {torch.get_rng_state().numel()} bytes (torch.get_rng_state())")
    if "numpy" in saved and not _numpy_ok(saved["numpy"]):
        bad("numpy", "['MT19937', 624 ints of 32 bits, position, has_gauss, cached] (numpy.random.get_state())")
    cuda = saved.get("torch_cuda", [])
    if not isinstance(cuda, list) or any(_decoded_len(s) is None for s in cuda):
        bad("torch_cuda", "a list of base64 strings (torch.cuda.get_rng_state_all())")


def _u32(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 32


def _python_ok(v) -> bool:
    return (isinstance(v, list) and len(v) == 3 and _u32(v[0]) and isinstance(v[1], list) and len(v[1]) == 625
            and all(_u32(x) for x in v[1]) and v[1][-1] <= 624
            and (v[2] is None or (isinstance(v[2], float))))


def _numpy_ok(v) -> bool:
    return (isinstance(v, list) and len(v) == 5 and v[0] == "MT19937" and isinstance(v[1], list)
            and len(v[1]) == 624 and all(_u32(x) for x in v[1]) and _u32(v[2]) and v[2] <= 624
            and v[3] in (0, 1) and isinstance(v[4], (int, float)) and not isinstance(v[4], bool))


def _decoded_len(s):
    """The bytes base64 ``s`` decodes to, or None where it is not base64."""
    if not isinstance(s, str):
        return None
    try:
        return len(base64.b64decode(s, validate=True))
    except ValueError:
        return None
