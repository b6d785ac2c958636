"""Swap rank folders are never reached through a symbolic link, dead-run
clean-up deletes only what a dead run's record proves its own, and a swap
path where no directory can be made is a named error (issue 34, item 2;
[Note: ownership of swap files] in infinity/io/swap/dir.py, [Note: a run's
record] in record.py)."""

import logging
import os
import re

import pytest
import torch
from paging_zoo import Chain, base_config

import infinity
from infinity.io import SwapPathError, SwapPathUnsafeError, SwapStore

MiB = 1 << 20
LOCK = ".infinity-swap.lock"


def store(path, **kw):
    return SwapStore(path, backend="python", block_size=65536, staging_bytes=256 * 1024, capacity_bytes=MiB, **kw)


def nvme_config(swap):
    return infinity.Config(**base_config(offload_params="nvme", offload_optimizer="nvme", device_memory=1 << 20,
                                         swap_paths=[str(swap)], swap_block_size=4096))


def model():
    torch.manual_seed(0)
    return Chain([16] * 4)


def test_rank_folder_that_is_a_symlink_is_refused_and_nothing_there_is_touched(tmp_path):
    swap, elsewhere = tmp_path / "swap", tmp_path / "elsewhere"
    swap.mkdir(mode=0o700)
    elsewhere.mkdir(mode=0o700)
    theirs = elsewhere / "swap-123-4.bin"  # another program's file with a swap file's name
    theirs.write_bytes(b"precious")
    os.symlink(elsewhere, swap / "rank0")
    link = re.escape(str(swap / "rank0"))
    with pytest.raises(SwapPathUnsafeError, match=rf"'{link}' is a symbolic link \(to '{re.escape(str(elsewhere))}'"
                                                  rf"\).*rm '{link}'"):
        infinity.initialize(model(), nvme_config(swap), lr=1e-2)
    assert sorted(os.listdir(elsewhere)) == ["swap-123-4.bin"] and theirs.read_bytes() == b"precious"
    assert os.path.islink(swap / "rank0")


def test_a_symlink_deeper_below_the_root_is_refused_and_the_root_itself_is_followed(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (real / "b").mkdir(mode=0o700)
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    os.symlink(real, root / "a")
    with pytest.raises(SwapPathUnsafeError, match=re.escape(f"'{root / 'a'}' is a symbolic link")):
        store(root / "a" / "b", roots=[root])
    assert os.listdir(real / "b") == []
    # The configured path itself may be a link (the user chose it): its rank folder is made in the real folder.
    os.symlink(real, tmp_path / "configured")
    with store(tmp_path / "configured" / "rank0", roots=[tmp_path / "configured"]) as s:
        s.write("k", torch.ones(8)).wait()
        assert os.path.isdir(real / "rank0") and LOCK in os.listdir(real / "rank0")
    assert not (real / "rank0").exists()  # made by the store, removed by it


def test_only_files_a_dead_runs_record_proves_ours_are_deleted(tmp_path, caplog):
    d = tmp_path / "swap"
    d.mkdir(mode=0o700)
    ours = d / "swap-4999999-0.bin"      # recorded by the dead run with its inode
    replaced = d / "swap-4999999-1.bin"  # recorded, but the name now leads to another file
    unrecorded = d / "swap-4999998-0.bin"
    for f in (ours, replaced, unrecorded):
        f.write_bytes(b"x" * 4096)
    st_ours, st_replaced = os.stat(ours), os.stat(replaced)
    os.unlink(replaced)
    replaced.write_bytes(b"someone else's")
    if os.stat(replaced).st_ino == st_replaced.st_ino:  # the filesystem reused the inode: make it differ
        os.rename(replaced, d / "tmp")
        replaced.write_bytes(b"someone else's")
        os.unlink(d / "tmp")
    (d / LOCK).write_text(f"4999999\nswap-4999999-0.bin {st_ours.st_dev} {st_ours.st_ino}\n"
                          f"swap-4999999-1.bin {st_replaced.st_dev} {st_replaced.st_ino}\n")
    with caplog.at_level(logging.WARNING, logger="infinity.io"), store(d) as s:
        assert s.stats()["paths"][0]["file"].startswith(str(d / f"swap-{os.getpid()}-"))
    assert not ours.exists()
    assert replaced.read_bytes() == b"someone else's" and unrecorded.read_bytes() == b"x" * 4096
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "reclaimed 2 file(s)" in said  # the dead lock and its recorded file
    assert "swap-4999998-0.bin" in said and "no dead run's record names it" in said, said


def test_the_proof_is_handed_on_by_a_store_that_dies_before_reclaiming(tmp_path, monkeypatch):
    """A store takes a dead run's lock and is killed before it removes the
    dead run's files: its own lock carries the dead run's entries, so the
    next store still removes them."""
    d = tmp_path / "swap"
    d.mkdir(mode=0o700)
    dead = d / "swap-4999999-0.bin"
    dead.write_bytes(b"x" * 4096)
    st = os.stat(dead)
    (d / LOCK).write_text(f"4999999\nswap-4999999-0.bin {st.st_dev} {st.st_ino}\n")

    left = []

    def killed(*a, **kw):  # stands for a SIGKILL once the lock is taken, before anything is reclaimed
        left.append((d / LOCK).read_text())
        raise KeyboardInterrupt

    from infinity.io.swap import path as swap_path
    with monkeypatch.context() as m:
        m.setattr(swap_path, "reclaim", killed)
        with pytest.raises(KeyboardInterrupt):
            store(d)
    assert dead.exists()
    mine = left[0].split("\n")
    assert mine[0] == str(os.getpid()) and f"swap-4999999-0.bin {st.st_dev} {st.st_ino}" in mine, left
    # What the SIGKILL leaves (no teardown): that lock, unflocked. The next store removes the file it hands on.
    (d / LOCK).write_text(left[0])
    with store(d):
        assert not dead.exists()


@pytest.mark.parametrize("path", ["/proc/nope", "/proc/self"])
def test_swap_path_where_no_directory_can_be_made_is_named(path):
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc here")
    with pytest.raises(SwapPathError) as e:
        infinity.initialize(model(), nvme_config(path), lr=1e-2)
    assert path in str(e.value) and "choose a swap path on a disk" in str(e.value), str(e.value)
