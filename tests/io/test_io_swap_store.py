"""SwapStore over every engine: round trips, concurrency, reuse, checksums, faults, locking, permissions.

Every test runs on the native io_uring engine, the native thread engine and the
pure-Python fallback (the same contract, the same errors).
"""

import array
import ctypes
import errno
import os
import stat
import shutil
import subprocess
import sys
import threading
import warnings

import pytest
import torch

from infinity.io import (ChecksumError, HostPool, StoreLockedError, SwapFullError, SwapIOError, SwapStore,
                         native_available)
from infinity.io.engine import NativeEngine, crc32c

MiB = 1 << 20
KB4 = 4096


def _uring_ok() -> bool:
    if not native_available():
        return False
    try:
        NativeEngine("io_uring", 2, KB4).close()
        return True
    except OSError:
        return False


BACKENDS = [
    pytest.param("io_uring", marks=pytest.mark.skipif(not _uring_ok(), reason="io_uring or native engine missing")),
    pytest.param("threads", marks=pytest.mark.skipif(not native_available(), reason="native engine not built")),
    "python",
]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def make_store(tmp_path, backend, npaths=1, **kw):
    kw.setdefault("block_size", 64 * 1024)
    kw.setdefault("queue_depth", 4)
    kw.setdefault("staging_bytes", 1 * MiB)
    kw.setdefault("capacity_bytes", 16 * MiB)
    return SwapStore([tmp_path / f"swap{i}" for i in range(npaths)], backend=backend, **kw)


def rand_bytes(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def rand_tensor(n_elems, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        return torch.randint(-128, 128, (n_elems,), dtype=torch.int8, generator=g)
    return torch.randn(n_elems, generator=g).to(dtype)


def unaligned(t):
    """A copy of t whose data pointer is NOT 4 KiB-aligned (forces the staged path)."""
    nbytes = t.numel() * t.element_size()
    raw = torch.empty(nbytes + KB4 + 64, dtype=torch.uint8)
    start = (-raw.data_ptr()) % KB4 + 64
    out = raw[start:start + nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % KB4 != 0
    return out


SIZES = [1, 3, 4095, 4096, 4097, 65535, 65536, 65537, 3 * 65536 + 4096, 1 * MiB + 5, 5 * MiB - 1]


@pytest.mark.parametrize("npaths", [1, 3])
def test_round_trip_sizes_bit_exact(tmp_path, backend, npaths):
    with make_store(tmp_path, backend, npaths, stripe_bytes=128 * 1024) as s, HostPool(16 * MiB) as pool:
        for i, n in enumerate(SIZES):
            x = rand_bytes(n, seed=i)
            for how, src in (("plain", unaligned(x)), ("aligned", None)):
                key = (n, how)
                if src is None:
                    buf = pool.acquire(n, block=False)
                    buf.tensor.copy_(x)
                    src = buf.tensor
                s.write(key, src).wait()
                # Read back both ways: into unaligned memory and into a pool buffer (zero-copy).
                y = unaligned(torch.zeros(n, dtype=torch.uint8))
                s.read(key, y).wait()
                assert torch.equal(y, x), (n, how)
                with pool.acquire(n, block=False) as dst:
                    dst.tensor.fill_(0)
                    s.read(key, dst.tensor).wait()
                    assert torch.equal(dst.tensor, x), (n, how)
                if how == "aligned":
                    buf.release()
        if npaths == 3:
            used = [p["used_bytes"] for p in s.stats()["paths"]]
            assert all(u > 0 for u in used), used  # large tensors were striped over every path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("npaths", [1, 3])
def test_round_trip_dtypes(tmp_path, backend, dtype, npaths):
    with make_store(tmp_path, backend, npaths, stripe_bytes=64 * 1024) as s:
        for i, n in enumerate([1, 1000, 333_333]):
            x = rand_tensor(n, dtype, seed=i).view(-1, 1) if n % 2 else rand_tensor(n, dtype, seed=i)
            s.write(("t", i), x).wait()
            assert s.meta(("t", i)) == (x.numel() * x.element_size(), dtype, tuple(x.shape))
            y = torch.empty_like(x)
            s.read(("t", i), y).wait()
            assert torch.equal(y.view(torch.uint8) if dtype != torch.int8 else y,
                               x.view(torch.uint8) if dtype != torch.int8 else x)


def test_non_contiguous_source_and_zero_size(tmp_path, backend):
    with make_store(tmp_path, backend) as s:
        x = torch.arange(64 * 1024, dtype=torch.float32).view(256, 256).t()
        s.write("t", x).wait()
        y = torch.empty(256, 256)
        s.read("t", y).wait()
        assert torch.equal(y, x.contiguous())
        s.write("empty", torch.empty(0)).wait()
        s.read("empty", torch.empty(0)).wait()
        with pytest.raises(ValueError, match="out has 4 bytes"):
            s.read("t", torch.empty(1))
        with pytest.raises(KeyError, match="nope"):
            s.read("nope", torch.empty(1))


def test_round_trip_256mib(tmp_path, backend):
    if backend == "python":
        pytest.skip("the large case runs on the native engines; the fallback runs every other case")
    n = 256 * MiB
    with SwapStore(tmp_path / "big", backend=backend, capacity_bytes=n + MiB, block_size=4 * MiB,
                   queue_depth=8) as s, HostPool(n) as pool:
        with pool.acquire(n) as buf:
            x = buf.tensor
            x.copy_(rand_bytes(n))
            ref = x.clone()
            s.write("big", x).wait()
            x.zero_()
            s.read("big", x).wait()
            assert torch.equal(x, ref)


def test_many_concurrent_reads_and_writes(tmp_path, backend):
    with make_store(tmp_path, backend, 2, capacity_bytes=64 * MiB, stripe_bytes=100_000, queue_depth=8) as s:
        xs = {i: rand_bytes(1 + (i * 7919) % 700_000, seed=i) for i in range(40)}
        handles = [s.write(i, unaligned(x) if i % 2 else x) for i, x in xs.items()]
        for h in handles:
            h.wait()
        outs = {i: torch.empty_like(x) for i, x in xs.items()}
        handles = [s.read(i, outs[i]) for i in xs]
        # Overwrites of half the keys interleaved with reads of the others.
        new = {i: rand_bytes(xs[i].numel(), seed=1000 + i) for i in range(0, 40, 2)}
        handles += [s.write(i, x) for i, x in new.items()]
        for h in handles:
            h.wait()
        for i, x in xs.items():
            if i % 2:
                assert torch.equal(outs[i], x), i
        for i, x in new.items():
            y = torch.empty_like(x)
            s.read(i, y).wait()
            assert torch.equal(y, x), i

        # Several Python threads at once.
        errors = []

        def worker(tid):
            try:
                for j in range(10):
                    x = rand_bytes(10_000 + 4096 * j + tid, seed=tid * 100 + j)
                    s.write((tid, j), x).wait()
                    y = torch.empty_like(x)
                    s.read((tid, j), y).wait()
                    assert torch.equal(x, y)
                    s.free((tid, j))
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors


def test_read_after_write_is_ordered_without_waiting(tmp_path, backend):
    with make_store(tmp_path, backend) as s:
        x = rand_bytes(300_000)
        s.write("k", x)  # not waited
        y = torch.empty_like(x)
        s.read("k", y).wait()
        assert torch.equal(x, y)


def test_free_and_reuse(tmp_path, backend):
    with make_store(tmp_path, backend, capacity_bytes=1 * MiB) as s:
        x = rand_bytes(600_000)
        s.write("a", x).wait()
        with pytest.raises(SwapFullError, match=r"needs \d+ bytes.*free"):
            s.write("b", x)
        assert "b" not in s
        off = s._index["a"].pieces[0].offset
        s.free("a")
        assert s.stats()["paths"][0]["used_bytes"] == 0
        s.write("b", x).wait()
        assert s._index["b"].pieces[0].offset == off  # the freed extent is reused
        y = torch.empty_like(x)
        s.read("b", y).wait()
        assert torch.equal(x, y)
        with pytest.raises(KeyError):
            s.free("a")


def _corrupt(path, offset):
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ 0x40]), offset)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.parametrize("where", ["body", "tail"])
def test_checksum_corruption_detected(tmp_path, backend, where):
    with make_store(tmp_path, backend) as s:
        x = rand_bytes(200_000)
        s.write("k", x).wait()
        piece = s._index["k"].pieces[0]
        path = s.stats()["paths"][0]["file"]
        flip = piece.offset + (70_000 if where == "body" else 200_000 - 3)
        _corrupt(path, flip)
        y = torch.empty_like(x)
        with pytest.raises(ChecksumError) as ei:
            s.read("k", y).wait()
        msg = str(ei.value)
        assert "'k'" in msg and path in msg and "checksum mismatch" in msg
        chunk = 65536 if where == "body" else 196608  # offsets of the failing chunk
        assert f"at offset {piece.offset + chunk} " in msg
        # Unaligned destination goes through the staged path: same detection.
        with pytest.raises(ChecksumError):
            s.read("k", unaligned(y)).wait()


def test_checksum_chunks_inside_large_blocks(tmp_path, backend):
    """4 MiB blocks hold sixteen 256 KiB checksum chunks: a flipped byte in
    the ninth is named by that chunk's offset, read into a pool buffer (direct)
    or a plain tensor (staged: 1 MiB blocks of four chunks on the native
    engines), written either way."""
    with make_store(tmp_path, backend, block_size=4 * MiB, staging_bytes=8 * MiB, capacity_bytes=32 * MiB) as s:
        x = rand_bytes(6 * MiB + 123)
        pool = HostPool(8 * MiB)
        try:
            buf = pool.acquire(x.numel())
            buf.tensor[:x.numel()].copy_(x)
            for key, src in (("direct", buf.tensor[:x.numel()]), ("staged", unaligned(x))):
                s.write(key, src).wait()
                piece = s._index[key].pieces[0]
                _corrupt(s.stats()["paths"][0]["file"], piece.offset + 2 * MiB + 77)
                for dst in (buf.tensor[:x.numel()], unaligned(torch.empty_like(x))):
                    with pytest.raises(ChecksumError) as ei:
                        s.read(key, dst).wait()
                    assert f"at offset {piece.offset + 2 * MiB} (262144 bytes)" in str(ei.value), str(ei.value)
                buf.tensor[:x.numel()].copy_(x)
        finally:
            pool.close()


def test_staged_and_direct_writes_store_the_same_checksums(tmp_path, backend):
    """The same bytes written from a pool buffer (direct, its 1-byte tail
    staged) and from unaligned memory (staged in 256 KiB blocks) land as the
    same file bytes with the same CRC list, and read back verified either way."""
    n = 3 * MiB + 4097  # 12 chunks of 256 KiB, one of 4 KiB, an unaligned tail
    x = rand_bytes(n, seed=5)
    with make_store(tmp_path, backend, block_size=1 * MiB, capacity_bytes=8 * MiB) as s, \
            HostPool(4 * MiB) as pool, pool.acquire(n) as buf:
        buf.tensor.copy_(x)
        crcs, files = {}, {}
        for key, src in (("direct", buf.tensor), ("staged", unaligned(x))):
            h = s.write(key, src)
            # Direct: only the tail goes through a (4 KiB) slot; staged: all of it.
            assert [st.capacity > 4096 for st in h._staging] == [key == "staged"]
            h.wait()
            piece = s._index[key].pieces[0]
            crcs[key] = list(piece.crcs)
            with open(s.stats()["paths"][0]["file"], "rb") as f:
                f.seek(piece.offset)
                files[key] = f.read(n)
        assert files["direct"] == files["staged"] == bytes(x.numpy())
        assert crcs["direct"] == crcs["staged"] and len(crcs["direct"]) == 14
        for key in crcs:
            buf.tensor.zero_()
            s.read(key, buf.tensor).wait()
            assert torch.equal(buf.tensor, x), key


def key_sums(t, chunk):
    """The store's chunk rule, computed here: CRC32C of each ``chunk`` bytes
    from byte 0, cut at the 4 KiB floor of the size, then the unaligned tail."""
    n = t.numel() * t.element_size()
    aligned, p = n // KB4 * KB4, t.data_ptr()
    sums = [crc32c(p + o, min(o + chunk, aligned) - o) for o in range(0, aligned, chunk)]
    return array.array("I", sums + ([crc32c(p + aligned, n - aligned)] if n > aligned else []))


@pytest.mark.skipif(not native_available(), reason="CRC32C needs the native library")
@pytest.mark.parametrize("npaths", [1, 3])
def test_producer_sums_are_stored_as_given(tmp_path, backend, npaths):
    """Sums passed by the producer (write(crcs=)) are the ones kept: right
    ones equal what the store computes itself and read back verified, from
    pool buffers and unaligned memory, striped over paths (shares are whole
    chunks); a wrong one is kept as given and fails the read at its chunk; a
    wrong count is refused before anything is written."""
    with make_store(tmp_path, backend, npaths, capacity_bytes=48 * MiB) as s, HostPool(8 * MiB) as pool:
        C = s.sum_chunk_bytes
        assert C == 64 * 1024
        for n in (1, 4097, 3 * 65536 + 4096, 1 * MiB + 5, 5 * MiB - 1):
            x = rand_bytes(n, seed=n)
            with pool.acquire(n) as buf:
                buf.tensor.copy_(x)
                sums = key_sums(x, C)
                for src in (buf.tensor, unaligned(x)):
                    s.write(("own", n), src).wait()
                    s.write(("given", n), src, crcs=(ctypes.c_uint32 * len(sums))(*sums)).wait()
                    own = [c for p in s._index[("own", n)].pieces for c in p.crcs]
                    given = [c for p in s._index[("given", n)].pieces for c in p.crcs]
                    assert own == given == list(sums), (n, src is buf.tensor)
                    y = torch.zeros_like(x)
                    s.read(("given", n), y).wait()
                    assert torch.equal(x, y)
        # A wrong sum is kept as given: the read names its chunk.
        x = rand_bytes(1 * MiB, seed=3)
        bad = key_sums(x, C)
        bad[5] ^= 1
        s.write("bad", x, crcs=bad).wait()
        piece = next(p for p in s._index["bad"].pieces if p.rel <= 5 * C < p.rel + p.nbytes)
        with pytest.raises(ChecksumError) as ei:
            s.read("bad", torch.empty_like(x)).wait()
        assert f"at offset {piece.offset + 5 * C - piece.rel} " in str(ei.value)
        with pytest.raises(ValueError, match=r"'short'.*15 crcs given.*16 checksum chunks of 65536 bytes"):
            s.write("short", x, crcs=bad[:15])
        assert "short" not in s


def test_producer_sums_ignored_without_checksums(tmp_path, backend):
    with make_store(tmp_path, backend, checksum=False) as s:
        assert s.sum_chunk_bytes is None
        x = rand_bytes(10_000)
        s.write("k", x, crcs=[0, 0, 0]).wait()
        y = torch.empty_like(x)
        s.read("k", y).wait()
        assert torch.equal(x, y)


def test_staging_held_to_queue_depth_slots(tmp_path, backend):
    """A staged request holds at most queue_depth slots of staging memory
    (on the native engines slots of min(block, 256 KiB) bytes for writes and
    min(block, 1 MiB) for reads; whole blocks on the Python engine), however
    large it is: the engine keeps no more than that in flight."""
    native = backend != "python"
    block = 2 * MiB
    with make_store(tmp_path, backend, block_size=block, queue_depth=3, staging_bytes=16 * MiB,
                    capacity_bytes=32 * MiB) as s:
        x = rand_bytes(12 * MiB + 5, seed=9)
        h = s.write("k", unaligned(x))
        assert [b.capacity for b in h._staging] == [3 * (256 * 1024 if native else block)]
        h.wait()
        y = unaligned(torch.zeros_like(x))
        h = s.read("k", y)
        assert [b.capacity for b in h._staging] == [3 * (MiB if native else block)]
        h.wait()
        assert torch.equal(x, y)


def test_checksum_off_reads_without_verifying(tmp_path, backend):
    with make_store(tmp_path, backend, checksum=False) as s:
        x = rand_bytes(10_000)
        s.write("k", x).wait()
        _corrupt(s.stats()["paths"][0]["file"], s._index["k"].pieces[0].offset)
        y = torch.empty_like(x)
        s.read("k", y).wait()
        assert not torch.equal(x, y)


@pytest.mark.parametrize("err,code", [("ENOSPC", errno.ENOSPC), ("EIO", errno.EIO)])
def test_injected_write_error_is_precise(tmp_path, backend, err, code):
    with make_store(tmp_path, backend) as s:
        x = rand_bytes(5 * 65536 + 100)
        s._inject_fault("write", 3, err)
        h = s.write("k", x)
        with pytest.raises(SwapIOError) as ei:
            h.wait()
        e = ei.value
        assert e.errno == code
        msg = str(e)
        path = s.stats()["paths"][0]["file"]
        assert "'k'" in msg and path in msg and "65536 bytes" in msg and os.strerror(code) in msg
        assert f"at offset {2 * 65536} " in msg  # the third block
        with pytest.raises(SwapIOError):
            h.wait()  # the error stays with the handle
        assert "k" not in s  # a failed write never leaves a half-written key behind
        assert s.stats()["paths"][0]["used_bytes"] == 0
        s.write("k", x).wait()  # the store keeps working


def test_injected_read_error_and_short_transfers(tmp_path, backend):
    with make_store(tmp_path, backend) as s:
        x = rand_bytes(4 * 65536 + 77)
        s.write("k", x).wait()
        s._inject_fault("read", 2, "EIO")
        y = torch.empty_like(x)
        with pytest.raises(SwapIOError, match=r"read of key 'k' failed: read of 65536 bytes at offset \d+ .*"
                                              r"Input/output error") as ei:
            s.read("k", y).wait()
        assert ei.value.errno == errno.EIO
        s.read("k", y).wait()  # the key survives a failed read
        assert torch.equal(x, y)
        for op in ("write", "read"):
            s._inject_fault(op, 1, "short")  # half a block, then the retry completes it
            s.write("s", x).wait()
            z = torch.zeros_like(x)
            s.read("s", z).wait()
            assert torch.equal(x, z)


def test_fault_env_variable(tmp_path, backend, monkeypatch):
    monkeypatch.setenv("INFINITY_IO_FAULT", "write:1:ENOSPC")
    with make_store(tmp_path, backend) as s:
        with pytest.raises(SwapIOError) as ei:
            s.write("k", rand_bytes(5000)).wait()
        assert ei.value.errno == errno.ENOSPC and "No space left on device" in str(ei.value)


def test_preallocation_too_large_fails_at_open(tmp_path, backend):
    with pytest.raises(SwapFullError, match=r"too small: .* needs \d+ more bytes .* has \d+ bytes free") as ei:
        make_store(tmp_path, backend, capacity_bytes=1 << 60)
    assert str(tmp_path / "swap0") in str(ei.value)
    assert not (tmp_path / "swap0").exists()  # nothing left behind


def test_second_store_on_locked_directory_refused(tmp_path, backend):
    s1 = make_store(tmp_path, backend)
    with pytest.raises(StoreLockedError, match=rf"in use by another SwapStore \(pid {os.getpid()}"):
        make_store(tmp_path, backend)
    # Another process too.
    code = ("import sys; from infinity.io import SwapStore, StoreLockedError\n"
            f"try:\n SwapStore({str(tmp_path / 'swap0')!r}, backend='python')\n"
            "except StoreLockedError as e:\n print('LOCKED', e); sys.exit(0)\nsys.exit(1)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert r.returncode == 0 and "LOCKED" in r.stdout, r.stdout + r.stderr
    s1.close()
    make_store(tmp_path, backend).close()  # free again once the first store closed


def test_permissions_and_cleanup_only_own_files(tmp_path, backend):
    pre = tmp_path / "existing"
    pre.mkdir()
    pre.chmod(0o700)  # a group/world-accessible one is refused (test_io_swap_dir.py)
    (pre / "someone-elses.bin").write_bytes(b"keep me")
    fresh = tmp_path / "new" / "dir"
    old_umask = os.umask(0)
    try:
        s = SwapStore([pre, fresh], backend=backend, capacity_bytes=2 * MiB, block_size=65536)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700
    files = [p["file"] for p in s.stats()["paths"]]
    for f in files + [str(pre / ".infinity-swap.lock"), str(fresh / ".infinity-swap.lock")]:
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f
    s.write("k", rand_bytes(100)).wait()
    s.close()
    s.close()  # idempotent
    for f in files:
        assert not os.path.exists(f)
    assert sorted(os.listdir(pre)) == ["someone-elses.bin"]
    assert not fresh.exists() and (tmp_path / "new").exists()
    with pytest.raises(RuntimeError, match="closed"):
        s.write("k", rand_bytes(1))


def test_swap_file_held_by_a_live_process_is_not_touched(tmp_path, backend):
    """A file with a swap file's name whose flock is held is a live run's: the
    store neither reclaims nor reuses it (a dead run's is reclaimed:
    test_io_swap_dir.py)."""
    import fcntl
    d = tmp_path / "swap0"
    d.mkdir(mode=0o700)
    stale = d / f"swap-{os.getpid()}-0.bin"
    stale.write_bytes(b"old")
    fd = os.open(stale, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with make_store(tmp_path, backend) as s:
            assert s.stats()["paths"][0]["file"] != str(stale)
        assert stale.read_bytes() == b"old"
    finally:
        os.close(fd)


def _mount_tmpfs(path, size):
    if os.geteuid() != 0:
        return False
    path.mkdir(exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


def _mount_ext4_loop(path, image, size_mib):
    """An ext4 filesystem of ``size_mib`` MiB in a file, loop-mounted: O_DIRECT
    works there (tmpfs refuses it), so the direct path meets a real full disk."""
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4"):
        return False
    with open(image, "wb") as f:
        f.truncate(size_mib * MiB)
    if subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True).returncode != 0:
        return False
    path.mkdir(exist_ok=True)
    return subprocess.run(["mount", "-o", "loop", str(image), str(path)], capture_output=True).returncode == 0


@pytest.fixture(params=["tmpfs", "ext4-loop"])
def small_fs(tmp_path, request):
    """A real filesystem of about 8 MiB free."""
    mnt = tmp_path / "small"
    ok = _mount_tmpfs(mnt, "8m") if request.param == "tmpfs" else \
        _mount_ext4_loop(mnt, tmp_path / "small.img", 10)
    if not ok:
        pytest.skip(f"cannot mount a small {request.param} here (needs root)")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_real_small_filesystem_fills_up(small_fs, backend):
    # Preallocation: refused at open, naming path and bytes.
    with pytest.raises(SwapFullError, match=r"needs \d+ more bytes"):
        SwapStore(small_fs / "a", backend=backend, capacity_bytes=32 * MiB)
    # Growing on demand: the write that does not fit fails at once, the others stay readable.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tmpfs may refuse O_DIRECT: one warning, then buffered I/O
        s = SwapStore(small_fs / "b", backend=backend, block_size=65536, grow_bytes=1 * MiB)
    with s:
        x = rand_bytes(3 * MiB)
        s.write("x", x).wait()
        with pytest.raises(SwapFullError, match=r"needs \d+ more bytes.*filesystem has \d+ bytes free|"
                                                r"No space left"):
            s.write("y", rand_bytes(6 * MiB)).wait()
        y = torch.empty_like(x)
        s.read("x", y).wait()
        assert torch.equal(x, y)


def test_engine_reports_real_enospc(small_fs):
    """A write that outgrows a real filesystem (no preallocation) surfaces as ENOSPC
    from wait(), naming path, offset and bytes: the engine checks every completion."""
    from infinity.io.engine import READ, WRITE
    from infinity.io.fallback import PythonEngine
    engines = [PythonEngine(4, 1 * MiB)]
    if native_available():
        engines += [NativeEngine("threads", 4, 1 * MiB)]
        if _uring_ok():
            engines += [NativeEngine("io_uring", 4, 1 * MiB)]
    with HostPool(16 * MiB) as pool, pool.acquire(16 * MiB) as buf:
        for i, eng in enumerate(engines):
            path = str(small_fs / f"grow{i}.bin")
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fid = eng.register(fd, path)
                t = eng.submit(WRITE, fid, 0, buf.ptr, 16 * MiB)
                with pytest.raises(SwapIOError) as ei:
                    eng.wait(t)
                assert ei.value.errno == errno.ENOSPC, (eng, ei.value)
                assert path in str(ei.value) and "No space left on device" in str(ei.value)
                # And a read past the end of the file is an error, never zero-fill.
                t = eng.submit(READ, fid, 0, buf.ptr, 16 * MiB)
                with pytest.raises(SwapIOError, match="end of file"):
                    eng.wait(t)
            finally:
                eng.close()
                os.close(fd)
                os.unlink(path)


def _round_trip_warnings(path, backend):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with SwapStore(path, backend=backend, block_size=65536, grow_bytes=MiB) as s:
            for n in (1, 70_000):
                x = rand_bytes(n)
                s.write("x", x).wait()
                y = torch.empty_like(x)
                s.read("x", unaligned(y)).wait()
                s.read("x", y).wait()
                assert torch.equal(x, y)
            direct = s.direct[0]
    return direct, [str(m.message) for m in w if "O_DIRECT" in str(m.message)]


def test_o_direct_refused_falls_back_to_buffered_with_one_warning(tmp_path, backend, monkeypatch):
    import infinity.io.swap.store as ss
    real_open = os.open

    def no_direct(path, flags, *a, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(ss.os, "open", no_direct)
    monkeypatch.setattr(ss, "_warned", set(), raising=False)
    import infinity.io.host_pool as hp
    monkeypatch.setattr(hp, "_warned", set())
    direct, msgs = _round_trip_warnings(tmp_path / "nd", backend)
    assert not direct
    assert len(msgs) == 1 and "using buffered I/O" in msgs[0] and str(tmp_path / "nd") in msgs[0]


def test_tmpfs_round_trip(small_fs, backend):
    # Kernels >= 6.6 accept O_DIRECT on tmpfs; older ones refuse it: then exactly one warning.
    direct, msgs = _round_trip_warnings(small_fs / "c", backend)
    assert direct or len(msgs) <= 1


def test_fallback_used_when_native_disabled(tmp_path):
    code = ("import warnings, torch\nwarnings.simplefilter('always')\n"
            "from infinity.io import SwapStore\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            f" s = SwapStore({str(tmp_path / 'fb')!r}, capacity_bytes=1 << 20, block_size=65536)\n"
            "assert s.backend == 'python', s.backend\n"
            "assert any('pure-Python' in str(m.message) for m in w), [str(m.message) for m in w]\n"
            "x = torch.arange(1000.)\ns.write('x', x).wait()\ny = torch.empty(1000)\ns.read('x', y).wait()\n"
            "assert torch.equal(x, y)\nassert s.checksum_name == 'crc32'\ns.close()\nprint('OK')\n")
    env = dict(os.environ, INFINITY_NATIVE="0")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
