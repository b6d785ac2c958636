"""Checkpoint writes straight from a tensor's own memory (issue 19, [Note:
checkpoint writes without the page cache]): the bytes round-trip exactly
beside copied ones, the memory is read until settle() and not after, an
error of such a write is raised (never lost), and saves that lend the tiers' buffers
resume exactly and, in the background, still hold the state at the call."""

import errno
import mmap
import os
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_checkpoint import train

import infinity
from infinity.checkpoint import direct_stream, save


def _page_aligned(nbytes: int) -> torch.Tensor:
    buf = mmap.mmap(-1, nbytes)
    return torch.frombuffer(buf, dtype=torch.uint8)


def _spy_lent(monkeypatch) -> list:
    """Counts the bytes written from tensors' own memory."""
    lent = [0]
    real = direct_stream.DirectStream._lend

    def lend(self, t, body):
        lent[0] += body
        return real(self, t, body)

    monkeypatch.setattr(direct_stream.DirectStream, "_lend", lend)
    return lent


def test_the_write_queue_never_holds_more_than_its_depth(tmp_path):
    """Lent writes not settled (a save of resident state settles only at the
    end) sit in the queue beside block writes: where only a lent one has
    finished, the queue still waits until a block is free (one ran out of
    blocks: StopIteration in a save)."""
    from concurrent.futures import Future
    s = direct_stream.DirectStream(str(tmp_path / "f.bin"))
    try:
        done = Future()
        done.set_result(None)
        slow = [Future() for _ in range(direct_stream.WRITE_DEPTH + 1)]
        s._pending.extend([(i, f) for i, f in enumerate(slow)] + [(-1, done)])  # 9 blocks and a lent write
        t = __import__("threading").Timer(0.2, lambda: slow[3].set_result(None))
        t.start()
        s._reap(direct_stream.WRITE_DEPTH)
        assert len(s._pending) <= direct_stream.WRITE_DEPTH
        assert {i for i, _ in s._pending} != set(range(direct_stream.WRITE_DEPTH + 1))  # a block is free
        for f in slow:
            if not f.done():
                f.set_result(None)
        s._pending.clear()
    finally:
        s.abort()


def test_lent_and_copied_bytes_round_trip_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(direct_stream, "BLOCK", 16 << 10)
    lent = _spy_lent(monkeypatch)
    g = torch.Generator().manual_seed(0)
    src = _page_aligned(1 << 20)
    src.copy_(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g))
    # aligned (copied: under a block), lent, odd; copied (the stream's position unaligned), odd (it
    # realigns), and an aligned body lent with its 123-byte tail copied
    pieces = [src[:4096], src[8192:8192 + 100 * 1024], src[4096:4096 + 1000], src[200 * 1024:300 * 1024],
              src[8:8 + 3096], src[512 * 1024:512 * 1024 + 64 * 1024 + 123]]
    s = direct_stream.DirectStream(str(tmp_path / "f.bin"))
    assert s.direct, "this test needs a filesystem that takes O_DIRECT"
    for p in pieces:
        s.write(p)
    s.close()
    want = torch.cat(pieces)
    got = (tmp_path / "f.bin").read_bytes()
    assert len(got) == want.numel() and got == bytes(want.numpy())
    # the 100 KiB piece after an aligned one, and the last piece's aligned body, came from their own memory
    assert lent[0] == 100 * 1024 + 64 * 1024, lent[0]


def test_lent_memory_is_read_until_settle_and_not_after(tmp_path, monkeypatch):
    monkeypatch.setattr(direct_stream, "BLOCK", 16 << 10)
    real_pwrite = os.pwrite

    def slow_pwrite(fd, data, pos):
        time.sleep(0.01)  # the write would still be reading if settle() did not wait
        return real_pwrite(fd, data, pos)

    monkeypatch.setattr(direct_stream.os, "pwrite", slow_pwrite)
    src = _page_aligned(256 << 10)
    src.fill_(7)
    s = direct_stream.DirectStream(str(tmp_path / "f.bin"))
    s.write(src)
    s.settle()
    src.fill_(9)  # the tiers change the memory once the save has settled
    s.close()
    assert (tmp_path / "f.bin").read_bytes() == bytes([7]) * (256 << 10)


def test_an_error_of_a_lent_write_is_raised_by_write_or_settle(tmp_path, monkeypatch):
    monkeypatch.setattr(direct_stream, "BLOCK", 16 << 10)

    def full(fd, data, pos):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    src = _page_aligned(64 << 10)
    s = direct_stream.DirectStream(str(tmp_path / "f.bin"))
    monkeypatch.setattr(direct_stream.os, "pwrite", full)
    with pytest.raises(OSError) as e:  # from the write where the next piece found it failed, else from settle()
        s.write(src)
        s.settle()
    assert e.value.errno == errno.ENOSPC
    s.abort()


class Square(nn.Module):
    """Residual blocks of 64x64 weights without biases: every tensor 16 KiB,
    so every one sits page-aligned in the tiers and in the file."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(64, 64, bias=False) for _ in range(4))

    def forward(self, x, y):
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        return F.mse_loss(x, y)


def _make(tmp_path, tag, place):
    torch.manual_seed(0)
    cfg = infinity.Config(device="cpu", dtype="fp32", offload_params=place, offload_optimizer=place,
                          device_memory=1 << 20, host_memory="64MiB", swap_block_size=4096,
                          swap_paths=[str(tmp_path / f"swap-{tag}")], unit_classes=["Linear"])
    return infinity.initialize(Square(), cfg, lr=1e-2)


def _batches(n):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)) for _ in range(n)]


@pytest.mark.parametrize("place", ["host", "nvme"])
def test_a_save_lending_the_tiers_buffers_resumes_exactly(tmp_path, monkeypatch, place):
    monkeypatch.setattr(direct_stream, "BLOCK", 4096)
    lent = _spy_lent(monkeypatch)
    batches = _batches(6)
    m, o = _make(tmp_path, "ref", place)
    ref = train(m, o, None, batches)
    ref_sd = infinity.full_state_dict(m)
    infinity.close(m)
    m, o = _make(tmp_path, "a", place)
    first = train(m, o, None, batches[:3])
    infinity.save_checkpoint(tmp_path / "ck", m, o)
    infinity.close(m)
    if place == "host":  # host homes are page-aligned views of the pool
        assert lent[0] >= 3 * 4 * 64 * 64 * 4, lent[0]
    m, o = _make(tmp_path, "b", place)
    infinity.load_checkpoint(tmp_path / "ck", m, o)
    rest = train(m, o, None, batches[3:])
    sd = infinity.full_state_dict(m)
    infinity.close(m)
    assert first + rest == ref
    assert all(torch.equal(sd[k], ref_sd[k]) for k in ref_sd)


def test_a_background_save_lending_host_homes_is_the_state_at_the_call(tmp_path, monkeypatch):
    """The updates after the call change the host homes the save writes
    from: each unit's fence lifts only once its writes have settled."""
    monkeypatch.setattr(direct_stream, "BLOCK", 4096)
    lent = _spy_lent(monkeypatch)
    batches = _batches(6)
    m, o = _make(tmp_path, "sync", "host")
    train(m, o, None, batches[:3])
    want = infinity.save_checkpoint(tmp_path / "sync", m, o)
    infinity.close(m)
    real_pwrite = os.pwrite

    def slow_pwrite(fd, data, pos):
        time.sleep(0.003)
        return real_pwrite(fd, data, pos)

    monkeypatch.setattr(direct_stream.os, "pwrite", slow_pwrite)
    monkeypatch.setattr(save, "test_hook", lambda point: time.sleep(0.002) if point == "tensor" else None)
    m, o = _make(tmp_path, "bg", "host")
    train(m, o, None, batches[:3])
    lent[0] = 0
    pending = infinity.save_checkpoint(tmp_path / "bg", m, o, blocking=False)
    train(m, o, None, batches[3:])
    got = pending.wait()
    infinity.close(m)
    assert lent[0] > 0
    for name in sorted(os.listdir(want)):
        if name.endswith(".safetensors"):
            assert (got / name).read_bytes() == (want / name).read_bytes(), name
