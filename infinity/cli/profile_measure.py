"""``infinity doctor --profile OUT.json``: this machine's speeds for the
step-time model (infinity/engine/plan/profile.py), measured in well under a
minute. Each figure is measured the way the engine uses the hardware:

- GEMM rate per dtype at a few square sizes (torch.mm on the run's device);
- the rates of the kernels a model runs (kernel_probe.py): matrix products
  on a grid of shapes, attention forward and backward, and the
  compute-bound elementwise ops per element;
- device memory bandwidth of an elementwise op (bytes read + written / s);
- the fixed cost of one op: a tiny model's forward and backward, whose ops
  cost next to nothing, timed and divided by its op count (costs.py counts
  them the way the model counts a real one): dispatch, autograd and module
  calls;
- the engine's own time per parameter tensor and per op of a unit, in
  forward and in backward, and at the step boundary (per step and per
  tensor): tiny units through infinity against plain PyTorch (engine_probe.py);
- copies: on CUDA pinned copies per direction; on the CPU a memcpy on one
  worker thread, as the mover's threads copy;
- the native AdamW, parameters/s, with bf16 and fp32 gradients and a bf16
  copy out, at the engine's thread count;
- the swap paths' O_DIRECT write and read through a SwapStore (perf.py);
- ZeRO's links: a gloo all-reduce between two local processes (net_probe.py);
- interference ([Note: interference between resources] in simulate.py):
  each pair of compute, a copy and the AdamW run for a fixed time alone and
  together, from which ``slow[a<b] = (work alone / work beside b) - 1``. On
  the CPU they share the cores; a GPU's copy engines leave compute alone.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn

from ..engine.plan.costs import count_pass
from ..engine.plan.profile import Profile
from ..optim import adamw_step_
from .engine_probe import engine_overhead
from .kernel_probe import attention_rates, elementwise_rates, gemm_grid
from .net_probe import net_rates
from .perf import disk_bandwidth

__all__ = ["measure_profile", "compute_speeds", "timed"]

GEMM_SIZES = (128, 256, 512, 1024, 2048)
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], None], device: torch.device, reps: int, window: float = 0.25) -> float:
    """Mean seconds of ``fn`` over at least ``reps`` runs and ``window`` seconds, after one warm-up.

    The mean over a window, not the median of short runs: on a machine shared
    with other jobs a short run is either undisturbed or descheduled, while a
    training step of seconds meets the average share of the cores."""
    fn()
    _sync(device)
    n, t0 = 0, time.perf_counter()
    while n < reps or time.perf_counter() - t0 < window:
        fn()
        n += 1
    _sync(device)
    return (time.perf_counter() - t0) / n


def gemm_rates(device: torch.device, dtype: torch.dtype, sizes=GEMM_SIZES) -> List[List[float]]:
    """[[n, FLOP/s]] of an n x n x n matrix product, n in ``sizes`` (stops early past ~0.3 s a product)."""
    out = []
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        t = timed(lambda: torch.mm(a, b), device, 3 if n >= 1024 else 7, window=0.4)
        out.append([n, 2.0 * n ** 3 / t])
        if t > 0.3:
            break
    return out


def memory_bandwidth(device: torch.device, nbytes: int = 64 << 20) -> float:
    """Bytes/s of ``c = a + b`` over fp32 tensors (two read, one written)."""
    a = torch.randn(nbytes // 4, device=device)
    b, c = torch.randn_like(a), torch.empty_like(a)
    return 3 * nbytes / timed(lambda: torch.add(a, b, out=c), device, 5)


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.GELU()) for _ in range(8))

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x.sum()


def op_overhead(device: torch.device, dtype: torch.dtype) -> float:
    """Seconds of one op's fixed cost: a tiny model's forward + backward over its op count."""
    with torch.device("meta"):
        meta = _Tiny()
    costs = count_pass(meta, lambda m: m(torch.zeros(2, 8, device="meta", dtype=dtype)), {}, dtype)
    ops = sum(len(v) for v in costs.forward.values()) + sum(len(v) for v in costs.backward.values())
    model = _Tiny().to(device=device, dtype=dtype)
    x = torch.randn(2, 8, device=device, dtype=dtype)

    def step():
        model(x).backward()
    return timed(step, device, 20, window=1.5) / ops


def copy_rates(device: torch.device, nbytes: int = 64 << 20) -> Dict[str, float]:
    """{"h2d", "d2h"} bytes/s: pinned copies on CUDA; one worker thread's memcpy on the CPU."""
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return {"h2d": nbytes / timed(lambda: dev.copy_(host, non_blocking=True), device, 5),
                "d2h": nbytes / timed(lambda: host.copy_(dev, non_blocking=True), device, 5)}
    src, dst = torch.empty(nbytes, dtype=torch.uint8).fill_(1), torch.empty(nbytes, dtype=torch.uint8)
    rate = nbytes / _on_thread(lambda: timed(lambda: dst.copy_(src), device, 5))
    return {"h2d": rate, "d2h": rate}


def _on_thread(fn: Callable[[], float]) -> float:
    """``fn()`` run on a fresh thread with one torch thread, as the mover's workers run."""
    out: List[float] = []

    def body():
        torch.set_num_threads(1)
        out.append(fn())
    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out[0]


def adamw_rates(threads: Optional[int], n: int = 1 << 22) -> Dict[str, float]:
    """{grad dtype: parameters/s} of the native AdamW with the compute copy
    out in the gradients' dtype, as a run of that dtype updates (an fp32
    run writes an fp32 copy, 2 bytes a parameter more than a bf16 one; a bf16
    copy out priced fp32 runs' updates at 1.4-1.5x the engine's measured rate)."""
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    rates = {}
    for name in ("bf16", "fp32"):
        g = torch.randn(n).to(_DTYPES[name])
        out = torch.empty(n, dtype=_DTYPES[name])

        def step():
            adamw_step_([p], [g], [m], [v], step=1, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
                        outs=[out], num_threads=threads, validate=False)
        rates[name] = n / timed(step, torch.device("cpu"), 5)
    return rates


def _work_loop(fn: Callable[[], None], stop: threading.Event, counts: List[int], one_thread: bool) -> None:
    if one_thread:
        torch.set_num_threads(1)
    while not stop.is_set():
        fn()
        counts[0] += 1


def _rate_beside(main: Callable[[], None], other: Optional[Callable[[], None]], other_one_thread: bool,
                 device: torch.device, seconds: float) -> float:
    """Runs of ``main`` per second on this thread, with ``other`` looping on another thread meanwhile."""
    stop, counts = threading.Event(), [0]
    th = None
    if other is not None:
        th = threading.Thread(target=_work_loop, args=(other, stop, counts, other_one_thread))
        th.start()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        main()
        _sync(device)
        n += 1
    el = time.perf_counter() - t0
    stop.set()
    if th is not None:
        th.join()
    return n / el


def interference(device: torch.device, dtype: torch.dtype, threads: Optional[int], seconds: float = 0.4) -> Dict[str, float]:
    """slow["a<b"] for a, b in compute, h2d, d2h, optimizer (see the module docstring)."""
    n = 512
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    cb = 16 << 20
    if device.type == "cuda":
        host = torch.empty(cb, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(cb, dtype=torch.uint8, device=device)
        copy = lambda: (dev.copy_(host, non_blocking=True), _sync(device))  # noqa: E731
    else:
        src, dst = torch.empty(cb, dtype=torch.uint8).fill_(1), torch.empty(cb, dtype=torch.uint8)
        copy = lambda: dst.copy_(src)  # noqa: E731
    na = 1 << 20
    p, m, v, g = torch.randn(na), torch.zeros(na), torch.zeros(na), torch.randn(na).bfloat16()
    out = torch.empty(na, dtype=torch.bfloat16)
    adam = lambda: adamw_step_([p], [g], [m], [v], step=1, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8,  # noqa: E731
                               weight_decay=0.1, outs=[out], num_threads=threads, validate=False)
    work = {"compute": (lambda: torch.mm(a, b), False), "copy": (copy, True), "optimizer": (adam, False)}
    alone = {k: _rate_beside(f, None, False, device, seconds) for k, (f, _) in work.items()}
    slow: Dict[str, float] = {}
    for x in work:
        for y in work:
            k = max(0.0, alone[x] / _rate_beside(work[x][0], work[y][0], work[y][1], device, seconds) - 1.0)
            for rx in (("h2d", "d2h") if x == "copy" else (x,)):
                for ry in (("h2d", "d2h") if y == "copy" else (y,)):
                    if rx != ry:
                        slow[f"{rx}<{ry}"] = round(k, 3)
    # One drive serves the reads and the writes of the swap paths.
    slow.update({"disk_read<disk_write": 1.0, "disk_write<disk_read": 1.0})
    return slow


def compute_speeds(device: torch.device, dtype: str, sizes=GEMM_SIZES) -> Dict[str, object]:
    """The compute side of a profile, alone (a few seconds): ``gemm_flops``
    ({dtype: [[n, FLOP/s]]}, fp32's too), ``mem_bw`` (bytes/s) and
    ``op_overhead_s`` (s), ``param_overhead_s`` and ``engine_op_overhead_s``
    ({"forward", "backward"}: s), ``step_overhead_s`` ({"fixed", "per_tensor"}:
    s), and the kernels' rates in ``dtype`` (``gemm_shapes``, ``attention_flops``, ``op_rates``: {dtype: ...}), as
    :func:`measure_profile` measures them."""
    dt = _DTYPES[dtype]
    gemm = {dtype: gemm_rates(device, dt, sizes)}
    if dtype != "fp32":
        gemm["fp32"] = gemm_rates(device, torch.float32, sizes)
    return {"gemm_flops": gemm, "mem_bw": memory_bandwidth(device), "op_overhead_s": op_overhead(device, dt),
            **engine_overhead(device, dtype), "gemm_shapes": {dtype: gemm_grid(device, dt)},
            "attention_flops": {dtype: attention_rates(device, dt)}, "op_rates": {dtype: elementwise_rates(device, dt)}}


def measure_profile(device: torch.device, dtype: str, swap_paths: List[str], threads: Optional[int] = None,
                    disk_bytes: int = 256 << 20) -> Profile:
    """The profile of this machine for compute on ``device`` in ``dtype`` ("bf16", "fp16", "fp32")."""
    t0 = time.perf_counter()
    dt = _DTYPES[dtype]
    comp = compute_speeds(device, dtype)
    copies = copy_rates(device)
    write, read = disk_bandwidth(swap_paths, disk_bytes) if swap_paths else (1e12, 1e12)
    net_bw, net_lat = net_rates(device.type)
    prof = Profile(
        name=f"measured on this machine ({device.type}, {dtype})",
        source=f"infinity doctor --profile, {time.strftime('%Y-%m-%d %H:%M:%S')}; swap paths {swap_paths}",
        device=device.type, gemm_flops=comp["gemm_flops"], mem_bw=comp["mem_bw"],
        op_overhead_s=comp["op_overhead_s"], param_overhead_s=comp["param_overhead_s"],
        engine_op_overhead_s=comp["engine_op_overhead_s"], step_overhead_s=comp["step_overhead_s"], gemm_shapes=comp["gemm_shapes"],
        attention_flops=comp["attention_flops"], op_rates=comp["op_rates"],
        h2d_bw=copies["h2d"], d2h_bw=copies["d2h"],
        adamw_params_per_s=adamw_rates(threads), disk_read_bw=read, disk_write_bw=write,
        net_bw=net_bw, net_latency_s=net_lat,
        slow=interference(device, dt, threads))
    prof.extra["seconds_to_measure"] = round(time.perf_counter() - t0, 2)
    prof.extra["torch_threads"] = torch.get_num_threads()
    return prof
