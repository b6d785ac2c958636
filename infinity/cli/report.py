"""``infinity report METRICS.jsonl [-o report.png]``: plots a metrics file
of ``infinity train``: the loss; the step time split into compute, stall and
optimizer wait (with the measured and predicted step when the run had a
``log.profile``); peak bytes per tier against its budget; bytes moved per link
per step. Needs matplotlib (``pip install matplotlib`` or ``infinity[plot]``).
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List

from .common import CLIError, UsageError
from .metrics import TIERS

UNITS = (("GiB", float(1 << 30)), ("MiB", float(1 << 20)), ("KiB", 1024.0), ("B", 1.0))


def _unit(largest: float):
    """``(name, divisor)``: the largest binary unit that ``largest`` bytes reach."""
    return next(((n, d) for n, d in UNITS if largest >= d), UNITS[-1])


def add_parser(sub: Any) -> None:
    p = sub.add_parser("report", help="plot a metrics file of `infinity train`", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", help="metrics JSONL file (log.metrics of the run file)")
    p.add_argument("-o", "--output", default="report.png", help="output image (default report.png)")
    p.set_defaults(run=run)


def read_metrics(path: str) -> List[Dict[str, Any]]:
    """The records of a metrics file; raises UsageError naming the file and line."""
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as exc:
                        raise UsageError(f"{path}:{i}: not a JSON line: {exc}") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot read the metrics file: {exc.strerror}") from None
    if not rows or "step" not in rows[0]:
        raise UsageError(f"{path}: no records with a 'step' (is it a metrics file of `infinity train`?)")
    return rows


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise CLIError("infinity report needs matplotlib: pip install matplotlib (or pip install 'infinity[plot]')") \
            from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    return plt


def plot(rows: List[Dict[str, Any]], out: str) -> None:
    """Writes the four panels of ``rows`` to the image ``out``."""
    plt = _pyplot()
    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    ax[0, 0].plot(steps, [r["loss"] for r in rows])
    ax[0, 0].set(title="loss", xlabel="step")
    parts = [("compute_s", "compute"), ("stall_s", "stall"), ("optimizer_wait_s", "optimizer wait")]
    ax[0, 1].stackplot(steps, *[[r.get(k, 0.0) for r in rows] for k, _ in parts], labels=[n for _, n in parts])
    pred = [r.get("predicted_s") for r in rows]
    if any(p is not None for p in pred):  # infinity train with log.profile: measured beside predicted
        ax[0, 1].plot(steps, [r.get("step_s") for r in rows], color="black", label="step, measured")
        ax[0, 1].plot(steps, pred, color="black", linestyle="--", label="step, predicted")
    ax[0, 1].set(title="step time", xlabel="step", ylabel="s")
    ax[0, 1].legend(loc="upper right")
    _tiers(ax[1, 0], steps, rows)
    _links(ax[1, 1], steps, rows)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def _tiers(ax, steps: List[int], rows: List[Dict[str, Any]]) -> None:
    """Peak bytes per tier (solid) against its budget (dashed)."""
    budgets = {t: rows[-1]["budget_bytes"].get(t) for t in TIERS}
    unit, div = _unit(max([r["peak_bytes"].get(t, 0) for r in rows for t in TIERS]
                          + [b for b in budgets.values() if b]))
    for t in TIERS:
        peak = [r["peak_bytes"].get(t, 0) / div for r in rows]
        if any(peak):
            line = ax.plot(steps, peak, label=f"{t} peak")[0]
            if budgets[t]:
                ax.axhline(budgets[t] / div, color=line.get_color(), linestyle="--", label=f"{t} budget")
    ax.set(title="bytes per tier", xlabel="step", ylabel=unit)
    ax.legend(loc="upper left")


def _links(ax, steps: List[int], rows: List[Dict[str, Any]]) -> None:
    """Bytes moved per link in each logged step."""
    links = sorted({k for r in rows for k in r.get("step_bytes_moved", {})})
    unit, div = _unit(max([r["step_bytes_moved"].get(k, 0) for r in rows for k in links] + [0]))
    for link in links:
        ax.plot(steps, [r["step_bytes_moved"].get(link, 0) / div for r in rows], label=link)
    ax.set(title="traffic per link per step", xlabel="step", ylabel=unit)
    if links:
        ax.legend(loc="upper right")


def run(args: argparse.Namespace) -> int:
    """Reads the metrics, writes the image; 0 on success."""
    rows = read_metrics(args.metrics)
    plot(rows, args.output)
    print(f"infinity report: {len(rows)} records -> {args.output}")
    return 0
