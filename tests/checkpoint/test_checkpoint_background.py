"""save_checkpoint(blocking=False) (issue 19): the checkpoint written while
training goes on holds exactly the state at the call, byte for byte what a
blocking save writes, across placements and overlap modes, while the next
steps' updates wait for it; a failure is raised by wait(), warned about at
the next step if never waited for, and loses nothing saved."""

import errno
import json
import os
import threading
import time

import pytest
import torch
from safetensors.torch import load_file
from test_checkpoint import data, make, train

import infinity
from infinity.checkpoint import owner, save
from infinity.engine.faults import UsageError


def _slow_writes(monkeypatch, seconds=0.004, hold=None):
    """Each tensor's write takes a while: the next steps run into the save's
    fence. ``hold`` (a threading.Event): no tensor is written before it is
    set, so "not done yet" is a state, not a race with a loaded machine."""
    def hook(point):
        if point == "tensor":
            if hold is not None:
                assert hold.wait(300), "the test never let the save write"
            time.sleep(seconds)
    monkeypatch.setattr(save, "test_hook", hook)


def _contents(path):
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update({f"{name}:{k}": v for k, v in load_file(os.path.join(path, name)).items()})
    manifest = json.loads((path / "manifest.json").read_text())
    return out, {k: manifest[k] for k in ("step", "param_steps", "param_groups", "rng", "extra")}


@pytest.mark.parametrize("params,opt,overlap", [("host", "host", "step"), ("host", "host", "backward"),
                                                ("nvme", "nvme", "step"), ("nvme", "nvme", "backward"),
                                                ("host", "nvme", "backward"), ("none", "host", "step")])
def test_background_save_is_the_state_at_the_call(tmp_path, monkeypatch, params, opt, overlap):
    batches = data(6)
    m, o, _ = make(tmp_path, "sync", params, opt, overlap)
    train(m, o, None, batches[:3])
    want = infinity.save_checkpoint(tmp_path / "sync", m, o, extra={"next": 3})
    infinity.close(m)

    hold = threading.Event()
    _slow_writes(monkeypatch, hold=hold)
    m, o, _ = make(tmp_path, "bg", params, opt, overlap)
    train(m, o, None, batches[:3])
    pending = infinity.save_checkpoint(tmp_path / "bg", m, o, extra={"next": 3}, blocking=False)
    assert isinstance(pending, infinity.AsyncCheckpoint) and not pending.done()
    hold.set()
    train(m, o, None, batches[3:])  # three more steps while it writes: their updates wait for it
    got = pending.wait()
    assert got.name == want.name
    after = infinity.full_state_dict(m)
    infinity.close(m)
    tensors, meta = _contents(got)
    ref_tensors, ref_meta = _contents(want)
    assert meta == ref_meta or {k: v for k, v in meta.items() if k != "rng"} == \
        {k: v for k, v in ref_meta.items() if k != "rng"}
    assert tensors.keys() == ref_tensors.keys()
    for k in ref_tensors:
        assert torch.equal(tensors[k], ref_tensors[k]), k
    assert infinity.verify_checkpoint(got)
    # ... and training after the call went on from the same state: it equals a run never saved.
    m, o, _ = make(tmp_path, "plain", params, opt, overlap)
    train(m, o, None, batches)
    plain = infinity.full_state_dict(m)
    infinity.close(m)
    assert all(torch.equal(after[k], plain[k]) for k in plain)


def test_background_save_resumes_exactly(tmp_path, monkeypatch):
    _slow_writes(monkeypatch)
    batches = data(6)
    m, o, _ = make(tmp_path, "ref", "nvme", "nvme", "backward")
    ref = train(m, o, None, batches)
    infinity.close(m)
    m, o, _ = make(tmp_path, "a", "nvme", "nvme", "backward")
    first = train(m, o, None, batches[:3])
    pending = infinity.save_checkpoint(tmp_path / "ck", m, o, extra={"next": 3}, blocking=False)
    train(m, o, None, batches[3:4])
    infinity.close(m)  # waits for the save first
    assert pending.done()
    m, o, _ = make(tmp_path, "b", "nvme", "nvme", "backward")
    extra = infinity.load_checkpoint(tmp_path / "ck", m, o)
    rest = train(m, o, None, batches[extra["next"]:])
    infinity.close(m)
    assert first + rest == ref


def _fail_writes(monkeypatch):
    def hook(point):
        if point == "tensor":
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
    monkeypatch.setattr(save, "test_hook", hook)


def test_a_failed_background_save_is_raised_by_wait_and_keeps_the_run(tmp_path, monkeypatch):
    m, o, _ = make(tmp_path, "f", "host", "nvme", "backward")
    train(m, o, None, data(2))
    first = infinity.save_checkpoint(tmp_path / "ck", m, o)
    _fail_writes(monkeypatch)
    pending = infinity.save_checkpoint(tmp_path / "ck", m, o, step=99, blocking=False)
    train(m, o, None, data(3)[2:])  # the run goes on
    with pytest.raises(infinity.CheckpointSpaceError, match="partial checkpoint was removed"):
        pending.wait()
    assert sorted(os.listdir(tmp_path / "ck")) == [owner.LOCK_NAME, first.name]  # nothing partial left, the first intact
    monkeypatch.setattr(save, "test_hook", None)
    again = infinity.save_checkpoint(tmp_path / "ck", m, o)  # already reported: not raised again
    assert infinity.verify_checkpoint(again) and infinity.verify_checkpoint(first)
    infinity.close(m)


def test_a_failed_background_save_never_waited_for_is_said_at_the_next_step(tmp_path, monkeypatch):
    m, o, _ = make(tmp_path, "w", "host", "host")
    train(m, o, None, data(1))
    _fail_writes(monkeypatch)
    pending = infinity.save_checkpoint(tmp_path / "ck", m, o, blocking=False)
    while not pending.done():
        time.sleep(0.01)
    with pytest.warns(RuntimeWarning, match="background checkpoint .* failed"):
        train(m, o, None, data(2)[1:])
    infinity.close(m)


def test_background_save_is_refused_under_zero(tmp_path):
    import torch.distributed as dist
    from test_checkpoint import model
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", world_size=1, rank=0)
    try:
        cfg = infinity.Config(device="cpu", dtype="fp32", zero_stage=1, host_memory="64MiB", device_memory=1 << 20,
                              swap_paths=[str(tmp_path / "swap")])
        m, o = infinity.initialize(model(), cfg, lr=1e-2)
        train(m, o, None, data(1))
        with pytest.raises(UsageError, match="ZeRO stage 0.*blocking=True"):
            infinity.save_checkpoint(tmp_path / "ck", m, o, blocking=False)
        assert not (tmp_path / "ck").exists()  # refused before anything was written
        infinity.close(m)
    finally:
        dist.destroy_process_group()


class CountingChain(torch.nn.Module):
    """A model whose buffer changes in every forward (as BatchNorm's running statistics do)."""

    def __init__(self):
        super().__init__()
        from test_checkpoint import model
        self.net = model()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x, y):
        self.seen += 1
        return self.net(x, y)


def test_buffers_changed_by_forward_are_saved_as_at_the_call(tmp_path, monkeypatch):
    from paging_zoo import base_config
    _slow_writes(monkeypatch)
    cfg = infinity.Config(**base_config(offload_params="host", offload_optimizer="host", device_memory=1 << 20,
                                        swap_paths=[str(tmp_path / "swap")]))
    m, o = infinity.initialize(CountingChain(), cfg, lr=1e-2)
    train(m, o, None, data(2))
    pending = infinity.save_checkpoint(tmp_path / "ck", m, o, blocking=False)
    train(m, o, None, data(3)[2:])
    path = pending.wait()
    assert float(m.seen) == 3.0
    assert float(load_file(os.path.join(path, "model-00001-of-00001.safetensors"))["seen"]) == 2.0
    infinity.close(m)


@pytest.mark.parametrize("overlap,clip", [("step", None), ("backward", None), ("backward", 1.0)])
def test_a_save_streams_unit_by_unit_in_update_order_and_the_fence_lifts_early(tmp_path, overlap, clip):
    """Each unit's weights and moments are written together, the units in the
    order their updates came in the last step (overlap="backward" updates during
    backward, in reverse program order, speculatively with clipping; overlap="step"
    in program order): the first update waits for its own unit only."""
    from infinity.api import engine_of
    from infinity.checkpoint.background import SaveFence
    from infinity.checkpoint.plan import SlotSource, plan_checkpoint
    m, o, _ = make(tmp_path, "x", "nvme", "nvme", overlap, clip=clip)
    train(m, o, None, data(1))
    plan = plan_checkpoint(m, engine_of(m))
    order = [src.u.index for _, (_, _, _, src) in plan.stream() if isinstance(src, SlotSource)]
    runs = [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k]
    units = [u.index for u in engine_of(m).units if u.layout.slots]
    early = overlap == "backward"
    if early and clip is not None:  # See [Note: speculation with NVMe parameters]
        assert infinity.stats(m)["speculation"]["steps"] == 1
    assert runs == (units[::-1] if early else units)  # contiguous, in update order
    fence, lifted = SaveFence(plan), []  # (unit, items written when its fence lifted)
    for n, (_, (_, _, _, src)) in enumerate(plan.stream()):
        fence.item_done(src)
        if isinstance(src, SlotSource) and src.u.index not in fence._left and src.u.index not in dict(lifted):
            lifted.append((src.u.index, n + 1))
    first_unit, after = lifted[0]
    assert first_unit == runs[0] and after < len(plan.stream()) / 2  # released before half the items
    infinity.close(m)
