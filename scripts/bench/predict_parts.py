#!/usr/bin/env python3
"""What a bench_predict row's step is made of, predicted against measured,
part by part (issue 40): where the step model misses.

In one process (one torch thread), interleaved, ``--reps`` times after
warm-up: the row's model in plain PyTorch (forward, backward: the ops alone)
and through infinity (forward, backward, step(), zero_grad(), and the
engine's counters: stall, optimizer busy and waited seconds). The
prediction (the same profile bench_predict builds from probes taken between
the passes) is split the same way: the ops of forward and backward, the
engine's own time per tensor and op, the waits on copies in each pass, and
step() (after the last backward task: the updates left, the step boundary). Prints one line per part: predicted,
measured (median, spread) and the difference. Usage:
  python scripts/bench/predict_parts.py --row 0 [--reps 7] [--profile P.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_predict as bp  # noqa: E402


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(i: int, reps: int, warmup: int = 3) -> dict:
    """The row's parts measured: plain PyTorch and infinity, interleaved (lists of seconds)."""
    import infinity
    from infinity.cli.profile_measure import adamw_rates, compute_speeds
    config, gcfg, batch = bp.row_config(i)
    hf = bp.ROWS[i][2].get("hf", False)
    torch.manual_seed(0)
    plain = bp.make_model(gcfg, hf).to(config.torch_dtype)
    torch.manual_seed(0)
    model, opt = infinity.initialize(bp.make_model(gcfg, hf), config, lr=1e-4)
    popt = torch.optim.AdamW(plain.parameters(), lr=1e-4)
    x = torch.randint(0, gcfg.vocab_size, (batch, gcfg.block_size))
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}[config.torch_dtype]
    out = {k: [] for k in ("plain_forward", "plain_backward", "plain_adamw", "forward", "backward", "step",
                           "zero_grad", "total", "stall", "optimizer", "optimizer_wait")}
    probes = []
    for s in range(warmup + reps):
        if s >= warmup:
            probes.append({**compute_speeds(torch.device("cpu"), dtype, bp.PROBE_SIZES), "adamw": adamw_rates(None)})
        holder = {}
        f = _timed(lambda: holder.setdefault("l", bp.loss_of(plain, x, hf)))
        b = _timed(lambda: holder["l"].backward())
        a = _timed(lambda: (popt.step(), popt.zero_grad()))
        st0 = infinity.stats(model)
        t0 = time.perf_counter()
        holder = {}
        fi = _timed(lambda: holder.setdefault("l", bp.loss_of(model, x, hf)))
        bi = _timed(lambda: holder["l"].backward())
        si = _timed(opt.step)
        zi = _timed(opt.zero_grad)
        tot = time.perf_counter() - t0
        st1 = infinity.stats(model)
        if s >= warmup:
            for k, v in (("plain_forward", f), ("plain_backward", b), ("plain_adamw", a), ("forward", fi),
                         ("backward", bi), ("step", si), ("zero_grad", zi), ("total", tot)):
                out[k].append(v)
            for k, key in (("stall", "stall_seconds"), ("optimizer", "optimizer_seconds"),
                           ("optimizer_wait", "optimizer_wait_seconds")):
                out[k].append(st1[key] - st0[key])
    probes.append({**compute_speeds(torch.device("cpu"), dtype, bp.PROBE_SIZES), "adamw": adamw_rates(None)})
    infinity.close(model)
    out["probes"] = probes
    return out


def predicted_parts(pr) -> dict:
    """The prediction split: ops and engine time of each pass, waits inside each pass, step() after compute."""
    tasks = pr.sim.tasks
    fwd = [t for t in tasks if t.name.startswith("forward ")]
    bwd = [t for t in tasks if t.name.startswith("backward ")]
    span = lambda ts: (max(t.end for t in ts) - min(t.start for t in ts)) if ts else 0.0  # noqa: E731
    busy = lambda ts: sum(t.end - t.start for t in ts)  # noqa: E731
    end = max(t.end for t in fwd + bwd)
    return {"forward": busy(fwd), "forward_wall": fwd[-1].end if fwd else 0.0,
            "backward": busy(bwd), "backward_wall": span(bwd) + (bwd[0].start - fwd[-1].end if bwd and fwd else 0),
            "step": pr.seconds - end, "total": pr.seconds, "optimizer": pr.busy.get("optimizer", 0.0)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--row", type=int, default=0)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--profile", help="profile JSON for the non-compute figures (default: measure one now)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from infinity.cli.profile_measure import measure_profile
    from infinity.engine.plan.profile import load_profile
    config = bp.row_config(a.row)[0]
    Path(bp.SWAP).mkdir(parents=True, exist_ok=True)
    profile = load_profile(a.profile) if a.profile else measure_profile(torch.device("cpu"), config.dtype, [bp.SWAP],
                                                                          disk_bytes=128 << 20)
    got = measure(a.row, a.reps)
    prof = bp.same_time_profile(profile, got.pop("probes"))
    pr = bp.predict_row(a.row, prof)
    pp = predicted_parts(pr)
    # The ops alone (no engine time), as the plain model runs them.
    import dataclasses
    bare = predicted_parts(bp.predict_row(a.row, dataclasses.replace(prof, param_overhead_s={},
                                                                      engine_op_overhead_s={})))
    pp["ops_forward"], pp["ops_backward"] = bare["forward"], bare["backward"]
    med = statistics.median
    print(f"row {a.row} ({bp.ROWS[a.row][0]}), {a.reps} reps; predicted {pr.seconds:.4f} s, bound {pr.bound}; "
          f"exposed {({k: round(v, 4) for k, v in pr.exposed.items()})}; busy "
          f"{({k: round(v, 4) for k, v in pr.busy.items()})}")
    print(f"{'part':24}{'predicted':>10}{'measured':>10}{'min':>8}{'max':>8}")
    rows = [("plain forward (ops)", pp.get("ops_forward"), "plain_forward"),
            ("plain backward (ops)", pp.get("ops_backward"), "plain_backward"),
            ("plain AdamW+zero", None, "plain_adamw"),
            ("forward (wall)", pp["forward_wall"], "forward"), ("backward (wall)", pp["backward_wall"], "backward"),
            ("step()", pp["step"], "step"), ("zero_grad()", None, "zero_grad"), ("total", pp["total"], "total"),
            ("stall", None, "stall"), ("optimizer busy", pp["optimizer"], "optimizer"),
            ("optimizer waited", None, "optimizer_wait")]
    for label, p, k in rows:
        xs = got[k]
        ps = f"{p:10.4f}" if p is not None else f"{'':10}"
        print(f"{label:24}{ps}{med(xs):10.4f}{min(xs):8.4f}{max(xs):8.4f}")
    print(f"compute busy: forward {pp['forward']:.4f}, backward {pp['backward']:.4f} (predicted)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
