#!/usr/bin/env python3
"""Predicted against measured step time (issue 40): ``infinity estimate
--time``'s model on this machine's measured profile, beside real runs.

For each configuration (placements, overlap modes, prefetch depths, batch
sizes, checkpointing) a child process trains the built-in GPT on the CPU
device for warm-up + ``--steps`` steps and reports the median step (forward,
backward, step(), zero_grad(), each timed to its end); the parent predicts
the same step from the meta model and the profile, never from the
measurements. Unless ``--profile FILE`` is given, a fresh profile is measured
(``infinity doctor --profile``'s code, in the row's dtype) just before each
row: on a machine shared with other jobs its speed drifts by tens of percent
within minutes, and a profile measured then is the machine the row runs on.
The compute figures (and the AdamW's rate) are probed again in the row's own
process before each measured step, with one unmeasured step between the
probe and the measured one (the probe's freed memory is refaulted there).
Nothing is fitted to the rows. The runs and the profile use ``--threads``
torch threads (default 1): with 2 on this shared 2-core machine an op's
fixed cost measured 1.6-5 ms against 0.1 ms with 1 (torch's parallel
regions wait for a descheduled worker), varying several-fold between runs
a minute apart, which no profile taken beforehand can follow.

Prints one row per configuration: predicted and measured seconds, the error
(predicted / measured - 1), the predicted bound, and the median absolute
error. Usage:
  python scripts/bench/bench_predict.py [--profile P.json] [--rows 0,3,5] [--steps 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from _common import run_json_child, write_json  # noqa: E402

SWAP = str(Path(tempfile.gettempdir()) / "infinity-bench-predict")
BASE = dict(device="cpu", dtype="fp32", offload_params="host", offload_optimizer="host", overlap="step",
            prefetch_depth=2, swap_paths=[SWAP])
MODEL = dict(n_layer=4, n_embd=256, n_head=4, vocab_size=512, block_size=64)

# (label, config changes, model changes, micro-batch); "min" device memory: the budget's minimum.
ROWS = [
    ("host step d2", {}, {}, 4),
    ("host backward d2", {"overlap": "backward"}, {}, 4),
    ("host delayed d2", {"overlap": "delayed"}, {}, 4),
    ("host step d0 min-budget", {"prefetch_depth": 0, "device_memory": "min"}, {}, 4),
    ("host step d4 min-budget", {"prefetch_depth": 4, "device_memory": "min"}, {}, 4),
    ("host step d1 b16", {"prefetch_depth": 1}, {}, 16),
    ("host backward b1", {"overlap": "backward"}, {}, 1),
    ("host step ckpt b8", {}, {"checkpoint": True}, 8),
    ("opt nvme step", {"offload_optimizer": "nvme"}, {}, 4),
    ("opt nvme backward", {"offload_optimizer": "nvme", "overlap": "backward"}, {}, 4),
    ("all nvme step", {"offload_params": "nvme", "offload_optimizer": "nvme"}, {}, 4),
    ("all nvme backward b1", {"offload_params": "nvme", "offload_optimizer": "nvme", "overlap": "backward"}, {}, 1),
    ("host step bf16 b2", {"dtype": "bf16"}, {"n_layer": 2, "n_embd": 128}, 2),
    ("host step no-ckpt b8", {}, {}, 8),
    ("host step accum 2", {"grad_accumulation_steps": 2}, {}, 4),
    ("host backward accum 2", {"overlap": "backward", "grad_accumulation_steps": 2}, {}, 4),
    ("HF Llama host step", {}, {"hf": True}, 4),
    ("ZeRO-3 2 ranks (torchrun)", {"zero_stage": 3}, {"world": 2}, 4),  # a micro-batch of 4 a rank
]
_NOT_GPT = ("hf", "world")  # model changes that are not GPTConfig fields
PROBE_SIZES = (128, 256, 512, 1024)  # the bench model's products are n ~ 200-700 (clamped beyond)
CI_ROWS = (3, 8, 14)  # the rows tests/cli/test_estimate_time.py predicts (structure only)


def make_model(gcfg, hf: bool):
    """The row's model: the built-in GPT, or a Hugging Face Llama of the same
    sizes (intermediate 688, grouped-query attention with 2 key/value heads)."""
    if not hf:
        from infinity.models import GPT
        return GPT(gcfg)
    import transformers
    c = transformers.LlamaConfig(vocab_size=gcfg.vocab_size, hidden_size=gcfg.n_embd, intermediate_size=688,
                                 num_hidden_layers=gcfg.n_layer, num_attention_heads=gcfg.n_head,
                                 num_key_value_heads=2, max_position_embeddings=gcfg.block_size)
    return transformers.LlamaForCausalLM(c).float()


def loss_of(model, x, hf: bool):
    """The row's loss of inputs ``x`` (next-token; on meta tensors a ready mask, as infinity estimate does)."""
    if not hf:
        return model(x, x)
    if x.device.type == "meta":
        b, n = x.shape
        mask = torch.zeros(1, 1, 1, 1, device="meta").expand(b, 1, n, n)
        return model(input_ids=x, attention_mask=mask, labels=x).loss
    return model(input_ids=x, labels=x).loss


def row_config(i: int):
    """(infinity.Config, GPTConfig, micro-batch) of row ``i``."""
    import infinity
    from infinity.models import GPTConfig
    label, cfg, mdl, batch = ROWS[i]
    gcfg = GPTConfig(**{**MODEL, **{k: v for k, v in mdl.items() if k not in _NOT_GPT}})
    fields = {**BASE, **cfg}
    minimum = fields.pop("device_memory", None) == "min"
    config = infinity.Config(**fields)
    if minimum:
        from infinity.cli.estimate import estimate
        with torch.device("meta"):
            m = make_model(gcfg, ROWS[i][2].get("hf", False))
        config = dataclasses.replace(config, device_memory=estimate(m, config)["device"]["minimum"])
    return config, gcfg, batch


def measure_row(i: int, steps: int, warmup: int = 3) -> dict:
    """Trains row ``i``: its median step seconds, the median forward,
    backward and step() seconds, the optimizer's seconds a step, and the
    bytes moved per step."""
    import infinity
    from infinity.cli.profile_measure import adamw_rates, compute_speeds
    config, gcfg, batch = row_config(i)
    hf, accum = ROWS[i][2].get("hf", False), config.grad_accumulation_steps
    if world_of(i) > 1:  # under torchrun: every rank trains its own micro-batch; rank 0 reports
        import torch.distributed as dist
        dist.init_process_group("gloo")
        config = dataclasses.replace(config, swap_paths=[os.path.join(SWAP, f"rank{dist.get_rank()}")])
    torch.manual_seed(0)
    model, opt = infinity.initialize(make_model(gcfg, hf), config, lr=1e-4)
    x = torch.randint(0, gcfg.vocab_size, (batch, gcfg.block_size))
    ts, parts, opt_s, probes = [], [], [], []
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[config.torch_dtype]
    for s in range(warmup + steps):
        if s >= warmup:  # the machine's compute speed now, between the steps it is compared with
            probes.append({**compute_speeds(torch.device("cpu"), dtype, PROBE_SIZES), "adamw": adamw_rates(None)})
            # The step right after a probe refaults the memory the probe gave back (about 1,500 page faults and
            # 5% of row 0's step here): a training loop runs no probe, so that step is not measured.
            _train_step(model, opt, x, hf, accum)
        got = _train_step(model, opt, x, hf, accum)
        ts.append(got[0])
        parts.append(got[1:4])
        opt_s.append(got[4])
    probes.append({**compute_speeds(torch.device("cpu"), dtype, PROBE_SIZES), "adamw": adamw_rates(None)})
    st = infinity.stats(model)
    infinity.close(model)
    if world_of(i) > 1:
        import torch.distributed as dist
        dist.destroy_process_group()
    med = lambda xs: statistics.median(xs[warmup:])  # noqa: E731
    return {"seconds": med(ts), "all": ts[warmup:], "bytes": st["step_bytes_moved"],
            "forward": med([p[0] for p in parts]), "backward": med([p[1] for p in parts]),
            "step": med([p[2] for p in parts]), "optimizer": med(opt_s), "probes": probes}


def _train_step(model, opt, x, hf: bool, accum: int) -> tuple:
    """One step of ``accum`` micro-batches: (seconds, forward s, backward s,
    step() + zero_grad() s, the optimizer's seconds), each timed to its end."""
    import infinity
    t0 = time.perf_counter()
    o0 = infinity.stats(model)["optimizer_seconds"]
    fb = [0.0, 0.0]
    for _ in range(accum):
        t1 = time.perf_counter()
        loss = loss_of(model, x, hf)
        t2 = time.perf_counter()
        loss.backward()
        fb = [fb[0] + t2 - t1, fb[1] + time.perf_counter() - t2]
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    t3 = time.perf_counter()
    return t3 - t0, fb[0], fb[1], t3 - t2, infinity.stats(model)["optimizer_seconds"] - o0


def world_of(i: int) -> int:
    """Row ``i``'s ranks (run under torchrun when above 1)."""
    return ROWS[i][2].get("world", 1)


def predict_row(i: int, profile):
    """The model's prediction of row ``i`` (a StepPrediction)."""
    from infinity.cli.estimate_time import predict
    config, gcfg, batch = row_config(i)
    hf = ROWS[i][2].get("hf", False)
    with torch.device("meta"):
        model = make_model(gcfg, hf)
    x = torch.zeros(batch, gcfg.block_size, dtype=torch.long, device="meta")
    return predict(model, config, lambda m: loss_of(m, x, hf), profile, world=world_of(i))


def same_time_profile(profile, probes: list):
    """``profile`` with its compute figures (GEMM rates, memory bandwidth,
    per-op cost, the engine's time per parameter tensor and op and at the
    step boundary, the kernels' rates, the AdamW's rate: it runs on the same
    cores) replaced by the medians of the probes the run measured
    between its steps: on a shared machine the speed drifts by 2x within a
    minute, so the speed the step is compared with is the one measured with it."""
    med = statistics.median
    gemm = {}
    for dt in probes[0]["gemm_flops"]:
        sizes = sorted({n for p in probes for n, _ in p["gemm_flops"][dt]})
        gemm[dt] = [[n, med([r for p in probes for m, r in p["gemm_flops"][dt] if m == n])] for n in sizes]
    engine = {k: {ph: med([p[k][ph] for p in probes]) for ph in probes[0][k]}
              for k in ("param_overhead_s", "engine_op_overhead_s", "step_overhead_s")}
    dt = next(iter(probes[0]["gemm_shapes"]))
    kernels = {  # the kernels' rates: each figure's median over the probes
        "gemm_shapes": {dt: [p[:3] + [med([q["gemm_shapes"][dt][j][3] for q in probes])]
                             for j, p in enumerate(probes[0]["gemm_shapes"][dt])]},
        "attention_flops": {dt: {ph: [[n, med([q["attention_flops"][dt][ph][j][1] for q in probes])]
                                      for j, (n, _) in enumerate(pts)]
                                 for ph, pts in probes[0]["attention_flops"][dt].items()}},
        "op_rates": {dt: {op: med([q["op_rates"][dt][op] for q in probes]) for op in probes[0]["op_rates"][dt]}}}
    if "adamw" in probes[0]:
        kernels["adamw_params_per_s"] = {k: med([p["adamw"][k] for p in probes]) for k in probes[0]["adamw"]}
    return dataclasses.replace(profile, gemm_flops=gemm, mem_bw=med([p["mem_bw"] for p in probes]),
                               op_overhead_s=med([p["op_overhead_s"] for p in probes]), **engine, **kernels)


def phases(pr, got: dict) -> str:
    """Predicted against measured seconds of each phase: forward and backward
    (predicted: the compute tasks' spans, no waits; measured: wall time),
    step() (after the last backward), and the optimizer's busy time."""
    tasks = pr.sim.tasks
    span = lambda kind: sum(t.end - t.start for t in tasks if t.name.startswith(kind))  # noqa: E731
    bwd_end = max((t.end for t in tasks if t.name.startswith(("forward ", "backward "))), default=0.0)
    pred = {"forward": span("forward "), "backward": span("backward "), "step": pr.seconds - bwd_end,
            "optimizer": pr.busy.get("optimizer", 0.0)}
    return "  ".join(f"{k} {pred[k]:.3f}/{got[k]:.3f}" for k in pred) + "  (s, predicted/measured)"


def _torchrun_child(world: int, args: list):
    """This script's child row under ``torchrun --nproc-per-node world``: rank 0's JSON line, and the process."""
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                        __file__, *args], capture_output=True, text=True, check=False)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    return (json.loads(lines[-1]) if p.returncode == 0 and lines else None), p


def one_row(i: int, profile, steps: int, threads: int):
    """Measures row ``i`` in a child, predicts it from ``profile`` with the
    compute speeds measured between its steps, prints both; the row's record."""
    load0 = os.getloadavg()[0]
    args = ["--child", str(i), "--steps", str(steps), "--threads", str(threads)]
    if world_of(i) > 1:
        got, proc = _torchrun_child(world_of(i), args)
    else:
        got, proc = run_json_child(__file__, args)
    if got is None:
        print(f"{i:2} {ROWS[i][0]:26} FAILED: {proc.stderr[-400:]}")
        return None
    prof = same_time_profile(profile, got["probes"])
    pr = predict_row(i, prof)
    err = pr.seconds / got["seconds"] - 1
    g512 = prof.gemm_rate(row_config(i)[0].dtype, 2 * 512 ** 3) / 1e9
    load = (load0, os.getloadavg()[0])
    print(f"{i:2} {ROWS[i][0]:26}{pr.seconds:10.3f}{got['seconds']:10.3f}{100 * err:7.1f}%  {pr.bound:10} "
          f"{pr.bytes['h2d'] / 1e6:7.1f}/{got['bytes'].get('h2d', 0) / 1e6:<7.1f}   {g512:.1f}, "
          f"{prof.op_overhead_s * 1e6:.0f}; {load[0]:.1f}-{load[1]:.1f}", flush=True)
    print("   " + phases(pr, got), flush=True)
    return {"row": i, "label": ROWS[i][0], "predicted": pr.seconds, "measured": got["seconds"],
            "steps": got["all"], "error": err, "bound": pr.bound, "exposed": pr.exposed, "busy": pr.busy,
            "bytes_predicted": pr.bytes, "bytes_measured": got["bytes"], "load_average": load,
            "phases_measured": {k: got[k] for k in ("forward", "backward", "step", "optimizer")},
            "profile": dataclasses.asdict(prof), "adamw_before_row": profile.adamw_params_per_s}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", help="profile JSON (default: measure one now)")
    ap.add_argument("--rows", help="comma-separated row indexes (default: all)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the runs and the profile (default 1: see the module docstring)")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    if a.child is not None:
        got = measure_row(a.child, a.steps)
        if os.environ.get("RANK", "0") == "0":
            print(json.dumps(got))
        return 0
    from infinity.engine.plan.profile import load_profile
    from infinity.cli.profile_measure import measure_profile
    Path(SWAP).mkdir(parents=True, exist_ok=True)
    profile = load_profile(a.profile) if a.profile else None
    rows = [int(r) for r in a.rows.split(",")] if a.rows else range(len(ROWS))
    out = []
    print(f"{'#':>2} {'configuration':26}{'predicted':>10}{'measured':>10}{'error':>8}  bound      h2d MB pred/meas"
          "   GEMM@512 GFLOP/s, op us (probes, median); load avg")
    for i in rows:
        if a.profile is None:
            profile = measure_profile(torch.device("cpu"), row_config(i)[0].dtype, [SWAP], disk_bytes=128 << 20)
        r = one_row(i, profile, a.steps, a.threads)
        if r is not None:
            out.append(r)
            if a.json:  # after each row: a long run cut short keeps the rows it measured
                write_json(a.json, {"rows": out})
    if out:
        errs = [abs(r["error"]) for r in out]
        print(f"\nmedian |error| {100 * statistics.median(errs):.1f}%, worst {100 * max(errs):.1f}%, "
              f"within 15%: {sum(e <= 0.15 for e in errs)}/{len(errs)}")
    if a.json:
        write_json(a.json, {"rows": out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
