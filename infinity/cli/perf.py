"""Machine limits measured now, for the lower bounds that benchmarks and the
main job print beside their figures: host-device copy bandwidth, swap-path
bandwidth through the engine's own store, and the CPU AdamW's time."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from ..optim import adamw_step_

__all__ = ["copy_bandwidth", "disk_bandwidth", "optimizer_time"]


def copy_bandwidth(nbytes: int, device: torch.device, pinned: bool = False) -> float:
    """Bytes/s of a host-to-device copy of ``nbytes`` (median of 5): from
    pageable memory, or with ``pinned`` from a page-locked HostPool buffer as
    the mover copies (asynchronous on CUDA, so timed to a synchronize)."""
    pool = buf = None
    if pinned:
        from ..io import HostPool
        pool = HostPool(nbytes, pin="auto")
        buf = pool.acquire(nbytes)
        src = buf.view(torch.float32)
        src.normal_()
    else:
        src = torch.empty(nbytes // 4, dtype=torch.float32).normal_()
    dst = torch.empty_like(src, device=device)
    ts = []
    for _ in range(6):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=pinned)
        if device.type == "cuda":
            torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    if pool is not None:
        del src
        buf.release()
        pool.close()
    return nbytes / statistics.median(ts[1:])


def disk_bandwidth(paths, nbytes: int):
    """(write, read) bytes/s of the swap paths, measured with a SwapStore of
    the same kind the engine uses (O_DIRECT, pool buffers), median of 3."""
    from ..io import HostPool, SwapStore
    dirs = [tempfile.mkdtemp(prefix="bw-", dir=p) for p in paths]
    pool = HostPool(nbytes)
    buf = pool.acquire(nbytes)
    t = buf.view(torch.uint8)
    t.random_(0, 255)
    w, r = [], []
    with SwapStore(dirs, capacity_bytes=nbytes + (16 << 20)) as store:
        for i in range(3):
            t0 = time.perf_counter()
            store.write("k", t).wait()
            w.append(nbytes / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            store.read("k", t).wait()
            r.append(nbytes / (time.perf_counter() - t0))
    buf.release()
    pool.close()
    for d in dirs:
        try:
            Path(d).rmdir()
        except OSError:
            pass
    return statistics.median(w), statistics.median(r)


def optimizer_time(n: int, threads) -> float:
    """Seconds of one CPU AdamW step over ``n`` fp32 parameters in flat buffers
    (median of 5; ``threads`` None: the default count)."""
    p, g, m, v = (torch.randn(n) for _ in range(4))
    v.abs_()
    ts = []
    for s in range(1, 7):
        t0 = time.perf_counter()
        adamw_step_([p], [g], [m], [v], step=s, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                    num_threads=threads)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[1:])
