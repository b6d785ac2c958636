"""``InfinityTrainer`` under ``torchrun --nproc-per-node 2`` (issue 35): the
Trainer neither moves nor DDP-wraps the managed model, and at ZeRO stages
0, 2 and 3 it logs the plain Trainer-with-DDP's losses and ends with its
weights (gloo ranks, one tiny Llama, the same data and seed)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

WORKER = Path(__file__).with_name("hf_ddp_worker.py")


def _run(tmp_path, which, stage):
    out = tmp_path / f"{which}{stage}.pt"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
           which, str(stage), str(out), str(tmp_path)]
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return torch.load(out)


def _check(tmp_path, stages):
    plain = _run(tmp_path, "plain", 0)
    for stage in stages:
        ours = _run(tmp_path, "ours", stage)
        assert ours["losses"] == pytest.approx(plain["losses"], rel=1e-6), stage
        assert len(ours["losses"]) == 3
        for k, v in plain["state"].items():
            torch.testing.assert_close(ours["state"][k], v, rtol=1e-5, atol=1e-6, msg=f"stage {stage}: {k}")


def test_trainer_at_stage_3_matches_the_plain_trainer_with_ddp(tmp_path):
    _check(tmp_path, [3])


@pytest.mark.slow
def test_trainer_at_stages_0_and_2_matches_the_plain_trainer_with_ddp(tmp_path):
    _check(tmp_path, [0, 2])
