#!/usr/bin/env python3
"""save_checkpoint / load_checkpoint against the disk's raw bandwidth,
torch.save and torch.distributed.checkpoint, in one run.

For a GPT-style model trained one step through infinity, with its state on
the host and on NVMe: the time of ``save_checkpoint`` and of
``load_checkpoint`` (page cache dropped for the checkpoint's files first, so
the disk is measured), as GB/s of checkpoint bytes; raw O_DIRECT write and
read bandwidth of the same folder (a thread pool of pwrite/pread, 8 MiB
blocks, 8 deep), measured just before and just after each placement's save
and load, and of a raw copy (reading one file while writing another: the
bound where the state lives on the same disk); ``torch.save`` of ``full_state_dict`` + the optimizer's
state dict and ``torch.distributed.checkpoint.save`` of the same tensors
(their time includes building those tensors, which infinity's streaming
avoids); peak RSS growth during save and load (VmHWM reset through
/proc/self/clear_refs). Targets: save and load >= 0.8x raw (raw write
and read for state in memory; raw copy for state in swap files on the
checkpoint's disk, which a save reads while it writes and a load writes
while it reads); >= 2x torch.save and DCP; peak RSS growth <= host_memory + staging. Also the
step-time cost of a background save (``blocking=False``): a few steps timed
alone and beside one, against the blocking save's time.

Usage: python scripts/bench/bench_checkpoint.py [--layers 12 --embd 1024] [--dir ./infinity-bench-ckpt]
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import infinity  # noqa: E402
from infinity.api import engine_of  # noqa: E402
from infinity.checkpoint import layout  # noqa: E402
from infinity.checkpoint.plan import plan_checkpoint  # noqa: E402
from infinity.models import GPT, GPTConfig  # noqa: E402
from _common import rss_bytes  # noqa: E402
from infinity.system.sysinfo import reset_peak_rss  # noqa: E402

BLOCK, DEPTH = 8 << 20, 8


def drop_cache(folder: str) -> None:
    """Evicts ``folder``'s files from the page cache (so a read measures the disk)."""
    for d, _, files in os.walk(folder):
        for n in files:
            fd = os.open(os.path.join(d, n), os.O_RDONLY)
            try:
                os.fsync(fd) if os.access(os.path.join(d, n), os.W_OK) else None
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def raw_bandwidth(folder: str, nbytes: int) -> dict:
    """GB/s of O_DIRECT pwrite/pread of ``nbytes`` in ``folder``: "write" (a
    new file), "read" (it back), "copy" (it read while a second new file is
    written, each ``nbytes``: what a save of NVMe-resident state must do,
    reading the swap files of the same disk), "copy_over" (the same into the
    second file's blocks again: a load of NVMe-resident state overwrites
    the swap files)."""
    nbytes = max(BLOCK, nbytes // BLOCK * BLOCK)
    mem = mmap.mmap(-1, 2 * DEPTH * BLOCK)
    mem.write(os.urandom(1 << 20) * (2 * DEPTH * BLOCK >> 20))
    bufs = [memoryview(mem)[i * BLOCK:(i + 1) * BLOCK] for i in range(2 * DEPTH)]
    src, dst = (os.path.join(folder, n) for n in ("raw-a.bin", "raw-b.bin"))
    fds = [os.open(p, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600) for p in (src, dst)]
    out = {}
    try:
        for op in ("write", "read", "copy", "copy_over"):
            jobs = []
            for i, off in enumerate(range(0, nbytes, BLOCK)):
                if op != "write":
                    jobs.append((os.preadv, fds[0], [bufs[i % DEPTH]], off))
                if op != "read":
                    jobs.append((os.pwrite, fds[0 if op == "write" else 1], bufs[DEPTH + i % DEPTH], off))
            t = time.perf_counter()
            with ThreadPoolExecutor(2 * DEPTH if op.startswith("copy") else DEPTH) as ex:
                list(ex.map(lambda j: j[0](*j[1:]), jobs))
            os.fsync(fds[0 if op == "write" else 1])
            out[op] = nbytes / (time.perf_counter() - t) / 1e9
    finally:
        for fd, p in zip(fds, (src, dst)):
            os.close(fd)
            os.unlink(p)
        del bufs, jobs  # the views go before the mapping
    return out


def raw_around(folder: str, nbytes: int, fn):
    """``fn()`` with the raw bandwidth measured just before and just after it
    (the disk drifts): (fn's result, the two measurements' means)."""
    before = raw_bandwidth(folder, nbytes)
    res = fn()
    after = raw_bandwidth(folder, nbytes)
    return res, {k: (before[k] + after[k]) / 2 for k in before} | {"spread": (before, after)}


def build(args, placement: str, swap: str):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=8192, block_size=128, n_layer=args.layers, n_head=16, n_embd=args.embd))
    cfg = infinity.Config(device="cpu", dtype="bf16", offload_params=placement, offload_optimizer=placement,
                          host_memory=args.host, device_memory="256MiB", swap_paths=[swap], overlap="backward")
    m, o = infinity.initialize(model, cfg, lr=1e-4)
    train_steps(m, o, 1)
    return m, o, cfg


def train_steps(m, o, n: int) -> None:
    for _ in range(n):
        ids = torch.randint(0, 8192, (2, 129))
        m(ids[:, :-1], ids[:, 1:]).backward()
        o.step()
        o.zero_grad()


def background_cost(m, o, ck: str, steps: int) -> dict:
    """Seconds of ``steps`` training steps alone, and of the same steps run
    while ``save_checkpoint(blocking=False)`` writes (through its wait)."""
    t = time.perf_counter()
    train_steps(m, o, steps)
    alone = time.perf_counter() - t
    t = time.perf_counter()
    pending = infinity.save_checkpoint(ck, m, o, blocking=False)
    train_steps(m, o, steps)
    pending.wait()
    return {"steps": steps, "steps_s": alone, "steps_with_bg_save_s": time.perf_counter() - t}


def timed(fn):
    reset_peak_rss()
    base = rss_bytes("VmRSS")
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t, rss_bytes("VmHWM") - base


def bench_placement(args, placement: str, root: str) -> dict:
    m, o, cfg = build(args, placement, os.path.join(root, f"swap-{placement}"))
    ck = os.path.join(root, f"ck-{placement}")
    est = plan_checkpoint(m, engine_of(m)).total_bytes

    def save_then_load(rep: int):
        path, t_save, rss_save = timed(lambda: infinity.save_checkpoint(ck, m, o, step=rep, keep_last=1))
        t = time.perf_counter()
        layout.wait_removals(ck)  # the previous checkpoint, deleted in the background: not beside what is measured
        prune_s = time.perf_counter() - t
        drop_cache(ck)
        _, t_load, rss_load = timed(lambda: infinity.load_checkpoint(ck, m, o))
        return {"path": path, "save_s": t_save, "save_rss": rss_save, "load_s": t_load, "load_rss": rss_load,
                "prune_s": prune_s}
    runs = []
    for rep in range(args.repeats):  # the disk drifts: each pair of runs with the raw bandwidth around it
        run, raw = raw_around(root, est, lambda: save_then_load(rep))
        runs.append(dict(run, raw=raw))
    path = runs[-1]["path"]
    nbytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    res = {"placement": placement, "bytes": nbytes, "runs": runs, "host_memory": cfg.host_memory,
           "save_s": statistics.median(r["save_s"] for r in runs),
           "load_s": statistics.median(r["load_s"] for r in runs)}
    if args.bg_steps:
        shutil.rmtree(ck, ignore_errors=True)
        res["background"] = background_cost(m, o, ck, args.bg_steps)
    if not args.no_baselines:
        res.update(baselines(m, o, root, placement))
    infinity.close(m)
    shutil.rmtree(ck, ignore_errors=True)
    return res


def baselines(m, o, root: str, placement: str) -> dict:
    """torch.save and DCP of the same state (full tensors built first, as they need)."""
    import torch.distributed.checkpoint as dcp
    out = {}
    p = os.path.join(root, f"torch-{placement}.pt")

    def tsave():
        torch.save({"model": infinity.full_state_dict(m), "optim": o.state_dict()}, p)
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    _, out["torch_save_s"], _ = timed(tsave)
    drop_cache(root)
    _, out["torch_load_s"], _ = timed(lambda: torch.load(p, weights_only=True))
    os.unlink(p)
    d = os.path.join(root, f"dcp-{placement}")

    def dsave():
        sd = {"model": infinity.full_state_dict(m), "optim": o.state_dict()["state"]}
        dcp.save(sd, checkpoint_id=d)
    _, out["dcp_save_s"], _ = timed(dsave)
    shutil.rmtree(d, ignore_errors=True)
    return out


def report(rows) -> bool:
    """Prints each placement's figures (each run's ratios against the raw
    bandwidth measured around it, and their medians); True if every target is met."""
    ok = True
    for r in rows:
        gb = r["bytes"] / 1e9
        print(f"\n[{r['placement']}] checkpoint {gb:.2f} GB ({BLOCK >> 20} MiB raw blocks, {DEPTH} deep)")
        ratios = []
        for k, run in enumerate(r["runs"]):
            raw, (b, a) = run["raw"], run["raw"]["spread"]
            sw, lr = gb / run["save_s"], gb / run["load_s"]
            x = (sw / raw["write"], sw / raw["copy"], lr / raw["read"], lr / raw["copy_over"])
            ratios.append(x)
            print(f"  run {k + 1}: raw before / after: write {b['write']:.2f} / {a['write']:.2f}, read {b['read']:.2f}"
                  f" / {a['read']:.2f}, copy {b['copy']:.2f} / {a['copy']:.2f}, copy over {b['copy_over']:.2f} / "
                  f"{a['copy_over']:.2f} GB/s")
            print(f"    save_checkpoint {run['save_s']:6.2f} s = {sw:.2f} GB/s = {x[0]:.2f}x raw write, {x[1]:.2f}x raw"
                  f" copy; peak RSS +{run['save_rss'] / 2**20:.0f} MiB (host_memory {r['host_memory'] / 2**20:.0f} MiB)")
            if run["prune_s"] > 0.005:
                print(f"    (the previous checkpoint's deletion went on {run['prune_s']:.2f} s after the save returned)")
            print(f"    load_checkpoint {run['load_s']:6.2f} s = {lr:.2f} GB/s = {x[2]:.2f}x raw read, {x[3]:.2f}x raw"
                  f" copy over; peak RSS +{run['load_rss'] / 2**20:.0f} MiB")
        med = [statistics.median(x[i] for x in ratios) for i in range(4)]
        print(f"  median of {len(ratios)}: save {med[0]:.2f}x raw write ({med[1]:.2f}x raw copy), load {med[2]:.2f}x "
              f"raw read ({med[3]:.2f}x raw copy over)")
        # The bound: state in memory is only written (save) or read (load); state in swap files on the same
        # disk is read while the checkpoint is written and the other way round (see the docstring).
        bound = (med[1], med[3]) if r["placement"] == "nvme" else (med[0], med[2])
        what = "raw copy / raw copy over" if r["placement"] == "nvme" else "raw write / raw read"
        met = bound[0] >= 0.8 and bound[1] >= 0.8
        print(f"  target save and load >= 0.8x {what}: {bound[0]:.2f}x / {bound[1]:.2f}x "
              f"{'met' if met else 'MISSED'}")
        ok &= met
        bg = r.get("background")
        if bg:
            cost = bg["steps_with_bg_save_s"] - bg["steps_s"]
            print(f"  blocking=False  {bg['steps']} steps alone {bg['steps_s']:.2f} s, with the background save "
                  f"{bg['steps_with_bg_save_s']:.2f} s: the save cost the steps {cost:.2f} s "
                  f"({cost / r['save_s']:.2f}x a blocking save's median {r['save_s']:.2f} s)")
        for k, base in (("torch_save_s", r["save_s"]), ("dcp_save_s", r["save_s"]), ("torch_load_s", r["load_s"])):
            if k in r:
                target = k != "torch_load_s"  # torch.load only fills RAM: both are bound by the same read
                print(f"  {k[:-2]:11s} {r[k]:6.2f} s: infinity (median) is {r[k] / base:.2f}x faster"
                      + (" (target 2x)" if target else " (no target: the same disk read, and an NVMe load also "
                         "writes the swap files)"))
                ok &= not target or r[k] / base >= 2.0
    print("\nthe copy ratios are the bound where the state lives on the checkpoint's own disk (a save reads the "
          "swap files while it writes a new file, a load overwrites them while it reads): the nvme targets are "
          "checked against them, the host ones against raw write and read")
    print("all targets met" if ok else "some targets missed (see the ratios above)")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12, help="GPT blocks (default 12)")
    ap.add_argument("--embd", type=int, default=1024, help="embedding width, a multiple of 16 (heads) (default 1024)")
    ap.add_argument("--host", default="2GiB", help="Config.host_memory, a size such as 2GiB (default 2GiB)")
    ap.add_argument("--dir", default="infinity-bench-ckpt",
                    help="scratch folder for swap files and checkpoints, removed at the end (default %(default)s)")
    ap.add_argument("--placements", default="host,nvme",
                    help="comma-separated placements of params and optimizer state: host, nvme (default both)")
    ap.add_argument("--bg-steps", type=int, default=3,
                    help="steps timed alone and beside a save_checkpoint(blocking=False); 0 skips (default 3)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="save+load pairs per placement, each with the raw bandwidth measured around it (default 3)")
    ap.add_argument("--no-baselines", action="store_true",
                    help="skip the torch.save and torch.distributed.checkpoint runs")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    root = os.path.abspath(args.dir)
    try:
        rows = [bench_placement(args, p, root) for p in args.placements.split(",")]
        sys.exit(0 if report(rows) else 1)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
