"""A machine's speeds, as the step-time model reads them: measured by
``infinity doctor --profile OUT.json`` or written by hand from data sheets
(the shipped ones are in ``profiles/``, each with its sources).

Every rate is per second; sizes are bytes. ``slow`` holds the interference
factors between the simulation's resources ([Note: interference between
resources] in simulate.py), keyed ``"a<b"``: while ``b`` is busy a task on
``a`` runs at ``1 / (1 + k)`` of its speed.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Tuple

__all__ = ["Profile", "load_profile", "shipped_profiles", "RESOURCES"]

# The resources of the step model (step_time.py); ``slow`` may name only these.
RESOURCES = ("compute", "h2d", "d2h", "optimizer", "disk_read", "disk_write", "net_device", "net_host")
_DIR = Path(__file__).with_name("profiles")


@dataclass
class Profile:
    """A machine's speeds; see the module docstring."""

    name: str
    source: str                                   # where the figures come from
    device: str                                   # "cpu" or "cuda": what the figures are of
    gemm_flops: Dict[str, List[List[float]]]      # dtype -> [[size, FLOP/s], ...]: a size-n GEMM is n x n x n
    mem_bw: float                                 # device memory, bytes/s (elementwise ops)
    op_overhead_s: float                          # fixed cost of one op (launch, dispatch), s
    h2d_bw: float                                 # host -> device copy, bytes/s (pinned on CUDA)
    d2h_bw: float
    adamw_params_per_s: Dict[str, float]          # gradient dtype -> parameters/s of the native AdamW
    disk_read_bw: float                           # all swap paths together, bytes/s (O_DIRECT)
    disk_write_bw: float
    # The engine's own time per parameter tensor of a unit, per pass ("forward", "backward"), s: its guard on
    # each parameter's use, each gradient's hand-off to the host, the hooks; measured beside plain PyTorch
    # (infinity doctor --profile; [Note: the engine's time per parameter] in step_time.py). Empty: none.
    param_overhead_s: Dict[str, float] = field(default_factory=dict)
    # ... and per op the unit runs (the saved-tensor hooks, the guard's dispatch), per pass, s.
    engine_op_overhead_s: Dict[str, float] = field(default_factory=dict)
    # ZeRO's links ([Note: collectives in the step model] in collectives.py): "net_device" / "net_host" ->
    # bytes/s this rank sends in a ring collective, and the fixed cost of one collective, s.
    net_bw: Dict[str, float] = field(default_factory=dict)
    net_latency_s: Dict[str, float] = field(default_factory=dict)
    slow: Dict[str, float] = field(default_factory=dict)
    extra: Dict[str, object] = field(default_factory=dict)  # measured figures kept for the record

    def __post_init__(self) -> None:
        for k in ("mem_bw", "h2d_bw", "d2h_bw", "disk_read_bw", "disk_write_bw"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"profile {self.name!r}: {k}={v!r} must be a positive number (bytes/s)")
        per_pass = [(f"{k}[{p!r}]", v) for k in ("param_overhead_s", "engine_op_overhead_s")
                    for p, v in getattr(self, k).items()]
        for k, v in [("op_overhead_s", self.op_overhead_s)] + per_pass:
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"profile {self.name!r}: {k}={v!r} must be a number >= 0 (seconds)")
        for k in ("param_overhead_s", "engine_op_overhead_s"):
            if set(getattr(self, k)) - {"forward", "backward"}:
                raise ValueError(f"profile {self.name!r}: {k} takes the keys 'forward' and 'backward', "
                                 f"not {sorted(set(getattr(self, k)) - {'forward', 'backward'})}")
        if not self.gemm_flops:
            raise ValueError(f"profile {self.name!r}: gemm_flops is empty; give [[size, FLOP/s], ...] per dtype")
        for key in self.slow:
            a, _, b = key.partition("<")
            if a not in RESOURCES or b not in RESOURCES:
                raise ValueError(f"profile {self.name!r}: slow[{key!r}] must be 'a<b' with a, b in {RESOURCES}")

    def gemm_rate(self, dtype: str, flops: float) -> float:
        """FLOP/s of a matrix product of ``flops`` in ``dtype`` ("bf16", "fp16",
        "fp32"): log-linear between the measured sizes, clamped at the ends;
        a dtype not measured takes fp32's, else the first given."""
        pts = sorted(self.gemm_flops.get(dtype) or self.gemm_flops.get("fp32") or next(iter(self.gemm_flops.values())))
        n = (max(flops, 1.0) / 2) ** (1 / 3)  # the side of the square GEMM of the same work
        if n <= pts[0][0]:
            return pts[0][1]
        for (n0, r0), (n1, r1) in zip(pts, pts[1:]):
            if n <= n1:
                w = math.log(n / n0) / math.log(n1 / n0)
                return r0 + w * (r1 - r0)
        return pts[-1][1]

    def net(self, link: str) -> Tuple[float, float]:
        """``(bytes/s, latency s)`` of ZeRO's ``link`` ("net_device" or "net_host")."""
        bw, lat = self.net_bw.get(link), self.net_latency_s.get(link, 0.0)
        if not (isinstance(bw, (int, float)) and bw > 0 and math.isfinite(bw)) or not lat >= 0:
            raise ValueError(f"profile {self.name!r}: no network figures for {link!r} (net_bw, net_latency_s), "
                             "needed on several ranks: measure with `infinity doctor --profile OUT.json` "
                             "or add them by hand")
        return float(bw), float(lat)

    def adamw_rate(self, grad_dtype: str) -> float:
        """Parameters/s of the AdamW with gradients in ``grad_dtype`` (fp32's when not measured)."""
        r = self.adamw_params_per_s.get(grad_dtype) or self.adamw_params_per_s.get("fp32")
        if not r:
            raise ValueError(f"profile {self.name!r}: adamw_params_per_s has no {grad_dtype!r} nor 'fp32' rate")
        return float(r)

    def slow_pairs(self) -> Dict[Tuple[str, str], float]:
        """``slow`` as the simulation takes it: {(a, b): k}."""
        return {tuple(k.split("<", 1)): float(v) for k, v in self.slow.items()}

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def load_profile(path: str) -> Profile:
    """A profile from a JSON file, or a shipped one by name (``shipped_profiles()``)."""
    p = Path(path)
    if not p.exists() and (_DIR / f"{path}.json").exists():
        p = _DIR / f"{path}.json"
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"profile {path!r}: no such file, nor a shipped profile ({shipped_profiles()})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"profile {path!r}: not JSON ({e})") from None
    if isinstance(data, dict) and "unit_overhead_s" in data:
        raise ValueError(f"profile {path!r}: unit_overhead_s (per unit) was replaced by param_overhead_s (per "
                         "parameter tensor and pass): measure the profile again with `infinity doctor --profile`")
    try:
        return Profile(**data)
    except TypeError as e:
        raise ValueError(f"profile {path!r}: {e}") from None


def shipped_profiles() -> List[str]:
    """Names of the hand-written profiles in the package."""
    return sorted(f.stem for f in _DIR.glob("*.json"))
