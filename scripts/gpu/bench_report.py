"""The figures of scripts/gpu/bench_gpu.py: one phase's rows summarized
against plain PyTorch and the raw probes, the printed table, and the check of
the report's format that its --dry-run (and CI) relies on."""

from __future__ import annotations

import math
import re
import statistics

FIELDS = ("steps", "step_s", "tokens_per_s", "tflops", "mfu", "ratio_to_torch", "peak_device_bytes",
          "pinned_bytes", "gpu_idle_frac", "h2d_bytes", "d2h_bytes", "transfer_source", "cpu_adam_s",
          "adam_Gparam_per_s", "hidden_share", "optimizer_threads", "pressure_events", "bound_s", "efficiency",
          "error")
ALWAYS_RUN = ("torch", "inf-opt")  # without these two there is no comparison


def _median(xs):
    return statistics.median(xs) if xs else None


def engine_figures(c0: dict, c1: dict, k: int) -> dict:
    """Per-step figures from infinity's counters before and after ``k`` timed steps."""
    d = lambda key: (c1[key] - c0[key]) / k  # noqa: E731
    opt, wait = d("optimizer_seconds"), d("optimizer_wait_seconds")
    return {"h2d_bytes": (c1["bytes_moved"]["h2d"] - c0["bytes_moved"]["h2d"]) / k,
            "d2h_bytes": (c1["bytes_moved"]["d2h"] - c0["bytes_moved"]["d2h"]) / k,
            "transfer_source": "counted", "cpu_adam_s": opt,
            "hidden_share": max(0.0, 1.0 - wait / opt) if opt > 0 else None,
            "stall_s": d("stall_seconds"), "device_stall_s": d("device_stall_seconds"),
            "optimizer_threads": c1["optimizer_threads"],
            "pressure_events": c1["pressure_events"][len(c0["pressure_events"]):]}


def bound_of(row: dict, compute_s, probes: dict, cuda: bool):
    """The row's lower bound, seconds: on CUDA max(GPU compute, CPU AdamW, H2D,
    D2H) (copies at the duplex rate: both directions run at once in a step);
    on the CPU compute + AdamW (they share the cores) against the copies."""
    if compute_s is None or row["cpu_adam_s"] is None or row["h2d_bytes"] is None:
        return None
    c = probes["copy"]
    rate = (c["duplex_GBps_each"] if cuda else min(c["h2d_GBps"], c["d2h_GBps"])) * 1e9
    h2d, d2h = row["h2d_bytes"] / rate, row["d2h_bytes"] / rate
    return max(compute_s, row["cpu_adam_s"], h2d, d2h) if cuda else max(compute_s + row["cpu_adam_s"], h2d + d2h)


def row_figures(row, counters: dict, idle: dict, probes: dict, ctx, peak) -> dict:
    """The figures of one row (FIELDS), before the comparison with torch."""
    n, k = ctx.n_params, len(row.times)
    step = _median([t["wall"] for t in row.times])
    f = dict.fromkeys(FIELDS)
    f.update(steps=k, step_s=step, pinned_bytes=row.pinned_bytes, gpu_idle_frac=idle.get(row.name), error=row.error,
             build_s=row.build_s, resident_device_bytes=row.resident_bytes)
    if step:
        f["tokens_per_s"] = ctx.shape.batch * ctx.shape.seq / step
        f["tflops"] = ctx.shape.flops_per_step(n) / step / 1e12
        f["mfu"] = f["tflops"] / peak if peak else None
    if ctx.device.type == "cuda" and row.step_extra:
        f["peak_device_bytes"] = row.resident_bytes + max(row.step_extra)
    c0, c1 = counters["before"].get(row.name), counters["after"].get(row.name)
    if c0 and "bytes_moved" in c0 and k:
        f.update(engine_figures(c0, c1, k))
    else:
        if row.transfer_modelled:
            f.update(h2d_bytes=row.transfer_modelled["h2d"], d2h_bytes=row.transfer_modelled["d2h"],
                     transfer_source="modelled")
        opt = _median([t["opt"] for t in row.times if "opt" in t])
        if row.name != "torch" and opt:
            # The optimizer step's wall (with its copies and waits); none of it runs beside backward.
            f.update(cpu_adam_s=opt, hidden_share=0.0)
    if f["cpu_adam_s"]:
        f["adam_Gparam_per_s"] = n / f["cpu_adam_s"] / 1e9
    return f


def summarize_phase(rows: list, skipped: dict, counters: dict, idle: dict, probes: dict, ctx, peak) -> dict:
    """The phase's report: a dict of row figures (FIELDS) by name, the skipped
    rows with their reasons, the compute time the bounds use."""
    out = {name: row_figures(r, counters, idle, probes, ctx, peak) for name, r in ((r.name, r) for r in rows)}
    ref = next((r for r in rows if r.name == "torch"), None)
    compute = _median([t["compute"] for t in ref.times]) if ref is not None and ref.times else None
    t_torch = out.get("torch", {}).get("step_s")
    cuda = ctx.device.type == "cuda"
    for name, f in out.items():
        if t_torch and f["step_s"]:
            f["ratio_to_torch"] = f["step_s"] / t_torch
        if name != "torch":
            f["bound_s"] = bound_of(f, compute, probes, cuda)
            f["efficiency"] = f["bound_s"] / f["step_s"] if f["bound_s"] and f["step_s"] else None
    return {"dtype": ctx.dtype, "params": ctx.n_params, "tokens_per_step": ctx.shape.batch * ctx.shape.seq,
            "gpu_compute_s": compute, "peak_tflops": peak, "rows": out, "skipped": skipped}


def _fmt(v, spec: str, scale: float = 1.0) -> str:
    """``v * scale`` formatted by ``spec``; '-' in the same width when there is no figure."""
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-".rjust(int(re.match(r"\d*", spec).group() or 0))
    return format(v * scale, spec)


def print_phase(phase: dict) -> None:
    """The phase's table: one line per row, then the skipped rows and infinity's thread budget and pressure events."""
    print(f"\n{phase['dtype']}: {phase['params'] / 1e9:.3f} B parameters, {phase['tokens_per_step']} tokens a step, "
          f"GPU compute (plain PyTorch forward+backward) {_fmt(phase['gpu_compute_s'], '.3f')} s")
    print(f"{'row':9s} {'n':>2s} {'step s':>7s} {'tok/s':>8s} {'TFLOPS':>7s} {'MFU':>5s} {'xtorch':>6s} "
          f"{'HBM GiB':>7s} {'pin GiB':>7s} {'idle':>5s} {'H2D GB':>6s} {'D2H GB':>6s} {'Adam s':>6s} "
          f"{'Gp/s':>5s} {'hidden':>6s} {'bound s':>7s} {'eff':>5s}")
    for name, f in phase["rows"].items():
        print(f"{name:9s} {f['steps']:2d} {_fmt(f['step_s'], '7.3f')} {_fmt(f['tokens_per_s'], '8.0f')} "
              f"{_fmt(f['tflops'], '7.1f')} {_fmt(f['mfu'], '5.2f')} {_fmt(f['ratio_to_torch'], '6.2f')} "
              f"{_fmt(f['peak_device_bytes'], '7.1f', 2**-30)} {_fmt(f['pinned_bytes'], '7.1f', 2**-30)} "
              f"{_fmt(f['gpu_idle_frac'], '5.2f')} {_fmt(f['h2d_bytes'], '6.2f', 1e-9)} "
              f"{_fmt(f['d2h_bytes'], '6.2f', 1e-9)} {_fmt(f['cpu_adam_s'], '6.3f')} "
              f"{_fmt(f['adam_Gparam_per_s'], '5.2f')} {_fmt(f['hidden_share'], '6.2f')} "
              f"{_fmt(f['bound_s'], '7.3f')} {_fmt(f['efficiency'], '5.2f')}"
              + (f"  {f['transfer_source']} bytes" if f["transfer_source"] == "modelled" else "")
              + (f"  FAILED: {f['error']}" if f["error"] else ""))
    for name, why in phase["skipped"].items():
        print(f"{name:9s} {why}")
    for name, f in phase["rows"].items():
        if f["optimizer_threads"] is not None:
            print(f"{name}: optimizer threads {f['optimizer_threads']}, pressure events {len(f['pressure_events'])}"
                  + (f" {f['pressure_events'][:3]}" if f["pressure_events"] else "")
                  + f", stall {_fmt(f.get('stall_s'), '.3f')} s/step, device stall "
                  f"{_fmt(f.get('device_stall_s'), '.3f')} s/step")


def check_report(report: dict, plan: list, strict: bool) -> list:
    """What is missing from ``report`` (strings): a planned phase or row absent,
    a row without every field of FIELDS, a failed row, no step time, torch or
    inf-opt not run. ``strict`` (the dry run): a skipped phase, or a skipped
    row other than torchao (CUDA only), is a problem too."""
    bad = []
    for dtype, names in plan:
        phase = report["phases"].get(dtype)
        if not names:
            continue
        if phase is None or "skipped_phase" in phase:
            if phase is None or strict:
                bad.append(f"{dtype}: phase not run")
            continue
        for name in names:
            f = phase["rows"].get(name)
            if f is None:
                if name not in phase["skipped"]:
                    bad.append(f"{dtype} {name}: neither run nor skipped with a reason")
                elif name in ALWAYS_RUN or (strict and name != "torchao"):
                    bad.append(f"{dtype} {name}: {phase['skipped'][name]}")
                continue
            missing = [k for k in FIELDS if k not in f]
            if missing:
                bad.append(f"{dtype} {name}: fields missing {missing}")
            if f.get("error"):
                bad.append(f"{dtype} {name}: {f['error']}")
            elif not (f.get("step_s") or 0) > 0:
                bad.append(f"{dtype} {name}: no step time")
    return bad
