"""The stress test's soak: training for a while, then judging what must not grow.

[Note: what the soak judges]
A leak is something that grows with the steps taken. The soak samples, once
per step, the process's RSS, open file descriptors, Python threads by name,
swap-file bytes on disk and pinned bytes, and judges each by what can be
known of it in advance, never by comparing one sample with another:

- Threads: the runtime's threads are known by name and bounded
  (``WORKER_THREADS`` in infinity/engine/mechanism/mover.py, ``swap_queue_depth``
  threads of the Python I/O engine, the main thread). Executors start their
  threads lazily, so a name may first appear after warm-up (under load the
  chain thread does, 3 -> 4 threads); that is within the bound. Every sample
  must stay within it: a name outside the known set, or more threads of a
  name than its bound, fails, naming them.
- RSS: the allocator oscillates by megabytes step to step, so first against
  last says nothing. The judgement is the least-squares slope of RSS against
  the step number over every sample after warm-up, in MiB per 1000 steps,
  and the soak runs enough steps for the slope's noise to stay well below the
  threshold (``MIN_STEPS``). Per step, not per second: a loaded machine takes
  fewer steps a minute but leaks no less per step.
- File descriptors, swap-file bytes, pinned bytes: step functions that grow
  only when something is opened or allocated. The peak of the second half of
  the post-warm-up samples must not exceed the peak of the first half, so a
  lazy allocation early on is allowed and a growth that continues is not.
"""

from __future__ import annotations

import re
import statistics
import threading
from collections import Counter
from typing import Dict, List, Sequence, Tuple

__all__ = ["thread_bounds", "thread_counts", "judge", "rss_slope", "steps_needed", "MIN_STEPS", "MIN_STEPS_FULL",
           "WARM_UP"]

WARM_UP = 0.2  # fraction of the samples dropped before judging: caches fill, executors start
# Thresholds in MiB of RSS per 1000 steps, and the post-warm-up samples that
# resolve each. The least-squares slope of n samples oscillating by +-s MiB
# has a standard error of about s * sqrt(12 / n**3) per step: with s = 3 MiB
# (the worst seen), 100 samples give about 10 MiB/1000 steps, so the quick
# threshold is six of them; 400 samples give about 1.3, and the full soak's
# threshold is six of those. The full soak runs at least that many steps
# however long --minutes is, so a loaded machine only makes it slower.
RSS_SLOPE_QUICK, MIN_STEPS = 64.0, 100
RSS_SLOPE_FULL, MIN_STEPS_FULL = 8.0, 400


def steps_needed(quick: bool) -> int:
    """Steps the soak runs at least, so that ``judge`` has its samples after warm-up."""
    return int((MIN_STEPS if quick else MIN_STEPS_FULL) / (1 - WARM_UP)) + 1


def thread_bounds(swap_queue_depth: int) -> Dict[str, int]:
    """The most Python threads of each name prefix the runtime may run at once
    during training (the main thread, the mover's workers, the Python I/O
    engine's ``swap_queue_depth`` workers where the native engine is absent, the
    collectives' clock)."""
    from ..engine.mechanism.mover import WORKER_THREADS
    return {"MainThread": 1, **WORKER_THREADS, "infinity-io": swap_queue_depth, "infinity-comm-clock": 1}


def thread_counts() -> Dict[str, int]:
    """This process's live Python threads, counted by name prefix (an
    executor's ``name_3`` counts as ``name``)."""
    return dict(Counter(_prefix(t.name) for t in threading.enumerate()))


def _prefix(name: str) -> str:
    return re.sub(r"_\d+$", "", name)


def rss_slope(rss: Sequence[int]) -> float:
    """Least-squares slope of ``rss`` (bytes, one sample per step) against the
    step number, in MiB per 1000 steps."""
    xs = list(range(len(rss)))
    if len(xs) < 2:
        return 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(rss)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, rss)) / den * 1000 / 2**20


def _thread_check(samples: List[dict], bounds: Dict[str, int]) -> Tuple[bool, str]:
    """Every sample's threads within ``bounds``: (ok, what exceeded it first)."""
    for i, s in enumerate(samples):
        counts = s.get("thread_names") or {}
        over = {n: c for n, c in counts.items() if c > bounds.get(n, 0)}
        if over:
            return False, f"sample {i}: " + ", ".join(
                f"{n} x{c} (bound {bounds.get(n, 0)}{'' if n in bounds else ', not a runtime thread'})"
                for n, c in sorted(over.items()))
    return True, ""


def _peaks_hold(values: List[int]) -> bool:
    """The second half's peak is at most the first half's."""
    half = len(values) // 2
    return bool(values) and max(values[half:]) <= max(values[:half] or values)


def judge(samples: List[dict], bounds: Dict[str, int], quick: bool) -> Tuple[Dict[str, bool], dict]:
    """The soak's checks on per-step ``samples`` (dicts with ``rss``, ``fds``,
    ``thread_names``, ``swap_bytes``, ``pinned``; bytes), the threads judged
    against ``bounds`` (see :func:`thread_bounds`): (checks, figures) where
    figures has ``rss_slope_mib_per_1000_steps``, ``steps_judged`` and
    ``threads_over`` (empty when within the bound)."""
    warm = samples[int(len(samples) * WARM_UP):]
    limit, least = (RSS_SLOPE_QUICK, MIN_STEPS) if quick else (RSS_SLOPE_FULL, MIN_STEPS_FULL)
    slope = rss_slope([s["rss"] for s in warm])
    threads_ok, over = _thread_check(samples, bounds)
    total = sum(bounds.values())
    checks = {
        f"at least {least} steps after warm-up to resolve the RSS slope (got {len(warm)})": len(warm) >= least,
        f"RSS slope after warm-up <= {limit:g} MiB per 1000 steps (got {slope:+.1f})":
            len(warm) >= 2 and slope <= limit,
        f"threads within the runtime's known set at every step (at most {total}: "
        + ", ".join(f"{n} x{c}" for n, c in bounds.items()) + ")" + (f"; over: {over}" if over else ""): threads_ok,
        "no fd growth (peak of the last half <= peak of the first half)": _peaks_hold([s["fds"] for s in warm]),
        "no swap-file growth (peak of the last half <= peak of the first half)":
            _peaks_hold([s["swap_bytes"] for s in warm]),
        "no pinned-memory growth (peak of the last half <= peak of the first half)":
            _peaks_hold([s["pinned"] for s in warm]),
    }
    return checks, {"rss_slope_mib_per_1000_steps": slope, "steps_judged": len(warm), "threads_over": over}


def soak(ctx) -> dict:
    """Training with deep prefetch for ``--minutes`` and at least
    :func:`steps_needed` steps (``--quick``: just those, however long they
    take), judged by :func:`judge`."""
    from .scenarios import row
    seconds = 0 if ctx.quick else 60 * ctx.minutes
    steps = steps_needed(ctx.quick)
    mins = ctx.budgets(depth=4)
    res = ctx.run(ctx.job(end=steps, seconds=seconds, depth=4, sample=True, device_memory=2 * mins["device"],
                          host_memory=max(mins["host"], mins["state"] // 3)), timeout=seconds + 900)
    s = res.get("samples") or []
    checks = {"ran": res["error"] is None and bool(s)}
    got, figures = judge(s, res.get("thread_bounds") or {"MainThread": 1}, ctx.quick)
    checks.update(got)
    return row("soak", checks, res, steps=len(res.get("step_s") or []), seconds=seconds, samples=s, **figures)
