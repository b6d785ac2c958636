"""Worker of tests/engine/test_zero.py: trains through infinity with ZeRO on one rank
of a gloo group and writes what the test compares (rank 0)."""

import contextlib
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import infinity  # noqa: E402
from engine_utils import batches, small_gpt, unequal_net, unit_bytes  # noqa: E402


def _emulated(on: bool):
    """Engines built inside use tests/cuda_emulator.py's LazyMover when ``on``."""
    if not on:
        return contextlib.nullcontext()
    from cuda_emulator import emulated_cuda_ordering
    return emulated_cuda_ordering()


@contextlib.contextmanager
def _reduce_on(where):
    """``where="host"``: engines built inside reduce gradients and gather
    stages 1-2's updated copies on the host even where placement.py would
    do it on the device (the reference of the device path's parity tests);
    None: as placement.py decides."""
    from infinity.engine.plan import placement
    real = placement.host_reduction_reason, placement.host_gather_reason
    if where == "host":
        placement.host_reduction_reason = lambda *a: "forced by the test"
        placement.host_gather_reason = lambda *a: "forced by the test"
    try:
        yield
    finally:
        placement.host_reduction_reason, placement.host_gather_reason = real


def model_of(case: dict):
    """small_gpt, or with ``case["model"] == "unequal"`` a stack of MLP units
    of unequal sizes (``"chunky"``: units of several state chunks, test_state_chunks.py)."""
    if case.get("model") == "unequal":
        return unequal_net()
    if case.get("model") == "chunky":
        return unequal_net(hidden=(8000, 40, 3000))
    return small_gpt(n_layer=case.get("layers", 8))


def _init(rank: int, world: int, rdzv: str, **kw) -> None:
    """Joins the gloo group of ``world`` processes through the FileStore at
    ``rdzv`` (a path no other spawn uses)."""
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world, **kw)


def run(rank: int, world: int, rdzv: str, cases: list, out_dir: str, group_size: int = 0) -> None:
    """Trains each case; with ``group_size``, the world splits into groups of
    that many consecutive ranks, each data-parallel on its own (initialize's
    process_group), and each group's first rank writes case{i}_g{group}.pt."""
    torch.set_num_threads(1)
    _init(rank, world, rdzv)
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
            dev = 64 << 20 if case.get("params") == "none" or case.get("model") == "chunky" else 8 * unit_bytes(small_gpt())
            cfg = infinity.Config(device="cpu", dtype=case.get("dtype", "fp32"), device_memory=dev,
                                  host_memory=case.get("host_units", 0) * unit_bytes(small_gpt()) or "256MiB",
                                  zero_stage=case["stage"],
                                  offload_params=case.get("params", "host"), overlap=case.get("overlap", "step"),
                                  offload_optimizer=case.get("opt", "host"),
                                  swap_paths=[os.path.join(out_dir, f"swap{ci}")],
                                  max_grad_norm=case.get("clip"), grad_accumulation_steps=case.get("accum", 1),
                                  moment_dtype=case.get("moment_dtype", "fp32"),
                                  master_dtype=case.get("master_dtype", "fp32"), seed=case.get("seed", 0),
                                  state_chunk_bytes=case.get("state_chunk", "64MiB"))
            with _emulated(case.get("emulate", False)) as movers, _reduce_on(case.get("reduce")):
                model, opt = infinity.initialize(model_of(case), cfg, lr=1e-3, weight_decay=0.1, process_group=group)
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
            # The parameters as torch reads them (the compute copies; full_state_dict reads the masters).
            seen = {k: v.detach().clone() for k, v in model.state_dict().items()}
            osd = opt.state_dict() if "moment_dtype" in case else None  # collective too
            eng = infinity.api.engine_of(model)
            # Every collective issued so far timed, whenever the clock thread got the CPU: the totals read are final.
            eng.sharding.clock.close()
            s = infinity.stats(model)
            s["emulated_copies"] = sum(st.ran for m in movers or [] for st in m.streams)
            s["unit_numels"] = [(u.place.trainable_numel, u.place.compute_numel) for u in eng.units]
            s["reduce_on_device"] = eng.modes.reduce_on_device
            s["gather_on_device"] = eng.modes.gather_on_device
            s["state_chunks"] = [len(u.place.windows) for u in eng.units]
            if grank == 0:
                torch.save({"losses": losses, "norms": norms, "state": full, "stats": s, "optimizer": osd, "seen": seen},
                           os.path.join(out_dir, f"case{ci}{suffix}.pt"))
            infinity.close(model)
    finally:
        dist.destroy_process_group()


def mismatch(rank: int, world: int, rdzv: str, out_dir: str) -> None:
    """Rank 1 builds a different model: initialize must fail on every rank."""
    _init(rank, world, rdzv)
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


def crash(rank: int, world: int, rdzv: str, out_dir: str) -> None:
    """Rank 1 raises in the middle of a step; rank 0 must fail too, soon:
    from rank 1's exit, long before the collectives' timeout (300 s here, so
    a loaded machine's slow steps are never taken for a hang)."""
    import datetime
    import time
    _init(rank, world, rdzv, timeout=datetime.timedelta(seconds=300))
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


def collectives(rank: int, world: int, rdzv: str, group_size: int = 0) -> None:
    """Sharding's collectives through the default group and through a gloo
    host group made for it (forced: gloo serves CPU tensors, so none would be
    made), sync against async; with ``group_size``, in subgroups of that many
    ranks, each with its own host group. Raises on any mismatch."""
    from infinity.engine.mechanism import zero
    from infinity.engine.mechanism.mover import CpuMover
    from infinity.engine.stats import Stats
    torch.set_num_threads(1)
    _init(rank, world, rdzv)
    group, ranks = None, list(range(world))
    for g in range(world // group_size if group_size else 0):  # every rank creates every group
        members = list(range(g * group_size, (g + 1) * group_size))
        pg = dist.new_group(members)
        if rank in members:
            group, ranks = pg, members
    try:
        plain = zero.Sharding(1, Stats(), group=group)
        assert plain.host_group is group  # gloo serves CPU tensors: no second group
        zero.backend_serves_cpu = lambda backend: False  # as under NCCL: a host group is made
        forced = zero.Sharding(1, Stats(), group=group)
        assert forced.host_group is not group and dist.get_process_group_ranks(forced.host_group) == ranks
        assert zero.Sharding(1, Stats(), group=group).host_group is forced.host_group  # made once, reused
        mover = CpuMover()
        for s in (plain, forced):
            _check_collectives(s, ranks, mover)
        mover.close()
        del plain, forced, s
    finally:
        # The host group made here is freed by destroy_process_group, not by
        # the interpreter's teardown (a gloo group freed then aborted rank 1 in CI).
        zero._HOST_GROUPS.clear()
        dist.barrier()  # no rank tears its groups down while another still uses them
        dist.destroy_process_group()


def _check_collectives(s, ranks: list, mover) -> None:
    world, me = len(ranks), ranks.index(dist.get_rank())
    full = torch.arange(8.0 * world) * (me + 1)
    total = torch.arange(8.0 * world) * sum(range(1, world + 1))
    out_sync, out_async = torch.empty(8), torch.empty(8)
    s.reduce_scatter(out_sync, full)
    ticket = s.reduce_scatter(out_async, full.clone(), async_op=True)
    ticket.wait()
    assert ticket.done(), "a waited ticket is done"
    assert torch.equal(out_sync, total[me * 8:(me + 1) * 8]), (out_sync, total)
    assert torch.equal(out_sync, out_async), (out_sync, out_async)
    host_out, dev_out = torch.empty(8), torch.empty(8)  # the device path: reduce-scatter, then the shard's copy
    before = dict(s.stats.bytes_moved)
    ticket = s.reduce_to_host(host_out, full.clone(), dev_out, mover)
    ticket.wait()
    assert ticket.done() and ticket.keep == () and torch.equal(host_out, out_sync), (host_out, out_sync)
    sent = s.stats.bytes_moved["net_device"] - before.get("net_device", 0)
    assert sent == full.numel() * 4 * (world - 1) // world, sent  # the ring's share of the buffer
    a, b = full.clone(), full.clone()
    s.all_reduce_(a)
    ticket = s.all_reduce_(b, async_op=True)
    ticket.wait()
    assert torch.equal(a, b) and torch.equal(a, total)
    assert s.sum(me + 0.5) == sum(r + 0.5 for r in range(world))
    s.check_same({"same": 1})
    trainable, numel = 6 * world, 10 * world  # a trainable and a frozen region, as in stage 3
    model = torch.arange(float(numel))
    shard = torch.cat([model[a + me * k:a + (me + 1) * k] for a, b, k in s._param_regions(numel, trainable)])
    inline, copied = torch.zeros(numel), torch.zeros(numel)
    s.gather_units_params(inline, shard, trainable).wait()
    s.gather_units_params(copied, shard, trainable, h2d=mover.h2d).wait()
    assert torch.equal(inline, model) and torch.equal(copied, model)
