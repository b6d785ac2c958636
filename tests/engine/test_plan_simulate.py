"""The step simulator (engine/plan/simulate.py) on hand-made schedules whose
answers are known exactly."""

import pytest

from infinity.engine.plan.simulate import Simulation


def test_serial_chain_adds_up():
    sim = Simulation()
    a = sim.add("read", "disk", 2.0, "nvme_read")
    b = sim.add("copy", "h2d", 1.0, "h2d", [a])
    sim.add("fwd", "compute", 3.0, "compute", [b])
    r = sim.run()
    assert r.makespan == pytest.approx(6.0)
    assert r.exposed == pytest.approx({"nvme_read": 2.0, "h2d": 1.0, "compute": 3.0})
    assert r.bound == "compute"
    assert [(t.start, t.end) for t in r.tasks] == [(0.0, 2.0), (2.0, 3.0), (3.0, 6.0)]


def test_perfectly_overlapped_pipeline_hides_the_copies():
    # Copy i+1 runs while unit i computes: only the first copy is exposed.
    sim = Simulation()
    copies = [sim.add(f"copy{i}", "h2d", 1.0, "h2d") for i in range(5)]
    prev = None
    for i, c in enumerate(copies):
        prev = sim.add(f"fwd{i}", "compute", 1.0, "compute", [c, prev])
    r = sim.run()
    assert r.makespan == pytest.approx(6.0)
    assert r.exposed == pytest.approx({"h2d": 1.0, "compute": 5.0})
    assert r.busy == pytest.approx({"h2d": 5.0, "compute": 5.0})


def test_slow_copies_bound_the_pipeline():
    sim = Simulation()
    copies = [sim.add(f"copy{i}", "h2d", 2.0, "h2d") for i in range(4)]
    prev = None
    for i, c in enumerate(copies):
        prev = sim.add(f"fwd{i}", "compute", 1.0, "compute", [c, prev])
    r = sim.run()
    assert r.makespan == pytest.approx(9.0)  # 4 copies back to back, then the last unit's compute
    assert r.bound == "h2d"
    assert r.exposed == pytest.approx({"h2d": 5.0, "compute": 4.0})


def test_resource_shared_by_two_streams_halves_each():
    # Read and write queues of one disk: each at half speed while both run.
    sim = Simulation(slow={("rd", "wr"): 1.0, ("wr", "rd"): 1.0})
    sim.add("read", "rd", 2.0, "nvme_read")
    sim.add("write", "wr", 1.0, "nvme_write")
    r = sim.run()
    # Both at half speed until the write ends at t=2 (1 s of work); the read has 1 s left at full speed.
    assert r.makespan == pytest.approx(3.0)
    assert r.tasks[1].end == pytest.approx(2.0)
    assert r.exposed == pytest.approx({"nvme_read": 2.0, "nvme_write": 1.0})


def test_one_sided_interference():
    # A copy slows compute by 50% but not the other way round.
    sim = Simulation(slow={("compute", "h2d"): 0.5})
    sim.add("copy", "h2d", 1.0, "h2d")
    sim.add("fwd", "compute", 2.0, "compute")
    r = sim.run()
    assert r.tasks[0].end == pytest.approx(1.0)
    assert r.tasks[1].end == pytest.approx(1.0 + (2.0 - 1.0 / 1.5))


def test_stream_order_blocks_later_tasks():
    sim = Simulation()
    a = sim.add("a", "x", 1.0, "p")
    sim.add("b", "y", 1.0, "q", [a])
    sim.add("c", "y", 1.0, "q")  # behind b on its stream, although free to run
    r = sim.run()
    assert r.tasks[2].start == pytest.approx(2.0)


def test_bad_input_is_named():
    sim = Simulation()
    with pytest.raises(ValueError, match="'t'.*deps \\[3\\]"):
        sim.add("t", "x", 1.0, "p", [3])
    with pytest.raises(ValueError, match="seconds=-1"):
        sim.add("u", "x", -1.0, "p")
    sim.add("first", "x", 1.0, "p")
    a = sim.add("waits", "y", 1.0, "p")
    sim.tasks[a].deps = (a + 1,)
    sim.add("later", "y", 1.0, "p")
    with pytest.raises(ValueError, match="circle"):
        sim.run()
