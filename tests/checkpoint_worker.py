"""Worker of tests/checkpoint/test_checkpoint_zero.py: one phase of a checkpointed run on
``world`` gloo ranks (spawned by torch.multiprocessing)."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from engine_utils import batches, small_gpt, unit_bytes  # noqa: E402
from zero_worker import _init  # noqa: E402

import infinity  # noqa: E402
from infinity.checkpoint import safetensors_io  # noqa: E402

# Small chunk sums, so the small test model's tensors are read by ranges (see read_range).
if os.environ.get("INFINITY_TEST_CHUNK_BYTES"):
    safetensors_io.CHUNK_BYTES = int(os.environ["INFINITY_TEST_CHUNK_BYTES"])

GLOBAL_BATCH = 4  # split over the ranks: the same global batch at any world size


def phase(rank: int, world: int, rdzv: str, cases: list, out_dir: str, which: str, k: int) -> None:
    """``which``: "full" (2k steps), "first" (k steps, then a checkpoint) or
    "rest" (the checkpoint loaded, then steps k..2k). Each case (stage,
    params, opt, name) writes ``{name}-{which}.pt`` from rank 0: the losses
    (averaged over ranks) and the full state dict."""
    torch.set_num_threads(1)
    _init(rank, world, rdzv)
    try:
        for case in cases:
            _run_case(rank, world, case, out_dir, which, k)
    finally:
        dist.destroy_process_group()


def _run_case(rank, world, case, out_dir, which, k) -> None:
    name = case["name"]
    params = case.get("params", "host")
    dev = 64 << 20 if params == "none" else 8 * unit_bytes(small_gpt())
    cfg = infinity.Config(device="cpu", dtype="fp32", device_memory=dev, host_memory="256MiB",
                          zero_stage=case["stage"], offload_params=params, offload_optimizer=case.get("opt", "host"),
                          overlap=case.get("overlap", "step"),
                          swap_paths=[os.path.join(out_dir, f"swap-{name}-{which}")])
    model, opt = infinity.initialize(small_gpt(), cfg, lr=1e-3, weight_decay=0.1)
    data = batches(2 * k, seed=0, b=GLOBAL_BATCH)
    ck = os.path.join(out_dir, f"ck-{name}")
    read = _count_reads()
    start = infinity.load_checkpoint(ck, model, opt)["next"] if which == "rest" else 0
    read_bytes, total = read[0], _checkpoint_bytes(ck) if which == "rest" else 0
    end = k if which == "first" else 2 * k
    losses = []
    for step in range(start, end):
        x, y = data[step]
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = torch.tensor([loss.item()])
        dist.all_reduce(t)
        losses.append(t.item() / world)
    if which == "first":
        infinity.save_checkpoint(ck, model, opt, extra={"next": k})
    full = infinity.full_state_dict(model)  # collective
    if rank == 0:
        torch.save({"losses": losses, "state": full, "read_bytes": read_bytes, "checkpoint_bytes": total},
                   os.path.join(out_dir, f"{name}-{which}.pt"))
    infinity.close(model)


def _count_reads() -> list:
    """From now on, the tensor bytes this rank reads from checkpoints ([0]),
    through either of DirectReader's reads."""
    import threading
    from infinity.checkpoint.direct_stream import DirectReader
    count, lock = [0], threading.Lock()  # the load's threads read too: no increment lost to another's
    read_into = getattr(DirectReader.read_into, "__wrapped__", DirectReader.read_into)
    submit = getattr(DirectReader.submit, "__wrapped__", DirectReader.submit)

    def counted_read_into(self, offset, dst):
        got = read_into(self, offset, dst)
        with lock:
            count[0] += got
        return got

    def counted_submit(self, offset, dst):
        pending = submit(self, offset, dst)
        with lock:
            count[0] += pending.nbytes
        return pending
    counted_read_into.__wrapped__, counted_submit.__wrapped__ = read_into, submit
    DirectReader.read_into, DirectReader.submit = counted_read_into, counted_submit
    return count


def _checkpoint_bytes(ck: str) -> int:
    from infinity.checkpoint import layout
    path = layout.resolve(ck)
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def state_dict_phase(rank: int, world: int, rdzv: str, stages: list, out_dir: str) -> None:
    """Issue 23 under ZeRO: ``model.state_dict()`` and ``load_state_dict()``
    called on every rank give and take the true values; one parameter read
    outside forward under ZeRO-3 raises naming state_dict(). Rank 0 writes
    ``sd-{stage}.pt``: the state dict after a step, the full state dict after
    loading, and whether the read raised."""
    torch.set_num_threads(1)
    _init(rank, world, rdzv)
    try:
        for stage in stages:
            cfg = infinity.Config(device="cpu", dtype="fp32", device_memory=8 * unit_bytes(small_gpt()),
                                  host_memory="256MiB", zero_stage=stage, offload_params="host",
                                  offload_optimizer="host", swap_paths=[os.path.join(out_dir, f"swap-sd{stage}")])
            model, opt = infinity.initialize(small_gpt(), cfg, lr=1e-3)
            x, y = batches(1, seed=0, b=GLOBAL_BATCH)[0]
            model(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
            opt.step()
            opt.zero_grad()
            after_step = model.state_dict()
            master = infinity.full_state_dict(model)  # collective: every rank
            other = small_gpt()
            with torch.no_grad():
                for p in other.parameters():
                    p.mul_(-3.0)
            model.load_state_dict(other.state_dict())
            loaded = infinity.full_state_dict(model)
            try:
                next(model.parameters()).sum()
                read_raised = False
            except infinity.engine.faults.UsageError as e:
                read_raised = "state_dict" in str(e)
            if rank == 0:
                torch.save({"after_step": after_step, "master": master, "loaded": loaded,
                            "want": other.state_dict(), "read_raised": read_raised},
                           os.path.join(out_dir, f"sd-{stage}.pt"))
            infinity.close(model)
    finally:
        dist.destroy_process_group()


def locked_phase(rank: int, world: int, rdzv: str, out_dir: str) -> None:
    """Issue 34: another saver holds the checkpoint folder's lock (taken
    here by rank 0 on its own descriptor, as a second job's rank 0 would).
    Every rank's ``save_checkpoint`` must raise (rank 0 naming the lock, the
    others naming rank 0) instead of waiting in the gathers; then a save
    after the lock is dropped succeeds. Each rank writes ``locked-{rank}.txt``."""
    from infinity.checkpoint import owner
    torch.set_num_threads(1)
    _init(rank, world, rdzv)
    try:
        cfg = infinity.Config(device="cpu", dtype="fp32", device_memory=8 * unit_bytes(small_gpt()),
                              host_memory="256MiB", zero_stage=3, offload_params="host", offload_optimizer="host",
                              swap_paths=[os.path.join(out_dir, "swap-locked")])
        model, opt = infinity.initialize(small_gpt(), cfg, lr=1e-3)
        x, y = batches(1, seed=0, b=GLOBAL_BATCH)[0]
        model(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
        opt.step()
        ck = os.path.join(out_dir, "ck-locked")
        held = None
        if rank == 0:
            owner.make_root(ck, "test")
            held = owner.SaveLock(ck)
        try:
            infinity.save_checkpoint(ck, model, opt)
            outcome = "saved"
        except Exception as e:  # noqa: BLE001 - the test reads the type and message
            outcome = f"{type(e).__name__}: {e}"
        if held is not None:
            held.release()
        infinity.save_checkpoint(ck, model, opt)  # the lock is free now
        with open(os.path.join(out_dir, f"locked-{rank}.txt"), "w") as f:
            f.write(outcome + "\n" + ",".join(sorted(os.listdir(ck))))
        infinity.close(model)
    finally:
        dist.destroy_process_group()
