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

With ``--checkpoint DIR`` it then saves a checkpoint, trains one more step,
builds the model again from nothing, loads the checkpoint and trains the same
step: the loss and the weights after it must be bit-identical. Last it
consolidates the checkpoint to bf16 safetensors in a subprocess and reports
that process's peak RSS. Free disk is checked first for the swap files plus
one checkpoint (about 26 bytes a parameter; ~2.5 B parameters fit the ~80 GB
free here: ``--layers 32``).

With ``--shape llama3-8b`` it trains a Llama-3-8B-shaped Hugging Face model
instead (hidden 4096, 32 layers, intermediate 14336, vocabulary 128256, 8
KV heads, untied head: 8.03 B parameters) with int8 moments and a bf16
master (about 8 bytes a parameter on disk), the embedding and the head their
own paging units, their state and gradients streamed in chunks; the
estimator's need (disk, RSS) is printed and the free disk checked first.

Usage: python scripts/scale_demo.py [--layers 51 --embd 2560] [--steps 3]
                                    [--host-memory 5.5GiB] [--device-memory 1GiB] [--swap-dir DIR]
                                    [--checkpoint DIR]
       python scripts/scale_demo.py --shape llama3-8b --steps 2 --swap-dir DIR [--layers 32]
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
from infinity.config.runtime import format_bytes, parse_bytes  # noqa: E402
from infinity.models import GPT, GPTConfig  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
from _common import rss_bytes  # noqa: E402  (scripts/bench/_common.py)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["gpt", "llama3-8b"], default="gpt",
                    help="gpt: the GPT of --layers/--embd (default); llama3-8b: a Llama-3-8B-shaped HF model "
                         "(scripts/scale_llama.py; --embd/--heads/--vocab ignored)")
    ap.add_argument("--layers", type=int, default=None,
                    help="GPT blocks (default 51: ~4 B params at --embd 2560); with --shape llama3-8b its decoder "
                         "layers (default 32; fewer keep the full width and vocabulary at a smaller disk need)")
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
    ap.add_argument("--checkpoint", default=None,
                    help="save a checkpoint here after the steps, resume it in a new model and compare one step "
                         "bit for bit, then consolidate it to bf16 (removed at the end)")
    return ap.parse_args()


def disk_check(args, n: int):
    """The swap folders (made), or None (with the error printed) if their disks
    and the checkpoint's have too little room."""
    dtype_bytes = {"bf16": 2, "fp16": 2, "fp32": 4}[args.dtype]
    # On disk: fp32 master + two moments, the compute copy, headroom for alignment.
    need = n * (12 + dtype_bytes) + (1 << 30)
    paths = args.swap_dir or ["./infinity-swap"]
    for p in paths:
        os.makedirs(p, exist_ok=True)
    if args.checkpoint:
        os.makedirs(args.checkpoint, exist_ok=True)
        paths_and_ckpt = paths + [args.checkpoint]
        need += 12 * n + (1 << 30)  # fp32 master + moments, the manifest and shard headers
    else:
        paths_and_ckpt = paths
    free = sum(shutil.disk_usage(p).free for p in {os.stat(p).st_dev: p for p in paths_and_ckpt}.values())
    print(f"model: {n / 1e9:.2f} B parameters ({args.layers} blocks of d={args.embd}); model state "
          f"{format_bytes(16 * n)} (fp32 master + Adam moments {format_bytes(12 * n)}); RAM "
          f"{format_bytes(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES'))}")
    print(f"disk: needs {format_bytes(need)} on {paths_and_ckpt} (swap files"
          + (" plus one checkpoint" if args.checkpoint else "") + f"); free {format_bytes(free)}")
    if free < need:
        print(f"error: not enough free disk space in {paths_and_ckpt}: {need} bytes needed, {free} free. Free space "
              "or pass --swap-dir/--checkpoint on a larger disk, or fewer --layers", file=sys.stderr)
        return None
    return paths


def train(model, opt, args, loss_fn=None) -> tuple:
    """args.steps steps on one fixed batch, each printed: (x, y, losses, step
    seconds); ``loss_fn(model, x, y)`` (default ``model(x, y)``)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    y = torch.roll(x, -1, dims=1)
    losses, times = [], []
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        loss = model(x, y) if loss_fn is None else loss_fn(model, x, y)
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
    return x, y, losses, times


def main() -> int:
    args = parse_args()
    if args.shape == "llama3-8b":
        from scale_llama import main_llama  # noqa: E402  (scripts/scale_llama.py)
        return main_llama(args, train)
    args.layers = 51 if args.layers is None else args.layers
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                    n_embd=args.embd)
    n = cfg.num_params()
    paths = disk_check(args, n)
    if paths is None:
        return 2

    config = infinity.Config(device="cpu", dtype=args.dtype, device_memory=args.device_memory,
                             host_memory=args.host_memory, offload_params="nvme", offload_optimizer="nvme",
                             swap_paths=paths, overlap="backward", prefetch_depth=2)
    model, opt = build(cfg, config, args.lr)
    x, y, losses, times = train(model, opt, args)
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
    if args.checkpoint:
        ok &= checkpoint_round_trip(args, cfg, config, model, opt, x, y, len(losses))
    else:
        infinity.close(model)
    print("OK" if ok else "FAILED: " + ("loss not finite or not falling" if not args.checkpoint else
                                        "see the lines above"))
    return 0 if ok else 1


def build(cfg, config, lr: float):
    """The model built under ``infinity.init`` and initialised into the tiers (seeded: every build is equal)."""
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with infinity.init(config):
        model = GPT(cfg)
    print(f"built under infinity.init in {time.perf_counter() - t0:.1f} s; RSS {format_bytes(rss_bytes('VmRSS'))}",
          flush=True)
    t0 = time.perf_counter()
    model, opt = infinity.initialize(model, config, lr=lr, weight_decay=0.0)
    print(f"initialised into the tiers in {time.perf_counter() - t0:.1f} s; RSS {format_bytes(rss_bytes('VmRSS'))},"
          f" peak {format_bytes(rss_bytes())}", flush=True)
    return model, opt


def one_step(model, opt, x, y):
    """(loss of one training step, loss of a forward after it): two numbers that change with any weight's bit."""
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    with torch.no_grad():
        return loss.item(), model(x, y).item()


def checkpoint_round_trip(args, cfg, config, model, opt, x, y, steps: int) -> bool:
    """Save, one more step live; a new model loads the checkpoint and takes
    the same step: bit-identical? Then consolidation to bf16 in a subprocess
    (its peak RSS). True if every check passed."""
    import subprocess
    t0 = time.perf_counter()
    path = infinity.save_checkpoint(args.checkpoint, model, opt, extra={"steps": steps})
    t_save = time.perf_counter() - t0
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    print(f"\nsaved {path} ({format_bytes(size)}) in {t_save:.1f} s = {size / t_save / 1e9:.2f} GB/s; "
          f"peak RSS {format_bytes(rss_bytes())}", flush=True)
    live = one_step(model, opt, x, y)
    infinity.close(model, keep_values=False)
    del model, opt
    print(f"closed the run; RSS {format_bytes(rss_bytes('VmRSS'))}", flush=True)
    model, opt = build(cfg, config, args.lr)
    t0 = time.perf_counter()
    extra = infinity.load_checkpoint(args.checkpoint, model, opt)
    t_load = time.perf_counter() - t0
    print(f"loaded in {t_load:.1f} s = {size / t_load / 1e9:.2f} GB/s (extra {extra}); peak RSS "
          f"{format_bytes(rss_bytes())}", flush=True)
    resumed = one_step(model, opt, x, y)
    infinity.close(model, keep_values=False)
    exact = resumed == live
    print(f"step {steps + 1}: live loss {live[0]!r} then {live[1]!r}; resumed {resumed[0]!r} then {resumed[1]!r}: "
          + ("bit-identical" if exact else "DIFFERENT"), flush=True)
    out = os.path.join(args.checkpoint, "consolidated-bf16")
    t0 = time.perf_counter()
    # The child reports its own VmHWM: the kernel's ru_maxrss of a child counts the parent's pages at fork.
    code = ("import sys; from infinity.checkpoint import consolidate; consolidate(sys.argv[1], sys.argv[2], "
            "dtype='bf16'); print([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1])")
    r = subprocess.run([sys.executable, "-c", code, str(path), out], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    child_rss = int(r.stdout.split()[-1]) * 1024 if r.returncode == 0 else 0
    out_bytes = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)) if os.path.isdir(out) else 0
    print(f"consolidated to bf16 ({format_bytes(out_bytes)}) in {time.perf_counter() - t0:.1f} s, exit "
          f"{r.returncode}; its peak RSS {format_bytes(child_rss)} (target <= 1 GiB)" + (r.stderr[-500:] if
                                                                                        r.returncode else ""))
    peak = rss_bytes()
    print(f"peak RSS of this process {format_bytes(peak)} (target <= 8 GiB)")
    shutil.rmtree(args.checkpoint, ignore_errors=True)
    return exact and r.returncode == 0 and child_rss <= 1 << 30 and peak <= 8 << 30


if __name__ == "__main__":
    sys.exit(main())
