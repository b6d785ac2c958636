#!/usr/bin/env python3
"""Offloaded training against in-memory training of the same model, in one run.

A GPT-style model whose model state (fp32 weights, gradients, Adam moments:
16 bytes a parameter) is several times the device budget is trained through
infinity; the same model is trained in memory with torch.optim.AdamW
(fused=True) on the same batches. Steps alternate (offloaded, in-memory,
offloaded, ...) so drift in machine speed hits both alike.

Reported:
  step time and tokens/s of both; overhead ratio = offloaded / in-memory;
  stall time (compute waiting for data), optimizer time, bytes moved per step;
  lower bound = max(compute + optimizer, transfer), each measured in this run:
    compute   forward+backward of the in-memory model (median)
    optimizer infinity's CPU AdamW over all parameters (median)
    transfer  bytes moved per step / copy bandwidth of the mover, measured
  (on CUDA the bound is max(GPU compute, CPU optimizer, PCIe transfers));
  overlap efficiency = lower bound / offloaded step time, the median over
  pairs of (offloaded step, in-memory step run next to it).
Also steps a few budgets to show bytes moved per step falling as the budget grows.

On CUDA also: copy bandwidth from pinned memory (the mover's path, used for
the transfer bound when the engine's pool is pinned) beside pageable; GPU-side
stalls when the engine reports ``device_stall_seconds``; the caching
allocator's peaks and retries and the pinned host bytes. Step times end with a
device synchronize. --profile PATH writes a torch.profiler trace of one
offloaded step (gzipped Chrome trace, dropped if over 16 MiB).

Usage: python scripts/bench/bench_train.py [--layers 12 --embd 512 --steps 6 --budget-frac 0.33]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import infinity  # noqa: E402
from infinity.cli.estimate import estimate  # noqa: E402
from infinity.models import GPT, GPTConfig  # noqa: E402
from infinity.cli.perf import copy_bandwidth, disk_bandwidth, optimizer_time  # noqa: E402
from _common import write_json  # noqa: E402


def make_model(args) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                         n_embd=args.embd, tie_weights=True))


def device_minimum(model, cfg: infinity.Config) -> int:
    """The smallest device budget, bytes, that runs ``model`` under ``cfg``'s
    placement, dtype and prefetch (what ``initialize`` checks against)."""
    return estimate(model, cfg)["device"]["minimum"]


def at_least_minimum(model, cfg: infinity.Config, label: str = "device budget") -> infinity.Config:
    """``cfg``, its device budget raised to the model's minimum if below it
    (a small model's state is too small for a fraction of it to run), saying so."""
    minimum = device_minimum(model, cfg)
    if cfg.device_memory >= minimum:
        return cfg
    print(f"{label} {cfg.device_memory} bytes ({cfg.device_memory / 2**20:.1f} MiB) is below this model's "
          f"minimum: raised to {minimum} bytes ({minimum / 2**20:.1f} MiB)")
    return dataclasses.replace(cfg, device_memory=minimum)


model_ref: list = []


def build(args) -> dict:
    """The in-memory baseline, the offloaded model and the batches (a dict)."""
    device = torch.device(args.device)
    ref = make_model(args)
    n_params = sum(p.numel() for p in ref.parameters())
    model_state = n_params * 16
    budget = int(n_params * 4 * args.budget_frac)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen),
             torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)) for _ in range(4)]

    # In-memory baseline: plain torch, fused AdamW.
    base = ref.to(device)
    base_opt = torch.optim.AdamW(base.parameters(), lr=1e-4, weight_decay=0.1, fused=True)

    model = make_model(args)
    host = model_state * 2 if args.offload == "host" else int(model_state * args.host_frac)
    cfg = infinity.Config(device=args.device, dtype="fp32", device_memory=budget, host_memory=host,
                          offload_params=args.params or args.offload, offload_optimizer=args.offload, overlap=args.overlap,
                          prefetch_depth=args.prefetch_depth, swap_paths=args.swap_dir or ["./infinity-swap"],
                          swap_checksum=not args.no_checksum, state_chunk_bytes=args.state_chunk)
    cfg = at_least_minimum(model, cfg, f"device budget (--budget-frac {args.budget_frac})")
    budget = cfg.device_memory
    model, opt = infinity.initialize(model, cfg, lr=1e-4, weight_decay=0.1)
    print(f"model: {n_params / 1e6:.1f} M params, model state {model_state / 2**20:.0f} MiB, device budget "
          f"{budget / 2**20:.0f} MiB ({model_state / budget:.1f}x smaller), host budget {host / 2**20:.0f} MiB, "
          f"offload {args.offload}, {len(model.blocks)} blocks, batch {args.batch}x{args.seq}")
    return dict(device=device, n_params=n_params, model_state=model_state, budget=budget, data=data, base=base,
                base_opt=base_opt, model=model, opt=opt, cfg=cfg)


def step_fns(ctx: dict):
    """(offloaded step, in-memory step): each returns its wall seconds; the
    offloaded one also the loss, the in-memory one also its forward+backward
    seconds. Both end with a device synchronize, so GPU time is counted."""
    device, model, opt, base, base_opt = (ctx[k] for k in ("device", "model", "opt", "base", "base_opt"))

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step_offload(x, y):
        t0 = time.perf_counter()
        loss = model(x.to(device), y.to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        sync()
        return time.perf_counter() - t0, loss.item()

    def step_base(x, y):
        t0 = time.perf_counter()
        loss = base(x.to(device), y.to(device))
        loss.backward()
        sync()  # else t1 is when the kernels were queued, not when they ran
        t1 = time.perf_counter()
        base_opt.step()
        base_opt.zero_grad()
        sync()
        return time.perf_counter() - t0, t1 - t0

    return step_offload, step_base


def stall_keys(stats: dict) -> tuple:
    """The stall counters infinity reports: host-side waits and, where the
    engine measures them, GPU-side waits (``device_stall_seconds``)."""
    return tuple(k for k in ("stall_seconds", "device_stall_seconds") if k in stats)


def measure(ctx: dict, args) -> dict:
    """Warm-up, then alternating offloaded and in-memory steps: per-step times and stats deltas."""
    step_offload, step_base = step_fns(ctx)
    data = ctx["data"]
    for i in range(2):  # warm-up: trace recording, allocator, page faults
        step_offload(*data[i % 4])
        step_base(*data[i % 4])
    if ctx["device"].type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    s0 = infinity.stats(ctx["model"])
    t_off, t_base, t_compute = [], [], []
    for i in range(args.steps):
        x, y = data[i % 4]
        a, _ = step_offload(x, y)
        b, c = step_base(x, y)
        t_off.append(a)
        t_base.append(b)
        t_compute.append(c)
    s = infinity.stats(ctx["model"])
    stalls = {k: (s[k] - s0[k]) / args.steps for k in stall_keys(s)}
    if args.profile:
        profile_step(step_offload, data[0], ctx["device"], args.profile)
    return dict(t_off=t_off, t_base=t_base, t_compute=t_compute, s=s, stalls=stalls,
                optsec=(s["optimizer_seconds"] - s0["optimizer_seconds"]) / args.steps)


def cuda_memory(model) -> dict:
    """Device and pinned host memory of this process (CUDA): the caching
    allocator's peaks since the timed steps began (both models are resident,
    the in-memory one included), its allocation retries, and pinned host
    bytes (the engine's pool when pinned, plus torch's pinned allocator)."""
    ms = torch.cuda.memory_stats()
    pool = infinity.api.engine_of(model).room.tier.pool
    out = {"max_memory_allocated": torch.cuda.max_memory_allocated(),
           "max_memory_reserved": torch.cuda.max_memory_reserved(),
           "num_alloc_retries": ms.get("num_alloc_retries", 0),
           "host_pool_pinned_bytes": pool.capacity_bytes if pool is not None and pool.pinned else 0}
    if hasattr(torch.cuda, "host_memory_stats"):
        out["torch_pinned_peak_bytes"] = torch.cuda.host_memory_stats().get("allocated_bytes.peak", 0)
    return out


def profile_step(step_offload, batch, device: torch.device, path: str, limit: int = 16 << 20) -> None:
    """A torch.profiler trace of one offloaded step, gzipped to ``path``
    (Chrome trace format); dropped, saying so, when over ``limit`` bytes."""
    import gzip
    import tempfile
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step_offload(*batch)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as f, gzip.open(out, "wb", compresslevel=6) as g:
            g.write(f.read())
    size = out.stat().st_size
    if size > limit:
        out.unlink()
        print(f"profile: trace of {size} bytes gzipped is over {limit}; dropped (profile a smaller config)")
    else:
        print(f"profile: one offloaded step, {size / 2**20:.1f} MiB gzipped: {out}")


def bandwidths(ctx: dict, nbytes: int) -> dict:
    """Copy bandwidths: pageable; on CUDA also pinned, which is the mover's
    path when the engine's pool is pinned (the transfer bound uses that)."""
    device = ctx["device"]
    out = {"copy_bandwidth_Bps": copy_bandwidth(nbytes, device)}
    if device.type == "cuda":
        out["copy_bandwidth_pageable_Bps"] = out["copy_bandwidth_Bps"]
        out["copy_bandwidth_pinned_Bps"] = copy_bandwidth(nbytes, device, pinned=True)
        if infinity.stats(ctx["model"])["host_pinned"]:
            out["copy_bandwidth_Bps"] = out["copy_bandwidth_pinned_Bps"]
    return out


def summarize(ctx: dict, m: dict, args) -> dict:
    """The report (the JSON written) from the measurements ``m``."""
    s, cfg, n_params = m["s"], ctx["cfg"], ctx["n_params"]
    sm = s["step_bytes_moved"]
    moved = sm["h2d"] + sm["d2h"]
    bws = bandwidths(ctx, min(n_params * 4, 256 << 20))
    bw = bws["copy_bandwidth_Bps"]
    t_opt = optimizer_time(n_params, cfg.num_threads)
    compute = statistics.median(m["t_compute"])
    transfer = moved / bw
    disk = None
    if args.offload == "nvme":
        wbw, rbw = disk_bandwidth(cfg.swap_paths, 256 << 20)
        disk = {"write_Bps": wbw, "read_Bps": rbw}
        # The disk serves reads and writes in turn; host copies run beside it.
        transfer = max(transfer, sm["nvme_read"] / rbw + sm["nvme_write"] / wbw)
    bound = max(compute + t_opt, transfer)
    t_off, t_base = m["t_off"], m["t_base"]
    off, bas = statistics.median(t_off), statistics.median(t_base)
    # Memory bandwidth drifts over minutes here: each offloaded step is judged
    # against the in-memory compute of the step run right after it.
    effs = [max(c + t_opt, transfer) / a for a, c in zip(t_off, m["t_compute"])]
    ratios = [a / b for a, b in zip(t_off, t_base)]
    tokens = args.batch * args.seq
    res = {
        "params": n_params, "model_state_bytes": ctx["model_state"], "device_budget_bytes": ctx["budget"],
        "offload_step_s": off, "inmemory_step_s": bas, "tokens_per_s_offload": tokens / off,
        "tokens_per_s_inmemory": tokens / bas, "overhead_ratio": statistics.median(ratios),
        "stall_s_per_step": m["stalls"]["stall_seconds"],
        "optimizer_s_per_step": m["optsec"],
        "bytes_moved_per_step": s["step_bytes_moved"], "copy_bandwidth_Bps": bw,
        "lower_bound": {"compute_s": compute, "optimizer_s": t_opt, "transfer_s": transfer, "bound_s": bound},
        "overlap_efficiency": statistics.median(effs), "overlap_efficiency_of_medians": bound / off,
        "peak_bytes": s["peak_bytes"], "overlap": args.overlap,
        "steps": args.steps, "device": str(ctx["device"]), "offload": args.offload, "disk_bandwidth": disk,
    }
    if "device_stall_seconds" in m["stalls"]:
        res["device_stall_s_per_step"] = m["stalls"]["device_stall_seconds"]
    if ctx["device"].type == "cuda":
        res.update({k: v for k, v in bws.items() if k != "copy_bandwidth_Bps"})
        res["cuda_memory"] = m["cuda_memory"]
    return res


def print_report(res: dict, moved_line: dict, budget: int) -> None:
    """The human-readable table of ``res`` (format quoted by docs: keep it)."""
    off, bas = res["offload_step_s"], res["inmemory_step_s"]
    lb, disk, bw = res["lower_bound"], res["disk_bandwidth"], res["copy_bandwidth_Bps"]
    sm = res["bytes_moved_per_step"]
    moved = sm["h2d"] + sm["d2h"]
    cuda = "cuda_memory" in res
    print(f"{'':24s} {'offloaded':>10s} {'in-memory':>10s}")
    print(f"{'step time (median, s)':24s} {off:10.3f} {bas:10.3f}")
    print(f"{'tokens/s':24s} {res['tokens_per_s_offload']:10.0f} {res['tokens_per_s_inmemory']:10.0f}")
    print(f"overhead ratio (median of per-step ratios): {res['overhead_ratio']:.3f}")
    dev_stall = (f" (GPU-side {res['device_stall_s_per_step'] * 1e3:.1f} ms/step)"
                 if cuda and "device_stall_s_per_step" in res else "")
    print(f"stall {res['stall_s_per_step'] * 1e3:.1f} ms/step{dev_stall}, optimizer "
          f"{res['optimizer_s_per_step'] * 1e3:.1f} ms/step, moved {moved / 2**20:.1f} MiB/step {moved_line}")
    pinned = (f" pinned; pageable {res['copy_bandwidth_pageable_Bps'] / 1e9:.1f} GB/s"
              if cuda and bw == res.get("copy_bandwidth_pinned_Bps") else "")
    print(f"lower bound max(compute {lb['compute_s']:.3f} + optimizer {lb['optimizer_s']:.3f}, transfer "
          f"{lb['transfer_s']:.3f}) = {lb['bound_s']:.3f} s [copies at {bw / 1e9:.1f} GB/s{pinned}"
          + (f"; disk write {disk['write_Bps'] / 1e9:.2f} GB/s, read {disk['read_Bps'] / 1e9:.2f} GB/s"
             if disk else "")
          + f"]; overlap efficiency {res['overlap_efficiency']:.3f} (median of pairs; of medians "
          f"{res['overlap_efficiency_of_medians']:.3f})")
    print(f"peak bytes: device {res['peak_bytes']['device'] / 2**20:.1f} MiB (budget {budget / 2**20:.1f}), "
          f"host {res['peak_bytes']['host'] / 2**20:.1f} MiB")
    if cuda:
        cm = res["cuda_memory"]
        print(f"cuda memory: max allocated {cm['max_memory_allocated'] / 2**20:.0f} MiB, max reserved "
              f"{cm['max_memory_reserved'] / 2**20:.0f} MiB (both models), alloc retries "
              f"{cm['num_alloc_retries']}, pinned host {cm['host_pool_pinned_bytes'] / 2**20:.0f} MiB pool"
              + (f" + {cm['torch_pinned_peak_bytes'] / 2**20:.0f} MiB torch peak"
                 if "torch_pinned_peak_bytes" in cm else ""))


def run(args) -> dict:
    """Builds both models, measures, prints and returns the report."""
    ctx = build(args)
    m = measure(ctx, args)
    if ctx["device"].type == "cuda":
        m["cuda_memory"] = cuda_memory(ctx["model"])
    model_ref.append(ctx["model"])
    res = summarize(ctx, m, args)
    print_report(res, m["s"]["step_bytes_moved"], ctx["budget"])
    return res


def sweep_budgets(args, fracs=(0.25, 0.5, 0.75, 1.1)) -> list:
    """(fraction of the compute copy, bytes) of each sweep budget; those below
    the model's minimum are raised to it (one row at the minimum), saying so."""
    with torch.device("meta"):
        model = make_model(args)
    copy = sum(p.numel() for p in model.parameters()) * 4
    minimum = device_minimum(model, sweep_config(args, copy // 4, None))
    low = [f for f in fracs if int(copy * f) < minimum]
    if low:
        print(f"  budgets {', '.join(f'{f:.2f}' for f in low)} x compute copy are below this model's minimum "
              f"({minimum} bytes, {minimum / copy:.2f} x): one run at the minimum instead")
    return [(minimum / copy, minimum)] * bool(low) + [(f, int(copy * f)) for f in fracs if f not in low]


def sweep_config(args, n: int, budget) -> infinity.Config:
    """The sweep's Config for a model of ``n`` parameters at device budget ``budget``."""
    return infinity.Config(device=args.device, dtype="fp32", device_memory=budget, host_memory=n * 40,
                           prefetch_depth=args.prefetch_depth)


def budget_sweep(args) -> list:
    """Bytes moved per step for several device budgets (fractions of the compute copy)."""
    rows = []
    gen = torch.Generator().manual_seed(2)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(args.device)
    for frac, budget in sweep_budgets(args):
        model = make_model(args)
        cfg = sweep_config(args, sum(p.numel() for p in model.parameters()), budget)
        try:
            model, opt = infinity.initialize(model, cfg, lr=1e-4)
        except infinity.BudgetError as e:
            print(f"  budget {frac:.2f} x compute copy: refused ({str(e)[:80]}...)")
            continue
        for _ in range(3):
            model(x, x).backward()
            opt.step()
            opt.zero_grad()
        s = infinity.stats(model)
        rows.append({"budget_frac": frac, "budget_bytes": cfg.device_memory, "h2d_per_step": s["step_bytes_moved"]["h2d"],
                     "peak_device": s["peak_bytes"]["device"]})
        print(f"  budget {frac:.2f} x compute copy ({cfg.device_memory / 2**20:6.1f} MiB): "
              f"h2d {s['step_bytes_moved']['h2d'] / 2**20:7.1f} MiB/step, peak {s['peak_bytes']['device'] / 2**20:6.1f} MiB")
        del model, opt
    return rows


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", help="torch device: cpu (default), cuda, cuda:N")
    ap.add_argument("--layers", type=int, default=12, help="GPT blocks (default 12)")
    ap.add_argument("--embd", type=int, default=512, help="embedding width, a multiple of --heads (default 512)")
    ap.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    ap.add_argument("--vocab", type=int, default=8192, help="vocabulary size, tokens (default 8192)")
    ap.add_argument("--seq", type=int, default=128, help="sequence length, tokens (default 128)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per batch (default 4)")
    ap.add_argument("--steps", type=int, default=12,
                    help="timed step pairs (offloaded, in-memory) after 2 warm-up pairs (default 12)")
    ap.add_argument("--budget-frac", type=float, default=0.45,
                    help="device budget as a fraction of the fp32 compute copy (model state is 4x that; default 0.45)")
    ap.add_argument("--prefetch-depth", type=int, default=2,
                    help="Config.prefetch_depth: units brought up ahead (default 2)")
    ap.add_argument("--overlap", default="backward", choices=["step", "backward", "delayed"],
                    help="Config.overlap: when the optimizer runs (default backward)")
    ap.add_argument("--offload", default="host", choices=["host", "nvme"],
                    help="home of params and optimizer state: host RAM or nvme swap files (default host)")
    ap.add_argument("--host-frac", type=float, default=0.4,
                    help="with --offload nvme: host budget as a fraction of the model state (default 0.4)")
    ap.add_argument("--swap-dir", action="append", default=None,
                    help="swap folder for --offload nvme; repeat for several (default ./infinity-swap)")
    ap.add_argument("--state-chunk", default="64MiB", metavar="BYTES",
                    help="Config.state_chunk_bytes (nvme): a unit's optimizer state larger than this streams in "
                         "chunks (default 64MiB)")
    ap.add_argument("--no-checksum", action="store_true", help="Config.swap_checksum=False (nvme)")
    ap.add_argument("--no-sweep", action="store_true",
                    help="skip the sweep of device budgets (it runs only with --offload host)")
    ap.add_argument("--profile", default=None, metavar="PATH",
                    help="write a torch.profiler trace of one offloaded step (gzipped JSON, under 16 MiB) to PATH")
    ap.add_argument("--clip", action="store_true",
                    help="instead: overlap='step' against 'backward' without clipping, with clipping never "
                         "triggered and always triggered, interleaved (bench_clip.py)")
    ap.add_argument("--params", default=None, choices=["none", "host", "nvme"],
                    help="with --clip: offload_params (default: --offload; 'host' with --offload nvme keeps "
                         "the parameters on the host and the optimizer state on NVMe)")
    ap.add_argument("--json", default="bench-results/bench_train.json",
                    help="where to write the JSON report (default %(default)s)")
    return ap.parse_args()


def clip_main(args) -> int:
    """``--clip``: see bench_clip.py (same model, batches and budgets as the main run)."""
    import bench_clip
    n = sum(p.numel() for p in make_model(args).parameters())
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(args.device),
             torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(args.device)) for _ in range(4)]
    base = dict(device=args.device, dtype="fp32", device_memory=None, host_memory=n * 16 * 3,
                offload_params=args.params or args.offload, offload_optimizer=args.offload, prefetch_depth=args.prefetch_depth,
                swap_paths=args.swap_dir or ["./infinity-swap"], swap_checksum=not args.no_checksum)
    res = bench_clip.run(args, make_model, data, base)
    print(f"JSON: {write_json(args.json.replace('bench_train', 'bench_train_clip'), res)}")
    return 0


def main() -> int:
    """The run, the sweep, the targets and the JSON; 2 (with the message) when a budget is refused."""
    args = parse_args()
    print(f"infinity {infinity.__version__}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"native {infinity.system.native.info()['simd']}")
    if args.clip:
        return clip_main(args)
    try:
        res = run(args)
        if not args.no_sweep and args.offload == "host":
            print("bytes moved per step as the device budget grows:")
            res["budget_sweep"] = budget_sweep(args)
    except infinity.BudgetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.offload == "host":
        print("\nTargets (host offload): overhead ratio <= 1.25: "
              f"{'PASS' if res['overhead_ratio'] <= 1.25 else 'FAIL'} ({res['overhead_ratio']:.3f}); "
              f"overlap efficiency >= 0.85: {'PASS' if res['overlap_efficiency'] >= 0.85 else 'FAIL'} "
              f"({res['overlap_efficiency']:.3f})")
    else:
        print(f"\nTarget (nvme offload): overlap efficiency >= 0.85: "
              f"{'PASS' if res['overlap_efficiency'] >= 0.85 else 'FAIL'} ({res['overlap_efficiency']:.3f}); "
              f"overhead ratio against in-memory {res['overhead_ratio']:.3f}")
    infinity.api.close(model_ref[0]) if model_ref else None
    out = write_json(args.json, res)
    print(f"JSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
