#!/usr/bin/env python3
"""Peak RSS of NVMe-offloaded training against plain torch training the same
model in memory, in one run (each in its own process, so neither inherits
the other's heap).

A GPT-style model is trained for a few steps (a) with torch.optim.AdamW
(foreach=False) holding everything in RAM (16 bytes a parameter plus
activations), (b) through infinity with parameters and optimizer state in
swap files, ``host_memory`` and ``device_memory`` budgets far below the model
state. Reported for each: peak RSS (VmHWM), steady RSS and its growth over
the measured steps, and for infinity the documented bound: host budget +
device budget (a region of RAM on the CPU) + swap staging (2 blocks a path)
+ the runtime (the RSS after importing torch, measured) + the activations
(plain torch's peak less its runtime and 16 bytes a parameter: both sides
hold the same) + a fixed overhead (FIXED_OVERHEAD: the worker threads'
malloc arenas, the engine's bookkeeping). Prints the ratio of the peak RSSs
and whether infinity's peak is within its bound.

Usage: python scripts/bench/bench_rss.py [--layers 12 --embd 768 --steps 4 --host 512MiB --device 192MiB]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from _common import run_json_child, status_kib

ROOT = Path(__file__).resolve().parents[2]


def _model(args):
    import torch
    from infinity.models import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                         n_embd=args.embd, tie_weights=True))


def _batches(args):
    import torch
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g) for _ in range(args.steps)]


def child(args) -> dict:
    """One side's run in this process; returns its figures."""
    sys.path.insert(0, str(ROOT))
    import torch
    import infinity
    torch.set_num_threads(os.cpu_count() or 1)
    base = status_kib("VmRSS")
    model = _model(args)
    params = sum(p.numel() for p in model.parameters())
    rss = []
    if args.side == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    else:
        cfg = infinity.Config(device="cpu", dtype="fp32", offload_params="nvme", offload_optimizer="nvme",
                              host_memory=args.host, device_memory=args.device, swap_paths=[args.swap],
                              overlap="backward")
        model, opt = infinity.initialize(model, cfg, lr=1e-4)
    for ids in _batches(args):
        loss = model(ids[:, :-1], ids[:, 1:])
        loss = loss[1] if isinstance(loss, tuple) else loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        rss.append(status_kib("VmRSS") * 1024)
    out = {"side": args.side, "params": params, "peak_rss": status_kib("VmHWM") * 1024, "rss": rss,
           "runtime_rss": base * 1024}
    if args.side == "infinity":
        st = infinity.stats(model)
        out["budgets"] = {"host": cfg.host_memory, "device": cfg.device_memory,
                          "staging": 2 * len(cfg.swap_paths) * cfg.swap_block_size}
        out["peak_bytes"] = st.get("peak_bytes")
        infinity.close(model)
    return out


def run_side(args, side: str, swap: str) -> dict:
    out, res = run_json_child(__file__, ["--child", side, "--swap", swap] + args.passthrough)
    if out is None:
        raise SystemExit(f"{side} run failed ({res.returncode}):\n{res.stderr[-4000:]}")
    return out


def report(t: dict, i: dict) -> bool:
    gib = 1 << 30
    b = i["budgets"]
    activations = max(0, t["peak_rss"] - t["runtime_rss"] - 16 * t["params"])
    bound = b["host"] + b["device"] + b["staging"] + i["runtime_rss"] + activations + FIXED_OVERHEAD
    print(f"model: {i['params'] / 1e6:.1f} M parameters, model state {16 * i['params'] / gib:.2f} GiB")
    for r in (t, i):
        growth = r["rss"][-1] - r["rss"][1] if len(r["rss"]) > 2 else 0
        print(f"  {r['side']:9s} peak RSS {r['peak_rss'] / gib:6.2f} GiB   last {r['rss'][-1] / gib:6.2f} GiB   "
              f"growth after step 2 {growth / (1 << 20):+7.1f} MiB")
    print(f"  infinity budgets: host {b['host'] / gib:.2f} GiB + device {b['device'] / gib:.2f} GiB + staging "
          f"{b['staging'] / (1 << 20):.0f} MiB + runtime {i['runtime_rss'] / gib:.2f} GiB + activations "
          f"{activations / (1 << 20):.0f} MiB + overhead {FIXED_OVERHEAD >> 20} MiB = bound {bound / gib:.2f} GiB")
    ratio = i["peak_rss"] / t["peak_rss"]
    ok = i["peak_rss"] <= t["peak_rss"] and i["peak_rss"] <= bound
    print(f"peak RSS ratio infinity / torch = {ratio:.3f}; within bound: {i['peak_rss'] <= bound}; "
          f"{'PASS' if ok else 'FAIL'}")
    return ok


FIXED_OVERHEAD = 256 << 20  # worker threads' malloc arenas, the engine's bookkeeping (docs/config.md, host_memory): ~190 MiB measured


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12, help="GPT blocks (default 12)")
    ap.add_argument("--embd", type=int, default=768, help="embedding width, a multiple of --heads (default 768)")
    ap.add_argument("--heads", type=int, default=12, help="attention heads (default 12)")
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary size, tokens (default 8192)")
    ap.add_argument("--seq", type=int, default=128, help="sequence length, tokens (default 128)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per batch (default 4)")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps on each side (default 4)")
    ap.add_argument("--host", default="512MiB", help="infinity's host_memory budget, a size (default 512MiB)")
    ap.add_argument("--device", default="192MiB",
                    help="infinity's device_memory budget (a region of RAM on the CPU), a size (default 192MiB)")
    ap.add_argument("--swap", default=None, help="swap folder (default: a temporary one under ./infinity-swap)")
    ap.add_argument("--child", choices=["torch", "infinity"], help=argparse.SUPPRESS)
    ap.add_argument("--json", action="store_true", help="also print both sides' figures as one JSON line")
    args = ap.parse_args()
    if args.child:
        args.side = args.child
        print(json.dumps(child(args)))
        return
    args.passthrough = [a for a in sys.argv[1:] if not a.startswith("--swap") and a != "--json"]
    os.makedirs("infinity-swap", exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.swap or "infinity-swap") as swap:
        t = run_side(args, "torch", swap)
        i = run_side(args, "infinity", swap)
    ok = report(t, i)
    if args.json:
        print(json.dumps({"torch": t, "infinity": i}))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
