"""``bench_train.py --clip``: clipping with overlap="backward", speculative
updates ([Note: speculative updates] in infinity/engine/step/speculate.py).

Four engines of the same model train on the same batches, one step each in
turn (so drift in machine speed hits all alike):

  step          overlap="step", clipping on every step
  backward      overlap="backward", no clipping (the optimizer hidden)
  never         overlap="backward", clipping that never triggers
  always        overlap="backward", clipping on every step (after the first, each step
                follows a clipped one and waits for step())

The thresholds come from the gradient norms measured in the warm-up steps
(100x above the largest, 100x below the smallest). Reported: mean step
times (a replay is one step in several, which a median leaves out), the
ratios the targets are about (never / backward <= 1.03, always / step <=
1.05), the optimizer's share of the step and the speculation counters.
"""

from __future__ import annotations

import os
import statistics
import time

import infinity

CASES = ("step", "backward", "never", "always")


def build(args, make_model, base_cfg: dict) -> dict:
    """(case -> (model, optimizer)): one engine per case."""
    out = {}
    for case in CASES:
        cfg = dict(base_cfg, overlap="step" if case == "step" else "backward",
                   max_grad_norm=None if case == "backward" else 1e30)  # thresholds set after the warm-up
        if "nvme" in (cfg.get("offload_params"), cfg.get("offload_optimizer")):  # a store locks its folder
            cfg["swap_paths"] = [os.path.join(p, case) for p in cfg["swap_paths"]]
        out[case] = infinity.initialize(make_model(args), infinity.Config(**cfg), lr=1e-4, weight_decay=0.1)
    return out


def one_step(model, opt, x, y) -> float:
    t0 = time.perf_counter()
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0


def run(args, make_model, data, base_cfg: dict) -> dict:
    """Warm-up (the norms), the interleaved timed steps, the report (printed and returned)."""
    engines = build(args, make_model, base_cfg)
    norms = []
    for i in range(2):
        for case, (m, o) in engines.items():
            one_step(m, o, *data[i % len(data)])
        norms.append(engines["step"][1].last_grad_norm)
    never, always = 100 * max(norms), min(norms) / 100
    for case, th in (("step", always), ("never", never), ("always", always)):
        engines[case][1].scaling.max_grad_norm = th
    s0 = {c: infinity.stats(m) for c, (m, _) in engines.items()}
    times = {c: [] for c in CASES}
    for i in range(args.steps):
        for case in CASES:
            times[case].append(one_step(*engines[case], *data[i % len(data)]))
    s1 = {c: infinity.stats(m) for c, (m, _) in engines.items()}
    # Means: a replay is one step in several (the back-off), which a median leaves out.
    med = {c: statistics.fmean(t) for c, t in times.items()}
    opt_s = (s1["step"]["optimizer_seconds"] - s0["step"]["optimizer_seconds"]) / args.steps
    res = {"norms": norms, "thresholds": {"never": never, "always": always}, "step_s": med,
           "step_s_median": {c: statistics.median(t) for c, t in times.items()},
           "optimizer_s_per_step": opt_s, "optimizer_share_of_step": opt_s / med["step"],
           "never_over_backward": med["never"] / med["backward"], "always_over_step": med["always"] / med["step"],
           "never_over_step": med["never"] / med["step"],
           "hidden": {c: s1[c]["overlap"] for c in CASES if c != "step"},
           "speculation": {c: {k: v - s0[c]["speculation"][k] for k, v in s1[c]["speculation"].items()
                               if k != "off"} for c in ("never", "always")}}
    for m, _ in engines.values():
        infinity.close(m)
    report(res)
    return res


def report(res: dict) -> None:
    med = res["step_s"]
    print(f"gradient norms in warm-up {', '.join(f'{n:.3g}' for n in res['norms'])}; clip thresholds: never "
          f"{res['thresholds']['never']:.3g}, always {res['thresholds']['always']:.3g}")
    print(f"{'case':10s} {'step (mean, s)':>15s} {'(median, s)':>12s}")
    for c in CASES:
        print(f"{c:10s} {med[c]:15.4f} {res['step_s_median'][c]:12.4f}")
    print(f"optimizer {res['optimizer_s_per_step'] * 1e3:.1f} ms/step = {res['optimizer_share_of_step']:.0%} of "
          f"overlap='step''s step; hidden share: "
          + ", ".join(f"{c} {h:.2f}" for c, h in res["hidden"].items()))
    for c, s in res["speculation"].items():
        print(f"speculation ({c}): {s['steps']} steps, {s['committed']} committed, {s['replayed']} replayed, "
              f"{s['waited']} waited, {s['units_without_room']} units without host room, "
              f"{s['units_without_disk']} without swap room, replays "
              f"{s['replay_seconds']:.3f} s")
    print(f"of means: never / backward = {res['never_over_backward']:.3f} (target <= 1.03: "
          f"{'PASS' if res['never_over_backward'] <= 1.03 else 'FAIL'}); always / step = "
          f"{res['always_over_step']:.3f} (target <= 1.05: {'PASS' if res['always_over_step'] <= 1.05 else 'FAIL'}); "
          f"never / step = {res['never_over_step']:.3f}")
