"""Worker of tests/test_zero.py: trains through infinity with ZeRO on one rank
of a gloo group and writes what the test compares (rank 0)."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import infinity  # noqa: E402
from engine_utils import batches, small_gpt, unit_bytes  # noqa: E402


def run(rank: int, world: int, port: int, cases: list, out_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for ci, case in enumerate(cases):
            dev = 64 << 20 if case.get("params") == "none" else 8 * unit_bytes(small_gpt())
            cfg = infinity.Config(device="cpu", dtype="fp32", device_memory=dev,
                                  host_memory="256MiB", zero_stage=case["stage"],
                                  offload_params=case.get("params", "host"), overlap=case.get("overlap", "step"),
                                  max_grad_norm=case.get("clip"), grad_accumulation_steps=case.get("accum", 1))
            model, opt = infinity.initialize(small_gpt(), cfg, lr=1e-3, weight_decay=0.1)
            accum, steps = case.get("accum", 1), case["steps"]
            data = batches(steps * accum, seed=0, b=2 * world)
            losses, norms = [], []
            for step in range(steps):
                tot = 0.0
                for a in range(accum):
                    x, y = data[step * accum + a]
                    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
                    loss = model(x, y) / accum
                    loss.backward()
                    tot += loss.item()
                opt.step()
                opt.zero_grad()
                t = torch.tensor([tot])
                dist.all_reduce(t)
                losses.append(t.item() / world)
                norms.append(opt.last_grad_norm)
            full = infinity.full_state_dict(model)  # collective: every rank calls it
            s = infinity.stats(model)
            if rank == 0:
                torch.save({"losses": losses, "norms": norms, "state": full, "stats": s}, os.path.join(out_dir, f"case{ci}.pt"))
            infinity.close(model)
    finally:
        dist.destroy_process_group()


def mismatch(rank: int, world: int, port: int, out_dir: str) -> None:
    """Rank 1 builds a different model: initialize must fail on every rank."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = infinity.Config(device="cpu", dtype="fp32", host_memory="256MiB", zero_stage=1,
                              prefetch_depth=1 + rank)
        try:
            infinity.initialize(small_gpt(n_layer=8 if rank == 0 else 6), cfg)
            msg = "no error"
        except ValueError as e:
            msg = str(e)
        with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
            f.write(msg)
    finally:
        dist.destroy_process_group()
