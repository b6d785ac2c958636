"""DirectReader.submit (issue 19): reads straight into the caller's memory
where memory and file offset share their page phase, through bounce blocks
where they do not, short where the file ends, errors raised after every
piece has finished."""

import os

import pytest
import torch

from infinity.checkpoint import direct_stream as ds
from infinity.checkpoint.direct_stream import DirectReader, aligned_empty

BLOCK = 64 << 10


@pytest.fixture
def data_file(tmp_path, monkeypatch):
    monkeypatch.setattr(ds, "BLOCK", BLOCK)  # several pieces per read on a small file
    data = torch.randint(0, 256, (10 * BLOCK + 1234,), dtype=torch.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(data.numpy().tobytes())
    return str(path), data


def _pieces(monkeypatch):
    """Counts the bytes read straight and through bounce blocks."""
    seen = {"straight": 0, "bounced": 0}
    for name, key in (("_pread_at", "straight"), ("_pread_bounced", "bounced")):
        orig = getattr(DirectReader, name)

        def job(self, out, a, b, offset, _orig=orig, _key=key):
            seen[_key] += b - a
            return _orig(self, out, a, b, offset)
        monkeypatch.setattr(DirectReader, name, job)
    return seen


@pytest.mark.parametrize("offset,n,phase", [
    (0, 10 * BLOCK, 0),               # aligned: all straight
    (4096, 3 * BLOCK + 100, 0),       # aligned start, a tail bounced
    (4096 + 17, 2 * BLOCK, 17),       # same phase: a head and a tail bounced, the body straight
    (4096 + 17, 2 * BLOCK, 0),        # phases differ: all bounced
    (5, 100, 5),                      # smaller than a page
    (9 * BLOCK, 2 * BLOCK, 0),        # past the end: short
])
def test_submit_reads_the_bytes_whatever_the_alignment(data_file, monkeypatch, offset, n, phase):
    path, data = data_file
    seen = _pieces(monkeypatch)
    r = DirectReader(path)
    try:
        out = aligned_empty(n, phase)
        out.fill_(0xAA)
        got = r.submit(offset, out).result()
        want = data[offset:offset + n]
        assert got == want.numel()
        assert torch.equal(out[:got], want)
        assert bool((out[got:] == 0xAA).all())  # nothing written past what the file holds
        if r.direct and phase == offset % 4096 and n >= 3 * 4096:
            assert seen["straight"] >= n - 2 * 4096 - (offset + n - data.numel() if got < n else 0)
        if r.direct and phase != offset % 4096:
            assert seen["straight"] == 0
    finally:
        r.close()


def test_submit_without_o_direct_reads_straight(data_file, monkeypatch):
    path, data = data_file
    seen = _pieces(monkeypatch)
    real = os.open

    def refuse_direct(p, flags, *a):  # as a filesystem without O_DIRECT (tmpfs, some network ones)
        if flags & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real(p, flags, *a)
    monkeypatch.setattr(ds.os, "open", refuse_direct)
    r = DirectReader(path)
    assert not r.direct
    try:
        out = torch.empty(3 * BLOCK + 7, dtype=torch.uint8)
        assert r.submit(13, out).result() == out.numel()
        assert torch.equal(out, data[13:13 + out.numel()])
        assert seen["bounced"] == 0
    finally:
        r.close()


def test_many_reads_in_flight_each_land_where_asked(data_file):
    path, data = data_file
    r = DirectReader(path)
    try:
        spans = [(o, min(o + BLOCK + 4096 * (o % 3), data.numel())) for o in range(0, data.numel(), BLOCK)]
        outs = [aligned_empty(b - a, a % 4096) for a, b in spans]
        pending = [r.submit(a, t) for (a, _), t in zip(spans, outs)]  # all started before any is waited for
        for (a, b), t, p in zip(spans, outs, pending):
            assert p.result() == b - a
            assert torch.equal(t, data[a:b])
    finally:
        r.close()


def test_an_error_in_one_piece_is_raised_after_all_pieces_end(data_file, monkeypatch):
    path, _ = data_file
    r = DirectReader(path)
    real, calls = os.preadv, []

    def preadv(fd, bufs, pos):
        calls.append(pos)
        if pos == 2 * BLOCK:
            raise OSError(5, "Input/output error (injected)")
        return real(fd, bufs, pos)
    monkeypatch.setattr(ds.os, "preadv", preadv)
    try:
        p = r.submit(0, aligned_empty(6 * BLOCK))
        with pytest.raises(OSError, match="injected"):
            p.result()
        assert all(f.done() for _, _, f in p._pieces)  # none still writes the memory
    finally:
        r.close()


def _odd_run(tmp_path, tag, placement):
    import infinity
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(333, 517), torch.nn.Linear(517, 3001), torch.nn.Linear(3001, 7))
    cfg = infinity.Config(device="cpu", dtype="fp32", offload_params=placement, offload_optimizer=placement,
                          host_memory="256MiB",
                          device_memory="64MiB", swap_paths=[str(tmp_path / f"swap-{tag}")])
    return infinity.initialize(model, cfg, lr=1e-3)


def _steps(m, o, n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        m(torch.randn(4, 333, generator=g)).square().mean().backward()
        o.step()
        o.zero_grad()


@pytest.mark.parametrize("placement", ["host", "nvme"])
def test_a_load_with_misaligned_tensors_resumes_exactly(tmp_path, monkeypatch, placement):
    """Tensors whose byte sizes are not multiples of 4 KiB put the following
    ones off their page phase in the file (read through bounce blocks): the
    continuation after a load equals the uninterrupted run bit for bit."""
    import infinity
    seen = _pieces(monkeypatch)
    m, o = _odd_run(tmp_path, "a", placement)
    _steps(m, o, 2, 1)
    path = infinity.save_checkpoint(tmp_path / "ck", m, o)
    _steps(m, o, 2, 2)
    want = infinity.full_state_dict(m)
    infinity.close(m)
    m, o = _odd_run(tmp_path, "b", placement)
    infinity.load_checkpoint(path, m, o)
    _steps(m, o, 2, 2)
    got = infinity.full_state_dict(m)
    infinity.close(m)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    assert seen["bounced"] > 0 and seen["straight"] > 0  # both ways were taken


def test_load_scratch_temporaries_start_on_pages():
    """The master and compute temporaries of an NVMe-homed unit's load start
    on 4 KiB boundaries: the swap store then writes them without a staging copy."""
    from infinity.checkpoint.unit_loads import Scratch
    s = Scratch(3 * 4096)
    s.reset()
    a, b = s(10, torch.float32), s(3, torch.bfloat16)
    assert a.data_ptr() % 4096 == 0 and b.data_ptr() % 4096 == 0
    assert b.data_ptr() - a.data_ptr() == 4096
    s.reset()
    assert s(1, torch.float32).data_ptr() == a.data_ptr()  # reused for the next unit
