"""Speculative updates on several ranks ([Note: speculation on several
ranks] in infinity/engine/step/speculate.py): data parallelism and ZeRO
1-3 on 2 gloo ranks, overlap="backward" with clipping or fp16 against
overlap="step" in the same processes. Every loss, parameter, moment and
step count must be equal bit for bit, and every rank must have decided
the same (committed, replayed, skipped) at every step."""

import pytest
import torch
import torch.multiprocessing as mp

import spec_worker

WORLD = 2
# Loss multipliers: the gradient norm is about 1e-3 or 10 times the batch's,
# so a threshold of 0.1 clips on the x10 steps only (as in test_speculation.py).
SOME = (1e-3, 10.0, 1e-3, 1e-3, 10.0)
CLIPS = {"never": (1e9, (1.0,) * 5), "always": (1e-6, (1.0,) * 5), "some": (0.1, SOME)}
# (committed, replayed, waited) over 5 steps: a step after a clipped one waits, and so does one in the
# back-off of 1, 2, 4 ... steps after replays.
EXPECT = {"never": (5, 0, 0), "always": (0, 1, 4), "some": (2, 2, 1)}
OVERFLOW = (1.0, 1.0, 1.0, 1e6, 1.0, 1.0, 1.0, 1.0)  # step 3 overflows fp16 (maybe step 0 too: loss scale 2^16)


def case(stage, clip=None, **kw):
    c = dict(stage=stage, **kw)
    if clip is not None:
        c["clip"], c["factors"], c["expect"] = CLIPS[clip][0], CLIPS[clip][1], EXPECT[clip]
    return c


# Stage 2 with the parameters on the device: its copies are gathered on the device group, after a
# rollback too ([Note: where the updated copies are gathered] in infinity/engine/step/copy_gathers.py).
FAST = [case(0, "some"), case(1, "some"), case(2, "some", params="none"), case(3, "some", accum=2),
        case(2, dtype="fp16", factors=OVERFLOW, params="none"),
        case(1, "some", dtype="bf16", master_dtype="bf16")]  # a bf16 master: the own shard's, saved ahead
FULL = [case(s, c, **kw) for s in (0, 1, 2, 3) for c in ("never", "always", "some") for kw in ({}, {"accum": 3})] + \
    [case(s, "some", params="none") for s in (0, 1, 2)] + \
    [case(s, dtype="fp16", factors=OVERFLOW) for s in (0, 1, 3)] + [case(s, "some", dtype="bf16") for s in (0, 3)]


def spawn(tmp_path, cases) -> list:
    """Runs ``cases`` on WORLD ranks; per case, per rank: the worker's dict."""
    mp.spawn(spec_worker.run, args=(WORLD, str(tmp_path / "rendezvous"), cases, str(tmp_path)), nprocs=WORLD,
             join=True)
    return [[torch.load(tmp_path / f"case{i}_r{r}.pt") for r in range(WORLD)] for i in range(len(cases))]


def assert_same_bits(got: dict, want: dict, what) -> None:
    """Losses, parameters, moments and step counts bitwise equal."""
    assert got["losses"] == want["losses"], what
    assert list(got["state"]) == list(want["state"]), what
    for k in want["state"]:
        assert torch.equal(got["state"][k], want["state"][k]), (what, k)
    sa, sb = got["optimizer"]["state"], want["optimizer"]["state"]
    assert sorted(sa) == sorted(sb) and sa, what
    for i in sb:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sa[i][k], sb[i][k]), (what, i, k)


def check(c: dict, ranks: list) -> None:
    for r, res in enumerate(ranks):
        assert_same_bits(res["backward"], res["step"], (c, r))
        s = res["backward"]["speculation"]
        assert s["off"] is None and s["units_without_room"] == 0, (c, s)
        assert s["steps"] == s["committed"] + s["replayed"] + s["skipped"], s
        assert s["steps"] + s["waited"] == len(c["factors"]), s
        if "expect" in c:
            assert (s["committed"], s["replayed"], s["waited"]) == c["expect"], (c, s)
        else:  # fp16 with an overflow
            assert s["skipped"] == res["step"]["skipped_steps"] >= 1 and s["committed"] >= 1, (c, s)
            assert res["backward"]["skipped_steps"] == res["step"]["skipped_steps"]
            assert res["backward"]["loss_scale"] == res["step"]["loss_scale"]
    counts = [{k: v for k, v in res["backward"]["speculation"].items() if k != "replay_seconds"} for res in ranks]
    assert all(s == counts[0] for s in counts), counts  # every rank decided alike


def test_speculation_on_two_ranks_bitwise_as_overlap_step(tmp_path):
    """Stage 0 and ZeRO 1-3, clipping on some steps (stage 3 with
    accumulation), fp16 with an overflow at stage 2 (stage 2 with the
    parameters on the device), a bf16 master at stage 1."""
    for c, ranks in zip(FAST, spawn(tmp_path, FAST)):
        check(c, ranks)


@pytest.mark.slow
def test_speculation_on_two_ranks_full_matrix(tmp_path):
    """Stages 0-3 x clipping never / always / some x accumulation 1 and
    3, parameters on the device, fp16 overflows, bf16 compute."""
    for c, ranks in zip(FULL, spawn(tmp_path, FULL)):
        check(c, ranks)


def test_speculation_with_nvme_optimizer_state_on_two_ranks(tmp_path):
    """NVMe optimizer state ([Note: speculation with NVMe optimizer state]):
    stage 0 and ZeRO-2, clipping on some steps; at stage 3 the parameters
    on NVMe too ([Note: speculation with NVMe parameters]; stage 2's are in
    the slow test below)."""
    cases = [case(s, "some", optimizer="nvme", swap=str(tmp_path / "swap")) for s in (0, 2)] + \
        [case(3, "some", optimizer="nvme", params="nvme", swap=str(tmp_path / "swap"))]
    for c, ranks in zip(cases, spawn(tmp_path, cases)):
        check(c, ranks)


@pytest.mark.slow
def test_speculation_with_nvme_parameters_on_two_ranks(tmp_path):
    """Parameters on NVMe at stage 2 (the own shard inside the full copy)
    with the optimizer state on the host and on NVMe, stage 0 with both on
    NVMe (the aliased fp32 master), clipping on some and on every step."""
    sw = str(tmp_path / "swap")
    cases = [case(2, c, optimizer=o, params="nvme", swap=sw) for o in ("host", "nvme") for c in ("some", "always")] + \
        [case(0, "some", optimizer="nvme", params="nvme", swap=sw)]
    for c, ranks in zip(cases, spawn(tmp_path, cases)):
        check(c, ranks)
