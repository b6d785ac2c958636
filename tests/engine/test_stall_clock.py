"""The CUDA stall clock folds executed wait pairs as it goes (issue 36): a
loop that never calls infinity.stats() held two CUDA events per fetch
forever (about a million after 10k steps). CUDA events are faked: the clock
only records, queries and times them."""

import torch

from infinity.engine.mechanism import mover


class FakeEvent:
    clock = 0.0
    done_upto = 0
    count = 0

    def __init__(self, enable_timing=False):
        FakeEvent.count += 1
        self.n = FakeEvent.count

    def record(self, stream):
        FakeEvent.clock += 1.0
        self.t = FakeEvent.clock

    def query(self):
        return self.n <= FakeEvent.done_upto

    def elapsed_time(self, other):
        return (other.t - self.t) * 1000.0  # ms


class FakeStream:
    def wait_event(self, event):
        pass


def test_the_stall_clock_stays_bounded_and_counts_every_executed_wait(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    clock, stream = mover.StallClock(), FakeStream()
    for i in range(10_000):
        clock.wait(stream, None)
        FakeEvent.done_upto = FakeEvent.count - 4  # the last two pairs not executed yet
        assert clock.pending <= 3, (i, clock.pending)
    FakeEvent.done_upto = FakeEvent.count
    assert clock.seconds() == 10_000.0  # each pair is 1 s apart: every wait counted once
    assert clock.pending == 0


def test_a_side_stream_wait_is_not_a_compute_stall(monkeypatch):
    """ZeRO-3's gather makes its side stream wait for the shard's copy: that wait must not be timed as
    compute waiting for a fetch; compute's own wait is."""
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    stream = FakeStream()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    clock = mover.StallClock()
    t = mover.CudaTicket(FakeEvent(), torch.device("cuda", 0), clock=clock)
    t.wait_compute(timed=False)
    assert clock.pending == 0
    t.wait_compute()
    assert clock.pending == 1
