#!/usr/bin/env python3
"""The largest model this machine trains: a GPT-style model of ~4 billion
parameters (model state of fp32 master weights and Adam moments alone ~48 GB,
twice this machine's RAM) trained for a few optimizer steps with a host budget
of a few GiB, everything else in NVMe swap files.

The model is built under ``infinity.init`` (no weights in RAM), materialised
unit by unit straight into the swap files, then trained on one repeated batch
so the loss visibly falls. Prints parameters, model-state bytes, peak RSS,
seconds per step and bytes moved; checks free disk space first and says what
it needs.

Usage: python scripts/scale_demo.py [--layers 51 --embd 2560] [--steps 3]
                                    [--host-memory 5.5GiB] [--device-memory 1GiB] [--swap-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import infinity  # noqa: E402
from infinity.config import format_bytes, parse_bytes  # noqa: E402
from infinity.models import GPT, GPTConfig  # noqa: E402


def rss_bytes(field: str = "VmHWM") -> int:
    """Peak (VmHWM) or current (VmRSS) resident set size of this process, bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=51, help="GPT blocks (default 51: ~4 B params at --embd 2560)")
    ap.add_argument("--embd", type=int, default=2560, help="embedding width, a multiple of --heads (default 2560)")
    ap.add_argument("--heads", type=int, default=20, help="attention heads (default 20)")
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary size, tokens (default 8192)")
    ap.add_argument("--seq", type=int, default=64, help="sequence length, tokens (default 64)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per batch (default 1)")
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps (default 3)")
    ap.add_argument("--dtype", default="bf16", help="compute dtype: bf16, fp16 or fp32 (default bf16)")
    ap.add_argument("--host-memory", default="5.5GiB", help="Config.host_memory, a size (default 5.5GiB)")
    ap.add_argument("--device-memory", default="1GiB",
                    help="Config.device_memory (a region of RAM: the device is the CPU), a size (default 1GiB)")
    ap.add_argument("--swap-dir", action="append", default=None,
                    help="swap folder; repeat for several (default ./infinity-swap)")
    ap.add_argument("--lr", type=float, default=3e-5, help="AdamW learning rate (default 3e-5)")
    args = ap.parse_args()

    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.embd)
    n = cfg.num_params()
    dtype_bytes = {"bf16": 2, "fp16": 2, "fp32": 4}[args.dtype]
    # On disk: fp32 master + two moments, the compute copy, headroom for alignment.
    need = n * (12 + dtype_bytes) + (1 << 30)
    paths = args.swap_dir or ["./infinity-swap"]
    for p in paths:
        os.makedirs(p, exist_ok=True)
    free = sum(shutil.disk_usage(p).free for p in {os.stat(p).st_dev: p for p in paths}.values())
    print(f"model: {n / 1e9:.2f} B parameters ({args.layers} blocks of d={args.embd}); model state "
          f"{format_bytes(16 * n)} (fp32 master + Adam moments {format_bytes(12 * n)}); RAM "
          f"{format_bytes(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'))}")
    print(f"swap: needs {format_bytes(need)} on {paths}; free {format_bytes(free)}")
    if free < need:
        print(f"error: not enough free disk space in {paths}: {need} bytes needed, {free} free. Free space or "
              "pass --swap-dir on a larger disk, or fewer --layers", file=sys.stderr)
        return 2

    config = infinity.Config(device="cpu", dtype=args.dtype, device_memory=args.device_memory,
                             host_memory=args.host_memory, offload_params="nvme", offload_optimizer="nvme",
                             swap_paths=paths, overlap="backward", prefetch_depth=2)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with infinity.init(config):
        model = GPT(cfg)
    t_build = time.perf_counter() - t0
    print(f"built under infinity.init in {t_build:.1f} s; RSS {format_bytes(rss_bytes('VmRSS'))}", flush=True)
    t0 = time.perf_counter()
    model, opt = infinity.initialize(model, config, lr=args.lr, weight_decay=0.0)
    print(f"initialised into the tiers in {time.perf_counter() - t0:.1f} s; RSS {format_bytes(rss_bytes('VmRSS'))},"
          f" peak {format_bytes(rss_bytes())}", flush=True)

    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    y = torch.roll(x, -1, dims=1)
    losses, times = [], []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        s = infinity.stats(model)
        mv = s["step_bytes_moved"]
        print(f"step {step}: loss {losses[-1]:.4f}  {times[-1]:.1f} s  moved: NVMe read "
              f"{format_bytes(mv['nvme_read'])}, write {format_bytes(mv['nvme_write'])}, h2d "
              f"{format_bytes(mv['h2d'])}; peak RSS {format_bytes(rss_bytes())}", flush=True)
    with torch.no_grad():
        final = model(x, y).item()
    s = infinity.stats(model)
    peak_rss = rss_bytes()
    host_budget = parse_bytes(args.host_memory)
    print(f"\nparameters {n / 1e9:.2f} B, model state {format_bytes(16 * n)}, {len(losses)} optimizer steps, "
          f"{sum(times) / len(times):.1f} s/step")
    print(f"loss {losses[0]:.4f} -> {final:.4f} (after the last step)")
    print("peak bytes per tier: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in s["peak_bytes"].items()))
    print(f"peak RSS {format_bytes(peak_rss)} (host budget {format_bytes(host_budget)})")
    print("bytes moved in total: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in s["bytes_moved"].items()))
    ok = all(torch.isfinite(torch.tensor(losses))) and final < losses[0]
    infinity.close(model)
    print("OK" if ok else "FAILED: loss not finite or not falling")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
