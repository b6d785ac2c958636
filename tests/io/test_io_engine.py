"""The engines below the store: CRC32C, checksum chunking, direct and bounce requests, errors."""

import ctypes
import errno
import os

import pytest
import torch

from infinity.io import HostPool, SwapIOError, native_available
from infinity.io.engine import READ, WRITE, NativeEngine, chunk_bytes, crc32c, crc_count
from infinity.io.fallback import PythonEngine

native = pytest.mark.skipif(not native_available(), reason="native engine not built")


@native
def test_crc32c_known_values_and_every_path_matches_table():
    """The folding (VPCLMULQDQ), crc32-instruction and table paths agree on
    every length around their thresholds, at odd alignments, and when split."""
    from infinity.io.engine import _lib
    lib = _lib()
    check = b"123456789"
    assert lib.inf_crc32c(0, check, 9) == 0xE3069283  # the CRC-32C check value
    assert lib.inf_crc32c(0, bytes(32), 32) == 0x8A9136AA  # RFC 3720 B.4: 32 bytes of zeros
    assert lib.inf_crc32c(0, b"\xff" * 32, 32) == 0x62A8AB43  # RFC 3720 B.4: 32 bytes of ones
    data = os.urandom(3 * 8192 * 3 + 1000)
    buf = ctypes.create_string_buffer(data)
    base = ctypes.addressof(buf)
    lengths = [0, 1, 7, 8, 9, 63, 64, 65, 255, 256, 257, 319, 320, 321, 383, 384, 511, 512, 513, 575, 576,
               767, 768, 769, 1000, 4096, 24575, 24576, 24577, 3 * 8192 * 3 + 999]
    try:
        for n in lengths:
            for off in (0, 1, 5, 64):
                if off + n > len(data):
                    continue
                results = []
                for force in (0, 2, 1):  # automatic (folding where the CPU has it), crc32 insn, table
                    lib.inf_crc32c_force_sw(force)
                    results.append(lib.inf_crc32c(0x5EED, base + off, n))
                lib.inf_crc32c_force_sw(0)
                split = lib.inf_crc32c(lib.inf_crc32c(0x5EED, base + off, n // 3), base + off + n // 3, n - n // 3)
                assert results[0] == results[1] == results[2] == split, (n, off, [hex(r) for r in results])
    finally:
        lib.inf_crc32c_force_sw(0)


def test_crc_count_rule():
    B = 65536
    assert crc_count(0, B) == 0
    assert crc_count(1, B) == 1                   # tail only
    assert crc_count(4096, B) == 1
    assert crc_count(4097, B) == 2                # body + tail
    assert crc_count(B, B) == 1
    assert crc_count(B + 4096 + 1, B) == 3        # two body chunks + tail
    # Chunks are the largest power of two dividing both the block and 256 KiB,
    # the most a staged block holds: 8 MiB blocks carry 32 chunks each.
    M = 1 << 20
    assert [chunk_bytes(b) for b in (4096, 12288, B, M, 8 * M, 3 * M + 4096, 3 * M)] == \
        [4096, 4096, B, M // 4, M // 4, 4096, M // 4]
    assert crc_count(8 * M, 8 * M) == 32 and crc_count(8 * M + 1, 8 * M) == 33
    if native_available():
        from infinity.io.engine import _lib
        for blk in (B, 8 * M, 3 * M + 4096):
            for n in (0, 1, 4095, 4096, 4097, B - 1, B, B + 1, 5 * B + 4097, 17 * M + 5):
                assert _lib().inf_io_crc_count(n, blk) == crc_count(n, blk), (n, blk)


def test_stage_block_rule():
    """Staged blocks: min(block, 1 MiB) for reads, min(block, 256 KiB) for
    writes (native), whole blocks (Python); always a multiple of the checksum
    chunk, so no chunk straddles a staged block."""
    M = 1 << 20
    for blk in (4096, 12288, 65536, 512 << 10, M, 3 * M + 4096, 8 * M):
        py = PythonEngine(1, blk)
        try:
            assert py.stage_block(READ) == py.stage_block(WRITE) == blk
        finally:
            py.close()
        if native_available():
            eng = NativeEngine("threads", 1, blk)
            try:
                assert eng.stage_block(READ) == min(blk, M) and eng.stage_block(WRITE) == min(blk, M // 4)
                assert eng.stage_block(READ) % chunk_bytes(blk) == eng.stage_block(WRITE) % chunk_bytes(blk) == 0
            finally:
                eng.close()
    if native_available():
        from infinity.io.engine import _lib
        assert _lib().inf_io_stage_block(7, M) == -errno.EINVAL
        assert _lib().inf_io_stage_block(READ, M + 1) == -errno.EINVAL


def engines():
    out = [("python", lambda blk: PythonEngine(4, blk))]
    if native_available():
        out.append(("threads", lambda blk: NativeEngine("threads", 4, blk)))
        try:
            NativeEngine("io_uring", 1, 4096).close()
            out.append(("io_uring", lambda blk: NativeEngine("io_uring", 4, blk)))
        except OSError:
            pass
    return out


@pytest.mark.parametrize("block", [65536, 2 << 20, (3 << 20) + 4096])
@pytest.mark.parametrize("name,make", engines(), ids=[e[0] for e in engines()])
def test_direct_and_bounce_give_same_bytes_and_checksums(tmp_path, name, make, block):
    """With 2 MiB blocks the native engine stages 256 KiB blocks and checksums
    256 KiB chunks (with 3 MiB + 4 KiB blocks, 4 KiB chunks): the list must
    still match a direct write's, and the Python engine's (same CRC32C)."""
    eng = make(block)
    M = 1 << 20
    path = str(tmp_path / "f.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, 32 * M)
    pool = HostPool(16 * M)
    try:
        fid = eng.register(fd, path)
        n = 3 * block + 5000
        src = torch.randint(0, 256, (n,), dtype=torch.uint8)
        a = pool.acquire(n)
        bounce = pool.acquire(2 * block)
        a.tensor.copy_(src)
        # Direct write of the aligned body + bounce write of the tail == one bounce write.
        body = n // 4096 * 4096
        c1 = (ctypes.c_uint32 * crc_count(body, block))()
        c2 = (ctypes.c_uint32 * 1)()
        eng.wait(eng.submit(WRITE, fid, 0, a.ptr, body, 0, 0, c1))
        eng.wait(eng.submit(WRITE, fid, body, a.ptr + body, n - body, bounce.ptr, bounce.capacity, c2))
        plain = src.clone()
        c3 = (ctypes.c_uint32 * crc_count(n, block))()
        eng.wait(eng.submit(WRITE, fid, 16 * M, plain.data_ptr(), n, bounce.ptr, bounce.capacity, c3))
        assert list(c1) + list(c2) == list(c3)
        if eng.checksum_name == "crc32c":  # (the Python engine without the native library: zlib's CRC-32)
            cb = chunk_bytes(block)
            want = [crc32c(a.ptr + i, min(cb, body - i)) for i in range(0, body, cb)] + [crc32c(a.ptr + body, n - body)]
            assert list(c3) == want
        with open(path, "rb") as f:
            f.seek(0)
            one = f.read(n + 100)
            f.seek(16 * M)
            two = f.read(n + 100)
        assert one == two and one[:n] == bytes(src.numpy()) and one[n:n + 100] == bytes(100)  # zero padding
        out = torch.zeros(n, dtype=torch.uint8)
        eng.wait(eng.submit(READ, fid, 16 * M, out.data_ptr(), n, bounce.ptr, bounce.capacity, c3, True))
        assert torch.equal(out, src)
        # A direct request with an unaligned buffer is refused up front.
        with pytest.raises(SwapIOError) as ei:
            eng.submit(READ, fid, 0, a.ptr + 8, 4096)
        assert ei.value.errno == errno.EINVAL
        a.release()
        bounce.release()
    finally:
        eng.close()
        os.close(fd)
        pool.close()


_DEAD_RING = r"""
import errno, sys, torch
from infinity.io import HostPool, SwapIOError, SwapStore
s = SwapStore(sys.argv[1], backend="io_uring", block_size=65536, queue_depth=4, capacity_bytes=4 << 20,
              staging_bytes=1 << 20)
x = torch.arange(100_000, dtype=torch.float32)
s.write("old", x).wait(timeout=300)
s._inject_fault("ring", 1, "EIO")
with HostPool(1 << 20) as pool, pool.acquire(400_000) as buf:
    y = torch.empty_like(x)
    for what, start in (("plain write", lambda: s.write("a", x)), ("direct write", lambda: s.write("b", buf.tensor)),
                        ("read", lambda: s.read("old", y)), ("later write", lambda: s.write("c", x))):
        try:
            start().wait(timeout=300)
        except SwapIOError as e:
            assert e.errno == errno.EIO and "io_uring_enter failed" in str(e), (what, e)
        else:
            raise AssertionError(what + " succeeded on a dead ring")
s.close()  # nothing is left in flight: returns
print("OK")
"""


@pytest.mark.skipif(not any(e[0] == "io_uring" for e in engines()), reason="io_uring or native engine missing")
def test_dead_ring_fails_its_blocks(tmp_path):
    """A failed io_uring_enter ([Note: a dead ring], io_uring.cpp) fails the
    ring's blocks with its errno, withdrawn or claimed later, and the engine
    still stops: no waiter hangs. In a child process, so a hang fails the
    test instead of the suite."""
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", _DEAD_RING, str(tmp_path / "swap")], capture_output=True, text=True,
                       timeout=900, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
    assert "io_uring_enter failed: Input/output error" in r.stderr  # one line per ring, for the operator
