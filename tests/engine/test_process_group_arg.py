"""initialize(process_group=...) takes a ProcessGroup or a one-dimensional
DeviceMesh (the data-parallel dimension of a larger mesh); anything else is
refused by name before the model is touched. A world of one gloo rank in
this process: the groups themselves are tested on 2 and 4 ranks in
test_zero.py."""

import pytest
import torch
import torch.distributed as dist

import infinity
from engine_utils import batches, small_gpt

device_mesh = pytest.importorskip("torch.distributed.device_mesh")


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _train(process_group) -> list:
    torch.manual_seed(0)
    model, opt = infinity.initialize(small_gpt(n_layer=2), infinity.Config(device="cpu", dtype="fp32", zero_stage=2),
                                     lr=1e-3, process_group=process_group)
    losses = []
    for x, y in batches(2):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = infinity.full_state_dict(model)
    assert infinity.stats(model)["world_size"] == 1
    infinity.close(model)
    return losses, state


def test_a_mesh_dimension_trains_as_its_group(world_of_one):
    mesh = device_mesh.init_device_mesh("cpu", (1, 1), mesh_dim_names=("tp", "dp"))
    with pytest.raises(ValueError, match=r"2-dimensional DeviceMesh.*\('tp', 'dp'\).*mesh\['dp'\]"):
        infinity.initialize(small_gpt(), infinity.Config(device="cpu"), process_group=mesh)
    with pytest.raises(TypeError, match="process_group must be .*got str"):
        infinity.initialize(small_gpt(), infinity.Config(device="cpu"), process_group="dp")
    by_mesh = _train(mesh["dp"])
    by_group = _train(mesh["dp"].get_group())
    assert by_mesh[0] == by_group[0]
    assert all(torch.equal(by_mesh[1][k], v) for k, v in by_group[1].items())


def _clock_threads() -> int:
    import threading
    return sum(t.name == "infinity-comm-clock" for t in threading.enumerate())


def test_close_ends_the_collectives_clock_thread(world_of_one):
    """The thread that times asynchronous collectives ([Note: exposed
    communication time]) is the engine's: it ends at close, so a process that
    initializes again and again does not gather threads."""
    before = _clock_threads()
    for _ in range(3):
        torch.manual_seed(0)
        model, opt = infinity.initialize(small_gpt(n_layer=2), infinity.Config(device="cpu", dtype="fp32",
                                                                               zero_stage=3), lr=1e-3)
        for x, y in batches(2):
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        assert _clock_threads() == before + 1  # the collectives are timed on it
        eng = infinity.api.engine_of(model)
        infinity.close(model)
        assert _clock_threads() == before
        assert eng.stats.comm_seconds > 0  # close timed every collective queued before it ended the thread
