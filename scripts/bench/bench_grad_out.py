#!/usr/bin/env python3
"""Python time on the autograd thread for gradients leaving the device:
the per-parameter path against buckets ([Note: gradients leave the device
in buckets] in infinity/engine/owners/grad_buckets.py), in one run.

Both engines train the same GPT on the same batches, steps alternating.
Every ``Engine.on_grad`` call (one per parameter: the hook's whole work, the
copy's issue included) is timed in the autograd thread's CPU time
(``time.thread_time``: its own work, not its waits for earlier copies); reported are the
median over steps of µs per unit, µs per parameter and copies issued per
step, and the ratio buckets / per-parameter. On the CPU device a "copy" is
a job handed to the mover's thread, far cheaper than CUDA's events and
stream switches, so the saving on a GPU is larger than this shows; the
bucket path is forced here with a mover that batches.

Usage: python scripts/bench/bench_grad_out.py [--layers 8 --embd 256 --steps 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import infinity  # noqa: E402
import infinity.engine.core as core  # noqa: E402
from infinity.engine.mechanism.mover import CpuMover  # noqa: E402
from infinity.models import GPT, GPTConfig  # noqa: E402


class BatchingMover(CpuMover):
    batches_grads = True


class Timed:
    """One engine with its on_grad timed."""

    def __init__(self, batching: bool, args, swap: str):
        real = core.make_mover
        core.make_mover = lambda device: BatchingMover() if batching else CpuMover()
        try:
            torch.manual_seed(0)
            cfg = GPTConfig(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.embd)
            self.model, self.opt = infinity.initialize(
                GPT(cfg), infinity.Config(device="cpu", dtype="fp32", offload_params="host",
                                          offload_optimizer="host", swap_paths=[swap]), lr=1e-3)
        finally:
            core.make_mover = real
        eng = infinity.api.engine_of(self.model)
        self.units = sum(1 for u in eng.units if u.place.trainable)
        self.params = sum(len(u.layout.trainable_slots) for u in eng.units)
        self.seconds, self.copies = 0.0, 0
        on_grad, grad_out = eng.on_grad, eng.mover.grad_out

        def timed(u, ti, p):
            t0 = time.thread_time()  # this thread's CPU time: the hook's own work, not its waits
            on_grad(u, ti, p)
            self.seconds += time.thread_time() - t0

        def counted(*a):
            self.copies += 1
            return grad_out(*a)

        eng.on_grad, eng.mover.grad_out = timed, counted  # the hooks look them up at each call

    def step(self, x, y) -> tuple:
        self.seconds, self.copies = 0.0, 0
        self.model(x, y).backward()
        self.opt.step()
        self.opt.zero_grad()
        return self.seconds, self.copies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    runs = {}
    with tempfile.TemporaryDirectory() as swap:
        runs = {"per-parameter": Timed(False, args, swap + "/a"), "buckets": Timed(True, args, swap + "/b")}
        g = torch.Generator().manual_seed(1)
        samples = {k: [] for k in runs}
        for i in range(args.steps + 2):
            x = torch.randint(0, 256, (args.batch, args.seq), generator=g)
            for k, r in runs.items():
                s, c = r.step(x, x)
                if i >= 2:  # the first steps record the trace
                    samples[k].append((s, c))
        rows = {}
        for k, r in runs.items():
            sec = statistics.median(s for s, _ in samples[k])
            copies = statistics.median(c for _, c in samples[k])
            rows[k] = sec
            print(f"{k:14s} {sec / r.units * 1e6:9.1f} µs/unit {sec / r.params * 1e6:7.1f} µs/param "
                  f"{copies:6.0f} copies/step ({r.units} units, {r.params} parameters)")
        ratio = rows["buckets"] / rows["per-parameter"]
        print(f"buckets / per-parameter (Python time on the autograd thread): {ratio:.2f}")
        for r in runs.values():
            infinity.close(r.model)


if __name__ == "__main__":
    main()
