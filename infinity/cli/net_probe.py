"""The network figures of ``infinity doctor --profile``: a ring all-reduce
between two local processes, timed ([Note: collectives in the step model]
in infinity/engine/plan/collectives.py reads them).

Two fresh interpreters (importing torch only, not infinity, to start in a
few seconds) join a gloo group through a FileStore and time an all-reduce
of 4 bytes (the latency: the median of 30) and of ``nbytes`` (the median of
5). A rank sends ``2 (N-1)/N`` of the buffer per all-reduce, so the rate is
those bytes over the big all-reduce's time less the latency. On the CPU
device both groups are this gloo group; on CUDA the device group is NCCL,
probed the same way on two GPUs when the machine has them (else left out:
a prediction on several ranks then names the missing figure).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Dict, Tuple

__all__ = ["net_rates"]

_WORKER = r"""
import json, statistics, sys, time, torch, torch.distributed as dist
rank, world, store, nbytes, backend, out = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6]
rank, world = int(rank), int(world)
torch.set_num_threads(1)
dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
if dev.type == "cuda":
    torch.cuda.set_device(dev)
dist.init_process_group(backend, init_method="file://" + store, rank=rank, world_size=world)
def timed(t, reps):
    ts = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
small, big = torch.zeros(1, device=dev), torch.zeros(nbytes // 4, device=dev)
timed(big, 2)
lat, t = timed(small, 30), timed(big, 5)
if rank == 0:
    json.dump({"latency": lat, "seconds": t}, open(out, "w"))
dist.destroy_process_group()
"""


def _probe(backend: str, nbytes: int, world: int = 2, timeout: float = 60.0) -> Tuple[float, float]:
    """``(bytes/s a rank sends, latency s)`` of a ``backend`` all-reduce on ``world`` local processes."""
    with tempfile.TemporaryDirectory() as d:
        store, out = os.path.join(d, "store"), os.path.join(d, "out.json")
        procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(r), str(world), store, str(nbytes), backend,
                                   out], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for r in range(world)]
        errs = []
        for p in procs:
            try:
                errs.append(p.communicate(timeout=timeout)[1].decode(errors="replace"))
            except subprocess.TimeoutExpired:
                p.kill()
                errs.append("timed out")
        if any(p.returncode for p in procs) or not os.path.exists(out):
            raise RuntimeError(f"the {backend} all-reduce probe failed: {errs[0][-500:] or errs[-1][-500:]}")
        r = json.load(open(out))
    sent = 2 * nbytes * (world - 1) / world
    return sent / max(r["seconds"] - r["latency"], 1e-9), r["latency"]


def net_rates(device_type: str, nbytes: int = 32 << 20) -> Tuple[Dict[str, float], Dict[str, float]]:
    """``(net_bw, net_latency_s)`` for a Profile: "net_host" from a gloo
    probe; "net_device" the same on the CPU device, NCCL's on two GPUs."""
    bw, lat = _probe("gloo", nbytes)
    rates, lats = {"net_host": bw}, {"net_host": lat}
    if device_type == "cpu":
        rates["net_device"], lats["net_device"] = bw, lat
    else:
        import torch
        if torch.cuda.device_count() >= 2:
            rates["net_device"], lats["net_device"] = _probe("nccl", nbytes)
    return rates, lats
