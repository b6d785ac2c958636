"""Speculative updates ([Note: speculative updates] in
infinity/engine/step/speculate.py): overlap="backward" with clipping or fp16
runs each update during backward and checks it at step(). Whatever the
check finds, every loss, every final tensor, every moment and step count
must be overlap="step"'s, bit for bit."""

import dataclasses
import threading
import warnings

import pytest
import torch

import infinity
from infinity.engine.plan.placement import host_need, undo_bytes, undo_keeps_compute
from engine_utils import batches, unequal_net

STEPS = 8
# Loss multipliers per step: the gradient norm is about 1e-3 or about 10 of
# the same batch's, so a threshold of 0.1 clips on steps 2 and 6 only.
SOME = (1e-3, 1e-3, 10.0, 1e-3, 1e-3, 1e-3, 10.0, 1e-3)
CLIPS = {"never": (1e9, (1.0,) * STEPS), "always": (1e-6, (1.0,) * STEPS), "some": (0.1, SOME)}


def tiny():
    return unequal_net(hidden=(16, 8, 24, 8))


def make(overlap, clip, accum=1, **kw):
    cfg = dict(device="cpu", dtype="fp32", offload_params="host", offload_optimizer="host", host_memory="64MiB",
               overlap=overlap, max_grad_norm=clip, grad_accumulation_steps=accum)
    cfg.update(kw)
    return infinity.initialize(tiny(), infinity.Config(**cfg), lr=1e-2, weight_decay=0.1)


def train(model, opt, factors, steps, accum=1, first=0) -> list:
    """Optimizer steps ``first`` .. ``steps - 1`` (the data and the loss
    multipliers are those of each step); returns the losses."""
    losses, data = [], batches(steps * accum, b=1)
    for i in range(first * accum, steps * accum):
        x, y = data[i]
        loss = model(x, y) * factors[i // accum] / accum
        opt.scale_loss(loss).backward()
        losses.append(loss.item())
        if (i + 1) % accum == 0:
            opt.step()
            opt.zero_grad()
    return losses


def finish(model, opt, losses) -> tuple:
    """(losses, full state dict, optimizer state dict, stats); closes the engine."""
    try:
        sd = {k: v.clone() for k, v in infinity.full_state_dict(model).items()}
        return losses, sd, opt.state_dict(), infinity.stats(model)
    finally:
        infinity.close(model)


def run(overlap, clip, factors, steps=STEPS, accum=1, **kw):
    """Trains tiny() for ``steps`` optimizer steps; returns :func:`finish`'s tuple."""
    model, opt = make(overlap, clip, accum, **kw)
    try:
        losses = train(model, opt, factors, steps, accum)
    except BaseException:
        infinity.close(model)
        raise
    return finish(model, opt, losses)


def assert_same_bits(a, b):
    """Losses, parameters, moments and step counts bitwise equal."""
    assert a[0] == b[0], (a[0], b[0])
    assert list(a[1]) == list(b[1])
    for k in a[1]:
        assert torch.equal(a[1][k], b[1][k]), k
    sa, sb = a[2]["state"], b[2]["state"]
    assert sorted(sa) == sorted(sb)
    for i in sa:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[i][k], sb[i][k]), (i, k)


@pytest.mark.parametrize("params", ["none", "host"])
@pytest.mark.parametrize("case", sorted(CLIPS))
def test_clipping_bitwise_as_overlap_step(case, params):
    clip, factors = CLIPS[case]
    want = run("step", clip, factors, offload_params=params)
    got = run("backward", clip, factors, offload_params=params)
    assert_same_bits(got, want)
    s = got[3]["speculation"]
    assert s["off"] is None and s["units_without_room"] == 0
    assert s["steps"] == s["committed"] + s["replayed"] + s["skipped"]
    assert s["steps"] + s["waited"] == STEPS
    if case == "never":
        assert s["committed"] == STEPS, s
    elif case == "always":  # the first step replays; every later one follows a clipped step, so waits
        assert (s["committed"], s["replayed"], s["waited"]) == (0, 1, STEPS - 1), s
    else:  # steps 2 and 6 clip: 0, 1 commit; 2 replays; 3 waits; 4, 5 commit; 6 replays; 7 waits
        assert (s["committed"], s["replayed"], s["waited"]) == (4, 2, 2), s


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("accum", [1, 3])
def test_accumulation_and_compute_dtypes(accum, dtype):
    clip, factors = CLIPS["some"]
    want = run("step", clip, factors, steps=6, accum=accum, dtype=dtype)
    got = run("backward", clip, factors, steps=6, accum=accum, dtype=dtype)
    assert_same_bits(got, want)
    s = got[3]["speculation"]
    assert s["committed"] >= 1 and s["replayed"] >= 1, s


def test_fp16_overflow_rolls_back_and_skips():
    """fp16: a step whose gradients overflow is skipped by both; the
    speculative updates that ran with the infinite gradients are undone."""
    factors = (1.0, 1.0, 1e6, 1.0, 1.0, 1.0)  # step 2 overflows fp16 (loss scale 2^16)
    want = run("step", None, factors, steps=6, dtype="fp16")
    got = run("backward", None, factors, steps=6, dtype="fp16")
    assert_same_bits(got, want)
    assert got[3]["skipped_steps"] == want[3]["skipped_steps"] >= 1
    assert got[3]["loss_scale"] == want[3]["loss_scale"]
    s = got[3]["speculation"]
    assert s["skipped"] >= 1 and s["committed"] >= 1, s
    assert all(torch.isfinite(v).all() for v in got[1].values())


@pytest.mark.parametrize("params", ["none", "host"])
def test_fp32_non_finite_norm_restores_the_compute_copy_from_the_master(params):
    """fp32 compute with host state keeps no compute bytes in the undo state
    (the copy is the master's bits: ``undo_keeps_compute``); a skipped step
    (a non-finite norm) restores the copy from the master's saved bytes,
    and training goes on as overlap="step"'s, bit for bit."""
    factors = (1.0, 1.0, float("inf"), 1.0, 1.0, 1.0)  # step 2: an infinite loss, a non-finite norm
    want = run("step", 1.0, factors, steps=6, offload_params=params)
    got = run("backward", 1.0, factors, steps=6, offload_params=params)
    assert_same_bits(got, want)
    assert got[3]["skipped_steps"] == want[3]["skipped_steps"] == 1
    s = got[3]["speculation"]
    assert s["skipped"] == 1 and s["committed"] >= 1, s
    model, _ = make("backward", 1.0, offload_params=params)
    try:
        modes = infinity.api.engine_of(model).modes
        assert not undo_keeps_compute(modes) and undo_keeps_compute(dataclasses.replace(modes, dtype=torch.bfloat16))
    finally:
        infinity.close(model)


def test_undo_state_without_room_waits_for_step():
    """A host budget with room for the undo state of only some units: the
    others wait for step() (said once), and the bytes are still overlap="step"'s."""
    clip, factors = CLIPS["some"]
    cfg = infinity.Config(device="cpu", dtype="fp32", offload_params="host", offload_optimizer="host",
                          overlap="backward", max_grad_norm=clip)
    model, _ = infinity.initialize(tiny(), cfg)
    eng = infinity.api.engine_of(model)
    need = host_need([u.place for u in eng.units], eng.modes)
    largest = max(undo_bytes(u.place, eng.modes) for u in eng.units if u.place.trainable)
    infinity.close(model)
    budget = need.minimum + need.undo_bytes - largest  # room for all undo states but the largest unit's
    assert need.undo_bytes > largest
    want = run("step", clip, factors, host_memory=budget)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = run("backward", clip, factors, host_memory=budget)
    assert_same_bits(got, want)
    said = [w for w in caught if "no room for the undo state" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    s = got[3]["speculation"]
    assert s["units_without_room"] > 0 and s["committed"] >= 1 and s["replayed"] >= 1, s
    assert got[3]["peak_bytes"]["host"] <= budget


def test_unavailable_combinations_say_why(tmp_path):
    """The optimizer on the device (torch's, no undo state): the updates wait for step(), and stats() says why."""
    clip, factors = CLIPS["some"]
    got = run("backward", clip, factors, steps=2, offload_params="none", offload_optimizer="none")
    s = got[3]["speculation"]
    assert s["steps"] == 0 and "offload_optimizer='none'" in s["off"], s
    assert run("backward", None, factors, steps=1)[3]["speculation"]["off"] is None  # not needed, not off


@pytest.mark.parametrize("blocking", [True, False])
def test_checkpoint_across_a_replayed_step(tmp_path, blocking):
    """A checkpoint saved after the replayed step 2 (blocking, or in the
    background while step 3's updates run) and resumed in a new engine
    ends where the uninterrupted overlap="step" run does."""
    clip, factors = CLIPS["some"]
    want = run("step", clip, factors)
    model, opt = make("backward", clip)
    losses = train(model, opt, factors, 3)
    assert infinity.stats(model)["speculation"]["replayed"] == 1
    path = infinity.save_checkpoint(str(tmp_path), model, opt, blocking=blocking)
    losses += train(model, opt, factors, 5, first=3)  # speculating while a background save reads
    if not blocking:
        path = path.wait()
    assert_same_bits(finish(model, opt, losses), run("step", clip, factors, steps=5))
    model, opt = make("backward", clip)
    infinity.load_checkpoint(path, model, opt)
    assert_same_bits(finish(model, opt, losses[:3] + train(model, opt, factors, STEPS, first=3)), want)


@pytest.mark.parametrize("where", ["rollback", "redo"])
def test_a_fault_during_a_replay_fails_the_engine_with_nothing_mixed(tmp_path, monkeypatch, where):
    """A fault while step 2's speculation is rolled back (the second unit's
    restore) or redone (the second unit's update): step() raises that fault,
    every later call EngineFailedError naming it (no mix of replayed and
    speculated units is served), and the checkpoint of before the step
    resumes to overlap="step"'s bytes."""
    from infinity.engine.step import speculate
    clip, factors = CLIPS["some"]
    want = run("step", clip, factors)
    model, opt = make("backward", clip)
    losses = train(model, opt, factors, 2)
    path = infinity.save_checkpoint(str(tmp_path), model, opt)
    calls = []

    def failing(real):
        def fn(*a, **kw):
            if threading.current_thread() is threading.main_thread():  # the replay, not the speculation
                calls.append(1)
                if len(calls) == 2:
                    raise RuntimeError(f"injected fault in the {where}")
            return real(*a, **kw)
        return fn

    if where == "rollback":
        monkeypatch.setattr(speculate, "_restore", failing(speculate._restore))
    else:
        monkeypatch.setattr(opt.updater, "run", failing(opt.updater.run))
    fail_step_2(model, opt, where, calls, monkeypatch)
    model, opt = make("backward", clip)
    infinity.load_checkpoint(path, model, opt)
    assert_same_bits(finish(model, opt, losses + train(model, opt, factors, STEPS, first=2)), want)


def fail_step_2(model, opt, where, calls, monkeypatch) -> None:
    """Step 2 (clipped) with a fault injected in its ``where``: step() raises
    it after two replay calls, every later call EngineFailedError; closes the engine."""
    from infinity.engine.faults import EngineFailedError
    x, y = batches(3, b=1)[2]
    opt.scale_loss(model(x, y) * SOME[2]).backward()
    with pytest.raises(RuntimeError, match=f"injected fault in the {where}"):
        opt.step()
    assert len(calls) == 2
    for call in (opt.step, lambda: model(x, y), opt.state_dict, lambda: infinity.full_state_dict(model)):
        with pytest.raises(EngineFailedError, match=f"injected fault in the {where}"):
            call()
    monkeypatch.undo()
    infinity.close(model)


def test_speculated_shares_of_the_norm_are_taken_in_their_jobs(monkeypatch):
    """Clipping that never triggers: each speculated unit's share of the norm
    is taken by its update's job, on a worker thread alone (num_threads=1),
    and step() sums it instead of reading the gradients again (See [Note: the
    norm's shares have fixed bits] in grad_norm.py); the bits are still
    overlap="step"'s."""
    from infinity.engine.owners import grad_norm, grads
    calls = []  # (on the main thread, num_threads)
    real = grad_norm.unit_part

    def spy(grad, ranges, num_threads=0):
        calls.append((threading.current_thread() is threading.main_thread(), num_threads))
        return real(grad, ranges, num_threads)

    monkeypatch.setattr(grads, "unit_part", spy)
    monkeypatch.setattr(grad_norm, "unit_part", spy)
    clip, factors = CLIPS["never"]
    want = run("step", clip, factors)
    in_step = len(calls)
    assert in_step > 0 and all(main for main, _ in calls)
    calls.clear()
    got = run("backward", clip, factors)
    assert_same_bits(got, want)
    assert got[3]["speculation"]["committed"] == STEPS
    in_jobs = [n for main, n in calls if not main]
    assert in_jobs and set(in_jobs) == {1}, calls
    assert len(in_jobs) == len(calls) == in_step, (in_step, calls)  # step() reads none again
