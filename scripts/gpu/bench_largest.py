#!/usr/bin/env python3
"""The largest model this machine trains: planned with the estimator, then run.

The plan: a GPT of fixed width (--embd, --heads; sequence and batch as given)
with parameters and optimizer state on NVMe (the placement that fits the
most), its depth the largest whose estimated peaks (infinity's estimator,
on the meta device, activations checkpointed) fit the free device memory,
the RAM available less --host-margin-gib and 90% of the free disk under
--swap-dir, and whose estimated time (initialization writes and two steps'
NVMe traffic at --disk-gbps, with the disk as the bound) fits --budget-s.
Then it builds that model lazily (infinity.init), trains 2 steps and prints
parameters, s/step, tokens/s, the estimate against the measured peaks per
tier, and the bytes moved. --dry-run: the CPU device, a tiny width and a
time plan (1 MB/s for 30 s) that stops the search well below its cap.

Usage: python scripts/gpu/bench_largest.py [--dry-run] [--swap-dir DIR] [--budget-s 150] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import infinity  # noqa: E402
from infinity.engine.plan.estimator import estimate_peaks  # noqa: E402
from infinity.models import GPT, GPTConfig  # noqa: E402
from infinity.system import sysinfo  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--embd", type=int, default=None, help="width (default 4096; 64 with --dry-run)")
    ap.add_argument("--heads", type=int, default=None, help="heads (default 32; 2 with --dry-run)")
    ap.add_argument("--seq", type=int, default=None, help="sequence (default 2048; 32 with --dry-run)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default 32000; 256 with --dry-run)")
    ap.add_argument("--max-layers", type=int, default=None, help="search cap (default 256; 64 with --dry-run)")
    ap.add_argument("--budget-s", type=float, default=150.0, help="wall seconds for build + 2 steps")
    ap.add_argument("--disk-gbps", type=float, default=3.0, help="NVMe GB/s assumed for the time plan")
    ap.add_argument("--host-margin-gib", type=float, default=6.0)
    ap.add_argument("--device-bytes", type=int, default=None, help="device memory to plan for (default: free)")
    ap.add_argument("--swap-dir", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    dry = a.dry_run
    a.device = "cpu" if dry else "cuda"
    a.embd = a.embd or (64 if dry else 4096)
    a.heads = a.heads or (2 if dry else 32)
    a.seq = a.seq or (32 if dry else 2048)
    a.vocab = a.vocab or (256 if dry else 32000)
    a.max_layers = a.max_layers or (64 if dry else 256)
    if dry:  # a disk of 1 MB/s and 30 s: the search stops near 10 MB of state, well below its cap
        a.device_bytes = a.device_bytes or 64 << 20
        a.host_margin_gib, a.disk_gbps, a.budget_s = 0.0, 0.001, 30.0
    return a


def _gpt_config(a, layers: int) -> GPTConfig:
    return GPTConfig(vocab_size=a.vocab, block_size=a.seq, n_layer=layers, n_head=a.heads, n_embd=a.embd,
                     checkpoint=True)


def _config(a, swap: str, device_bytes: int, host_bytes: int) -> infinity.Config:
    return infinity.Config(device=a.device, dtype="fp32" if a.dry_run else "bf16", offload_params="nvme",
                           offload_optimizer="nvme", device_memory=device_bytes, host_memory=host_bytes,
                           swap_paths=[swap], unit_classes=["Block"], swap_block_size="1MiB" if a.dry_run else "8MiB")


def machine(a, swap: str) -> dict:
    """Bytes free now: device, host (less the margin), disk under ``swap`` (90%)."""
    if a.device_bytes is not None:
        dev = a.device_bytes
    else:
        dev = torch.cuda.mem_get_info()[0]
    host = sysinfo.available_ram() - int(a.host_margin_gib * 2**30)
    return {"device": dev, "host": host, "disk": int(0.9 * shutil.disk_usage(swap).free)}


def plan(a, free: dict, swap: str, host_budget: int) -> tuple:
    """(layers, estimate, seconds planned) of the deepest model that fits
    ``free`` and the time budget; (0, None, 0) if not even one layer does."""
    def estimate(layers: int):
        with torch.device("meta"):
            model = GPT(_gpt_config(a, layers))
        x = torch.zeros(a.batch, a.seq, dtype=torch.long, device="meta")
        cfg = _config(a, swap, int(free["device"] * 0.9), host_budget)
        est = estimate_peaks(model, cfg, lambda m: m(x, x), lazy=True)
        nvme = est["nvme"]["peak"]
        # Initialization writes the state once; a step reads and writes it (params twice: fetched forward, backward).
        seconds = 3 * nvme / (a.disk_gbps * 1e9)
        fits = (est["device"]["peak"] <= free["device"] and est["rss"]["peak"] <= free["host"] + est["rss"]["baseline"]
                and nvme <= free["disk"] and seconds <= a.budget_s)
        return fits, est, seconds

    lo, best = 1, (0, None, 0.0)
    hi = a.max_layers
    while lo <= hi:
        mid = (lo + hi) // 2
        fits, est, sec = estimate(mid)
        if fits:
            best, lo = (mid, est, sec), mid + 1
        else:
            hi = mid - 1
    return best


def train_two_steps(a, layers: int, swap: str, device_bytes: int, host_bytes: int) -> dict:
    """Builds the model lazily, trains 2 steps; the figures."""
    cfg = _config(a, swap, device_bytes, host_bytes)
    t0 = time.perf_counter()
    with infinity.init(cfg):
        model = GPT(_gpt_config(a, layers))
    params = sum(p.numel() for p in model.parameters())
    model, opt = infinity.initialize(model, cfg, lr=1e-4)
    built = time.perf_counter() - t0
    g = torch.Generator().manual_seed(0)
    times = []
    try:
        for _ in range(2):
            x = torch.randint(0, a.vocab, (a.batch, a.seq), generator=g).to(a.device)
            t = time.perf_counter()
            model(x, x).backward()
            opt.step()
            opt.zero_grad()
            if a.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        st = infinity.stats(model)
    finally:
        infinity.close(model, keep_values=False)
    return {"parameters": params, "build_s": built, "step_s": times, "tokens_per_s": a.batch * a.seq / times[-1],
            "peak_bytes": dict(st["peak_bytes"], rss=sysinfo.rss_bytes(peak=True)),
            "step_bytes_moved": st["step_bytes_moved"]}


def main(argv=None) -> int:
    a = parse_args(argv)
    swap = a.swap_dir or tempfile.mkdtemp(prefix="infinity-largest-")
    os.makedirs(swap, exist_ok=True)
    free = machine(a, swap)
    host_budget = max(256 << 20, min(free["host"] // 2, 64 << 30))
    layers, est, planned = plan(a, free, swap, host_budget)
    out = {"free": free, "layers": layers, "planned_s": planned}
    if layers == 0:
        print(f"largest: not even one layer of width {a.embd} fits {free}")
        return 1
    out["estimate"] = {t: est[t]["peak"] for t in ("device", "host", "nvme", "rss")}
    print(f"largest: {layers} layers of width {a.embd} planned ({planned:.0f} s of disk traffic); free {free}")
    got = train_two_steps(a, layers, os.path.join(swap, "run"), int(free["device"] * 0.9), host_budget)
    out.update(got)
    print(f"largest: {got['parameters'] / 1e9:.3f} B parameters, built in {got['build_s']:.1f} s, "
          f"steps {', '.join(f'{s:.2f}' for s in got['step_s'])} s, {got['tokens_per_s']:.0f} tokens/s")
    for t in ("device", "host", "nvme", "rss"):
        e, m = out["estimate"][t], got["peak_bytes"].get(t, 0)
        print(f"  {t:6s} estimate {e / 2**20:10.1f} MiB  measured {m / 2**20:10.1f} MiB")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    if not a.swap_dir:
        shutil.rmtree(swap, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
