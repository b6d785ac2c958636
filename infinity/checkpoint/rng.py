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
