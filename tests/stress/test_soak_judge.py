"""The soak's judgement (infinity/stress/soak.py, issue 34) on synthetic
per-step sample series: what cannot grow is judged against a known bound or
a slope over the whole post-warm-up window, never first sample against last.
No process runs and nothing is timed."""

import random

from infinity.stress.soak import (MIN_STEPS, MIN_STEPS_FULL, RSS_SLOPE_FULL, RSS_SLOPE_QUICK, WARM_UP, judge, rss_slope,
                                  steps_needed, thread_bounds)

BOUNDS = thread_bounds(swap_queue_depth=16)
MiB = 1 << 20


def series(n=160, rss=lambda i: 400 * MiB, threads=lambda i: {"MainThread": 1, "infinity-h2d": 1,
                                                               "infinity-d2h": 1}, fds=lambda i: 40):
    return [{"rss": rss(i), "fds": fds(i), "thread_names": threads(i), "swap_bytes": 64 * MiB, "pinned": 0}
            for i in range(n)]


def failed(checks):
    return [k for k, ok in checks.items() if not ok]


def test_the_bound_is_the_runtimes_named_thread_set():
    assert BOUNDS["MainThread"] == 1 and BOUNDS["infinity-chain"] == 1 and BOUNDS["infinity-io"] == 16
    assert BOUNDS["infinity-cast"] >= 1


def test_flat_run_passes_quick_and_full():
    for quick in (True, False):
        checks, fig = judge(series(n=steps_needed(quick)), BOUNDS, quick)
        assert not failed(checks), checks
        assert fig["rss_slope_mib_per_1000_steps"] == 0 and fig["threads_over"] == ""


def test_a_thread_started_lazily_after_warm_up_passes():
    # The chain executor's thread first starts at step 100 (after the 20% cut): 3 -> 4 threads, within the bound.
    def threads(i):
        t = {"MainThread": 1, "infinity-h2d": 1, "infinity-d2h": 1}
        if i >= 100:
            t["infinity-chain"] = 1
        return t
    checks, _ = judge(series(threads=threads), BOUNDS, True)
    assert not failed(checks), checks


def test_a_thread_leak_fails_naming_it():
    # A new chain executor per 20 steps: its threads pile up past the bound of one.
    checks, fig = judge(series(threads=lambda i: {"MainThread": 1, "infinity-chain": 1 + i // 20}), BOUNDS, True)
    assert [k for k in failed(checks) if "threads" in k] and "infinity-chain x2 (bound 1)" in fig["threads_over"]
    # Threads the runtime does not name (another library's, a leaked plain Thread) are outside the known set.
    checks, fig = judge(series(threads=lambda i: {"MainThread": 1, "Thread": 1 + i // 50}), BOUNDS, True)
    assert failed(checks) and "not a runtime thread" in fig["threads_over"]


def test_oscillating_flat_rss_passes():
    # 6-7 MiB up and down from step to step around a flat level, in a random order, ending high.
    rng = random.Random(7)
    rss = [400 * MiB + rng.choice([0, 6 * MiB, 7 * MiB]) for _ in range(160)]
    rss[-1] = 407 * MiB
    rss[int(0.2 * len(rss))] = 400 * MiB  # first post-warm-up sample low, last high: first-vs-last would fail
    checks, fig = judge(series(rss=lambda i: rss[i]), BOUNDS, True)
    assert not failed(checks), checks
    assert abs(fig["rss_slope_mib_per_1000_steps"]) < RSS_SLOPE_QUICK / 2


def test_a_steady_rss_climb_fails():
    # 256 KiB a step (256 MiB per 1000 steps), hidden under the same oscillation.
    rng = random.Random(8)
    checks, fig = judge(series(rss=lambda i: 400 * MiB + i * (MiB // 4) + rng.choice([0, 6 * MiB])), BOUNDS, True)
    assert [k for k in failed(checks) if k.startswith("RSS slope")], checks
    assert fig["rss_slope_mib_per_1000_steps"] > RSS_SLOPE_QUICK
    # The full soak's finer threshold: 16 KiB a step over 4000 steps.
    checks, _ = judge(series(n=4000, rss=lambda i: 400 * MiB + i * (MiB // 64)), BOUNDS, False)
    assert [k for k in failed(checks) if k.startswith("RSS slope")]
    assert rss_slope([400 * MiB + i * (MiB // 64) for i in range(100)]) == 1000 / 64 > RSS_SLOPE_FULL


def test_too_few_steps_cannot_pass():
    for quick, least in ((True, MIN_STEPS), (False, MIN_STEPS_FULL)):
        assert int(steps_needed(quick) * (1 - WARM_UP)) >= least  # the soak runs enough
        checks, _ = judge(series(n=least), BOUNDS, quick)
        assert [k for k in failed(checks) if k.startswith("at least")]


def test_oscillating_flat_rss_passes_the_full_soaks_finer_threshold():
    rng = random.Random(9)
    n = steps_needed(False)
    rss = [400 * MiB + rng.choice([0, 6 * MiB, 7 * MiB]) for _ in range(n)]
    checks, fig = judge(series(n=n, rss=lambda i: rss[i]), BOUNDS, False)
    assert not failed(checks), checks


def test_fds_opened_lazily_pass_an_fd_leak_fails():
    checks, _ = judge(series(fds=lambda i: 40 if i < 50 else 41), BOUNDS, True)  # one opened early after warm-up
    assert not failed(checks), checks
    checks, _ = judge(series(fds=lambda i: 40 + i // 10), BOUNDS, True)
    assert [k for k in failed(checks) if "fd" in k]
