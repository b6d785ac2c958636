"""Ranged reads of checkpoint tensors (issue 19): a rank loading only its
shard reads the chunks the shard touches and checks each chunk's CRC32C;
a flipped byte in a chunk it reads is a named error, one outside its range
is not its concern (verify_checkpoint still finds it)."""

import os

import pytest
import torch
from test_checkpoint_faults import flip_byte

from infinity.checkpoint import safetensors_io as sio
from infinity.checkpoint.chunk_sums import chunk_sums
from infinity.checkpoint.direct_stream import DirectReader
from infinity.io.engine import crc32c


@pytest.fixture
def shard(tmp_path, monkeypatch):
    monkeypatch.setattr(sio, "CHUNK_BYTES", 4096)
    t = torch.randn(10_000)  # 40,000 bytes: 10 chunks of 4 KiB
    small = torch.randn(100)
    path = str(tmp_path / "x.safetensors")
    w = sio.ShardWriter(path, [("small", torch.float32, (100,)), ("t", torch.float32, (10_000,))])
    w.write("small", small)
    w.write("t", t)
    w.close()
    recs = {r["name"]: r for r in w.records}
    return path, recs, t, small


def _read(path, rec, start, stop):
    out = torch.empty(stop - start)
    f = DirectReader(path)
    try:
        sio.read_range(f, path, rec, torch.float32, start, stop, out)
    finally:
        f.close()
    return out


def test_ranges_across_chunk_boundaries_equal_the_tensor(shard):
    path, recs, t, small = shard
    assert len(recs["t"]["chunks"]["crc32c"]) == 10 and "chunks" not in recs["small"]
    for a, b in ((0, 10_000), (0, 1), (1023, 1025), (2500, 7501), (9_999, 10_000), (4096, 8192)):
        assert torch.equal(_read(path, recs["t"], a, b), t[a:b]), (a, b)
    assert torch.equal(_read(path, recs["small"], 10, 20), small[10:20])  # no chunks: the whole tensor, checked


def test_a_flipped_byte_in_a_chunk_read_is_named_and_one_outside_is_not_read(shard):
    path, recs, t, _ = shard
    rec = recs["t"]
    flip_byte(path, rec["offset"] + 2 * 4096 + 17, 0x01)  # in chunk 2
    assert torch.equal(_read(path, rec, 0, 1024), t[:1024])  # chunk 0 only: not its concern
    with pytest.raises(sio.CorruptCheckpointError, match=r"tensor 't', chunk 2 at offset \d+ \(4096 bytes\)"):
        _read(path, rec, 2000, 2100)  # elements 2000-2100: bytes 8000-8400, chunks 1 and 2
    with pytest.raises(sio.CorruptCheckpointError, match="CRC32C"):
        _read(path, rec, 0, 10_000)  # the whole tensor: its own sum


def test_a_truncated_file_is_named_on_a_ranged_read(shard):
    path, recs, _, _ = shard
    rec = recs["t"]
    os.truncate(path, rec["offset"] + 5 * 4096)
    with pytest.raises(sio.CorruptCheckpointError, match="file truncated"):
        _read(path, rec, 8000, 9000)


@pytest.mark.parametrize("n", [1, 4095, 4096, 4097, 40_000, (4 << 20) + 3])
def test_the_whole_sum_combined_from_chunk_sums_equals_one_pass(n):
    b = torch.randint(0, 256, (n,), dtype=torch.uint8)
    full, sums = chunk_sums(b.data_ptr(), n, 4096)
    assert full == crc32c(b.data_ptr(), n)
    assert sums == [crc32c(b.data_ptr() + o, min(4096, n - o)) for o in range(0, n, 4096)]


def test_a_whole_read_checks_every_chunk_and_the_manifest_whole_sum(shard):
    path, recs, t, _ = shard
    rec = dict(recs["t"])
    assert rec["crc32c"] == crc32c(t.data_ptr(), 40_000)
    flip_byte(path, rec["offset"] + 9 * 4096 + 1, 0x01)  # the last, short chunk
    with pytest.raises(sio.CorruptCheckpointError, match=r"chunk 9 at offset"):
        _read(path, rec, 0, 10_000)
    flip_byte(path, rec["offset"] + 9 * 4096 + 1, 0x01)  # back
    assert torch.equal(_read(path, rec, 0, 10_000), t)
    bad = dict(rec, crc32c=rec["crc32c"] ^ 1)  # a manifest whose whole sum disagrees with its chunks
    with pytest.raises(sio.CorruptCheckpointError, match="CRC32C"):
        _read(path, bad, 0, 10_000)
    short = dict(rec, chunks={"bytes": 4096, "crc32c": rec["chunks"]["crc32c"][:-1]})
    with pytest.raises(sio.CorruptCheckpointError, match="chunk"):
        _read(path, short, 0, 10_000)
