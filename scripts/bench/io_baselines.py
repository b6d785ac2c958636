"""The baselines scripts/bench/bench_io.py measures the swap store against,
each on the same files and sizes in the same run: fio, raw O_DIRECT reads and
writes from Python (one thread, or a pool of pwrite/pread threads), aiofiles,
and DeepSpeed's AIO where it is installed (see bench_io.py's docstring)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Optional

import torch

MiB = 1 << 20


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


# ---- raw baseline -----------------------------------------------------------------------


def fio_run(path: str, rw: str, size: int, bs: int, depth: int, jobs: int = 1) -> float:
    # jobs > 1: each job takes its own contiguous 1/jobs of the file.
    part = size // jobs
    cmd = ["fio", "--name=raw", f"--filename={path}", f"--rw={rw}", f"--bs={bs}", f"--iodepth={depth}",
           "--direct=1", "--ioengine=io_uring", f"--size={part}", f"--offset_increment={part}",
           "--output-format=json", f"--numjobs={jobs}", "--group_reporting=1", "--end_fsync=0"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return job["write" if rw == "write" else "read"]["bw_bytes"] / 1e9


def pyraw_run(path: str, rw: str, size: int, bs: int, depth: int, jobs: int = 1,
              mem: Optional[memoryview] = None) -> float:
    """O_DIRECT thread pool of pread/pwrite, no checksums: the best case of
    the engine's own method, measured like fio. Its ``depth`` buffers are
    slices of ``mem`` (4 KiB-aligned, huge pages, at least ``depth * bs``
    bytes): see [Note: warm memory] for why not fresh ones. ``jobs`` is
    fio_run's argument, taken so both share one call; the pool is always one
    job of ``depth`` threads."""
    if mem is None or len(mem) < depth * bs:
        raise ValueError(f"pyraw_run needs {depth} x {bs} bytes of buffer memory")
    bufs = [mem[i * bs:(i + 1) * bs] for i in range(depth)]
    flags = os.O_RDWR | os.O_CREAT | os.O_DIRECT
    fd = os.open(path, flags, 0o600)
    if rw == "write" and os.fstat(fd).st_size < size:
        os.posix_fallocate(fd, 0, size)
    dt = thread_pool_io([(fd, off, bufs[i % depth]) for i, off in enumerate(range(0, size, bs))], rw, depth)
    os.close(fd)
    return gbps(size, dt)


def thread_pool_io(jobs, rw: str, depth: int) -> float:
    """Seconds for ``depth`` threads to pwrite (rw="write") or preadv each
    ``(fd, offset, buffer)`` job: the raw O_DIRECT method of this script."""
    from concurrent.futures import ThreadPoolExecutor

    def one(job):
        fd, off, b = job
        if rw == "write":
            os.pwrite(fd, b, off)
        else:
            os.preadv(fd, [b], off)

    t = time.perf_counter()
    with ThreadPoolExecutor(depth) as ex:
        list(ex.map(one, jobs))
    return time.perf_counter() - t


# ---- aiofiles ----------------------------------------------------------------------------


def aiofiles_run(path: str, data: bytes, size: int, bs: int) -> tuple:
    import aiofiles

    async def write():
        async with aiofiles.open(path, "r+b" if os.path.exists(path) else "wb") as f:
            for off in range(0, size, bs):
                await f.write(data)
            await f.flush()
            os.fsync(f.fileno())

    async def read():
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # cold read: drop this file's cached pages
        os.close(fd)
        async with aiofiles.open(path, "rb") as f:
            while await f.read(bs):
                pass

    t = time.perf_counter()
    asyncio.run(write())
    w = gbps(size, time.perf_counter() - t)
    t = time.perf_counter()
    asyncio.run(read())
    r = gbps(size, time.perf_counter() - t)
    return w, r


# ---- DeepSpeed AIO (the reference system), where installed -----------------------------------


def ds_aio_handle():
    """DeepSpeed's async I/O op in its best configuration measured on these
    machines (1 MiB blocks, queue depth 32, two threads), or None when
    DeepSpeed (or its AIO op: libaio) is not available."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        b = AsyncIOBuilder()
        if not b.is_compatible(verbose=False):
            return None
        return b.load(verbose=False).aio_handle(1 * MiB, 32, False, True, 2)
    except Exception as exc:  # not installed, or its JIT build failed
        print(f"[bench_io] DeepSpeed AIO not measured: {exc!r}"[:200], file=sys.stderr)
        return None


def ds_aio_run(handle, path: str, size: int, t: torch.Tensor) -> dict:
    """Fresh write, overwrite and read of one file by DeepSpeed AIO, from ``t``:
    its own page-locked tensor, or an ordinary tensor (its bounce path). Both
    are allocated once and reused over rounds, like the store's buffers
    ([Note: warm memory])."""
    res = {}
    try:
        for name, fn in [("write_fresh", lambda: handle.sync_pwrite(t, path)),
                         ("write_over", lambda: handle.sync_pwrite(t, path)),
                         ("read", lambda: handle.sync_pread(t, path))]:
            start = time.perf_counter()
            fn()
            res[name] = gbps(size, time.perf_counter() - start)
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return res


# ---- store -----------------------------------------------------------------------------------


def raw_extents(pieces, rw: str, bs: int, depth: int, mem: memoryview) -> float:
    """O_DIRECT pread/pwrite of exactly the store's extents ((path, offset,
    nbytes, rel) pieces) by a pool of ``depth`` threads in ``bs`` blocks, to
    and from the same pool buffer the store uses (``mem``, byte ``rel`` of
    the key), no checksums: the raw disk on the same file, region, data
    freshness and memory as the store's transfer it is compared with."""
    fds = {p: os.open(p, os.O_RDWR | os.O_DIRECT) for p in {p[0] for p in pieces}}
    jobs = [(fds[p], off + a, mem[rel + a:rel + min(n, a + bs)]) for p, off, n, rel in pieces for a in range(0, n, bs)]
    total = sum(len(j[2]) for j in jobs)
    dt = thread_pool_io(jobs, rw, depth)
    for fd in fds.values():
        os.close(fd)
    return gbps(total, dt)
