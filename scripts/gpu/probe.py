#!/usr/bin/env python3
"""The machine, the pinned pool and the copy bandwidths (the probe stage of scripts/gpu/check.sh).

Reports torch, CUDA, driver and NCCL versions; the host: /proc/meminfo
(a small-RAM start makes the engine's host budget refuse, or its pressure
monitor lower prefetch), CPUs (nproc, affinity, lscpu), ``ulimit -l`` (what
may be pinned), free disk of the swap folders; which optional baselines
import (torchao); whether ``infinity.io.HostPool(size,
pin="auto")`` is pinned; whether, after closing it, a second pool of the same
size (usually mapped at the same address) is pinned again and the CUDA
runtime's last error is still clean (a synchronize and a tiny kernel launch
succeed; review B1/B2); then H2D and D2H GB/s from the pool (pinned) and from a
plain ``torch.empty`` (pageable), timed with CUDA events.

Exit 1 on CUDA when: CUDA is not available, a pool is not pinned, or a kernel
launch after the re-registration fails. On the CPU (--device cpu) every step
runs with a small pool and host copies, and nothing is required of pinning.

Usage: python scripts/gpu/probe.py [--device cuda] [--pool-mib 1024] [--json probe.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from infinity.io import HostPool  # noqa: E402


def versions() -> dict:
    """torch, CUDA runtime, driver and GPU names (what is there to report)."""
    out = {"torch": torch.__version__, "cuda_runtime": torch.version.cuda,
           "cuda_available": torch.cuda.is_available()}
    if out["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, gpu_memory_bytes=props.total_memory, device_count=torch.cuda.device_count(),
                   capability=f"{props.major}.{props.minor}")
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        out["driver"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as exc:
        out["driver"] = f"nvidia-smi unavailable: {exc}"
    return out


def host_facts() -> dict:
    """Memory, CPUs, lock limit, disk and optional packages of this machine."""
    import os
    import resource
    import shutil
    out = {"python": sys.version.split()[0], "nproc": os.cpu_count(),
           "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}
    try:
        out["meminfo"] = {ln.split(":")[0]: ln.split(":")[1].strip() for ln in
                          Path("/proc/meminfo").read_text().splitlines() if ":" in ln}
    except OSError as exc:
        out["meminfo"] = f"unreadable: {exc}"
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    unlimited = resource.RLIM_INFINITY
    out["ulimit_l_bytes"] = {"soft": None if soft == unlimited else soft, "hard": None if hard == unlimited else hard}
    for path in (".", "/tmp"):
        du = shutil.disk_usage(path)
        out[f"disk_free_bytes {path}"] = du.free
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        keep = ("Model name", "Socket(s)", "Core(s) per socket", "Thread(s) per core", "NUMA node(s)", "Flags",
                "L3 cache")
        out["lscpu"] = {k.strip(): v.strip() for k, _, v in (ln.partition(":") for ln in lscpu.splitlines())
                        if k.strip() in keep}
        flags = out["lscpu"].pop("Flags", "")
        out["lscpu"]["simd"] = [f for f in ("avx2", "avx512f", "avx512bf16", "amx_bf16") if f in flags.split()]
    except (OSError, subprocess.TimeoutExpired) as exc:
        out["lscpu"] = f"unavailable: {exc}"
    if torch.cuda.is_available():
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None
    try:
        import torchao
        out["torchao"] = torchao.__version__
    except ImportError as exc:
        out["torchao"] = f"not importable: {exc}"
    return out


def peek_last_error() -> object:
    """cudaPeekAtLastError of the libcudart this process loaded (it does not
    clear the error); None when no libcudart is mapped (torch's binding lacks
    the call)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    libs = sorted({ln.split()[-1] for ln in maps if "libcudart" in ln and ln.split()[-1].startswith("/")})
    for path in libs:
        try:
            return int(ctypes.CDLL(path).cudaPeekAtLastError())
        except (OSError, AttributeError):
            continue
    return None


def launch_ok(device: torch.device) -> str:
    """'' when a synchronize and a tiny kernel succeed on ``device``, else the error."""
    try:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = torch.ones(4, device=device).add_(1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return "" if float(t.sum()) == 8.0 else f"wrong result {t.tolist()}"
    except Exception as exc:  # exactly what B2 predicts: a stale error raised at the next launch
        return f"{type(exc).__name__}: {exc}"


def pool_reopen(nbytes: int, device: torch.device) -> dict:
    """Opens a pool, closes it, opens another of the same size: pinned each time?
    Same address? Last error clean? Both pools are closed on return."""
    first = HostPool(nbytes, pin="auto")
    res = {"pool_bytes": first.capacity_bytes, "first_pinned": first.pinned, "first_method": first.pin_method,
           "first_reason": first.pin_reason, "first_ptr": hex(first.base_ptr)}
    first.close()
    second = HostPool(nbytes, pin="auto")
    res.update(second_pinned=second.pinned, second_reason=second.pin_reason, second_ptr=hex(second.base_ptr),
               same_address=second.base_ptr == first.base_ptr)
    res["last_error_after"] = peek_last_error() if device.type == "cuda" else None
    res["launch_after"] = launch_ok(device) or "ok"
    second.close()
    return res


def _time_copy(dst: torch.Tensor, src: torch.Tensor, reps: int) -> float:
    """Median seconds of ``dst.copy_(src)`` (CUDA events on a GPU, else wall time)."""
    cuda = dst.is_cuda or src.is_cuda
    ts = []
    for _ in range(reps + 1):  # the first copy pays for page-table and TLB set-up
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            ts.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts[1:])


def bandwidths(nbytes: int, device: torch.device, reps: int) -> dict:
    """GB/s of H2D and D2H, pinned (from a HostPool) and pageable (torch.empty)."""
    pool = HostPool(nbytes, pin="auto")
    buf = pool.acquire(nbytes)
    try:
        pinned = buf.view(torch.uint8)
        pageable = torch.empty(nbytes, dtype=torch.uint8)
        pageable.fill_(1)
        pinned.fill_(1)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        out = {"bytes": nbytes, "pool_pinned": pool.pinned}
        for name, host in (("pinned", pinned), ("pageable", pageable)):
            out[f"h2d_{name}_GBps"] = nbytes / _time_copy(dev, host, reps) / 1e9
            out[f"d2h_{name}_GBps"] = nbytes / _time_copy(host, dev, reps) / 1e9
        del pinned, pageable, dev
    finally:
        buf.release()
        pool.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a run with host copies")
    ap.add_argument("--pool-mib", type=int, default=1024, help="size of each of the two host pools opened, MiB (default 1024)")
    ap.add_argument("--copy-mib", type=int, default=256, help="bytes per timed copy, MiB (default 256)")
    ap.add_argument("--reps", type=int, default=5,
                    help="timed copies per direction, after one untimed; median (default 5)")
    ap.add_argument("--json", default=None, help="also write the results as JSON to this file")
    args = ap.parse_args()
    device = torch.device(args.device)
    res = {"versions": versions(), "host": host_facts()}
    print(json.dumps(res["versions"]), flush=True)
    mi = res["host"]["meminfo"]
    print("host:", json.dumps({k: v for k, v in res["host"].items() if k != "meminfo"}), flush=True)
    if isinstance(mi, dict):
        print("meminfo:", {k: mi.get(k) for k in ("MemTotal", "MemAvailable", "Mlocked", "HugePages_Total")},
              flush=True)
    problems = []
    if device.type == "cuda" and not torch.cuda.is_available():
        problems.append("CUDA is not available")
    else:
        res["pool"] = pool_reopen(args.pool_mib << 20, device)
        print("pool:", json.dumps(res["pool"]), flush=True)
        res["bandwidth"] = bandwidths(args.copy_mib << 20, device, args.reps)
        print("bandwidth:", json.dumps({k: round(v, 2) if isinstance(v, float) else v
                                        for k, v in res["bandwidth"].items()}), flush=True)
        p = res["pool"]
        if device.type == "cuda":
            for which in ("first", "second"):
                if not p[f"{which}_pinned"]:
                    problems.append(f"{which} pool not pinned: {p[f'{which}_reason']}")
            if p["launch_after"] != "ok":
                problems.append(f"kernel launch after re-registering failed: {p['launch_after']}")
    res["problems"] = problems
    print("problems:", problems or "none")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
