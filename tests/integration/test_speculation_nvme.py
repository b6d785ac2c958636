"""Speculative updates with NVMe optimizer state ([Note: speculation with
NVMe optimizer state] in infinity/engine/step/speculate.py): the new state
goes to fresh extents, the old one stays on disk until step() decides.
Every loss, parameter, moment and step count must be overlap="step"'s, bit
for bit, whatever the check finds."""

import threading
import warnings

import pytest
import torch

import infinity
from test_speculation import CLIPS, STEPS, assert_same_bits, fail_step_2, finish, make, run, train

SUBDIRS = iter(range(1 << 30))


def nv(tmp_path, **kw) -> dict:
    """Config fields for NVMe optimizer state in a fresh folder of ``tmp_path``."""
    return dict(offload_optimizer="nvme", swap_paths=[str(tmp_path / f"swap{next(SUBDIRS)}")],
                swap_block_size=4096, **kw)


def swap_free(model) -> int:
    """Bytes free in the engine's swap files."""
    return sum(p["free_bytes"] for p in infinity.api.engine_of(model).nvme.store.stats()["paths"])


SLOW = pytest.mark.slow


@pytest.mark.parametrize("case,params", [("some", "none"), ("some", "host"), ("never", "host"), ("always", "host"),
                                         pytest.param("never", "none", marks=SLOW),
                                         pytest.param("always", "none", marks=SLOW)])
def test_clipping_bitwise_as_overlap_step(tmp_path, case, params):
    clip, factors = CLIPS[case]
    want = run("step", clip, factors, **nv(tmp_path, offload_params=params))
    got = run("backward", clip, factors, **nv(tmp_path, offload_params=params))
    assert_same_bits(got, want)
    s = got[3]["speculation"]
    assert s["off"] is None and s["units_without_room"] == s["units_without_disk"] == 0, s
    assert s["steps"] + s["waited"] == STEPS
    expect = {"never": (STEPS, 0, 0), "always": (0, 1, STEPS - 1), "some": (4, 2, 2)}[case]
    assert (s["committed"], s["replayed"], s["waited"]) == expect, s


def test_gradients_spilled_when_the_pool_cannot_hold_them_all(tmp_path):
    """A host budget a page below the pool's capacity: the gradients of the
    speculated units go to disk after their update (the norm's share taken
    first), and a replay reads them back; still overlap="step"'s bytes."""
    from infinity.engine.plan.placement import host_need
    clip, factors = CLIPS["some"]
    model, _ = make("backward", clip, **nv(tmp_path))
    eng = infinity.api.engine_of(model)
    budget = host_need([u.place for u in eng.units], eng.modes).capacity - 4096
    infinity.close(model)
    want = run("step", clip, factors, **nv(tmp_path, host_memory=budget))
    model, opt = make("backward", clip, **nv(tmp_path, host_memory=budget))
    assert not opt.schedule.spec.keep_grads
    got = finish(model, opt, train(model, opt, factors, STEPS))
    assert_same_bits(got, want)
    s = got[3]["speculation"]
    assert s["committed"] >= 1 and s["replayed"] >= 1, s


@pytest.mark.parametrize("accum,dtype", [(1, "bf16"), (3, "fp32")])
def test_accumulation_and_compute_dtypes(tmp_path, accum, dtype):
    clip, factors = CLIPS["some"]
    want = run("step", clip, factors, steps=6, accum=accum, **nv(tmp_path, dtype=dtype))
    got = run("backward", clip, factors, steps=6, accum=accum, **nv(tmp_path, dtype=dtype))
    assert_same_bits(got, want)
    s = got[3]["speculation"]
    assert s["committed"] >= 1 and s["replayed"] >= 1, s


def test_fp16_overflow_rolls_back_and_skips(tmp_path):
    """Step 2 overflows: the speculative state written during backward is
    dropped, the old extents (moments written before, or never) are read again."""
    factors = (1.0, 1.0, 1e6, 1.0, 1.0, 1.0)
    want = run("step", None, factors, steps=6, **nv(tmp_path, dtype="fp16"))
    got = run("backward", None, factors, steps=6, **nv(tmp_path, dtype="fp16"))
    assert_same_bits(got, want)
    assert got[3]["skipped_steps"] == want[3]["skipped_steps"] >= 1
    s = got[3]["speculation"]
    assert s["skipped"] >= 1 and s["committed"] >= 1, s


def test_swap_files_without_room_for_a_second_copy_wait_for_step(tmp_path):
    """Swap files filled after step 0 up to about one unit's second copy:
    the units that find no room wait for step() (said once), the others
    speculate, the bytes are overlap="step"'s, and every extent speculation
    took is given back."""
    clip, factors = CLIPS["some"]
    want = run("step", clip, factors, **nv(tmp_path))
    model, opt = make("backward", clip, **nv(tmp_path))
    try:
        losses = train(model, opt, factors, 1)
        store = infinity.api.engine_of(model).nvme.store
        free = swap_free(model)
        largest = max(3 * 4096 * -(-u.place.state_numel * 4 // 4096) for u in infinity.api.engine_of(model).units)
        store.write(("filler",), torch.zeros(free - largest - 4096, dtype=torch.uint8)).wait()
        keys = set(store.keys())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses += train(model, opt, factors, STEPS, first=1)
        # Gradients of the units that waited are spilled, new keys; nothing else stays taken.
        left = swap_free(model) + sum(-(-store.meta(k)[0] // 4096) * 4096 for k in set(store.keys()) - keys)
    except BaseException:
        infinity.close(model)
        raise
    got = finish(model, opt, losses)
    assert_same_bits(got, want)
    said = [w for w in caught if "no room for a second copy" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    s = got[3]["speculation"]
    assert s["units_without_disk"] > 0 and s["committed"] >= 1 and s["replayed"] >= 1, s
    assert left == largest + 4096


def test_a_disk_without_room_for_a_second_copy_starts_the_run(tmp_path, monkeypatch):
    """The filesystem has room for the state but not for its second copy:
    initialize does not refuse the run (as it did not before speculation
    with NVMe existed); the swap files are sized without the copy (units
    that then find no room wait for step(): the fallback test above), and
    the bytes are overlap="step"'s."""
    from infinity.io.swap import path as swap_path
    clip, factors = CLIPS["some"]
    want = run("step", clip, factors, **nv(tmp_path))
    grows = []
    real_grow = swap_path.SwapPath.grow

    def grow(self, nbytes, what):  # the first size asked for (with the copy) finds the disk too small
        grows.append(nbytes)
        if len(grows) == 1:
            raise swap_path.SwapFullError(28, f"swap path too small for {nbytes} bytes (test)")
        return real_grow(self, nbytes, what)
    monkeypatch.setattr(swap_path.SwapPath, "grow", grow)
    got = run("backward", clip, factors, **nv(tmp_path))
    assert_same_bits(got, want)
    assert len(grows) == 2 and grows[1] < grows[0], grows  # the second: without the copy's room


@pytest.mark.parametrize("blocking", [True, pytest.param(False, marks=SLOW)])
def test_checkpoint_across_a_replayed_step(tmp_path, blocking):
    """A checkpoint saved after the replayed step 2 (in the background while
    step 3's updates write their copies) resumes to overlap="step"'s bytes."""
    clip, factors = CLIPS["some"]
    want = run("step", clip, factors, **nv(tmp_path))
    model, opt = make("backward", clip, **nv(tmp_path))
    losses = train(model, opt, factors, 3)
    assert infinity.stats(model)["speculation"]["replayed"] == 1
    path = infinity.save_checkpoint(str(tmp_path / "ckpt"), model, opt, blocking=blocking)
    losses += train(model, opt, factors, 5, first=3)
    if not blocking:
        path = path.wait()
    assert_same_bits(finish(model, opt, losses), run("step", clip, factors, steps=5, **nv(tmp_path)))
    model, opt = make("backward", clip, **nv(tmp_path))
    infinity.load_checkpoint(path, model, opt)
    assert_same_bits(finish(model, opt, losses[:3] + train(model, opt, factors, STEPS, first=3)), want)


@pytest.mark.parametrize("where", ["rollback", "redo"])
def test_a_fault_during_a_replay_fails_the_engine_with_nothing_mixed(tmp_path, monkeypatch, where):
    """A fault while step 2 is rolled back (the second unit's keys mapped
    back) or redone (the second unit's update): step() raises it, every later
    call EngineFailedError, and the checkpoint of before resumes exactly."""
    from infinity.engine.owners.optstate import OptimizerState
    clip, factors = CLIPS["some"]
    want = run("step", clip, factors, **nv(tmp_path))
    model, opt = make("backward", clip, **nv(tmp_path))
    losses = train(model, opt, factors, 2)
    path = infinity.save_checkpoint(str(tmp_path / "ckpt"), model, opt)
    calls = []

    def maybe_fail() -> None:
        if threading.current_thread() is threading.main_thread():  # the replay, not the speculation
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError(f"injected fault in the {where}")

    if where == "rollback":
        real_settle = OptimizerState.settle_copy

        def settle(self, u, keep, fresh=False):
            if not keep:
                maybe_fail()
            return real_settle(self, u, keep, fresh)
        monkeypatch.setattr(OptimizerState, "settle_copy", settle)
    else:
        real_run = opt.updater.run

        def run_(*a, **kw):
            maybe_fail()
            return real_run(*a, **kw)
        monkeypatch.setattr(opt.updater, "run", run_)
    fail_step_2(model, opt, where, calls, monkeypatch)
    model, opt = make("backward", clip, **nv(tmp_path))
    infinity.load_checkpoint(path, model, opt)
    assert_same_bits(finish(model, opt, losses + train(model, opt, factors, STEPS, first=2)), want)
