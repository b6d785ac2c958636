"""Speculative updates of a bf16 master ([Note: speculative updates] in
infinity/engine/step/speculate.py, its "Low-bit state"; [Note: a bf16 master
in the engine] in update.py): whatever the check at step() finds, every
loss, parameter, moment and step count is overlap="step"'s, bit for bit."""

import pytest

from test_speculation import CLIPS, STEPS, assert_same_bits, run

SEED = 1234


@pytest.mark.parametrize("case,opt_home", [("some", "host"), ("always", "host"), ("some", "nvme"),
                                           ("never", "nvme")])
def test_backward_overlap_with_clipping_speculates_and_gives_overlap_step_bytes(tmp_path, case, opt_home):
    """A bf16 master under overlap='backward' with clipping: each update runs
    during backward, its state copied ahead into the undo buffer; a clipped
    step rolls back (master, moments, step counts) and replays, and the
    stochastic rounding, keyed by the restored step count, gives
    overlap='step''s bytes: losses, parameters, moments, step counts."""
    clip, factors = CLIPS[case]
    kw = dict(dtype="bf16", master_dtype="bf16", seed=SEED, offload_optimizer=opt_home,
              swap_paths=[str(tmp_path / "swap")], swap_block_size=4096)
    want = run("step", clip, factors, **kw)
    got = run("backward", clip, factors, **kw)
    assert_same_bits(got, want)
    s = got[3]["speculation"]
    assert s["off"] is None and s["units_without_room"] == s["units_without_disk"] == 0, s
    assert s["steps"] + s["waited"] == STEPS
    if case == "never":
        assert s["committed"] == STEPS, s
    elif case == "always":
        assert s["committed"] == 0 and s["replayed"] >= 1, s
    else:
        assert s["committed"] >= 1 and s["replayed"] >= 1, s
