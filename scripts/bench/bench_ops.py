#!/usr/bin/env python3
"""Each aten op of a bench_predict row's forward and backward, timed on real
tensors, beside the step model's price of it (issue 40): where the
prediction of the compute misses, op by op.

The row's model runs in plain PyTorch on the CPU (the ops the engine runs are
the same; its own time is priced apart, [Note: the engine's time per
parameter]) under a dispatch mode that times each op to its end, ``--reps``
forward + backward passes after one warm-up; each op's price is
``step_time.op_seconds`` of its cost (costs._op_cost on the real tensors) on
the compute figures probed in the same process before and after the passes
(medians), less the per-op fixed cost (dispatch, autograd, module calls:
outside the op's own time, which is what is timed here). Prints per op name (and per product shape): ops a pass, measured
and predicted ms a pass, predicted / measured. Usage:
  python scripts/bench/bench_ops.py [--row 0] [--reps 5] [--threads 1] [--by-shape]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_predict as bp  # noqa: E402


class _Timer(TorchDispatchMode):
    """Times every op and keeps its cost (costs._op_cost of its real arguments)."""

    def __init__(self):
        super().__init__()
        self.ops = []  # (cost, seconds)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from infinity.engine.plan.costs import _op_cost
        kwargs = kwargs or {}
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        dt = time.perf_counter() - t0
        cost = _op_cost(func, args, kwargs, out)
        if cost is not None:
            self.ops.append((cost, dt))
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--row", type=int, default=0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--by-shape", action="store_true", help="products per (name, m, n, k)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from infinity.cli.profile_measure import compute_speeds
    from infinity.engine.plan.profile import load_profile
    from infinity.engine.plan.step_time import op_seconds
    config, gcfg, batch = bp.row_config(a.row)
    hf = bp.ROWS[a.row][2].get("hf", False)
    dt = {torch.float32: "fp32", torch.bfloat16: "bf16"}[config.torch_dtype]
    torch.manual_seed(0)
    model = bp.make_model(gcfg, hf).to(config.torch_dtype)
    x = torch.randint(0, gcfg.vocab_size, (batch, gcfg.block_size))
    probes = [compute_speeds(torch.device("cpu"), dt, bp.PROBE_SIZES)]
    bp.loss_of(model, x, hf).backward()
    passes = []
    for _ in range(a.reps):
        tm = _Timer()
        with tm:
            bp.loss_of(model, x, hf).backward()
        passes.append(tm.ops)
    probes.append(compute_speeds(torch.device("cpu"), dt, bp.PROBE_SIZES))
    prof = bp.same_time_profile(load_profile("h200-pcie5-nvme"), probes)
    rows = defaultdict(lambda: [0, [], 0.0])  # key -> [ops a pass, measured s per pass, predicted s a pass]
    for r, ops in enumerate(passes):
        per = defaultdict(float)
        for cost, secs in ops:
            key = (cost.name,) + (cost.shape if a.by_shape and cost.shape else ())
            per[key] += secs
            if r == 0:
                rows[key][0] += 1
                rows[key][2] += op_seconds(cost, prof, dt) - prof.op_overhead_s  # the fixed cost is not timed here
        for key, secs in per.items():
            rows[key][1].append(secs)
    print(f"row {a.row} ({bp.ROWS[a.row][0]}), {a.reps} passes, {dt}; op cost {prof.op_overhead_s * 1e6:.0f} us")
    print(f"{'op':44}{'n':>5}{'measured ms':>13}{'predicted ms':>14}{'ratio':>8}")
    tot_m = tot_p = 0.0
    for key, (n, ms, pred) in sorted(rows.items(), key=lambda kv: -statistics.median(kv[1][1])):
        m = statistics.median(ms)
        tot_m, tot_p = tot_m + m, tot_p + pred
        print(f"{' '.join(map(str, key)):44}{n:5}{1e3 * m:13.2f}{1e3 * pred:14.2f}{pred / m:8.2f}")
    print(f"{'total':44}{'':5}{1e3 * tot_m:13.2f}{1e3 * tot_p:14.2f}{tot_p / tot_m:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
