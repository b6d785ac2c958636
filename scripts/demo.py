#!/usr/bin/env python3
"""The main job: train a GPT on readable text through infinity with a device
budget far smaller than the model state, a host budget smaller than it and
NVMe swap files in ./infinity-swap; train the same model in plain PyTorch in
memory in the same run; say where every second and byte of a step went.

The text is English prose every Python installation carries: the docstrings
of its standard library, read byte by byte (vocabulary 256), so the loss
falls visibly within the run: from ln 256 = 5.55 nats a byte (uniform
guessing) to about 3.3, where the model has learnt the bytes' frequencies
(English letters and spaces instead of noise, as the samples before and
after show). Words take some 10x more tokens than this run's few minutes on 2 cores.

Printed: the loss as it falls; samples before and after; plain PyTorch's
loss beside infinity's at the steps both ran; the overhead ratio of
infinity's step against the plain-PyTorch step with its lower bound
max(compute + optimizer, transfers) measured on this machine (a ratio below
it is reported as noise, not as a result); the whole step's time split into
its parts (they add up to the measured step); bytes and bandwidth per link;
peak bytes per tier against budget; peak RSS split into the runtime, the
model as built and what the infinity run added.
Written: OUT/metrics.jsonl and, where matplotlib is installed, OUT/report.png
(loss, time, tiers, links; without matplotlib the run says how to draw it
later with `infinity report`), and with --json a machine-readable summary. The swap files are removed at
the end; nothing is written outside --swap-dir and --out.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import infinity  # noqa: E402
from infinity.models.corpus import stdlib_corpus  # noqa: E402
from infinity.cli.metrics import Metrics  # noqa: E402
from infinity.config.runtime import format_bytes  # noqa: E402
from infinity.models import GPT, GPTConfig  # noqa: E402
from infinity.cli import perf
from infinity.system import sysinfo  # noqa: E402

PROMPT = "The function returns "


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a = ap.add_argument
    a("--quick", action="store_true", help="a small model and few steps (~20 s; what the test suite runs)")
    a("--steps", type=int, default=None, help="optimizer steps through infinity (default 60; --quick 24)")
    a("--plain-steps", type=int, default=None, help="steps of the plain-PyTorch comparison (default 6; --quick 4)")
    a("--layers", type=int, default=None, help="transformer blocks (default 12; --quick 4)")
    a("--embd", type=int, default=None, help="model width (default 384; --quick 128)")
    a("--heads", type=int, default=6, help="attention heads (must divide --embd)")
    a("--seq", type=int, default=128, help="sequence length in bytes")
    a("--batch", type=int, default=8, help="sequences per step")
    a("--lr", type=float, default=2e-3, help="AdamW learning rate (after a 5-step linear warm-up)")
    a("--max-grad-norm", type=float, default=1.0,
      help="clip the global gradient norm to this (default 1.0, the Hugging Face Trainer's; 0: no clipping)")
    a("--device", default="auto", help="cpu, cuda or auto (cuda when available)")
    a("--dtype", default=None, help="compute dtype: fp32 (default on the CPU), bf16 (default on CUDA), fp16")
    a("--offload", default="nvme", choices=["nvme", "host"], help="home of parameters and optimizer state")
    a("--swap-dir", action="append", default=None,
      help="swap directory (repeat for several disks; default ./infinity-swap)")
    a("--device-memory", default=None, help="device budget, e.g. 32MiB (default: model state / 10)")
    a("--host-memory", default=None, help="host budget (default: model state / 2.5 with nvme, x 2.5 with host)")
    a("--out", default="./infinity-demo", help="folder for metrics.jsonl and report.png")
    a("--json", default=None, help="also write the summary as JSON to this file")
    args = ap.parse_args(argv)
    quick = args.quick
    for k, full, small in (("steps", 60, 24), ("plain_steps", 6, 4), ("layers", 12, 4), ("embd", 384, 128)):
        if getattr(args, k) is None:
            setattr(args, k, small if quick else full)
    if quick:
        args.heads = 4
    args.dtype = args.dtype or ("bf16" if torch.cuda.is_available() and args.device != "cpu" else "fp32")
    return args


class Batches:
    """Seeded random windows of the corpus: (inputs, targets) of bytes."""

    def __init__(self, data: torch.Tensor, batch: int, seq: int, seed: int = 1):
        self.data, self.batch, self.seq = data, batch, seq
        self.gen = torch.Generator().manual_seed(seed)

    def next(self):
        i = torch.randint(0, self.data.numel() - self.seq - 1, (self.batch,), generator=self.gen)
        w = torch.stack([self.data[j:j + self.seq + 1] for j in i.tolist()]).long()
        return w[:, :-1], w[:, 1:]


@torch.no_grad()
def sample(model, n: int = 64, temperature: float = 0.8) -> str:
    """PROMPT continued by ``n`` bytes drawn from the model (seeded, so runs compare)."""
    gen = torch.Generator().manual_seed(7)
    ids = torch.tensor([list(PROMPT.encode())])
    for _ in range(n):
        logits = model(ids[:, -model.cfg.block_size:])[0, -1].float().cpu()
        nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)
        ids = torch.cat([ids, nxt.view(1, 1).to(ids.device)], dim=1)
    return bytes(ids[0].tolist()).decode("ascii", errors="replace")


def budgets(args, model, config: infinity.Config, state: int):
    """(device, host) budgets: the given ones, else state / 10 and state / 2.5
    (nvme; host: 2.5 x state) raised to what this model needs at least, so small models run."""
    from infinity.cli.estimate import estimate
    est = estimate(model, config)
    dev = args.device_memory or max(state // 10, est["device"]["minimum"])
    # Host state: its homes, gradients and the undo state of the clipped steps' speculative updates (16 bytes a
    # parameter, [Note: speculative updates] in infinity/engine/step/speculate.py) fit in 2.5x the model state.
    host = args.host_memory or max(int(state / 2.5) if args.offload == "nvme" else int(2.5 * state),
                                   est["host"]["minimum"])
    return dev, host


def lr_at(step: int, base: float, warmup: int = 5) -> float:
    return base * min(1.0, step / warmup)


class Phases:
    """Seconds per phase of each step, each timed on its own with perf_counter."""

    NAMES = ("data", "forward+backward", "optimizer.step()", "zero_grad")

    def __init__(self):
        self.rows = []

    def run(self, batches, model, opt, step: int, lr: float, dev, clip: float = 0.0):
        # The step's LR is set before backward: with overlap="backward" infinity's
        # AdamW updates each unit during backward, with the LR the groups hold then.
        for g in opt.param_groups:
            g["lr"] = lr
        t = [time.perf_counter()]
        x, y = batches.next()
        x, y = x.to(dev), y.to(dev)
        t.append(time.perf_counter())
        loss = model(x, y)
        loss.backward()
        t.append(time.perf_counter())
        if clip:  # plain PyTorch only: infinity clips inside opt.step() (Config.max_grad_norm)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        t.append(time.perf_counter())
        opt.zero_grad()
        value = loss.item()
        t.append(time.perf_counter())
        self.rows.append([b - a for a, b in zip(t, t[1:])])
        return value, t[-1] - t[0]

    def mean(self, skip: int):
        rows = self.rows[skip:] or self.rows
        return {n: statistics.fmean(r[i] for r in rows) for i, n in enumerate(self.NAMES)}


def train_plain(model, batches, args, dev):
    """The same model in memory with torch.optim.AdamW: (median s/step, median
    forward+backward s, the loss of each step in nats/byte)."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    ph, losses = Phases(), []
    for step in range(1, args.plain_steps + 1):
        losses.append(ph.run(batches, model, opt, step, lr_at(step, args.lr), dev, args.max_grad_norm)[0])
    rows = ph.rows[1:] or ph.rows
    return statistics.median(sum(r) for r in rows), statistics.median(r[1] for r in rows), losses


def train_infinity(model, opt, batches, args, dev, metrics):
    """Trains through infinity; prints the loss every few steps. Returns (losses, per-step seconds, Phases)."""
    ph, losses, times = Phases(), [], []
    t_run = time.perf_counter()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        loss, _ = ph.run(batches, model, opt, step, lr_at(step, args.lr), dev)
        losses.append(loss)
        metrics.record(step, loss, lr_at(step, args.lr), infinity.stats(model))
        if step == 1 or step % 5 == 0 or step == args.steps:
            recent = times[-4:] + [time.perf_counter() - t0]
            print(f"step {step:4d}  loss {loss:6.3f} nats/byte  {statistics.fmean(recent):6.3f} s/step (last "
                  f"{len(recent)})  {args.batch * args.seq / statistics.fmean(recent):7.0f} tokens/s  elapsed "
                  f"{time.perf_counter() - t_run:6.1f} s", flush=True)
        times.append(time.perf_counter() - t0)  # the whole loop body: the parts plus metrics and printing
    return losses, times, ph


def lower_bound(n_params: int, step_moved: dict, compute_s: float, dev, swap_dirs, offload: str) -> dict:
    """max(compute + optimizer, transfers), each measured on this machine now (see scripts/bench/bench_train.py)."""
    opt_s = perf.optimizer_time(n_params, None)
    bw = {"h2d": perf.copy_bandwidth(16 << 20, dev), "d2h": perf.copy_bandwidth(16 << 20, dev)}
    if offload == "nvme":
        bw["nvme_write"], bw["nvme_read"] = perf.disk_bandwidth(swap_dirs, 32 << 20)
    transfer = sum(step_moved.get(k, 0) / b for k, b in bw.items())
    return {"compute_s": compute_s, "optimizer_s": opt_s, "transfer_s": transfer,
            "bound_s": max(compute_s + opt_s, transfer), "bandwidth_Bps": bw}


def account(ph: Phases, times, stats: dict, skip: int) -> dict:
    """The mean step (steps after ``skip``) split into its measured parts."""
    parts = ph.mean(skip)
    n = max(1, len(times) - skip)
    step = statistics.fmean(times[skip:] or times)
    return {"step_s": step, "parts_s": parts, "parts_sum_s": sum(parts.values()),
            "stall_s": stats["stall_seconds"] / len(times), "optimizer_wait_s": stats["optimizer_wait_seconds"] / n,
            "optimizer_s": stats["optimizer_seconds"] / len(times), "hidden": stats["overlap"],
            "speculation": speculation_figures(stats)}


def speculation_figures(stats: dict) -> dict:
    """What clipping did to the overlap: the steps whose updates ran during
    backward speculatively and the share of them replayed (rolled back and
    redone with the clip coefficient, or skipped), with ``stats()``'s
    ``speculation`` record beside (``off``: why the updates waited instead)."""
    sp = stats["speculation"]
    redone = sp["replayed"] + sp["skipped"]
    return dict(sp, speculated_share=sp["steps"] / max(1, stats["steps"]),
                replay_rate=redone / sp["steps"] if sp["steps"] else None)


def print_summary(res: dict) -> None:
    acc = res["accounting"]
    print(f"\nwhere the time of a step went (mean over steps {res['skip'] + 1}-{res['steps']}):")
    for name, s in acc["parts_s"].items():
        note = ""
        if name == "forward+backward":
            note = f"  of which waiting for parameter fetches {acc['stall_s']:.3f} s"
        elif name == "optimizer.step()":
            note = (f"  of which waiting for the CPU AdamW {acc['optimizer_wait_s']:.3f} s (it ran "
                    f"{acc['optimizer_s']:.3f} s a step, {100 * acc['hidden']:.0f}% hidden behind backward)")
        print(f"  {name:<20} {s:7.3f} s{note}")
    other = acc["step_s"] - acc["parts_sum_s"]
    print(f"  {'other (stats, log)':<20} {other:7.3f} s")
    print(f"  {'whole step, measured':<20} {acc['step_s']:7.3f} s   (the parts above, each timed on its own, sum to "
          f"{acc['parts_sum_s']:.3f} s)")
    print(speculation_line(res))
    print(f"\nplain PyTorch, in memory, same model and batches: {res['plain_step_s']:.3f} s/step")
    print("\n".join(loss_lines(res)))
    print("\n".join(overhead_lines(res)))
    print("\nbytes moved per step (bandwidth over the step):")
    for k, v in res["step_bytes_moved"].items():
        if v:
            print(f"  {k:<11} {format_bytes(v):>10}  {format_bytes(v / acc['step_s'])}/s")
    print("peak bytes per tier against budget:")
    for k, v in res["peak_bytes"].items():
        b = res["budget_bytes"].get(k)
        print(f"  {k:<7} {format_bytes(v):>10} of {format_bytes(b) if b else 'no budget':>10}")
    print("\n".join(rss_lines(res)))


def speculation_line(res: dict) -> str:
    """The clipping's cost to the overlap: with max_grad_norm the updates
    run during backward speculatively ([Note: speculative updates] in
    infinity/engine/step/speculate.py); the replay rate is the share of the
    speculated steps redone in optimizer.step()."""
    acc, clip = res["accounting"], res["max_grad_norm"]
    sp, hidden = acc["speculation"], f"{100 * acc['hidden']:.0f}% of the optimizer hidden behind backward"
    if not clip:
        return f"  no clipping (--max-grad-norm 0): {hidden}"
    head = f"  clipping at max_grad_norm={clip:g}: "
    if sp["off"]:
        return head + f"the updates wait for optimizer.step() (speculation off: {sp['off']}); {hidden}"
    rate = "none" if sp["replay_rate"] is None else f"{sp['replay_rate']:.2f}"
    return (head + f"{sp['steps']} of {res['steps']} steps updated speculatively during backward, replay rate {rate} "
            f"({sp['replayed']} replayed, {sp['skipped']} skipped, {sp['waited']} waited, "
            f"{sp['replay_seconds']:.3f} s of replays); {hidden}")


def loss_lines(res: dict) -> list:
    """Infinity's loss beside plain PyTorch's for the steps both ran (same
    initial weights, same batches, same AdamW): they train the same numbers."""
    n = len(res["plain_losses"])
    pairs = list(zip(res["losses"][:n], res["plain_losses"]))
    rounding = "" if res["dtype"] == "fp32" else f"; infinity computes in {res['dtype']}, plain PyTorch in fp32"
    out = [f"loss in nats/byte at the same steps (same initial weights, batches and AdamW{rounding}):",
           f"  {'step':>4}  {'infinity':>9}  {'plain PyTorch':>13}  {'difference':>10}"]
    out += [f"  {i:4d}  {a:9.5f}  {b:13.5f}  {a - b:10.1e}" for i, (a, b) in enumerate(pairs, 1)]
    return out


def overhead_lines(res: dict) -> list:
    """The overhead ratio beside its lower bound; a ratio below the bound is
    impossible for a steady machine (infinity's step cannot beat the compute it
    contains), so it is reported as noise instead of as a result."""
    lb = res["lower_bound"]
    bound = (f"lower bound on this machine {res['bound_ratio']:.2f}x = max(compute {lb['compute_s']:.3f} + optimizer "
             f"{lb['optimizer_s']:.3f}, transfers {lb['transfer_s']:.3f}) s / plain step")
    if res["timing_consistent"]:
        return [f"overhead ratio infinity / plain: {res['overhead_ratio']:.2f}x;  {bound}"]
    return [f"overhead ratio: timing too noisy to trust: the measured {res['overhead_ratio']:.2f}x is below its own "
            f"{bound}, so the machine was busy (other processes took the CPU during some of the timed steps); "
            "rerun on a quiet machine for a ratio"]


def rss_lines(res: dict) -> list:
    """Peak RSS split into what was resident before infinity.initialize (the
    runtime, then the corpus and the model as built) and what the run added
    (the tiers, activations, buffers), against the host budget, which bounds
    only the model state kept in RAM. Figures in bytes, printed in binary units."""
    r, f = res["rss"], format_bytes
    peak, start, before = res["peak_rss_bytes"], r["at_start_bytes"], r["before_initialize_bytes"]
    on_cpu = res["device"] == "cpu"
    tiers = f"the host tier (at most {f(res['budget_bytes']['host'])})" + (
        f" and the device tier (at most {f(res['budget_bytes']['device'])}, in RAM on a CPU device)" if on_cpu else "")
    return [f"peak RSS of the process during the infinity run: {f(peak)}; the host budget bounds only the model state "
            "kept in RAM, and the RSS holds more:",
            f"  {f(start):>10}  the Python interpreter, torch and infinity, resident when the run started",
            f"  {f(before - start):>10}  the corpus, the model as built in fp32 and what torch kept from the "
            "plain-PyTorch comparison (that model was freed and the heap trimmed), before infinity.initialize",
            f"  {f(peak - before):>10}  added during the infinity run: {tiers}, the batch's activations (as in plain "
            "torch), the swap staging buffers and the worker threads' allocator arenas"]


def build(args):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.embd)
    return GPT(cfg)


def run(args) -> dict:
    rss_start = sysinfo.rss_bytes()
    data = torch.frombuffer(bytearray(stdlib_corpus(2 << 20)), dtype=torch.uint8)
    model = build(args)
    n = sum(p.numel() for p in model.parameters())
    state = 16 * n
    swap = args.swap_dir or ["./infinity-swap"]
    config = infinity.Config(device=args.device, dtype=args.dtype, offload_params=args.offload,
                             offload_optimizer=args.offload, swap_paths=swap, overlap="backward", prefetch_depth=2,
                             max_grad_norm=args.max_grad_norm or None)
    dev_budget, host_budget = budgets(args, model, config, state)
    config = dataclasses.replace(config, device_memory=dev_budget, host_memory=host_budget)
    dev = config.resolve_device()
    print(f"infinity {infinity.__version__} | device {dev} | compute dtype {args.dtype} | CPU AdamW "
          f"{infinity.system.native.info()['simd']} x{infinity.system.native.default_num_threads()} threads")
    print(f"data: {format_bytes(data.numel())} of the Python standard library's docstrings, read as bytes")
    print(f"model: GPT, {n / 1e6:.1f} M parameters; model state {format_bytes(state)} (fp32 weights, gradients, "
          f"two Adam moments); device budget {format_bytes(dev_budget)} ({state / dev_budget:.0f}x smaller), "
          f"host budget {format_bytes(host_budget)} ({state / host_budget:.1f}x smaller); state in {args.offload}"
          + (f" ({', '.join(swap)})" if args.offload == "nvme" else ""))
    plain = copy.deepcopy(model).to(dev)
    print(f"\nsample before training: {sample(plain)!r}")
    plain_step, compute, plain_losses = train_plain(plain, Batches(data, args.batch, args.seq), args, dev)
    del plain
    gc.collect()
    sysinfo.trim_heap()  # what the plain run freed is not counted in the infinity run's RSS
    rss_before = sysinfo.rss_bytes()
    sysinfo.reset_peak_rss()
    model, opt = infinity.initialize(model, config, lr=args.lr, weight_decay=0.1)
    os.makedirs(args.out, exist_ok=True)
    metrics = Metrics(os.path.join(args.out, "metrics.jsonl"), 1, args.steps, 0, args.batch * args.seq, False)
    open(metrics.path, "w").close()
    losses, times, ph = train_infinity(model, opt, Batches(data, args.batch, args.seq), args, dev, metrics)
    metrics.close()
    s = infinity.stats(model)
    rss = sysinfo.rss_bytes(peak=True)
    skip = min(2, args.steps - 1)
    bound = lower_bound(n, s["step_bytes_moved"], compute, dev, swap, args.offload)  # the swap paths still exist
    infinity.close(model)  # swap files removed; the model keeps its trained fp32 values
    res = {"steps": args.steps, "skip": skip, "losses": losses, "loss_start": losses[0],
           "loss_end": statistics.fmean(losses[-3:]), "plain_step_s": plain_step, "plain_steps": args.plain_steps,
           "accounting": account(ph, times, s, skip), "step_bytes_moved": s["step_bytes_moved"],
           "peak_bytes": s["peak_bytes"], "budget_bytes": s["budget_bytes"], "peak_rss_bytes": rss,
           "budgets_held": all(s["peak_bytes"][k] <= s["budget_bytes"][k] for k in ("device", "host"))}
    res["lower_bound"] = bound
    res["overhead_ratio"] = res["accounting"]["step_s"] / plain_step
    res["bound_ratio"] = res["lower_bound"]["bound_s"] / plain_step
    # infinity's step contains the compute of the plain one: below the bound, the timings were disturbed.
    res["timing_consistent"] = res["overhead_ratio"] >= res["bound_ratio"]
    res["plain_losses"], res["device"], res["dtype"] = plain_losses, dev.type, args.dtype
    res["max_grad_norm"] = args.max_grad_norm
    res["rss"] = {"at_start_bytes": rss_start, "before_initialize_bytes": rss_before}
    res["sample_end"] = sample(model.to(dev))
    return res


def write_plots(out: str) -> str:
    """Writes OUT/report.png from OUT/metrics.jsonl when matplotlib is
    installed; returns the line saying where the metrics (and plots) are, or
    how to get the plots without it (matplotlib is an optional extra)."""
    metrics, png = os.path.join(out, "metrics.jsonl"), os.path.join(out, "report.png")
    try:
        import matplotlib  # noqa: F401 - only to know whether the plots can be drawn here
    except ImportError:
        return (f"metrics: {metrics}; no plots: matplotlib is not installed (for them: pip install matplotlib, "
                f"then infinity report {metrics} -o {png})")
    from infinity.cli.report import plot, read_metrics
    plot(read_metrics(metrics), png)
    return f"metrics: {metrics}; plots: {png}"


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        res = run(args)
    except (infinity.BudgetError, infinity.engine.faults.UsageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"sample after training:  {res['sample_end']!r}")
    print_summary(res)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    print("\n" + write_plots(args.out))
    ok = res["budgets_held"] and res["loss_end"] < res["loss_start"]
    print(f"\nloss {res['loss_start']:.3f} -> {res['loss_end']:.3f} nats/byte (uniform guessing: 5.545); "
          f"device and host budgets held: {res['budgets_held']}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
