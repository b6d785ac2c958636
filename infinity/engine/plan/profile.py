"""A machine's speeds, as the step-time model reads them: measured by
``infinity doctor --profile OUT.json`` or written by hand from data sheets
(the shipped ones are in ``profiles/``, each with its sources).

Every rate is per second; sizes are bytes. ``slow`` holds the interference
factors between the simulation's resources ([Note: interference between
resources] in simulate.py), keyed ``"a<b"``: while ``b`` is busy a task on
``a`` runs at ``1 / (1 + k)`` of its speed.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

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
    # The engine's own time at the step boundary, outside the optimizer's kernels ([Note: the step boundary] in
    # step_time.py): "fixed" s a step, "per_tensor" s per parameter tensor of the model. Empty: none.
    step_overhead_s: Dict[str, float] = field(default_factory=dict)
    # ZeRO's links ([Note: collectives in the step model] in collectives.py): "net_device" / "net_host" ->
    # bytes/s this rank sends in a ring collective, and the fixed cost of one collective, s.
    net_bw: Dict[str, float] = field(default_factory=dict)
    net_latency_s: Dict[str, float] = field(default_factory=dict)
    slow: Dict[str, float] = field(default_factory=dict)
    # Rates of the kernels that run ([Note: an op's time] in costs.py), per compute dtype; empty: not measured
    # (products then take gemm_flops' square rates, attention its FLOPs at those, every other op the roofline).
    # Matrix products on a grid of shapes: [[m, n, k, FLOP/s], ...], every (m, n, k) of the sizes given per axis.
    gemm_shapes: Dict[str, List[List[float]]] = field(default_factory=dict)
    # Attention (F.scaled_dot_product_attention, causal, as the device runs it): {"forward" | "backward":
    # [[sequence length, FLOP/s], ...]}, the FLOPs torch's counter gives.
    attention_flops: Dict[str, Dict[str, List[List[float]]]] = field(default_factory=dict)
    # Compute-bound elementwise ops: {aten op name: elements of its first result / s}.
    op_rates: Dict[str, Dict[str, float]] = field(default_factory=dict)
    extra: Dict[str, object] = field(default_factory=dict)  # measured figures kept for the record

    def __post_init__(self) -> None:
        for k in ("mem_bw", "h2d_bw", "d2h_bw", "disk_read_bw", "disk_write_bw"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and v > 0 and math.isfinite(v)):
                raise ValueError(f"profile {self.name!r}: {k}={v!r} must be a positive number (bytes/s)")
        per_pass = [(f"{k}[{p!r}]", v) for k in ("param_overhead_s", "engine_op_overhead_s", "step_overhead_s")
                    for p, v in getattr(self, k).items()]
        for k, v in [("op_overhead_s", self.op_overhead_s)] + per_pass:
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"profile {self.name!r}: {k}={v!r} must be a number >= 0 (seconds)")
        for k, keys in (("param_overhead_s", ("forward", "backward")), ("engine_op_overhead_s", ("forward", "backward")),
                        ("step_overhead_s", ("fixed", "per_tensor"))):
            if set(getattr(self, k)) - set(keys):
                raise ValueError(f"profile {self.name!r}: {k} takes the keys {' and '.join(map(repr, keys))}, "
                                 f"not {sorted(set(getattr(self, k)) - set(keys))}")
        for dt, grid in self.gemm_shapes.items():
            _check_grid(self.name, dt, grid)
        if not self.gemm_flops:
            raise ValueError(f"profile {self.name!r}: gemm_flops is empty; give [[size, FLOP/s], ...] per dtype")
        for key in self.slow:
            a, _, b = key.partition("<")
            if a not in RESOURCES or b not in RESOURCES:
                raise ValueError(f"profile {self.name!r}: slow[{key!r}] must be 'a<b' with a, b in {RESOURCES}")

    def gemm_rate(self, dtype: str, flops: float, shape: Optional[Sequence[int]] = None) -> float:
        """FLOP/s of a matrix product of ``flops`` in ``dtype`` ("bf16", "fp16",
        "fp32"). With its ``shape`` (m, n, k) and a grid measured for the
        dtype (``gemm_shapes``): interpolated on the grid, log-linear in each
        size, clamped at its edges. Else by the square sizes: log-linear
        between them, clamped at the ends; a dtype not measured takes fp32's,
        else the first given."""
        grid = self.gemm_shapes.get(dtype)
        if shape is not None and len(shape) == 3 and grid:
            return _grid_rate(grid, shape)
        pts = self.gemm_flops.get(dtype) or self.gemm_flops.get("fp32") or next(iter(self.gemm_flops.values()))
        n = (max(flops, 1.0) / 2) ** (1 / 3)  # the side of the square GEMM of the same work
        return _interp(sorted(pts), n)

    def attention_rate(self, dtype: str, backward: bool, length: int) -> Optional[float]:
        """FLOP/s of attention at sequence ``length`` (its backward when
        ``backward``), log-linear between the measured lengths and clamped;
        None when the profile has none for ``dtype``."""
        pts = self.attention_flops.get(dtype, {}).get("backward" if backward else "forward")
        return _interp(sorted(pts), length) if pts else None

    def op_rate(self, dtype: str, name: str) -> Optional[float]:
        """Elements/s of the elementwise aten op ``name`` in ``dtype``; None when not measured."""
        r = self.op_rates.get(dtype, {}).get(name)
        return float(r) if r else None

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


def _interp(pts: List[List[float]], x: float) -> float:
    """The rate at ``x`` of sorted ``[[x, rate], ...]``: log-linear between points, clamped at the ends."""
    if x <= pts[0][0]:
        return float(pts[0][1])
    for (x0, r0), (x1, r1) in zip(pts, pts[1:]):
        if x <= x1:
            w = math.log(x / x0) / math.log(x1 / x0)
            return r0 + w * (r1 - r0)
    return float(pts[-1][1])


def _axis(sizes: List[float], x: float) -> List[Tuple[float, float]]:
    """``[(size, weight), ...]`` of ``x`` between its two bracketing ``sizes`` (log-linear, clamped)."""
    if x <= sizes[0]:
        return [(sizes[0], 1.0)]
    for s0, s1 in zip(sizes, sizes[1:]):
        if x <= s1:
            w = math.log(x / s0) / math.log(s1 / s0)
            return [(s0, 1.0 - w), (s1, w)]
    return [(sizes[-1], 1.0)]


def _grid_rate(grid: List[List[float]], shape: Sequence[int]) -> float:
    """The rate at ``shape`` (m, n, k) of a full grid ``[[m, n, k, rate], ...]``, multilinear in log sizes."""
    table = {tuple(p[:3]): p[3] for p in grid}
    axes = [sorted({p[i] for p in grid}) for i in range(3)]
    rate = 0.0
    for (m, wm), (n, wn), (k, wk) in itertools.product(*(_axis(a, max(float(x), 1.0)) for a, x in zip(axes, shape))):
        rate += wm * wn * wk * table[(m, n, k)]
    return rate


def _check_grid(name: str, dtype: str, grid: List[List[float]]) -> None:
    if not all(len(p) == 4 and all(isinstance(v, (int, float)) and v > 0 for v in p) for p in grid):
        raise ValueError(f"profile {name!r}: gemm_shapes[{dtype!r}] takes [[m, n, k, FLOP/s], ...], all positive")
    axes = [{p[i] for p in grid} for i in range(3)]
    if len({tuple(p[:3]) for p in grid}) != len(axes[0]) * len(axes[1]) * len(axes[2]):
        raise ValueError(f"profile {name!r}: gemm_shapes[{dtype!r}] must hold every (m, n, k) of its sizes once "
                         f"(m in {sorted(axes[0])}, n in {sorted(axes[1])}, k in {sorted(axes[2])})")


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
