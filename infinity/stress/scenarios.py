"""The scenarios of ``infinity stress``: each runs jobs in their own
processes (infinity/stress/worker.py) and judges what they report.

A scenario returns a row: ``name``, ``passed``, ``checks`` (what was
checked, each True/False), ``peaks``/``budgets`` of its main job, step time
p50/p95, the first error message seen, ``resumed_exactly`` where a fault
was followed by a resume, and ``notes``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, Optional

from .fs import loop_ext4, unmount
from .soak import soak

__all__ = ["SCENARIOS", "Context"]


class Context:
    """The stress run's model, folders and reference losses."""

    def __init__(self, out: str, swap_root: str, quick: bool, minutes: float):
        self.out, self.swap_root, self.quick, self.minutes = out, swap_root, quick, minutes
        self.base = dict(layers=6, embd=192, seq=64, batch=4, place="nvme", depth=2)
        self.steps = 6
        self._ref: Optional[Dict[int, float]] = None
        self._mins: Dict[tuple, Dict[str, int]] = {}  # budgets() by its job changes
        self._n = 0

    def job(self, **kw) -> dict:
        """A job with its own swap folder (``swap=`` to share one); budgets:
        the host's a third of the model state (at least its minimum), the
        device's twice its minimum."""
        self._n += 1
        if "host_memory" not in self.base:
            mins = self.budgets()
            self.base.update(host_memory=max(mins["host"], mins["state"] // 3), device_memory=2 * mins["device"])
        j = dict(self.base, end=self.steps, swap=os.path.join(self.swap_root, f"job{self._n}"))
        j.update(kw)
        return j

    def run(self, job: dict, timeout: float = 600, preexec: Optional[Callable] = None) -> dict:
        """Runs ``job`` in a new process: its RESULT plus ``returncode`` and ``seconds``."""
        t0 = time.time()
        p = subprocess.run([sys.executable, "-m", "infinity.stress.worker", json.dumps(job)], capture_output=True,
                           text=True, timeout=timeout, preexec_fn=preexec)
        res = {"losses": {}, "error": None}
        for line in p.stdout.splitlines():
            if line.startswith("RESULT "):
                res = json.loads(line[len("RESULT "):])
            elif line.startswith("LOSS "):  # kept even when the process died before RESULT
                _, step, value = line.split()
                res["losses"].setdefault(step, float(value))
        res["losses"] = {int(k): v for k, v in res["losses"].items()}
        res.update(returncode=p.returncode, seconds=time.time() - t0, stderr=p.stderr[-2000:])
        return res

    def reference(self) -> Dict[int, float]:
        """Losses of an uninterrupted run (computed once)."""
        if self._ref is None:
            self._ref = self.run(self.job())["losses"]
        return self._ref

    def budgets(self, **kw) -> Dict[str, int]:
        """The model's minimum device and host budgets under the stress placement (bytes; ``kw``: job changes)."""
        key = tuple(sorted(kw.items()))
        if key not in self._mins:
            self._mins[key] = self._estimate(**kw)
        return self._mins[key]

    def _estimate(self, **kw) -> Dict[str, int]:
        import torch

        from ..engine.plan.estimator import estimate_peaks
        from .worker import build
        job = dict(self.base, device_memory=None, host_memory=None, swap=self.swap_root, **kw)
        with torch.device("meta"):
            model, cfg = build(job)
        p = estimate_peaks(model, cfg)
        return {"device": p["device"]["minimum"], "host": p["host"]["minimum"], "state": 16 * p["units"]["parameters"]}


def row(name: str, checks: Dict[str, bool], main: Optional[dict] = None, **kw) -> dict:
    steps = (main or {}).get("step_s") or []
    row = {"name": name, "passed": all(checks.values()), "checks": checks,
           "peaks": (main or {}).get("peak"), "budgets": (main or {}).get("budget"),
           "p50_s": statistics.median(steps) if steps else None,
           "p95_s": sorted(steps)[int(0.95 * (len(steps) - 1))] if steps else None,
           "first_error": (main or {}).get("error")}
    row.update(kw)
    return row


def _held(res: dict) -> bool:
    p, b = res.get("peak") or {}, res.get("budget") or {}
    return bool(p) and all(p[t] <= b[t] for t in ("device", "host") if b.get(t))


def budget_squeeze(ctx: Context) -> dict:
    """Device budget stepped down to the minimum: peaks within budgets at
    every level, throughput per level; below the minimum a refusal naming bytes."""
    mins = ctx.budgets()
    host = max(mins["host"], mins["state"] // 3)
    levels, checks, curve, main = ([2.0, 1.0] if ctx.quick else [4.0, 2.0, 1.5, 1.25, 1.0]), {}, [], None
    for f in levels:
        res = ctx.run(ctx.job(device_memory=int(f * mins["device"]), host_memory=host, end=3))
        checks[f"device {f:g}x minimum: ran, peaks within budgets"] = res["error"] is None and _held(res)
        curve.append({"device_budget": int(f * mins["device"]), "p50_s": statistics.median(res["step_s"] or [0])})
        main = main or res
    below = ctx.run(ctx.job(device_memory=int(0.9 * mins["device"]), host_memory=host, end=1))
    checks["below the minimum: refused naming the bytes"] = bool(below["error"]) and "needs at least" in below["error"]
    low_host = ctx.run(ctx.job(device_memory=2 * mins["device"], host_memory=mins["host"] // 2, end=1))
    checks["host budget below its minimum: refused naming the bytes"] = \
        bool(low_host["error"]) and "bytes" in low_host["error"] and "host_memory" in low_host["error"]
    return row("budget squeeze", checks, main, curve=curve, refusal=below["error"], state_bytes=mins["state"],
                host_budget=host)


def ram_squeeze(ctx: Context) -> dict:
    """RAM left to the process falls (a simulated signal, steps 2-4): the
    run gives way (cache capped, pages returned, prefetch lowered; host homes
    spilled to NVMe), goes on to the same losses, and grows back. The full
    run adds a ballast process squeezing the machine's RAM and memory
    cgroup limits (root)."""
    res = ctx.run(ctx.job(end=ctx.steps + 4, pressure=[2, 4, 100 << 20]))
    ref = ctx.reference()
    actions = [e["action"] for e in res.get("events", [])]
    checks = {"finished": res["error"] is None and res["returncode"] == 0,
              "gave way": "cap host cache" in actions or "lower prefetch depth" in actions,
              "grew back": "grow back" in actions,
              "same losses as the undisturbed run": all(res["losses"].get(k) == v for k, v in ref.items()),
              "not OOM-killed": res["returncode"] != -9}
    notes = "simulated signal"
    if not ctx.quick:
        checks.update(_spill_case(ctx))
        need = _rss_need(ctx)
        got, outcomes = _ballast_cases(ctx, need)
        checks.update(got)
        notes += "; a ballast process leaving MemAvailable just above, then just below the run's need: " + \
            "; ".join(outcomes)
        cg = memory_cgroup()
        if cg is None:
            notes += "; no writable memory cgroup here: the cgroup cases did not run"
        else:
            got, outcomes = _cgroup_cases(ctx, cg, need)
            checks.update(got)
            notes += "; cgroup limits just above and just below the run's estimated need: " + "; ".join(outcomes)
    return row("RAM squeeze", checks, res, events=res.get("events"), notes=notes)


def _spill_case(ctx: Context) -> Dict[str, bool]:
    """Parameters homed on the host, optimizer state on NVMe, under the
    simulated signal: the host homes spill to the swap files and come back,
    and the losses are those of the same run undisturbed."""
    kw = dict(place="host", opt_place="nvme", host_memory=ctx.budgets(place="host", opt_place="nvme")["host"] + (8 << 20))
    ref = ctx.run(ctx.job(end=ctx.steps + 4, **kw))["losses"]
    res = ctx.run(ctx.job(end=ctx.steps + 4, pressure=[2, 4, 100 << 20], **kw))
    acts = [e["action"] for e in res.get("events") or []]
    return {"host homes spilled to NVMe and came back, same losses": res["error"] is None and
            "spill to NVMe" in acts and any(e.get("taken_home") for e in res.get("events") or []) and
            bool(ref) and res["losses"] == ref}


def _rss_need(ctx: Context) -> int:
    """The stress job's estimated peak RSS (bytes)."""
    import torch

    from ..engine.plan.estimator import estimate_peaks
    from .worker import build
    with torch.device("meta"):
        model, cfg = build(ctx.job())
    return estimate_peaks(model, cfg)["rss"]["peak"]


# [Note: what a squeezed run may do]
# The promise under memory pressure is: never OOM-killed, a named error,
# nothing lost. So a run squeezed from outside (a ballast, a cgroup limit)
# passes when it ends in one of three ways: it finished; it stopped mid-run
# with MemoryPressureError (the state whole, a checkpoint can be saved); or
# initialize refused it before any step ran, with a named error naming the
# bytes (BudgetError, or MemoryLimitError when the cgroup limit is below the
# run's floor). And the steps it did run give the undisturbed run's losses.
# It fails when it is killed (SIGKILL: the OOM killer), ends with any other
# error, or a step's loss differs.
GONE_WITHIN_S = 300  # the swap device gone: a named error within this (a hang runs into the job's 600 s timeout)
REFUSALS = ("BudgetError", "MemoryLimitError")  # named start-up refusals (infinity.engine.mechanism.tiers)
SQUEEZED_OK = "finished, stopped with MemoryPressureError, or refused at start-up naming the bytes; " \
    "not OOM-killed; the steps run give the undisturbed losses"


def squeezed_outcome(res: dict, ref: Dict[int, float]) -> tuple:
    """(passed, what happened) for a run squeezed from outside, by [Note: what a squeezed run may do];
    ``res`` is a job's result, ``ref`` the undisturbed run's losses."""
    err, losses = res.get("error") or "", res.get("losses") or {}
    name = err.split(":")[0]
    same = all(ref.get(k) == v for k, v in losses.items())
    if res.get("returncode") == -9:
        return False, f"killed by SIGKILL (the OOM killer) after {len(losses)} steps"
    if not err:
        how, ok = "finished", res.get("returncode") == 0
    elif name == "MemoryPressureError":
        how, ok = f"stopped with MemoryPressureError after {len(losses)} steps", True
    elif name in REFUSALS and not losses:
        how, ok = f"refused at start-up: {err[:160]}", "bytes" in err or "MiB" in err
    else:
        how, ok = f"ended with an error the promise does not name: {err[:160]}", False
    return ok and same, how + ("" if same else "; the losses differ from the undisturbed run's")


def _ballast_cases(ctx: Context, need: int):
    """The run beside a ballast that leaves the machine's MemAvailable at
    its need (estimated peak RSS) plus twice the monitor's margin, then at
    its need alone, so the run's own pages take it below the margin: the run
    ends as [Note: what a squeezed run may do] allows, and the ballast is not
    OOM-killed either."""
    from ..engine.adapt.pressure import MIN_MARGIN
    checks, outcomes, ref = {}, [], ctx.reference()
    for name, leave in (("above", need + 2 * MIN_MARGIN), ("below", need)):
        b = subprocess.Popen([sys.executable, "-m", "infinity.stress.ballast", str(leave)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        try:
            ready = b.stdout.readline().split()
            res = ctx.run(ctx.job(end=ctx.steps))
            alive = b.poll() is None
        finally:
            b.stdin.close()
            b.wait(timeout=300)  # a loaded machine frees the ballast's GiBs slowly
        ok, how = squeezed_outcome(res, ref)
        taken = int(ready[1]) if len(ready) == 2 else 0
        checks[f"ballast leaves {leave >> 20} MiB ({name} the need {need >> 20} MiB + the margin): {SQUEEZED_OK}; "
               "the ballast not OOM-killed"] = ok and alive
        acts = sorted({e["action"] for e in res.get("events") or []})
        outcomes.append(f"{name}: ballast took {taken >> 20} MiB, run {how}" +
                        (f", gave way ({', '.join(acts)})" if acts else "") +
                        ("" if alive else ", the kernel killed the ballast"))
    return checks, outcomes


def memory_cgroup(prefix: str = "infinity-stress") -> Optional[str]:
    """A new child of this process's memory cgroup (v1 or v2) named
    ``<prefix>-<pid>``, or None where it cannot be made (not root, no
    memory controller). The caller removes it."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = [ln.split(":", 2) for ln in f.read().splitlines()]
    except OSError:
        return None
    for _, controllers, rel in lines:
        base = "/sys/fs/cgroup/memory" if "memory" in controllers.split(",") else \
            ("/sys/fs/cgroup" if controllers == "" else None)
        if base is None or not os.path.isdir(base + rel):
            continue
        path = os.path.join(base + rel, f"{prefix}-{os.getpid()}")
        try:
            os.mkdir(path)
            return path
        except OSError:
            continue
    return None


def _cgroup_cases(ctx: Context, cg: str, need: int):
    """The run under a cgroup limit just above, then just below, its need
    (bytes of estimated peak RSS): it ends as [Note: what a squeezed run may
    do] allows (below the need, a refusal at start-up is one right answer)."""
    v1 = os.path.exists(os.path.join(cg, "memory.limit_in_bytes"))
    limit_file = os.path.join(cg, "memory.limit_in_bytes" if v1 else "memory.max")
    checks, outcomes, ref = {}, [], ctx.reference()
    try:
        for name, limit in (("above", int(need * 1.25)), ("below", int(need * 0.9))):
            with open(limit_file, "w") as f:
                f.write(str(limit))
            res = ctx.run(ctx.job(end=ctx.steps), preexec=lambda: _join(cg))
            ok, how = squeezed_outcome(res, ref)
            checks[f"cgroup limit {limit >> 20} MiB ({name} the estimated need {need >> 20} MiB): {SQUEEZED_OK}"] = ok
            acts = sorted({e["action"] for e in res.get("events") or []})
            outcomes.append(f"{name}: {how}" + (f", gave way ({', '.join(acts)})" if acts else "")
                            + f", exit {res['returncode']}")
    finally:
        try:
            os.rmdir(cg)
        except OSError:
            pass
    return checks, outcomes


def _join(cg: str) -> None:
    with open(os.path.join(cg, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))


def pinned_squeeze(ctx: Context) -> dict:
    """``ulimit -l`` small: the run goes on (on CUDA with one warning and unlocked memory)."""
    import resource

    def small_memlock():
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (64 << 10, 64 << 10))

    res = ctx.run(ctx.job(end=3), preexec=small_memlock)
    checks = {"finished under ulimit -l 64": res["error"] is None and res["returncode"] == 0,
              "at most one pinning warning": res.get("stderr", "").count("pin") <= 1}
    return row("pinned-memory squeeze", checks, res, notes="CPU device: the host pool is not page-locked here")


def disk_faults(ctx: Context) -> dict:
    """EIO and a short transfer at block k (retried: nothing lost), the swap
    folder removed mid-run (the open files carry on: nothing lost), a
    checkpoint filesystem that fills (the save refused naming the bytes, the
    run goes on, the checkpoint that fitted resumes exactly), a corrupted
    swap extent (a named error in seconds, the last checkpoint intact,
    resumed exactly), and a swap path too small (refused naming it)."""
    ref, checks = ctx.reference(), {}
    for spec, retried in (("read:9:EIO", 1), ("write:7:short", 0)):  # a short transfer completes inside the I/O engine
        res = ctx.run(ctx.job(io_fault=spec))
        checks[f"{spec}: survived, same losses"] = res["error"] is None and res["losses"] == ref and \
            res["retried"] >= retried
    gone = ctx.run(ctx.job(remove_swap_after=2))
    checks["swap folder removed mid-run: the open files carry on, same losses, clean close"] = \
        gone["error"] is None and gone["losses"] == ref and gone["returncode"] == 0
    ck = os.path.join(ctx.out, "ck-corrupt")
    swap = os.path.join(ctx.swap_root, "corrupt")
    bad = ctx.run(ctx.job(swap=swap, ckpt=ck, ckpt_every=2, corrupt_after=3))
    err = bad["error"] or ""
    checks["corrupt extent: a named checksum error"] = "Checksum" in err and ("swap" in err or "key" in err)
    again = ctx.run(ctx.job(swap=swap, ckpt=ck, resume=True))
    # The flipped moments fail the step after them, or the checkpoint that reads them: the latest complete one is kept.
    checks["resumed from the last checkpoint exactly"] = again["error"] is None and bool(again["losses"]) and \
        all(ref[k] == v for k, v in again["losses"].items()) and max(again["losses"]) == ctx.steps - 1
    checks.update(_full_checkpoint_disk(ctx, ref))
    checks.update(_device_gone(ctx, ref))
    tiny = loop_ext4(ctx.swap_root, "tiny", 4 << 20)
    notes = "loop-mounted ext4 images" if tiny else "not root or no loop devices: the real-filesystem cases did not run"
    if tiny is not None:
        try:
            small = ctx.run(ctx.job(swap=tiny, end=1))
        finally:
            unmount(tiny)
        checks["swap filesystem too small: refused naming the path"] = bool(small["error"]) and tiny in small["error"]
    return row("disk faults", checks, bad, first_error=err, notes=notes, resumed_exactly=all(
        v for k, v in checks.items() if "resume" in k))


def _device_gone(ctx: Context, ref: Dict[int, float]) -> Dict[str, bool]:
    """The swap filesystem unmounted (lazily: the open files carry on) and
    its device gone (every I/O fails): a named error within seconds naming
    the path, the checkpoint on another disk intact, resumed exactly."""
    checks: Dict[str, bool] = {}
    mnt = loop_ext4(ctx.swap_root, "unmounted", 64 << 20)
    if mnt is None:
        return checks
    try:
        res = ctx.run(ctx.job(swap=mnt, unmount_swap_after=2))
        checks["swap filesystem unmounted mid-run: the open files carry on, same losses"] = \
            res["error"] is None and res["losses"] == ref and res["returncode"] == 0
    finally:
        unmount(mnt, lazy=True)
    mnt = loop_ext4(ctx.swap_root, "gone", 64 << 20)
    if mnt is None:
        return checks
    ck = os.path.join(ctx.out, "ck-gone")
    try:
        res = ctx.run(ctx.job(swap=mnt, ckpt=ck, ckpt_every=2, shut_down_swap_after=3))
    finally:
        unmount(mnt, lazy=True)
    err, after = res["error"] or "", (res.get("error_after_s") or 0) - (res.get("last_step_at") or 0)
    # The promise is a named error, not a hang: at the next I/O, seconds after the last step on an idle
    # machine. The bound leaves a loaded machine (steps of seconds) room, and still tells a hang apart.
    checks[f"swap device gone: a named I/O error naming the swap path, within {GONE_WITHIN_S} s"] = \
        "Input/output error" in err and mnt in err and 0 <= after <= GONE_WITHIN_S
    again = ctx.run(ctx.job(swap=os.path.join(ctx.swap_root, "after-gone"), ckpt=ck, resume=True))
    checks["swap device gone: resumed on another disk from the last checkpoint exactly"] = \
        again["error"] is None and bool(again["losses"]) and all(ref[k] == v for k, v in again["losses"].items())
    return checks


def _full_checkpoint_disk(ctx: Context, ref: Dict[int, float]) -> Dict[str, bool]:
    """Checkpoints to a filesystem with room for one and a half of them: the
    second save fails naming the path and the bytes, the run goes on with the
    same losses, and the first checkpoint still resumes exactly."""
    one = ctx.budgets()["state"] + (2 << 20)  # fp32 weights, both moments, the compute copies' share, the manifest
    disk = loop_ext4(ctx.swap_root, "ckfull", int(1.5 * one) + (2 << 20))  # + ext4's own blocks
    if disk is None:
        return {}
    try:
        res = ctx.run(ctx.job(ckpt=disk, ckpt_every=2))
        errs = res.get("checkpoint_errors") or []
        checks = {"checkpoint disk full: the save fails naming the path and the bytes": bool(errs) and
                  disk in errs[0] and "bytes" in errs[0],
                  "checkpoint disk full: the run goes on, same losses": res["error"] is None and res["losses"] == ref}
        again = ctx.run(ctx.job(ckpt=disk, resume=True))
        checks["checkpoint disk full: the checkpoint that fitted resumes exactly"] = again["error"] is None and \
            bool(again["losses"]) and all(ref[k] == v for k, v in again["losses"].items())
        return checks
    finally:
        unmount(disk)


def process_faults(ctx: Context) -> dict:
    """SIGKILL, SIGTERM and SIGINT mid-step, and SIGKILL at points spread over
    a save: the process ends; a new run on the same swap folder starts (the
    dead run's lock and files reclaimed) and resumes exactly from the last
    complete checkpoint."""
    ref, checks = ctx.reference(), {}
    first = None
    for sig in ("KILL", "TERM", "INT"):
        ck = os.path.join(ctx.out, f"ck-{sig.lower()}")
        swap = os.path.join(ctx.swap_root, f"sig-{sig.lower()}")
        dead = ctx.run(ctx.job(swap=swap, ckpt=ck, ckpt_every=2, kill_at=3, signal=sig))
        first = first or dead
        said = {"KILL": None, "TERM": "Terminated", "INT": "KeyboardInterrupt"}[sig]
        ended = dead["returncode"] == -9 if said is None else (dead["returncode"] in (0, 143) and
                                                                said in (dead["error"] or ""))
        checks[f"SIG{sig} mid-step ended the run"] = ended
        again = ctx.run(ctx.job(swap=swap, ckpt=ck, resume=True))
        checks[f"after SIG{sig}: same swap folder, resumed exactly"] = again["error"] is None and \
            all(ref[k] == v for k, v in again["losses"].items()) and min(again["losses"], default=99) == 2
    points = [("tensor", 3)] if ctx.quick else [("tensor", 1), ("tensor", 9), ("tensor", 20), ("manifest", 1),
                                                  ("commit", 1)]
    for point, nth in points:
        ck = os.path.join(ctx.out, f"ck-save-{point}-{nth}")
        swap = os.path.join(ctx.swap_root, f"save-{point}-{nth}")
        dead = ctx.run(ctx.job(swap=swap, ckpt=ck, ckpt_every=2, kill_in_save=[point, nth]))
        again = ctx.run(ctx.job(swap=swap, ckpt=ck, resume=True))
        checks[f"SIGKILL mid-save ({point} #{nth}): the previous checkpoint resumed exactly"] = \
            dead["returncode"] == -9 and again["error"] is None and min(again["losses"], default=99) == 2 and \
            all(ref[k] == v for k, v in again["losses"].items())
    return row("process faults", checks, first, resumed_exactly=all(v for k, v in checks.items() if "resumed" in k))


SCENARIOS = {"budget": budget_squeeze, "ram": ram_squeeze, "pinned": pinned_squeeze, "disk": disk_faults,
             "process": process_faults, "soak": soak}


def clean(ctx: Context) -> None:
    shutil.rmtree(ctx.swap_root, ignore_errors=True)
