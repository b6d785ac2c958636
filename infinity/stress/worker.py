"""One stress job in its own process: ``python -m infinity.stress.worker JOB_JSON``.

Trains the stress model (a GPT built from the job's dimensions, data drawn
per step from a seeded generator, so two jobs see the same batches) from
step ``start`` to ``end`` and prints, on stdout, ``LOSS <step> <value>``
per step and a final ``RESULT <json>`` (peaks, budgets, step times, pressure
events, RSS/fd/thread samples, the first error). A job may inject a fault
(the engine's I/O fault hook, a flipped swap byte, a signal to itself,
simulated memory pressure) and may resume from the newest checkpoint.
A kill is observed by the parent, not suffered here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback

import torch


def build(job: dict):
    """(model, config) of ``job``."""
    import infinity
    from infinity.models import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=job["seq"], n_layer=job["layers"], n_head=4,
                          n_embd=job["embd"]))
    cfg = infinity.Config(device="cpu", dtype="fp32", offload_params=job["place"],
                          offload_optimizer=job.get("opt_place", job["place"]),
                          device_memory=job.get("device_memory"), host_memory=job.get("host_memory"),
                          swap_paths=[job["swap"]], prefetch_depth=job.get("depth", 2), swap_block_size=1 << 20)
    return model, cfg


def batch(job: dict, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, 256, (job["batch"], job["seq"] + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _flip_moments(eng) -> None:
    """A bad disk: one byte of every unit's first moment flipped in its swap file."""
    store = eng.nvme.store
    for u in eng.units:
        entry = store._index.get((u.index, "exp_avg"))
        if entry is None:
            continue
        piece = entry.pieces[0]
        with open(store._paths[piece.path_index].file_path, "r+b") as f:
            f.seek(piece.offset + 11)
            b = f.read(1)
            f.seek(piece.offset + 11)
            f.write(bytes([b[0] ^ 0x20]))
            os.fsync(f.fileno())


def _sample(samples: list, eng, job: dict) -> None:
    """RSS, open fds, threads, swap-file bytes on disk and pinned bytes (locked pages, or the pinned pool) now."""
    from infinity.system import sysinfo

    from .soak import thread_counts
    swap = 0
    for d, _, files in os.walk(job["swap"]):
        for f in files:
            try:
                swap += os.stat(os.path.join(d, f)).st_blocks * 512
            except OSError:
                pass
    tier = eng.room.tier
    pinned = (sysinfo.locked_bytes()) + (tier.pool.capacity_bytes if tier.pinned else 0)
    samples.append({"t": time.time(), "rss": sysinfo.rss_bytes(), "fds": len(os.listdir("/proc/self/fd")),
                    "threads": threading.active_count(), "thread_names": thread_counts(), "swap_bytes": swap, "pinned": pinned})


def _step(job, model, opt, eng, step: int) -> float:
    """One training step, with the job's faults at their steps."""
    x, y = batch(job, step)
    loss = model(x, y)
    loss.backward()
    if job.get("kill_at") == step:
        # To the main thread (this one): a process-wide signal may be taken by a worker thread, whose
        # handler may run late on a loaded machine. SIGTERM's handler raises at the next bytecode;
        # SIGKILL never returns.
        signal.pthread_kill(threading.main_thread().ident, getattr(signal, "SIG" + job.get("signal", "KILL")))
        time.sleep(5)
    opt.step()
    opt.zero_grad()
    if job.get("corrupt_after") == step:
        _flip_moments(eng)
    if job.get("remove_swap_after") == step:
        shutil.rmtree(job["swap"])  # an operator's rm -rf: the open files live on until closed
    if job.get("unmount_swap_after") == step:
        from .fs import unmount
        unmount(job["swap"], lazy=True)  # detached: the open files live on, the folder is gone
    if job.get("shut_down_swap_after") == step:
        from .fs import shut_down
        shut_down(job["swap"])  # the device is gone: every I/O fails from here on
    return loss.item()


def _arm_kill_in_save(job: dict, saves: int) -> None:
    """``kill_in_save: [point, nth]``: the save after the first is SIGKILLed at
    the ``nth`` time it reaches ``point`` (see infinity.checkpoint.save.test_hook)."""
    if not job.get("kill_in_save") or saves != 1:
        return
    from infinity.checkpoint import save
    point, nth = job["kill_in_save"]
    seen = [0]

    def hook(p):
        if p == point:
            seen[0] += 1
            if seen[0] == nth:
                os.kill(os.getpid(), signal.SIGKILL)
    save.test_hook = hook


def run(job: dict) -> dict:
    """Trains ``job``; returns the RESULT record."""
    import infinity
    from infinity.api import engine_of
    res = {"losses": {}, "step_s": [], "samples": [], "error": None}
    model, cfg = build(job)
    model, opt = infinity.initialize(model, cfg, lr=1e-3, weight_decay=0.1)
    eng = engine_of(model)
    if job.get("sample"):
        from .soak import thread_bounds
        res["thread_bounds"] = thread_bounds(eng.config.swap_queue_depth)
    if job.get("io_fault"):
        eng.nvme.store._inject_fault(*job["io_fault"].split(":"))
    if job.get("pressure"):
        lo, hi, free = job["pressure"]
        eng.pressure.available = lambda: free if lo <= eng.stats.steps < hi else 64 << 30
    start = 0
    if job.get("resume"):
        start = infinity.load_checkpoint(job["ckpt"], model, opt)["next"]
    deadline = time.time() + job["seconds"] if job.get("seconds") else None
    saves = 0
    try:
        step = start
        while step < job["end"] or (deadline is not None and time.time() < deadline):
            t0 = time.perf_counter()
            res["losses"][step] = _step(job, model, opt, eng, step)
            res["step_s"].append(time.perf_counter() - t0)
            res["last_step_at"] = time.time()
            print(f"LOSS {step} {res['losses'][step]!r}", flush=True)
            step += 1
            if job.get("ckpt") and job.get("ckpt_every") and step % job["ckpt_every"] == 0:
                try:
                    infinity.save_checkpoint(job["ckpt"], model, opt, extra={"next": step}, keep_last=2)
                    saves += 1
                    _arm_kill_in_save(job, saves)
                except infinity.CheckpointSpaceError as e:  # the partial one is removed; the run goes on
                    res.setdefault("checkpoint_errors", []).append(str(e))
            if job.get("sample"):
                _sample(res["samples"], eng, job)
    except BaseException as e:  # noqa: BLE001 - the parent judges the error
        res["error"] = f"{type(e).__name__}: {e}"
        res["error_after_s"] = time.time()
    s = infinity.stats(model)
    res.update(peak=s["peak_bytes"], budget=s["budget_bytes"], events=s["pressure_events"],
               skipped=s["skipped_steps"], retried=len(eng.nvme.retried) if eng.nvme is not None else 0)
    try:
        infinity.close(model, keep_values=False)
    except Exception as e:  # noqa: BLE001 - e.g. swap files on a device that is gone
        res["close_error"] = f"{type(e).__name__}: {e}"
    return res


def main() -> int:
    job = json.loads(sys.argv[1])
    torch.set_num_threads(job.get("threads", 1))
    # A SIGINT fault stands for a user's Ctrl-C: Python's own handler, even where this process inherited
    # SIGINT ignored (a shell starts background jobs so, and Python then keeps it ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        res = run(job)
    except BaseException as e:  # noqa: BLE001 - e.g. a budget refused at initialize
        res = {"losses": {}, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
    print("RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
