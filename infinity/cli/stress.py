"""``infinity stress``: the memory-pressure stress test.

Trains a model whose state is about 3x the host budget it sets, with NVMe
swap, through each scenario in its own processes (a kill is observed, not
suffered): budget squeeze, RAM squeeze, pinned-memory squeeze, disk faults,
process faults and a soak (infinity/stress/scenarios.py and soak.py say what each
checks). Prints a table, writes OUT/stress.json and, with matplotlib,
OUT/stress.png. Exit 0 when every scenario passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from typing import Any, List

from .common import UsageError


def add_parser(sub: Any) -> None:
    p = sub.add_parser("stress", help="memory-pressure and fault stress test", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default="budget,ram,pinned,disk,process,soak",
                   help="comma-separated: budget, ram, pinned, disk, process, soak (default: all)")
    p.add_argument("--minutes", type=float, default=10.0, help="length of the soak in minutes (default 10)")
    p.add_argument("--quick", action="store_true", help="short versions (~3 minutes in all; what CI runs)")
    p.add_argument("--swap-path", default="./infinity-stress-swap",
                   help="folder for the scenarios' swap files (removed at the end; default ./infinity-stress-swap)")
    p.add_argument("--out", default="./infinity-stress", help="folder for stress.json, stress.png and checkpoints")
    p.set_defaults(run=run)


def _table(rows: List[dict]) -> str:
    """One line per scenario (result, step time p50/p95, resumed exactly, RSS growth, peaks against budgets,
    the first error), then each check and the notes."""
    from ..config.runtime import format_bytes
    lines = [f"{'SCENARIO':24}{'RESULT':8}{'p50 s':>7}{'p95 s':>7} {'RESUMED':8}{'LEAK':>13}  "
             "PEAK/BUDGET (device, host)   FIRST ERROR"]
    for r in rows:
        p, b = r.get("peaks") or {}, r.get("budgets") or {}
        tiers = ", ".join(f"{format_bytes(p[t])}/{format_bytes(b[t])}" for t in ("device", "host") if p.get(t)
                          and b.get(t))
        p50 = f"{r['p50_s']:.3f}" if r.get("p50_s") else "-"
        p95 = f"{r['p95_s']:.3f}" if r.get("p95_s") else "-"
        resumed = {True: "exact", False: "NOT"}.get(r.get("resumed_exactly"), "-")
        slope = r.get("rss_slope_mib_per_1000_steps")
        leak = f"{slope:+.1f}MiB/kstep" if slope is not None else "-"
        err = (r.get("first_error") or "-").split("\n")[0][:60]
        lines.append(f"{r['name']:24}{'PASS' if r['passed'] else 'FAIL':8}{p50:>7}{p95:>7} {resumed:8}{leak:>13}  "
                     f"{tiers:28} {err}")
        for what, ok in r["checks"].items():
            lines.append(f"    {'ok  ' if ok else 'FAIL'} {what}")
        if r.get("notes"):
            lines.append(f"    note: {r['notes']}")
    return "\n".join(lines)


def _plot(rows: List[dict], path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for r in rows:
        if r["name"] == "budget squeeze":
            ax[0].plot([c["device_budget"] / 2**20 for c in r["curve"]], [c["p50_s"] for c in r["curve"]], "o-")
        if r["name"] == "soak" and r.get("samples"):
            t0 = r["samples"][0]["t"]
            ax[1].plot([(s["t"] - t0) / 60 for s in r["samples"]], [s["rss"] / 2**20 for s in r["samples"]])
    ax[0].set(title="budget squeeze: step time per device budget", xlabel="device budget (MiB)", ylabel="s/step")
    ax[1].set(title="soak: RSS", xlabel="minutes", ylabel="MiB")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def run(args: argparse.Namespace) -> int:
    from ..stress.scenarios import SCENARIOS, Context
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [n for n in names if n not in SCENARIOS]
    if bad:
        raise UsageError(f"--scenarios: unknown {bad}; choose from {sorted(SCENARIOS)}")
    os.makedirs(args.out, exist_ok=True)
    ctx = Context(args.out, os.path.abspath(args.swap_path), args.quick, args.minutes)
    rows = []
    try:
        for n in names:
            t0 = time.time()
            row = SCENARIOS[n](ctx)
            row["seconds"] = round(time.time() - t0, 1)
            rows.append(row)
            print(f"[stress] {row['name']}: {'PASS' if row['passed'] else 'FAIL'} ({row['seconds']} s)", flush=True)
    finally:
        shutil.rmtree(ctx.swap_root, ignore_errors=True)
    print("\n" + _table(rows))
    with open(os.path.join(args.out, "stress.json"), "w") as f:
        json.dump(rows, f, indent=1)
    png = os.path.join(args.out, "stress.png")
    print(f"\nwrote {os.path.join(args.out, 'stress.json')}" + (f" and {png}" if _plot(rows, png) else ""))
    return 0 if all(r["passed"] for r in rows) else 1
