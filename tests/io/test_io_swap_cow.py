"""Copy-on-write keys of the swap store ([Note: copy-on-write keys] in
infinity/io/swap/store.py): a ``keep_old`` write leaves the old bytes on
disk until commit (freed) or rollback (the key's again, checksums and all)."""

import pytest
import torch

from infinity.io import SwapStore

MiB = 1 << 20


def store(tmp_path, capacity=1 * MiB):
    return SwapStore([tmp_path / "swap"], backend="python", block_size=64 * 1024, queue_depth=4,
                     staging_bytes=1 * MiB, capacity_bytes=capacity)


def read(s, key, like):
    out = torch.empty_like(like)
    s.read(key, out).wait()
    return out


def used(s) -> int:
    return s.stats()["paths"][0]["used_bytes"]


@pytest.mark.parametrize("reserved", [True, False])
def test_rollback_gives_the_old_bytes_back_and_commit_frees_them(tmp_path, reserved):
    old, new = torch.arange(50_000, dtype=torch.float32), -torch.arange(50_000, dtype=torch.float32)
    with store(tmp_path) as s:
        s.write("k", old).wait()
        one = used(s)
        assert not reserved or s.reserve("k", old.numel() * 4)
        s.write("k", new, keep_old=True).wait()
        assert used(s) == 2 * one and torch.equal(read(s, "k", new), new)
        s.rollback("k")
        assert used(s) == one and torch.equal(read(s, "k", old), old)  # checked against the old sums
        assert not reserved or s.reserve("k", old.numel() * 4)
        s.write("k", new, keep_old=True).wait()
        s.commit("k")
        assert used(s) == one and torch.equal(read(s, "k", new), new)


def test_a_new_key_rolled_back_is_gone_and_a_full_store_refuses_to_reserve(tmp_path):
    x = torch.zeros(300_000, dtype=torch.uint8)
    with store(tmp_path) as s:
        assert s.reserve("a", x.numel())
        s.write("a", x, keep_old=True).wait()
        s.rollback("a")
        assert "a" not in s and used(s) == 0
        s.write("a", x).wait()
        s.write("b", x).wait()
        assert s.reserve("a", x.numel())
        assert not s.reserve("b", x.numel())  # no room for a second copy: nothing reserved
        s.unreserve("a")
        assert used(s) == 2 * s._layout.paths[0].alloc.round(x.numel())
