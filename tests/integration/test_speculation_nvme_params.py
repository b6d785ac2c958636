"""Speculative updates with the parameters on NVMe ([Note: speculation
with NVMe parameters] in infinity/engine/step/speculate.py): a speculated
compute copy may be written back to its NVMe home before step() decides;
the undo buffer keeps the old bytes, so whatever the check finds every
loss, parameter, moment and step count is overlap="step"'s, bit for bit.
The fp32 master aliasing (both homes on NVMe, fp32, no ZeRO) is covered:
there the master is the compute copy."""

import pytest

from test_speculation import CLIPS, STEPS, assert_same_bits, run

SUBDIRS = iter(range(1 << 30))
OVERFLOW = (1.0, 1.0, 1e6, 1.0, 1.0, 1.0)  # step 2 overflows fp16


def nv(tmp_path, **kw) -> dict:
    """Config fields for NVMe parameter homes in a fresh swap folder of ``tmp_path``."""
    return dict(offload_params="nvme", swap_paths=[str(tmp_path / f"swap{next(SUBDIRS)}")], swap_block_size=4096,
                **kw)


def check(got, want, expect=None):
    assert_same_bits(got, want)
    s = got[3]["speculation"]
    assert s["off"] is None and s["units_without_room"] == s["units_without_disk"] == 0, s
    if expect is not None:
        assert (s["committed"], s["replayed"], s["waited"]) == expect, s
    return s


@pytest.mark.parametrize("opt,dtype,case", [("host", "fp32", "some"), ("nvme", "bf16", "some"),
                                            ("nvme", "fp32", "always")])
def test_clipping_bitwise_as_overlap_step(tmp_path, opt, dtype, case):
    clip, factors = CLIPS[case]
    kw = nv(tmp_path, offload_optimizer=opt, dtype=dtype)
    want = run("step", clip, factors, **kw)
    got = run("backward", clip, factors, **kw)
    s = check(got, want, {"some": None, "always": (0, 1, STEPS - 1)}[case])
    assert s["replayed"] >= 1 and (case == "always" or s["committed"] >= 1), s


def evicting_updates(monkeypatch):
    """Every update's compute copy (and an aliased master) is written back to
    its NVMe home and dropped from the host as the update ends: a speculated
    copy then reaches the disk before step() decides, the case the undo
    buffer is there for."""
    from infinity.engine.owners.host_cache import HostCache
    real = HostCache.close_update

    def close_update(self, u, sums=None):
        real(self, u, sums)
        while self.evict_one(None):
            pass
    monkeypatch.setattr(HostCache, "close_update", close_update)


@pytest.mark.parametrize("opt,dtype,case", [("nvme", "fp32", "some"), ("nvme", "bf16", "always"),
                                            ("host", "fp32", "some"), ("nvme", "fp16", None), ("host", "fp16", None)])
def test_speculated_copies_written_back_before_step(tmp_path, monkeypatch, opt, dtype, case):
    """fp32 with both homes on NVMe is the aliased master: a replay must
    read the master of before, which the speculated write-back overwrote
    on disk."""
    clip, factors = CLIPS[case] if case else (None, OVERFLOW)
    kw = nv(tmp_path, offload_optimizer=opt, dtype=dtype)
    steps = STEPS if case else len(OVERFLOW)
    want = run("step", clip, factors, steps=steps, **kw)
    evicting_updates(monkeypatch)
    got = run("backward", clip, factors, steps=steps, **kw)
    s = check(got, want)
    assert got[3]["evictions"] > 0
    assert s["committed"] + s["replayed"] + s["skipped"] == s["steps"] > 0 and s["replayed"] + s["skipped"] > 0, s
