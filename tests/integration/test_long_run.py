"""A long run leaks nothing (issue 18): over 1,000 steps of an NVMe-offloaded
model with updates during backward, open file descriptors and swap bytes
stay flat, threads stay within the runtime's known set, and the slopes of
the Python heap and of RSS over the last 500 are bounded (hooks made
reference cycles per step; retried handles held their tensors). The heap
settles in the first ~500 steps (the interpreter's own caches of
specialised code: +170 KB, then flat).

Judged as the stress soak judges (see [Note: what the soak judges] in
infinity/stress/soak.py), so a loaded machine passes as an idle one does:
executors start their threads lazily (under load one may first start after
the warm-up), so threads are held to their known bound at every sample, not
to the first sample's count; the slopes are fitted to a sample every step,
enough samples for the allocator's step-to-step noise to fall far below the
thresholds."""

import array
import os
import tracemalloc

import torch

import infinity
from infinity.stress.soak import thread_bounds, thread_counts
from paging_zoo import Chain, base_config

STEPS, WARMUP = 1000, 500
HEAP_SLOPE_BYTES_PER_STEP = 32   # measured ~4: far under one small object a step
RSS_SLOPE_BYTES_PER_STEP = 1024  # page-granular and noisy; a leaked buffer a step is >= 4096


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _swap_bytes(folder) -> int:
    return sum(os.stat(os.path.join(d, f)).st_size for d, _, fs in os.walk(folder) for f in fs)


def _slope(xs, ys) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def test_a_thousand_steps_leak_no_fds_swap_bytes_threads_heap_or_rss(tmp_path):
    torch.manual_seed(0)
    cfg = infinity.Config(**base_config(offload_params="nvme", offload_optimizer="nvme", device_memory=1 << 20,
                                        swap_paths=[str(tmp_path)], swap_block_size=4096, overlap="backward"))
    others = thread_counts()  # threads not of this run (pytest's, earlier tests'): not judged
    bounds = thread_bounds(cfg.swap_queue_depth)
    m, o = infinity.initialize(Chain([32, 16, 64, 8]), cfg, lr=1e-3)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)) for _ in range(8)]
    # One sample a step after warm-up, into arrays made before tracing starts: the samples add nothing to the heap.
    n = STEPS - WARMUP + 1
    steps, heap, fds, swap, rss = (array.array("q", bytes(8 * n)) for _ in range(5))
    over = []
    tracemalloc.start()
    try:
        for step in range(1, STEPS + 1):
            x, y = batches[step % len(batches)]
            loss = m(x, y)
            loss.backward()
            o.step()
            o.zero_grad()
            if step >= WARMUP:
                i = step - WARMUP
                steps[i], heap[i], fds[i] = step, tracemalloc.get_traced_memory()[0], _fds()
                swap[i], rss[i] = _swap_bytes(tmp_path), _rss()
                over += [(step, name, c - others.get(name, 0)) for name, c in thread_counts().items()
                         if c - others.get(name, 0) > bounds.get(name, 0)]
    finally:
        tracemalloc.stop()
    assert torch.isfinite(loss)
    infinity.close(m)
    half = n // 2  # a growth that continues, not a transient fd at one sample (a thread of another's)
    assert max(fds[half:]) <= max(fds[:half]), f"open fds grow: {list(fds[::50])}"
    assert len(set(swap)) == 1, f"swap bytes per sample: {sorted(set(swap))}"
    assert not over, f"threads beyond the runtime's known set {bounds} (step, name, count): {over[:5]}"
    slope = _slope(steps, heap)
    assert slope < HEAP_SLOPE_BYTES_PER_STEP, f"heap grows {slope:.0f} B/step: {list(heap[::50])}"
    slope = _slope(steps, rss)
    assert slope < RSS_SLOPE_BYTES_PER_STEP, f"RSS grows {slope:.0f} B/step: {list(rss[::50])}"
    assert _fds() < fds[0], "close() gives back the run's fds"


def test_close_gives_the_memory_back_while_the_optimizer_is_still_held(tmp_path):
    """A run that closes and initializes again in one process needs room for
    one run: after close the tiers' RAM is returned even though the caller
    still holds the optimizer (which references the engine)."""
    import gc

    from infinity.system import sysinfo
    gc.collect()
    before = sysinfo.rss_bytes()
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(16)])  # 16.8 M parameters
    cfg = infinity.Config(device="cpu", dtype="fp32", offload_params="host", offload_optimizer="host",
                          device_memory="32MiB", host_memory="512MiB", swap_paths=[str(tmp_path)],
                          unit_classes=[torch.nn.Linear])
    m, o = infinity.initialize(net, cfg, lr=1e-3)
    m(torch.randn(4, 1024)).sum().backward()
    o.step()
    o.zero_grad()
    during = sysinfo.rss_bytes()
    infinity.close(m, keep_values=False)
    gc.collect()
    after = sysinfo.rss_bytes()
    assert during - before > 200 << 20, (before, during)  # the tiers held ~270 MB of state
    assert after - before < 64 << 20, (before, during, after)
    assert o.engine.closed
