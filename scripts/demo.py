#!/usr/bin/env python3
"""The main job: train a GPT-style model whose model state is larger than
the host budget and ~10x the device budget, through infinity, with NVMe swap
files in a local directory, and say where the time and bytes went.

Model state (fp32 weights, gradients and two Adam moments: 16 bytes a
parameter) lives in swap files (default ./infinity-swap); the host tier caches
what fits its budget; each block's compute copy is paged onto the device ahead
of use under a hard device budget; the native CPU AdamW updates each block as
soon as its gradients have left the device, reading and writing its state
from and to the swap files in a pipeline. The task is synthetic (next token
= a fixed function of the current one), so the loss falls quickly and visibly.
The swap files are removed at the end.

Usage: python scripts/demo.py [--steps 40] [--offload nvme|host] [--swap-dir DIR] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import infinity  # noqa: E402
from infinity.config import format_bytes  # noqa: E402
from infinity.models import GPT, GPTConfig  # noqa: E402


def batch(gen: torch.Generator, n: int, seq: int, vocab: int):
    start = torch.randint(0, vocab, (n, 1), generator=gen)
    steps = torch.arange(seq + 1).unsqueeze(0)
    tokens = (start * 7 + steps * 13) % vocab  # a rule the model can learn
    return tokens[:, :-1], tokens[:, 1:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="fp32" if not torch.cuda.is_available() else "bf16")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--embd", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device-memory", default=None, help="device budget (default: model state / 10)")
    ap.add_argument("--overlap", default="backward", choices=["step", "backward", "delayed"])
    ap.add_argument("--offload", default="nvme", choices=["nvme", "host"],
                    help="home of parameters and optimizer state (default nvme)")
    ap.add_argument("--swap-dir", action="append", default=None,
                    help="swap directory (repeat for several disks; default ./infinity-swap)")
    ap.add_argument("--host-memory", default=None, help="host budget (default: model state / 2.5 with nvme)")
    args = ap.parse_args()

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.embd)
    model = GPT(cfg)
    n = sum(p.numel() for p in model.parameters())
    state = 16 * n
    budget = args.device_memory or max(state // 10, 1)
    host = args.host_memory or (int(state / 2.5) if args.offload == "nvme" else state * 2)
    config = infinity.Config(device=args.device, dtype=args.dtype, device_memory=budget, host_memory=host,
                             offload_params=args.offload, offload_optimizer=args.offload,
                             swap_paths=args.swap_dir or ["./infinity-swap"], overlap=args.overlap,
                             prefetch_depth=2)
    t0 = time.perf_counter()
    try:
        model, opt = infinity.initialize(model, config, lr=1e-3, weight_decay=0.1)
    except infinity.BudgetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    dev = config.resolve_device()
    print(f"infinity {infinity.__version__} | device {dev} | compute dtype {args.dtype} | CPU AdamW "
          f"{infinity.native.info()['simd']} x{infinity.native.default_num_threads()} threads")
    print(f"model: {n / 1e6:.1f} M parameters, model state {format_bytes(state)}; device budget "
          f"{format_bytes(config.device_memory)} ({state / config.device_memory:.1f}x smaller than the state), "
          f"host budget {format_bytes(config.host_memory)} ({state / config.host_memory:.1f}x smaller); "
          f"parameters and optimizer state in {args.offload}"
          + (f" (swap: {', '.join(config.swap_paths)})" if args.offload == "nvme" else "")
          + f"; set up in {time.perf_counter() - t0:.1f} s")
    gen = torch.Generator().manual_seed(1)
    t_start = time.perf_counter()
    first = None
    for step in range(1, args.steps + 1):
        x, y = batch(gen, args.batch, args.seq, args.vocab)
        loss = model(x.to(dev), y.to(dev))
        loss.backward()
        opt.step()
        opt.zero_grad()
        first = first if first is not None else loss.item()
        if step == 1 or step % 5 == 0 or step == args.steps:
            el = time.perf_counter() - t_start
            print(f"step {step:4d}  loss {loss.item():7.4f}  {el / step:6.3f} s/step  "
                  f"{args.batch * args.seq * step / el:8.0f} tokens/s", flush=True)
    total = time.perf_counter() - t_start
    s = infinity.stats(model)
    print("\nwhere the time went (whole run):")
    print(f"  wall time                 {total:8.2f} s ({total / args.steps:.3f} s/step)")
    print(f"  optimizer (CPU AdamW)     {s['optimizer_seconds']:8.2f} s, {100 * s['overlap']:.0f}% of it hidden "
          f"behind backward")
    print(f"  step() waiting for it     {s['optimizer_wait_seconds']:8.2f} s")
    print(f"  compute stalled on data   {s['stall_seconds']:8.2f} s")
    print(f"  fetches {s['fetches']}, prefetches {s['prefetches']}, evictions {s['evictions']}")
    print("bytes moved per step: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in s["step_bytes_moved"].items()
                                               if v))
    print("peak bytes per tier: " + ", ".join(
        f"{k} {format_bytes(v)}" + (f" (budget {format_bytes(s['budget_bytes'][k])})" if s['budget_bytes'][k] else "")
        for k, v in s["peak_bytes"].items()))
    held = all(s["peak_bytes"][k] <= s["budget_bytes"][k] for k in ("device", "host"))
    ok = held and loss.item() < first
    print(f"\nloss {first:.3f} -> {loss.item():.3f}; device and host budgets held: {held}")
    infinity.api.close(model)  # stops the workers, removes the swap files
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
