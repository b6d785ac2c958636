#!/usr/bin/env python3
"""ZeRO stages over data-parallel ranks: per-rank memory, step time and bytes
communicated against theory, in one run.

Launch with torchrun (gloo on CPUs, NCCL on GPUs):
    torchrun --nproc-per-node 2 scripts/bench/bench_zero.py [--device cpu] [--layers 24 --embd 192]

For each stage (0 = plain data parallelism, 1, 2, 3) it trains the same GPT-style
model with host offload for a few steps and reports, from infinity.stats on
every rank: the persistent bytes of fp32 master, moments and gradients (the
theoretical ZeRO share is 1/N of them for the sharded kinds), the median step
time, and the bytes communicated per step against theory: 2 x psi for every stage
(stage 0: an all-reduce, counted as reduce-scatter + all-gather; stages 1-2:
reduce-scatter of the gradients + all-gather of the parameters), 3 x psi for
stage 3 (parameters gathered for forward and for backward), psi being the
model's fp32 parameter bytes.

Every stage also runs in a world of one (each rank alone in its own process
group, same model and batch), and stage 3 with the gradients reduced on the
host (the path before issue 39), so each stage's per-rank device-to-host
bytes of the device reduction are compared in the same run with the world
of one's: target <= 0.55 x at stage 3 (the own shard only, 1/N; stages 1-2
too, stage 0 moves the whole sum: 1.00 x), and the stage-3 / stage-0 step
time <= 1.05. Each row also gives the collectives' own time per step and the
part the engine's threads waited for (``stats()["comm_seconds"]`` and
``["comm_wait_seconds"]``, medians over the timed steps) and the share
hidden behind compute (target >= 70% where compute is longer than the
communication).

Stages 1-2 also run with the parameters on the device
(``offload_params="none"``): the updated compute copies all-gathered on the
device group (each rank's shard up H2D, [Note: where the updated copies are
gathered] in infinity/engine/step/copy_gathers.py) and, interleaved in the
same run, on the host group as before (the baseline): per rank the bytes per
link against theory (the gradients' Psi_t, fp32 and padded, trainable
bytes: device path H2D Psi_t/N, device ring 2 Psi_t (N-1)/N, host ring 0;
host path H2D the whole copies, each ring Psi_t (N-1)/N) and the step and
exposed communication times of both. ``--gathers`` runs only those rows.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import infinity  # noqa: E402
from infinity.models import GPT, GPTConfig  # noqa: E402
from _common import write_json  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu",
                    help="cpu (gloo) or cuda (NCCL; each rank takes LOCAL_RANK) (default cpu)")
    # Deep and narrow: at the smallest device budget the few units kept at the
    # turn of forward to backward are a small part of the model, as in real ones.
    ap.add_argument("--layers", type=int, default=24, help="GPT blocks (default 24)")
    ap.add_argument("--embd", type=int, default=192, help="embedding width, a multiple of 6 (heads) (default 192)")
    ap.add_argument("--seq", type=int, default=128, help="sequence length, tokens (default 128)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per rank per step (default 2)")
    ap.add_argument("--steps", type=int, default=5,
                    help="timed optimizer steps per stage, after one warm-up (default 5)")
    ap.add_argument("--device-memory", default=None,
                    help="device budget per rank, a size (default: all fits; small: stage 3 gathers again for backward)")
    ap.add_argument("--gathers", action="store_true",
                    help="only stages 1-2 with the parameters on the device, copies gathered on the device "
                         "group against the host group, interleaved")
    ap.add_argument("--json", default="bench-results/bench_zero.json",
                    help="where rank 0 writes every rank's rows as JSON (default %(default)s)")
    return ap.parse_args()


def main() -> int:
    args = parse_args()
    cuda = args.device.startswith("cuda")
    if cuda:  # before anything touches CUDA (docs/distributed.md)
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    # NCCL for device tensors; infinity adds a gloo group for its host tensors.
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    rows = []
    minimum = None
    # Stage 3 runs twice: with the budget given (units the budget can keep
    # stay on the device from forward to backward and are not gathered again)
    # and at the smallest budget, where every unit but the few at the turn
    # of forward to backward is gathered twice: the 3 psi of theory.
    # Every rank makes every one-rank group (new_group is collective), then uses its own.
    alone = [dist.new_group([r]) for r in range(world)][rank]
    runs = [(st, args.device_memory, "") for st in (0, 1, 2, 3)] + [(3, "minimum", "")]
    runs += [(st, args.device_memory, "world1") for st in (0, 1, 2, 3)] + [(3, args.device_memory, "host-reduce")]
    gathers = [(st, args.device_memory, v) for _ in range(2) for st in (1, 2) for v in ("none", "none-host-gather")]
    runs = gathers if args.gathers else runs + gathers[:4]
    for stage, budget, variant in runs:
        row, minimum = run_stage(args, stage, budget, minimum, rank, variant, alone)
        rows.append(row)
    everyone = [None] * world
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        report(everyone, rows, world, args.gathers)
        write_json(args.json, everyone)
    dist.destroy_process_group()
    return 0


@contextlib.contextmanager
def on_host(reduce: bool, gather: bool = False):
    """Engines built inside reduce gradients (``reduce``) or gather stages
    1-2's updated copies (``gather``) on the host group (the paths before
    issue 39), the baselines of the device paths' bytes."""
    from infinity.engine.plan import placement
    real = placement.host_reduction_reason, placement.host_gather_reason
    if reduce:
        placement.host_reduction_reason = lambda *a: "the benchmark's baseline"
    if gather:
        placement.host_gather_reason = lambda *a: "the benchmark's baseline"
    try:
        yield
    finally:
        placement.host_reduction_reason, placement.host_gather_reason = real


def run_stage(args, stage: int, budget, minimum, rank: int, variant: str = "", alone=None) -> tuple:
    """One ZeRO stage at one device budget on this rank: (its row, the smallest
    device budget, found at the first stage-3 run). ``variant``: "world1"
    (this rank alone in group ``alone``), "host-reduce" (gradients reduced on the host), "none" (the
    parameters on the device), "none-host-gather" (and their copies gathered on the host group)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=4096, block_size=args.seq, n_layer=args.layers, n_head=6, n_embd=args.embd))
    n = sum(p.numel() for p in model.parameters())
    cfg = infinity.Config(device=args.device, dtype="fp32", host_memory="8GiB", zero_stage=stage,
                          device_memory=minimum if budget == "minimum" else budget,
                          offload_params="none" if variant.startswith("none") else "host",
                          offload_optimizer="host", overlap="step")
    with on_host(variant == "host-reduce", variant == "none-host-gather"):
        model, opt = infinity.initialize(model, cfg, lr=1e-4, process_group=alone if variant == "world1" else None)
    if stage == 3 and minimum is None and not variant:
        minimum = infinity.api.engine_of(model).budget.minimum()
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 4096, (args.batch, args.seq), generator=gen).to(infinity.api.engine_of(model).device)
    times, comm_s, wait_s = [], [], []
    for i in range(args.steps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        model(x, x).backward()
        opt.step()
        opt.zero_grad()
        if i:
            times.append(time.perf_counter() - t0)
            s = infinity.stats(model)
            comm_s.append(s["comm_seconds"]["step"])
            wait_s.append(s["comm_wait_seconds"]["step"])
    s = infinity.stats(model)
    comm = {k: v for k, v in s["step_bytes_moved"].items() if k in ("all_reduce", "reduce_scatter", "all_gather")}
    psi = 4 * n
    theory = {0: 2 * psi, 1: 2 * psi, 2: 2 * psi, 3: 3 * psi}[stage]
    state = s["state_bytes"]
    share = {k: v / (4 * n) for k, v in state.items()}
    step = s["step_bytes_moved"]
    row = {"stage": stage, "budget": "minimum" if budget == "minimum" else budget, "rank": rank, "params": n,
           "variant": variant, "world": s["world_size"], "step_s": statistics.median(times),
           "links": {k: step.get(k, 0) for k in ("d2h", "h2d", "net_device", "net_host")},
           "state_bytes": state, "state_share": share, "comm_bytes_per_step": sum(comm.values()),
           "comm_theory": theory, "comm_ratio": sum(comm.values()) / theory, "comm": comm,
           "peak_bytes": s["peak_bytes"], "comm_s": statistics.median(comm_s),
           "comm_wait_s": statistics.median(wait_s),
           "reduce_on_device": infinity.api.engine_of(model).modes.reduce_on_device,
           "gather_on_device": infinity.api.engine_of(model).modes.gather_on_device,
           "grad_bytes": sum(4 * u.place.trainable_numel for u in infinity.api.engine_of(model).units),
           "compute_bytes": sum(u.place.compute_bytes for u in infinity.api.engine_of(model).units)}
    infinity.close(model)
    return row, minimum


def _tag(r: dict) -> str:
    return "3min" if r["budget"] == "minimum" else f"{r['stage']}{'-' + r['variant'] if r['variant'] else ''}"


def report(everyone: list, rows: list, world: int, gathers_only: bool = False) -> None:
    """Rank 0: every rank's rows, then the targets."""
    print(f"{world} ranks, {dist.get_backend()}, {rows[0]['params'] / 1e6:.1f} M params "
          f"(psi = {4 * rows[0]['params'] / 2**20:.0f} MiB fp32); per-step bytes per rank in MiB")
    print(f"{'stage':>14} {'rank':>4} {'step s':>7} {'master':>7} {'moments':>8} {'grads':>6} {'comm/step':>10} "
          f"{'x theory':>8} {'D2H':>7} {'H2D':>7} {'net dev':>8} {'net host':>8} {'host peak':>9} "
          f"{'comm s':>7} {'waited':>7} {'hidden':>6}")
    mib = 2 ** 20
    for rr in everyone:
        for r in rr:
            sh, ln = r["state_share"], r["links"]
            print(f"{_tag(r):>14s} {r['rank']:4d} {r['step_s']:7.3f} {sh['master']:7.3f} "
                  f"{(sh['exp_avg'] + sh['exp_avg_sq']) / 2:8.3f} {sh['grad']:6.3f} "
                  f"{r['comm_bytes_per_step'] / mib:9.1f}M {r['comm_ratio']:8.3f} {ln['d2h'] / mib:7.2f} "
                  f"{ln['h2d'] / mib:7.2f} {ln['net_device'] / mib:8.2f} {ln['net_host'] / mib:8.2f} "
                  f"{r['peak_bytes']['host'] / mib:9.1f} {r['comm_s']:7.3f} {r['comm_wait_s']:7.3f} "
                  f"{_hidden(r):>6}")
    if not gathers_only:
        targets(everyone, world)
    gather_targets(everyone, world)


def _hidden(r: dict) -> str:
    """The share of the collectives' time hidden behind compute, or "-" without collectives."""
    return f"{1 - r['comm_wait_s'] / r['comm_s']:.0%}" if r["comm_s"] > 0 else "-"


def targets(everyone: list, world: int) -> None:
    """Rank 0: the targets, from rank 0's rows (every rank moves the same bytes)."""
    r0 = {r["stage"]: r for r in everyone[0] if r["budget"] != "minimum" and not r["variant"]}
    by = {r["variant"]: r for r in everyone[0] if r["stage"] == 3 and r["budget"] != "minimum"}
    one = {r["stage"]: r for r in everyone[0] if r["variant"] == "world1"}
    r3min = [r for r in everyone[0] if r["budget"] == "minimum"][0]
    ok_mem = all(abs(r0[st]["state_share"][k] * world - 1) <= 0.05 for st in (1, 2, 3)
                 for k in ("master", "exp_avg", "exp_avg_sq")) and \
        all(abs(r0[st]["state_share"]["grad"] * world - 1) <= 0.05 for st in (2, 3))
    ok_comm = all(abs(r0[st]["comm_ratio"] - 1) <= 0.10 for st in (0, 1, 2))
    ok3 = abs(r3min["comm_ratio"] - 1) <= 0.10
    ratio3 = r0[3]["step_s"] / r0[0]["step_s"]
    d2h = by[""]["links"]["d2h"] / max(1, by["world1"]["links"]["d2h"])
    d2h_host = by["host-reduce"]["links"]["d2h"] / max(1, by["world1"]["links"]["d2h"])
    h2d = by[""]["links"]["h2d"] / max(1, by["world1"]["links"]["h2d"])
    print(f"\nTargets: per-rank sharded state within 5% of 1/N: {'PASS' if ok_mem else 'FAIL'}; "
          f"communicated bytes within 10% of theory: stages 0-2 {'PASS' if ok_comm else 'FAIL'}, "
          f"stage 3 at the smallest device budget {r3min['comm_ratio']:.3f} x 3 psi "
          f"{'PASS' if ok3 else 'FAIL'} (with the budget given: {r0[3]['comm_ratio']:.3f} x 3 psi; units "
          f"kept on the device from forward to backward are not gathered again)")
    print(f"stage 3, per rank per step against a world of one: D2H {d2h:.3f} x (<= 0.55: "
          f"{'PASS' if d2h <= 0.55 else 'FAIL'}; reduced on the host as before: {d2h_host:.3f} x), H2D {h2d:.3f} x")
    print("D2H per rank per step against a world of one, by stage: " + ", ".join(
        f"{st}: {r0[st]['links']['d2h'] / max(1, one[st]['links']['d2h']):.3f} x"
        f"{'' if r0[st]['reduce_on_device'] else ' (host path)'}" for st in (0, 1, 2, 3)))
    hid = {st: 1 - r0[st]["comm_wait_s"] / r0[st]["comm_s"] for st in (0, 1, 2, 3) if r0[st]["comm_s"] > 0}
    print("collective time hidden behind compute (>= 70%): " + ", ".join(
        f"stage {st} {h:.0%} of {r0[st]['comm_s'] * 1e3:.0f} ms/step {'PASS' if h >= 0.7 else 'MISS'}"
        for st, h in hid.items()))
    print(f"stage 3 / stage 0 step time {ratio3:.3f} (<= 1.05: {'PASS' if ratio3 <= 1.05 else 'FAIL'})")


def gather_targets(everyone: list, world: int) -> None:
    """Rank 0: stages 1-2 with the parameters on the device, the copies
    gathered on the device group against the host group: each rank's bytes
    per link against theory (exact within 1%), the medians of the step and
    exposed communication times over the interleaved runs, and their ratios."""
    ring = (world - 1) / world
    for st in (1, 2):
        both = {}
        for v in ("none", "none-host-gather"):
            rs = [r for rr in everyone for r in rr if r["stage"] == st and r["variant"] == v]
            if not rs:
                return
            gb, cb = rs[0]["grad_bytes"], rs[0]["compute_bytes"]
            dev = v == "none"
            want = {"h2d": gb / world if dev else cb, "net_device": (2 if dev else 1) * gb * ring,
                    "net_host": 0 if dev else gb * ring}
            ok = all(abs(r["links"][k] - w) <= 0.01 * max(w, 1) for r in rs for k, w in want.items())
            both[v] = (statistics.median(r["step_s"] for r in rs), statistics.median(r["comm_wait_s"] for r in rs),
                       statistics.median(r["comm_s"] for r in rs), rs[0]["links"], ok,
                       all(r["gather_on_device"] is dev for r in rs))
        (ts, ws, cs, ln, ok, on), (tb, wb, cbs, lb, okb, onb) = both["none"], both["none-host-gather"]
        mib = 2 ** 20
        print(f"stage {st}, params on the device, per rank per step: device gather H2D {ln['h2d'] / mib:.2f} / "
              f"net dev {ln['net_device'] / mib:.2f} / net host {ln['net_host'] / mib:.2f} MiB, host gather "
              f"{lb['h2d'] / mib:.2f} / {lb['net_device'] / mib:.2f} / {lb['net_host'] / mib:.2f} MiB; "
              f"bytes = theory within 1%: {'PASS' if ok and okb and on and onb else 'FAIL'}; "
              f"step {ts:.3f} s vs {tb:.3f} s ({ts / tb:.3f} x); exposed comm {ws * 1e3:.0f} of {cs * 1e3:.0f} ms "
              f"vs {wb * 1e3:.0f} of {cbs * 1e3:.0f} ms")


if __name__ == "__main__":
    sys.exit(main())
