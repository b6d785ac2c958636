#!/usr/bin/env python3
"""infinity's offloaded step against plain PyTorch and the offload baselines, interleaved in one run.

The rows (scripts/gpu/bench_rows.py: torch, inf-opt, inf-all, inf-nvme,
torchao, fsdp2) train the same GPT on the same batches. After --warmup rounds,
each round runs one step of every row in turn, so drift of the machine hits
all alike. bf16 first (the figure users see), then fp32 (--fp32-rows) if the
time left allows; a row that cannot run here is SKIPPED with its reason.

Per row: step time (median), tokens/s, TFLOPS and MFU (model FLOPs over
--peak-tflops), the step time over plain PyTorch's, peak device memory
(resident + the step's peak above it), pinned host bytes, GPU idle fraction
(one profiled step: 1 - union of kernel time / wall), H2D/D2H bytes a step
(infinity's counters; modelled for torchao and FSDP2), CPU AdamW Gparam/s and
the share of it hidden behind backward (infinity), the thread budget and
pressure events (infinity).

Raw probes in the same run: pinned copies H2D and D2H alone and both at once
(own copy engines), CPU AdamW Gparam/s (infinity's and torch's fused).
Bound: on CUDA max(GPU compute, CPU AdamW, H2D, D2H), each timed or probed
here (compute = plain PyTorch's forward+backward, copies at the duplex rate);
on the CPU, where compute and AdamW share cores, compute + AdamW against the
copies. Efficiency = bound / step time.

--dry-run: the same code path on the CPU with a tiny model, both dtypes, and a
check of the report's format (exit 1 when a row or a field is missing).
--budget-s: stops starting rounds and phases that would not end in time.

--largest: instead, the largest model the machine trains 2 steps of in the time
and memory left, planned with the estimator (scripts/gpu/bench_largest.py; its
options follow).

Usage: python scripts/gpu/bench_gpu.py [--dry-run] [--json bench_gpu.json] [--profile trace.json.gz]
       python scripts/gpu/bench_gpu.py --largest [--dry-run] [--swap-dir DIR] [--budget-s 150]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import traceback
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parents[1]), str(HERE)]
import infinity  # noqa: E402
from infinity.engine.plan.limits import optimizer_threads  # noqa: E402
from bench_rows import (ROWS, Ctx, Shape, Skip, adamw_probe, build_row, copy_probe, mem_available,  # noqa: E402
                        now)
from bench_report import check_report, print_phase, summarize_phase  # noqa: E402

CUDA_SHAPE = Shape(layers=20, embd=2048, heads=16, vocab=32000, seq=1024, batch=8)  # 1.07 B parameters
DRY_SHAPE = Shape(layers=2, embd=64, heads=2, vocab=256, seq=32, batch=2)
PEAK_TFLOPS = {"bf16": 989.0, "fp32": 67.0}  # H200 SXM dense, from NVIDIA's data sheet
BUILD_SHARE = 0.5  # of a phase's time, at most, for building its rows


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model, both dtypes, format check")
    ap.add_argument("--device", default=None, help="torch device (default cuda; cpu with --dry-run)")
    for k, v in vars(CUDA_SHAPE).items():
        ap.add_argument(f"--{k}", type=int, default=None, help=f"model/batch shape (default {v} on CUDA)")
    ap.add_argument("--rows", default=",".join(ROWS), help="bf16 rows, comma-separated (default all)")
    ap.add_argument("--fp32-rows", default="torch,inf-opt,inf-all", help="fp32 rows (default %(default)s; '' none)")
    ap.add_argument("--steps", type=int, default=6, help="timed rounds (default 6; 3 with --dry-run)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2; 1 with --dry-run)")
    ap.add_argument("--slow-s", type=float, default=5.0,
                    help="a row whose warm-up step takes longer is timed only twice (default 5 s)")
    ap.add_argument("--budget-s", type=float, default=170.0, help="wall seconds for the whole bench (default 170)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="device peak for MFU, TFLOP/s (default: H200's 989 bf16 / 67 fp32 on CUDA; none on CPU)")
    ap.add_argument("--copy-mib", type=int, default=512, help="bytes per probe copy, MiB (default 512)")
    ap.add_argument("--adam-mparams", type=int, default=64, help="parameters of the AdamW probe, M (default 64)")
    ap.add_argument("--host-margin-gib", type=float, default=6.0,
                    help="MemAvailable a row must leave free, GiB (default 6)")
    ap.add_argument("--swap-dir", default=None, help="folder of the NVMe row's swap files (default: a temp folder)")
    ap.add_argument("--no-idle", action="store_true", help="skip the profiled step per row (GPU idle fraction)")
    ap.add_argument("--profile", default=None, help="gzipped Chrome trace of inf-opt's profiled step (<= 16 MiB)")
    ap.add_argument("--json", default=None, help="write the report as JSON to this file")
    args = ap.parse_args(argv)
    base = DRY_SHAPE if args.dry_run else CUDA_SHAPE
    args.shape = Shape(**{k: getattr(args, k) if getattr(args, k) is not None else v for k, v in vars(base).items()})
    args.device = torch.device(args.device or ("cpu" if args.dry_run else "cuda"))
    if args.dry_run:
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
        args.copy_mib, args.adam_mparams = min(args.copy_mib, 8), min(args.adam_mparams, 1)
        args.host_margin_gib = min(args.host_margin_gib, 0.5)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available (use --dry-run for the CPU)")
    return args


def batches(shape: Shape, device: torch.device, n: int = 4) -> list:
    gen = torch.Generator().manual_seed(1)
    return [tuple(torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=gen).to(device)
                  for _ in range(2)) for _ in range(n)]


def build_rows(ctx: Ctx, names: list, deadline: float) -> tuple:
    """(rows built, {name: reason} of those skipped or failed to build). Rows
    are built in order until BUILD_SHARE of the time left is spent, so that
    the rows built are also measured."""
    rows, skipped = [], {}
    stop = now() + BUILD_SHARE * (deadline - now())
    for name in names:
        t0 = now()
        try:
            if t0 > stop:
                raise Skip(f"no time left to build it: building took {BUILD_SHARE:.0%} of the time left")
            rows.append(build_row(ctx, name))
            rows[-1].build_s = now() - t0
            print(f"  built {name} in {rows[-1].build_s:.1f} s", flush=True)
        except Skip as e:
            skipped[name] = f"SKIP: {e}"
        except Exception as e:  # one broken baseline must not hide the others
            traceback.print_exc()
            skipped[name] = f"FAILED to build: {type(e).__name__}: {str(e)[:300]}"
        if name in skipped:
            print(f"  {name}: {skipped[name]}", flush=True)
    return rows, skipped


def one_step(row, batch, device) -> None:
    """One step of ``row``, its times and device peak recorded; an error retires the row."""
    if row.error:
        return
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        row.times.append(row.step(*batch))
        if device.type == "cuda":
            row.step_extra.append(torch.cuda.max_memory_allocated(device) - base)
    except Exception as e:
        traceback.print_exc()
        row.error = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"  {row.name}: FAILED at step {len(row.times)}: {row.error}", flush=True)


def run_rounds(rows: list, data: list, args, deadline: float) -> dict:
    """Warm-up rounds, then timed rounds of one step per row until --steps or
    the deadline; returns the counters before and after the timed rounds."""
    for i in range(args.warmup):
        for row in rows:
            one_step(row, data[i % len(data)], args.device)
    quota = {}
    for row in rows:
        # A row slower than --slow-s a step (NVMe on a slow disk) is timed twice, not --steps times.
        slow = bool(row.times) and row.times[-1]["wall"] > args.slow_s
        quota[row.name] = min(2, args.steps) if slow else args.steps
        if slow:
            print(f"  {row.name}: {row.times[-1]['wall']:.1f} s a step (over --slow-s {args.slow_s:g}): "
                  f"timed {quota[row.name]} times", flush=True)
        row.times.clear()
        row.step_extra.clear()
    c0 = {r.name: r.counters() for r in rows if not r.error}
    t_round = None
    for i in range(args.steps):
        left = deadline - now()
        if t_round is not None and i >= 3 and left < 1.5 * t_round:
            print(f"  stopped after {i} timed rounds: {left:.0f} s left, a round takes {t_round:.1f} s", flush=True)
            break
        t0 = now()
        for row in rows:
            if i < quota[row.name]:
                one_step(row, data[i % len(data)], args.device)
        t_round = now() - t0
    c1 = {r.name: r.counters() for r in rows if not r.error}
    return {"before": c0, "after": c1}


def kernel_busy(prof):
    """Seconds of the union of the profile's device kernels (memcpy/memset
    left out); None when the profile holds no kernel (CUPTI not working)."""
    spans = []
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA") and not e.name.startswith(("Memcpy", "Memset")):
            spans.append((e.time_range.start, e.time_range.end))
    if not spans:
        return None
    busy, end = 0.0, -math.inf
    for a, b in sorted(spans):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy / 1e6


def idle_fractions(rows: list, data: list, args) -> dict:
    """GPU idle fraction of one profiled step per row (None on the CPU); the
    inf-opt step's trace to --profile."""
    from torch.profiler import ProfilerActivity, profile
    cuda = args.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out = {}
    for row in rows:
        if row.error:
            continue
        with profile(activities=acts) as prof:
            wall = row.step(*data[0])["wall"]
        busy = kernel_busy(prof) if cuda else None
        out[row.name] = max(0.0, 1.0 - busy / wall) if busy is not None else None
        if args.profile and row.name == "inf-opt":
            save_trace(prof, args.profile)
    return out


def save_trace(prof, path: str, limit: int = 16 << 20) -> None:
    """The profile as a gzipped Chrome trace at ``path``; dropped, saying so, over ``limit`` bytes."""
    import gzip
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(raw, "rb") as f, gzip.open(path, "wb", compresslevel=6) as g:
            g.write(f.read())
    size = Path(path).stat().st_size
    if size > limit:
        Path(path).unlink()
        print(f"  profile: {size} bytes gzipped is over {limit}; dropped")
    else:
        print(f"  profile: inf-opt's step, {size / 2**20:.1f} MiB gzipped: {path}")


def run_phase(dtype: str, names: list, template, args, probes: dict, deadline: float) -> dict:
    """Builds the rows of one dtype, runs them interleaved, summarizes, prints, closes them."""
    print(f"\n=== {dtype}: rows {','.join(names)} ===", flush=True)
    ctx = Ctx(device=args.device, dtype=dtype, shape=args.shape, template=template, swap_dir=args.swap_dir,
              host_margin=int(args.host_margin_gib * 2**30))
    rows, skipped = build_rows(ctx, names, deadline)
    try:
        data = batches(args.shape, args.device)
        counters = run_rounds(rows, data, args, deadline)
        idle = {} if args.no_idle or now() > deadline else idle_fractions(rows, data, args)
        peak = args.peak_tflops or (PEAK_TFLOPS[dtype] if args.device.type == "cuda" else None)
        phase = summarize_phase(rows, skipped, counters, idle, probes, ctx, peak)
    finally:
        for row in rows:
            try:
                row.close()
            except Exception:  # closing must not hide the figures
                traceback.print_exc()
        del rows
        gc.collect()
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
    print_phase(phase)
    return phase


def save(report: dict, path) -> None:
    """``report`` as JSON at ``path`` (None: nowhere)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=1, default=str))


def probes_of(args) -> dict:
    t0 = now()
    # The AdamW probe at the engine's own thread budget ([Note: the optimizer's thread budget]).
    threads = optimizer_threads(None, infinity.system.native.default_num_threads(), args.device.type == "cuda",
                                env_set="INFINITY_NUM_THREADS" in os.environ)
    probes = {"copy": copy_probe(args.copy_mib << 20, args.device),
              "adamw": adamw_probe(args.adam_mparams * 10**6, threads)}
    c, a = probes["copy"], probes["adamw"]
    print(f"probes ({now() - t0:.1f} s): copies {'pinned' if c['pinned'] else 'NOT pinned'} H2D "
          f"{c['h2d_GBps']:.1f} GB/s, D2H {c['d2h_GBps']:.1f} GB/s, both at once {c['duplex_GBps_each']:.1f} GB/s "
          f"each; CPU AdamW infinity {a['infinity_Gparam_per_s']:.2f} Gparam/s ({a['threads']} threads), torch "
          f"fused {a['torch_fused_Gparam_per_s']:.2f} Gparam/s ({a['torch_threads']} threads)", flush=True)
    return probes


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--largest" in argv:  # the largest model the machine trains, planned by the estimator: bench_largest.py
        from bench_largest import main as largest
        return largest([a for a in argv if a != "--largest"])
    args = parse_args(argv)
    t_start = now()
    deadline = t_start + args.budget_s
    tmp = tempfile.TemporaryDirectory(prefix="bench-gpu-swap-")
    args.swap_dir = args.swap_dir or tmp.name
    torch.manual_seed(0)
    template = infinity.models.GPT(args.shape.gpt())
    n = sum(p.numel() for p in template.parameters())
    meta = {"torch": torch.__version__, "device": str(args.device), "shape": vars(args.shape), "params": n,
            "tokens_per_step": args.shape.batch * args.shape.seq, "mem_available_bytes": mem_available(),
            "native": infinity.system.native.available(), "dry_run": args.dry_run}
    if args.device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(args.device)
    print("bench_gpu:", json.dumps(meta), flush=True)
    report = {"meta": meta, "probes": probes_of(args), "phases": {}}
    save(report, args.json)
    plan = [("bf16", [r for r in args.rows.split(",") if r]), ("fp32", [r for r in args.fp32_rows.split(",") if r])]
    for dtype, names in plan:
        if not names:
            continue
        left, spent = deadline - now(), now() - t_start
        if report["phases"] and left < 1.1 * spent:
            report["phases"][dtype] = {"skipped_phase": f"{left:.0f} s left, the bf16 phase took {spent:.0f} s"}
            print(f"\n=== {dtype}: SKIPPED, {report['phases'][dtype]['skipped_phase']} ===")
            continue
        report["phases"][dtype] = run_phase(dtype, names, template, args, report["probes"], deadline)
        save(report, args.json)  # a run cut short keeps the phases it finished
    report["seconds"] = now() - t_start
    problems = check_report(report, plan, strict=args.dry_run)
    report["problems"] = problems
    print(f"\nbench_gpu: {report['seconds']:.0f} s; format problems: {problems or 'none'}")
    save(report, args.json)
    tmp.cleanup()
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
