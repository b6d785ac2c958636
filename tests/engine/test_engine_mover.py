"""The mover's and the stage-3 gather's stream and event discipline, and the
host tier's release, on the CPU: the CUDA code runs against a fake torch.cuda
that records which stream waits on what, which device each call names, and
how each event was created."""

import contextlib
import threading
import time

import pytest
import torch

from infinity.engine.mechanism import mover as mv
from infinity.engine.mechanism.tiers import HostTier
from infinity.io import host_pool as hp


class FakeEvent:
    def __init__(self, enable_timing=False, blocking=False, interprocess=False, external=False):
        self.blocking = blocking
        self.stream = None
        self.synced = False

    def record(self, stream):
        self.stream = stream
        stream.log.append(("record", self))

    def synchronize(self):
        self.synced = True

    def query(self):
        return True

    def elapsed_time(self, end):
        return 2.5  # milliseconds


class FakeStream:
    def __init__(self, device, name):
        self.device, self.name, self.log = device, name, []

    def wait_event(self, ev):
        self.log.append(("wait_event", ev))

    def wait_stream(self, other):
        self.log.append(("wait_stream", other))

    def __repr__(self):
        return f"FakeStream({self.name}, {self.device})"


class FakeCuda:
    """What the mover uses of torch.cuda; the current stream is per device
    and per thread, as CUDA keeps it (the mover's chain and grad threads
    issue copies on their streams while the main thread asks for its own),
    and torch.cuda.stream(s) makes ``s`` current on its device."""

    def __init__(self):
        self.compute = {}   # device index -> the compute stream
        self._threads = threading.local()
        self.asked = []     # the device argument of every current_stream call
        self.created = 0

    @property
    def current(self) -> dict:
        """The calling thread's current streams: device index -> stream."""
        if not hasattr(self._threads, "current"):
            self._threads.current = {}
        return self._threads.current

    def _compute(self, index):
        return self.compute.setdefault(index, FakeStream(torch.device("cuda", index), "compute"))

    def current_stream(self, device=None):
        self.asked.append(device)
        index = torch.device(device).index if device is not None else 0
        return self.current.get(index) or self._compute(index)

    def Stream(self, device):
        self.created += 1
        return FakeStream(torch.device(device), f"side{self.created}")

    @contextlib.contextmanager
    def stream(self, s):
        index, current = s.device.index, self.current
        prev = current.get(index)
        current[index] = s
        try:
            yield
        finally:
            current[index] = prev


@pytest.fixture
def cuda(monkeypatch):
    fake = FakeCuda()
    for name in ("current_stream", "Stream", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    return fake


def test_h2d_waits_for_queued_compute_unless_the_range_is_fresh(cuda):
    m = mv.CudaMover(torch.device("cuda", 1))
    compute = cuda._compute(1)
    dst, src = torch.zeros(8), torch.arange(8.0)
    t = m.h2d(dst, src)  # a live range (refresh of a device-resident unit)
    assert torch.equal(dst, src)
    h2d = m._h2d_stream
    assert h2d.log[0] == ("wait_stream", compute), h2d.log  # the compute stream, not the copy stream itself
    assert h2d.log[1] == ("record", t.event) and t.event.blocking and t.device == torch.device("cuda", 1)
    m.release_marker()
    marker = m._last_release
    assert marker.stream is compute and not marker.blocking  # only streams wait on it
    h2d.log.clear()
    t2 = m.h2d(dst, src, fresh=True)
    assert h2d.log == [("wait_event", marker), ("record", t2.event)]  # the marker only
    h2d.log.clear()
    m.h2d(dst, src)
    assert h2d.log[:2] == [("wait_event", marker), ("wait_stream", compute)]
    assert all(d == torch.device("cuda", 1) for d in cuda.asked), cuda.asked  # never the current device
    m.close()


def test_tickets_wait_on_the_movers_device(cuda):
    m = mv.CudaMover(torch.device("cuda", 1))
    t = m.h2d(torch.zeros(4), torch.ones(4), fresh=True)
    t.wait_compute()
    log = cuda._compute(1).log
    # Timed on the device: a timing event on each side of the stream wait, nothing between.
    assert [k for k, _ in log[-3:]] == ["record", "wait_event", "record"] and log[-2][1] is t.event
    assert m.stall_clock.seconds() == pytest.approx(2.5e-3)
    assert 0 not in cuda.compute  # device 0's stream was never touched
    t.wait()
    assert t.event.synced
    m.close()


def test_d2h_ready_mark_is_a_stream_event_and_the_ticket_blocks(cuda):
    m = mv.CudaMover(torch.device("cuda", 1))
    dst, src = torch.zeros(5), torch.arange(5.0)
    t = m.d2h(dst, src)
    assert torch.equal(dst, src)
    ready = cuda._compute(1).log[-1][1]
    assert not ready.blocking and m._d2h_stream.log[0] == ("wait_event", ready)
    assert t.event.blocking and t.event.stream is m._d2h_stream
    m.close()


def test_cuda_synchronize_drains_the_threads_then_the_streams(cuda):
    m = mv.CudaMover(torch.device("cuda", 1))
    finished = threading.Event()

    def slow():
        time.sleep(0.2)
        finished.set()

    m.host_job(slow)
    m.synchronize()
    assert finished.is_set()
    for s in (m._h2d_stream, m._d2h_stream, cuda._compute(1)):
        kind, ev = s.log[-1]
        assert kind == "record" and ev.blocking and ev.synced, s
    m.close()


def test_cpu_mover_same_interface_and_synchronize():
    m = mv.CpuMover()
    dst, src = torch.zeros(1000), torch.randn(1000)
    m.h2d(dst, src, fresh=True).wait()
    assert torch.equal(dst, src)
    order = []

    def first():
        time.sleep(0.2)
        order.append("read")

    def then():
        order.append("copy")
        return m.h2d(dst, src * 2)

    m.chain(first, then)
    m.host_job(lambda: (time.sleep(0.1), order.append("job")))
    m.synchronize()  # the chain's copy too, submitted by the chain thread after the call began
    assert sorted(order) == ["copy", "job", "read"] and torch.equal(dst, src * 2)
    m.close()
    m.synchronize()  # after close: nothing left, no error


def test_host_tier_pins_on_its_device_and_closes_once(monkeypatch):
    calls = []

    class Cudart:
        def cudaHostRegister(self, ptr, n, flags):
            calls.append(("register", dev[0]))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", dev[0]))
            return 0

    dev = [None]

    @contextlib.contextmanager
    def device(index):
        dev[0] = index
        yield
        dev[0] = None

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    monkeypatch.setattr(hp, "_cuda_device", device)
    tier = HostTier(1 << 20, 1 << 21, pin=True, device=torch.device("cuda", 3))
    t = tier.alloc(100, torch.float32)
    t.fill_(1.0)
    assert tier.pinned and calls == [("register", 3)]
    peak = tier.peak_bytes
    tier.close()
    tier.close()
    assert calls == [("register", 3), ("unregister", 3)] and tier.peak_bytes == peak and not tier.pinned
    with pytest.raises(RuntimeError, match="tier is closed"):
        tier.acquire(10, torch.float32)
    assert float(t.sum()) == 100.0  # a live view keeps the (unlocked) mapping until it goes


def test_host_tier_on_cpu_ignores_the_device():
    tier = HostTier(1 << 16, 1 << 16, pin=False, device=torch.device("cpu"))
    assert tier.pool.pin_method == "none"
    tier.close()


def test_stage3_gather_waits_for_the_copy_on_a_side_stream(cuda, monkeypatch):
    """With an h2d, each region's copy is waited for, and its gather issued,
    with the side stream current (so NCCL waits on it, not on compute); the
    ticket's wait() waits for the works there and synchronizes a blocking
    event; wait_compute() waits with the caller's stream current. Only this
    thread's waits count: the engine's clock thread also waits for each Work
    (to time it, [Note: exposed communication time]), at any moment."""
    from infinity.engine.mechanism import zero
    from infinity.engine.stats import Stats
    s = zero.Sharding(0, Stats())
    side = FakeStream(torch.device("cuda", 1), "side")
    monkeypatch.setattr(s, "_side_stream", lambda t: side)
    issued, copy_waits = [], []

    class Work:
        def __init__(self):
            self.waits = []

        def wait(self):
            if threading.current_thread() is threading.main_thread():
                self.waits.append(cuda.current.get(1))

        def is_completed(self):
            return False

    def all_gather(out, inp, group=None, async_op=False):
        assert async_op
        issued.append(cuda.current.get(1))
        return Work()

    class CopyTicket:
        def wait_compute(self, timed=True):
            assert not timed  # the side stream's wait is not a compute stall (StallClock)
            copy_waits.append(cuda.current.get(1))

    monkeypatch.setattr(zero, "_all_gather", all_gather)
    full, shard = torch.zeros(10), torch.arange(10.0)
    t = s.gather_units_params(full, shard, 6, h2d=lambda dst, src: (dst.copy_(src), CopyTicket())[1])
    assert torch.equal(full, shard)  # world 1: the own shard is everything
    assert copy_waits == [side, side] and issued == [side, side]
    assert t.stream is side and not t.done()
    t.wait_compute()
    assert all(w.waits == [None] for w in t.works)  # the caller's (compute) stream was current
    t.wait()
    assert all(w.waits == [None, side] for w in t.works)
    kind, ev = side.log[-1]
    assert kind == "record" and ev.blocking and ev.synced and t.done()
    s.clock.close()  # the clock thread the gathers started ends here, not at some later test's moment


def test_updated_copy_gathered_on_the_device_after_its_shard_copy(cuda, monkeypatch):
    """[Note: where the updated copies are gathered]: refreshing a unit that
    lives on the device, with ``gather_on_device``, copies the own shard of
    the trainable range up on the copy stream after the compute queued so
    far (the range is live), makes the side stream wait for that copy's
    event, and issues the gather of the trainable range (never the frozen
    tail) with the side stream current; the h2d bytes are the shard's."""
    from types import SimpleNamespace
    from infinity.engine.mechanism import zero
    from infinity.engine.owners.residency import DeviceRecord, Residency
    from infinity.engine.stats import Stats
    stats = Stats()
    s = zero.Sharding(0, stats)
    side = FakeStream(torch.device("cuda", 1), "side")
    monkeypatch.setattr(s, "_side_stream", lambda t: side)
    issued = []

    class Work:
        def wait(self):
            pass

        def is_completed(self):
            return True

    def all_gather(out, inp, group=None, async_op=False):
        issued.append((cuda.current.get(1), out.numel(), group is s.device_group))
        return Work()

    monkeypatch.setattr(zero, "_all_gather", all_gather)
    m = mv.CudaMover(torch.device("cuda", 1))
    r = Residency.__new__(Residency)  # the parts refresh uses
    home = torch.arange(10.0)
    r.modes, r.sharding, r.mover, r.stats = SimpleNamespace(gather_on_device=True), s, m, stats
    r.source = SimpleNamespace(home=lambda u: home)
    u = SimpleNamespace(index=0, dev=DeviceRecord(compute=torch.zeros(10), permanent=True),
                        place=SimpleNamespace(trainable_numel=6, compute_bytes=40))
    r.refresh(u)
    h2d = m._h2d_stream
    assert h2d.log[0] == ("wait_stream", cuda._compute(1)), h2d.log  # after the queued compute
    copied = h2d.log[1][1]
    assert side.log == [("wait_event", copied)], side.log  # the side stream waits for the copy
    assert issued == [(side, 6, True)]                      # then the trainable range, from the side stream
    assert torch.equal(u.dev.compute[:6], home[:6]) and not u.dev.compute[6:].any()  # world 1: the shard is all
    assert stats.bytes_moved["h2d"] == 24
    m.close()
    s.clock.close()


def _pinned_allocations(monkeypatch) -> list:
    """The shapes of every ``torch.empty(..., pin_memory=True)`` from now on
    (allocated unpinned: there is no CUDA here)."""
    pinned = []
    real_empty = torch.empty

    def empty(*a, **kw):
        if kw.get("pin_memory"):
            pinned.append(a)
            kw = dict(kw, pin_memory=False)
        return real_empty(*a, **kw)

    monkeypatch.setattr(torch, "empty", empty)
    return pinned


def test_gradient_straight_into_the_pinned_buffer_without_staging(cuda, monkeypatch):
    """Same dtype and nothing to add: one copy on the d2h stream, no pinned
    staging and no host job; otherwise staging and an upcast on a host thread."""
    staged = _pinned_allocations(monkeypatch)
    m = mv.CudaMover(torch.device("cuda", 1))
    g = torch.randn(6, 4, dtype=torch.bfloat16)
    dst = torch.zeros(24, dtype=torch.bfloat16)
    t = m.grad_out(dst, g, accumulate=False)
    assert t.fut is None and not staged and torch.equal(dst, g.reshape(-1))
    up = torch.zeros(24)
    t = m.grad_out(up, g, accumulate=False)
    t.wait()
    assert staged and torch.equal(up, g.reshape(-1).float())
    t = m.grad_out(up, g, accumulate=True)  # accumulation always goes through the host
    t.wait()
    assert torch.equal(up, 2 * g.reshape(-1).float())
    m.close()


def test_staged_gradients_cross_through_the_fixed_pinned_ring(cuda, monkeypatch):
    """[Note: the gradient staging ring]: gradients added or upcast on the host cross in block-sized pieces
    through a ring allocated once (not a pinned block per gradient), every block given back, the sums exact."""
    pinned = _pinned_allocations(monkeypatch)
    m = mv.CudaMover(torch.device("cuda", 0))
    m.staging = mv.StagingRing(blocks=2, block_bytes=64)  # 32 bf16 elements a block
    dst = torch.zeros(100)
    grads = [torch.randn(100, dtype=torch.bfloat16) for _ in range(3)]
    for i, g in enumerate(grads):
        m.grad_out(dst, g, accumulate=i > 0).wait()  # 4 pieces each through 2 blocks
    want = grads[0].float() + grads[1].float() + grads[2].float()
    assert torch.equal(dst, (grads[0].float() + grads[1].float()) + grads[2].float()) and torch.allclose(dst, want)
    assert pinned == [(64,), (64,)] and m.staging.pinned_bytes == 128  # two blocks, made once
    assert m.staging.free_blocks == 2  # every block given back
    m.close()


def test_large_upcast_split_over_threads_equals_one_pass(monkeypatch):
    monkeypatch.setattr(mv, "_CAST_CHUNK", 1000)
    src = torch.randn(10_000 + 17, dtype=torch.bfloat16)
    a, b = torch.zeros(src.numel()), torch.ones(src.numel())
    mv._cast_into(a, src, accumulate=False)
    mv._cast_into(b, src, accumulate=True)
    assert torch.equal(a, src.float()) and torch.equal(b, 1 + src.float())
