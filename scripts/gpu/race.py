#!/usr/bin/env python3
"""Race stress of the engine's copy streams (the race stage of scripts/gpu/check.sh).

Two models, each at the engine's minimum device budget (read off the
BudgetError of ``device_memory=1``): the tests' tiny GPT (equal units) and
UnequalNet (blocks Linear 16->h->16, h = 64, 8, 32, 8, 64, 16, 8, 32), over
offload_params {host, none} x overlap {step, backward} x dtype {fp32, bf16} x
prefetch_depth (--depths). Every case trains twice, without and with a lag of
about --lag-ms of GPU time before each block's forward and backward
(``torch.cuda._sleep``; a no-op on the CPU), so compute falls behind the copy
streams and a missing wait reads bytes a copy is still writing. A plain-torch
model (deep copy, torch.optim.AdamW(foreach=False), same data) trains on the
same device as the reference.

Requirements (any violation: exit 1):
  lag        losses and final parameters bitwise equal with and without the lag
  fp32       |loss - ref| <= 1e-6 x |ref| every step; max |param - ref| <=
             1e-6 x the model's largest |ref param| (TF32 off)
  bf16       against the fp32 reference: |loss - ref| <= 3e-2 x |ref|, and per
             tensor ||update - ref update|| <= 0.5 x ||ref update|| (update =
             final - initial). bf16 rounding gives 0.05-0.17 here; wrong
             gradients (review finding A1) give > 1.
  CUDA       the host pool is pinned (without it the synchronous fallback runs)

Modes: --sanitize (the sanitize stage: two steps of the tiniest case, under
TORCH_CUDA_SANITIZER=1); --dist BACKEND (the nccl stage: a world of one
process, ZeRO stages --zero, against the same reference). --json is rewritten
after every case.

Usage: python scripts/gpu/race.py [--device cuda] [--json race.json]
"""

from __future__ import annotations

import os

# Before CUDA starts: cuBLAS is only reproducible across streams with a fixed workspace.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import copy  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import infinity  # noqa: E402
from engine_utils import (add_lag, batches, cuda_lag, deterministic, min_device_budget, small_gpt,  # noqa: E402
                          unequal_net)

MODELS = {"gpt": small_gpt, "unequal": unequal_net}
FP32_RTOL = 1e-6
BF16_LOSS_RTOL = 3e-2
BF16_UPDATE_RTOL = 0.5
LR, WD = 1e-3, 0.1


def train(model, opt, data) -> list:
    """Steps over ``data`` (batches on the model's device); the losses."""
    losses = []
    for x, y in data:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def reference(make, data, device) -> tuple:
    """Plain torch on ``device``: (losses, CPU state dict)."""
    ref = copy.deepcopy(make()).to(device)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, foreach=False)
    losses = train(ref, opt, data)
    return losses, {k: v.detach().cpu() for k, v in ref.state_dict().items()}


def case_config(case: dict, device: str) -> dict:
    """infinity.Config keywords of ``case`` (without device_memory)."""
    return dict(device=device, dtype=case["dtype"], host_memory="64MiB", offload_params=case["params"],
                offload_optimizer="host", overlap=case["overlap"], prefetch_depth=case["depth"],
                zero_stage=case.get("zero", 0))


def engine_run(make, kw: dict, budget: int, data, lag) -> dict:
    """Trains ``make()`` through infinity (with ``lag`` hooks if given): losses,
    CPU state dict, whether the host pool was pinned."""
    model = make()
    if lag is not None:
        add_lag(model, lag)
    model, opt = infinity.initialize(model, infinity.Config(**kw, device_memory=budget), lr=LR, weight_decay=WD)
    try:
        losses = train(model, opt, data)
        state = infinity.full_state_dict(model)
        pinned = infinity.stats(model)["host_pinned"]
    finally:
        infinity.api.close(model)
    return {"losses": losses, "state": state, "pinned": pinned}


def loss_err(losses, ref_losses) -> float:
    """Largest |loss - ref| / |ref| over the steps (inf on NaN)."""
    errs = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, ref_losses)]
    return max(errs) if all(e == e for e in errs) else float("inf")


def param_err(state, ref_state, init, dtype: str) -> float:
    """fp32: max |p - ref| / (model's max |ref|); bf16: the largest per-tensor
    ||update - ref update|| / ||ref update||."""
    if dtype == "fp32":
        scale = max(v.abs().max().item() for v in ref_state.values())
        diff = max((state[k].float() - v).abs().max().item() for k, v in ref_state.items())
        return diff / scale if diff == diff else float("inf")
    worst = 0.0
    for k, v in ref_state.items():
        du, dr = state[k].float() - init[k], v - init[k]
        e = ((du - dr).norm() / dr.norm().clamp_min(1e-30)).item()
        worst = max(worst, e if e == e else float("inf"))
    return worst


def bitwise_equal(a: dict, b: dict) -> bool:
    """Same losses and the same bits in every final tensor."""
    return a["losses"] == b["losses"] and all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"])


def judge(row: dict, on_cuda: bool) -> list:
    """The requirements ``row`` violates (strings; empty when it passes)."""
    bad = []
    if row["dtype"] == "fp32":
        tol_l = tol_p = FP32_RTOL
    else:
        tol_l, tol_p = BF16_LOSS_RTOL, BF16_UPDATE_RTOL
    if not row["loss_err"] <= tol_l:
        bad.append(f"loss error {row['loss_err']:.2e} > {tol_l:g}")
    if not row["param_err"] <= tol_p:
        bad.append(f"parameter error {row['param_err']:.2e} > {tol_p:g}")
    if row.get("lag_equal") is False:
        bad.append("lag changed the result")
    if on_cuda and not row["pinned"]:
        bad.append("host pool not pinned")
    return bad


def run_case(name: str, case: dict, device: str, data, refs: dict, lag) -> dict:
    """One case with and without ``lag``: a table row (errors, verdict)."""
    t0 = time.perf_counter()
    make = MODELS[name]
    row = dict(model=name, **case)
    try:
        kw = case_config(case, device)
        row["budget"] = min_device_budget(make, **kw)
        plain = engine_run(make, kw, row["budget"], data, None)
        ref_losses, ref_state, init = refs[name]
        row["loss_err"] = loss_err(plain["losses"], ref_losses)
        row["param_err"] = param_err(plain["state"], ref_state, init, case["dtype"])
        row["pinned"] = plain["pinned"]
        if lag is not None:
            row["lag_equal"] = bitwise_equal(plain, engine_run(make, kw, row["budget"], data, lag))
        row["violations"] = judge(row, device.startswith("cuda"))
    except Exception as exc:  # one broken case must not hide the others
        traceback.print_exc()
        row["violations"] = [f"raised {type(exc).__name__}: {str(exc)[:200]}"]
    row["seconds"] = round(time.perf_counter() - t0, 2)
    return row


def print_table(rows: list) -> None:
    print(f"{'model':8s} {'params':6s} {'overlap':8s} {'dtype':5s} {'depth':>5s} {'budget':>8s} "
          f"{'loss_err':>9s} {'param_err':>9s} {'lag_eq':>6s} {'pinned':>6s} {'s':>5s}  verdict")
    for r in rows:
        f = lambda k: f"{r[k]:9.2e}" if k in r else f"{'-':>9s}"  # noqa: E731
        name = r["model"] + (f"/z{r['zero']}" if r.get("zero") else "")
        print(f"{name:8s} {r['params']:6s} {r['overlap']:8s} {r['dtype']:5s} {r['depth']:5d} "
              f"{r.get('budget', 0):8d} {f('loss_err')} {f('param_err')} {str(r.get('lag_equal', '-')):>6s} "
              f"{str(r.get('pinned', '-')):>6s} {r['seconds']:5.1f}  "
              + ("ok" if not r["violations"] else "FAIL: " + "; ".join(r["violations"])))


def make_lag(device: str, ms: float):
    """The lag hook: a GPU sleep of ``ms`` on CUDA, ``time.sleep(0)`` on the CPU
    (the hooks still run, so the CPU dry run exercises them)."""
    if device.startswith("cuda") and ms > 0:
        return cuda_lag(ms, torch.device(device))
    return lambda: time.sleep(0)


def references(models, device: str, data) -> dict:
    """model name -> (reference losses, reference state, initial state)."""
    out = {}
    for name in models:
        losses, state = reference(MODELS[name], data, device)
        out[name] = (losses, state, {k: v.detach().clone() for k, v in MODELS[name]().state_dict().items()})
    return out


def run_matrix(args) -> list:
    """Every case of the matrix; the rows."""
    data = [(x.to(args.device), y.to(args.device)) for x, y in batches(args.steps)]
    models = args.models.split(",")
    refs = references(models, args.device, data)
    lag = make_lag(args.device, args.lag_ms) if args.lag_ms > 0 else None
    rows = []
    for name, params, overlap, dtype, depth in itertools.product(
            models, ("host", "none"), ("step", "backward"), args.dtypes.split(","), args.depths):
        case = dict(params=params, overlap=overlap, dtype=dtype, depth=depth)
        rows.append(run_case(name, case, args.device, data, refs, lag))
        save_rows(args.json, rows)
        print(f"  {name} {case}: {'ok' if not rows[-1]['violations'] else rows[-1]['violations']}", flush=True)
    return rows


def sanitize(args) -> list:
    """The sanitize stage: two steps of the tiniest cases (GPT, params on the host, both
    overlaps, fp32 and bf16), no lag, under the CUDA sanitizer."""
    if args.device.startswith("cuda"):
        from torch.cuda import _sanitizer
        if not getattr(_sanitizer.cuda_sanitizer, "enabled", False):
            raise SystemExit("--sanitize: the CUDA sanitizer is off; run with TORCH_CUDA_SANITIZER=1")
    data = [(x.to(args.device), y.to(args.device)) for x, y in batches(2)]
    refs = references(["gpt"], args.device, data)
    return [run_case("gpt", dict(params="host", overlap=o, dtype=d, depth=1), args.device, data, refs, None)
            for o in ("step", "backward") for d in ("fp32", "bf16")]


def distributed(args) -> list:
    """The nccl stage: a world of one process over ``args.dist``, each ZeRO
    stage of ``args.zero``. Stage 3 is the one that reaches NCCL: its gathers
    fill the device arena on the side stream (zero.py); stages 1 and 2 send
    every collective, on host tensors, through the gloo host group. One
    process only: NCCL (2.5 and later) refuses two ranks on one GPU
    ("Duplicate GPU detected", ncclInvalidUsage)."""
    import random

    import torch.distributed as dist
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(random.randint(20000, 40000)))
    if args.device.startswith("cuda"):
        # set_device needs an index: torch.device("cuda") has none.
        torch.cuda.set_device(torch.device(args.device).index or 0)
    dist.init_process_group(args.dist, rank=0, world_size=1)
    try:
        data = [(x.to(args.device), y.to(args.device)) for x, y in batches(args.steps)]
        refs = references(["gpt"], args.device, data)
        rows = []
        for z in args.zero:
            rows.append(run_case("gpt", dict(params="host", overlap="step", dtype="fp32", depth=1, zero=z),
                                 args.device, data, refs, None))
            save_rows(args.json, rows)
        return rows
    finally:
        dist.destroy_process_group()


def save_rows(path, rows: list) -> None:
    """The rows so far as JSON at ``path`` (None: nowhere), rewritten after
    every case so that a run cut by its time limit still leaves them."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(rows, indent=1, default=str))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="torch device (default: cuda if available, else cpu)")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per case (default 6; --sanitize runs 2)")
    ap.add_argument("--models", default="gpt,unequal",
                    help="comma-separated: gpt (the tests' tiny GPT), unequal (UnequalNet) (default both)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma-separated compute dtypes: fp32, bf16 (default both)")
    ap.add_argument("--depths", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2],
                    help="comma-separated prefetch depths (default 1,2; 1: the tightest arena, where A1 shows)")
    ap.add_argument("--lag-ms", type=float, default=1.0,
                    help="GPU sleep per block hook, ms (default 1.0; 0: no lag run)")
    ap.add_argument("--sanitize", action="store_true", help="the sanitize stage: tiniest cases, for TORCH_CUDA_SANITIZER=1")
    ap.add_argument("--dist", default=None, help="the nccl stage: torch.distributed backend (gloo, nccl, "
                    "cpu:gloo,cuda:nccl) of a world of one")
    ap.add_argument("--zero", type=lambda s: [int(v) for v in s.split(",")], default=[3, 2, 1],
                    help="with --dist: comma-separated ZeRO stages (default 3,2,1; 3 reaches NCCL)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON to this file")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, device {args.device}, native {infinity.system.native.available()}", flush=True)
    with deterministic():
        rows = sanitize(args) if args.sanitize else distributed(args) if args.dist else run_matrix(args)
    print_table(rows)
    bad = [r for r in rows if r["violations"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} cases pass")
    save_rows(args.json, rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
