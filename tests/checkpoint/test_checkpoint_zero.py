"""Checkpoints under ZeRO (issue 19): saved on 2 gloo ranks at stages 0-3
(host and NVMe homes) and resumed on 2, bit-identical to the uninterrupted
run; resharded 2 ranks stage 3 NVMe -> 1 rank host and 1 -> 2 ranks stage 2,
equal to the uninterrupted run within 1e-6 relative (the gradient reduction
order differs with the world size, so not bitwise)."""

import torch
import torch.multiprocessing as mp

import checkpoint_worker

K = 3
SAME_WORLD = [
    {"name": "s0", "stage": 0},
    {"name": "s1", "stage": 1, "opt": "nvme"},
    {"name": "s2", "stage": 2, "overlap": "backward", "params": "none"},  # copies gathered on the device
    {"name": "s3", "stage": 3, "params": "nvme", "opt": "nvme"},
]


def _spawn(tmp_path, world, cases, which, tag):
    rdzv = str(tmp_path / f"rendezvous-{tag}")
    mp.spawn(checkpoint_worker.phase, args=(world, rdzv, cases, str(tmp_path), which, K), nprocs=world, join=True)


def _load(tmp_path, name, which):
    return torch.load(tmp_path / f"{name}-{which}.pt")


def test_two_ranks_every_stage_resume_bit_exactly(tmp_path, monkeypatch):
    # Chunk sums every 1 KiB: each rank reads (and checks) only its shard's ranges of the moments.
    monkeypatch.setenv("INFINITY_TEST_CHUNK_BYTES", "1024")
    for which in ("full", "first", "rest"):
        _spawn(tmp_path, 2, SAME_WORLD, which, which)
    for case in SAME_WORLD:
        full, first, rest = (_load(tmp_path, case["name"], w) for w in ("full", "first", "rest"))
        assert first["losses"] + rest["losses"] == full["losses"], case
        for k, v in full["state"].items():
            assert torch.equal(rest["state"][k], v), (case, k)
    # ZeRO-3 on 2 ranks: a rank reads its shard's ranges of the weights and the moments, about half the
    # checkpoint (plus the chunks at the shard's edges and the tensors too small to have chunks).
    s3 = _load(tmp_path, "s3", "rest")
    assert 0 < s3["read_bytes"] < 0.65 * s3["checkpoint_bytes"], s3["read_bytes"] / s3["checkpoint_bytes"]
    s0 = _load(tmp_path, "s0", "rest")
    assert s0["read_bytes"] > 0.9 * s0["checkpoint_bytes"]  # stage 0 keeps everything: it reads everything


def _close(a, b, rtol=1e-6):
    return (a - b).abs().max().item() <= rtol * max(1.0, b.abs().max().item())


def test_resharding_two_ranks_stage3_nvme_to_one_rank_host_and_back(tmp_path):
    down = {"name": "down", "stage": 3, "params": "nvme", "opt": "nvme"}
    up = {"name": "up", "stage": 0}
    _spawn(tmp_path, 2, [down], "full", "down-full")
    _spawn(tmp_path, 2, [down], "first", "down-first")
    _spawn(tmp_path, 1, [dict(down, stage=0, params="host", opt="host")], "rest", "down-rest")
    _spawn(tmp_path, 1, [up], "full", "up-full")
    _spawn(tmp_path, 1, [up], "first", "up-first")
    _spawn(tmp_path, 2, [dict(up, stage=2)], "rest", "up-rest")
    for name in ("down", "up"):
        full, first, rest = (_load(tmp_path, name, w) for w in ("full", "first", "rest"))
        got = first["losses"] + rest["losses"]
        assert all(abs(a - b) <= 1e-6 * abs(b) for a, b in zip(got, full["losses"])), (name, got, full["losses"])
        for k, v in full["state"].items():
            assert _close(rest["state"][k], v), (name, k)


def test_state_dict_and_load_state_dict_on_two_ranks_every_stage(tmp_path):
    """model.state_dict() / load_state_dict() under ZeRO (every rank calls
    them, as with FSDP) give and take the true values (issue 23)."""
    stages = [0, 1, 2, 3]
    mp.spawn(checkpoint_worker.state_dict_phase, args=(2, str(tmp_path / "rdzv-sd"), stages, str(tmp_path)),
             nprocs=2, join=True)
    for stage in stages:
        r = torch.load(tmp_path / f"sd-{stage}.pt")
        for k, v in r["want"].items():
            assert torch.equal(r["loaded"][k], v), (stage, k)
        assert r["read_raised"] == (stage == 3), stage  # ZeRO-3: a single read would be a collective
        assert r["after_step"].keys() == r["master"].keys()
        for k, v in r["after_step"].items():  # fp32 compute copies: the masters themselves
            assert torch.equal(v, r["master"][k]), (stage, k)


def test_a_locked_folder_refuses_the_save_on_every_rank(tmp_path):
    """Under ZeRO only rank 0 takes the lock; the refusal must reach every rank (none left waiting in a
    gather), and nothing is written. After the lock is dropped, the same ranks save."""
    rdzv = str(tmp_path / "rendezvous-locked")
    ctx = mp.start_processes(checkpoint_worker.locked_phase, args=(2, rdzv, str(tmp_path)), nprocs=2,
                             join=False, start_method="spawn")
    deadline = 600.0  # a hang is the failure this test looks for: never wait for ever (generous: a loaded machine)
    import time
    t0 = time.monotonic()
    while not ctx.join(timeout=5):
        if time.monotonic() - t0 > deadline:
            for p in ctx.processes:
                p.kill()
            raise AssertionError("save_checkpoint into a locked folder left a rank waiting")
    r0 = (tmp_path / "locked-0.txt").read_text().splitlines()
    r1 = (tmp_path / "locked-1.txt").read_text().splitlines()
    assert r0[0].startswith("CheckpointLockedError") and "another save" in r0[0], r0
    assert r1[0].startswith("RuntimeError") and "rank 0 could not prepare" in r1[0], r1
    assert "step-00000001" in r0[1] and not any(n.startswith(".step") for n in r0[1].split(",")), r0
