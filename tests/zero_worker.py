"""Worker of tests/test_zero.py: trains through infinity with ZeRO on one rank
of a gloo group and writes what the test compares (rank 0)."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import infinity  # noqa: E402
from engine_utils import batches, small_gpt, unit_bytes  # noqa: E402


def _init(rank: int, world: int, port: int, **kw) -> None:
    """Joins the gloo group of ``world`` processes on localhost:``port``."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, **kw)


def run(rank: int, world: int, port: int, cases: list, out_dir: str, group_size: int = 0) -> None:
    """Trains each case; with ``group_size``, the world splits into groups of
    that many consecutive ranks, each data-parallel on its own (initialize's
    process_group), and each group's first rank writes case{i}_g{group}.pt."""
    torch.set_num_threads(1)
    _init(rank, world, port)
    group, gid, suffix = None, 0, ""
    if group_size:
        for g in range(world // group_size):  # every rank creates every group
            pg = dist.new_group(list(range(g * group_size, (g + 1) * group_size)))
            if rank // group_size == g:
                group, gid = pg, g
        suffix = f"_g{gid}"
    grank, gworld = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (rank, world)
    try:
        for ci, case in enumerate(cases):
            dev = 64 << 20 if case.get("params") == "none" else 8 * unit_bytes(small_gpt())
            cfg = infinity.Config(device="cpu", dtype="fp32", device_memory=dev,
                                  host_memory=case.get("host_units", 0) * unit_bytes(small_gpt()) or "256MiB",
                                  zero_stage=case["stage"],
                                  offload_params=case.get("params", "host"), overlap=case.get("overlap", "step"),
                                  offload_optimizer=case.get("opt", "host"),
                                  swap_paths=[os.path.join(out_dir, f"swap{ci}")],
                                  max_grad_norm=case.get("clip"), grad_accumulation_steps=case.get("accum", 1))
            model, opt = infinity.initialize(small_gpt(n_layer=case.get("layers", 8)), cfg, lr=1e-3,
                                             weight_decay=0.1, process_group=group)
            accum, steps = case.get("accum", 1), case["steps"]
            data = batches(steps * accum, seed=0, b=2 * gworld)
            losses, norms = [], []
            for step in range(steps):
                tot = 0.0
                for a in range(accum):
                    x, y = data[step * accum + a]
                    x, y = x.chunk(gworld)[grank], y.chunk(gworld)[grank]
                    loss = model(x, y) / accum
                    loss.backward()
                    tot += loss.item()
                opt.step()
                opt.zero_grad()
                t = torch.tensor([tot])
                dist.all_reduce(t, group=group)
                losses.append(t.item() / gworld)
                norms.append(opt.last_grad_norm)
            full = infinity.full_state_dict(model)  # collective: every rank of the group calls it
            s = infinity.stats(model)
            if grank == 0:
                torch.save({"losses": losses, "norms": norms, "state": full, "stats": s},
                           os.path.join(out_dir, f"case{ci}{suffix}.pt"))
            infinity.close(model)
    finally:
        dist.destroy_process_group()


def mismatch(rank: int, world: int, port: int, out_dir: str) -> None:
    """Rank 1 builds a different model: initialize must fail on every rank."""
    _init(rank, world, port)
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


def crash(rank: int, world: int, port: int, out_dir: str) -> None:
    """Rank 1 raises in the middle of a step; rank 0 must fail too, soon."""
    import datetime
    import time
    _init(rank, world, port, timeout=datetime.timedelta(seconds=60))
    cfg = infinity.Config(device="cpu", dtype="fp32", host_memory="256MiB", zero_stage=2, overlap="backward")
    model, opt = infinity.initialize(small_gpt(), cfg)
    x, y = batches(1, b=world)[0]
    t0 = time.perf_counter()
    try:
        for step in range(3):
            loss = model(x.chunk(world)[rank], y.chunk(world)[rank])
            if rank == 1 and step == 1:
                raise RuntimeError("injected failure on rank 1")
            loss.backward()
            opt.step()
            opt.zero_grad()
        msg = "finished"
    except Exception as e:  # noqa: BLE001 - the test reads what each rank saw
        msg = f"{type(e).__name__}: {e}"
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{time.perf_counter() - t0:.1f}\n{msg}")
    os._exit(0)  # like a crashed job: no orderly shutdown
