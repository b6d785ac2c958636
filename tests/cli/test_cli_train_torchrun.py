"""``infinity train`` under ``torchrun`` (issue 35; [Note: infinity train on
several ranks] in infinity/cli/launch.py): a ZeRO-3 run file on 2 gloo ranks
trains, checkpoints and resumes exactly (the same losses and the same
weights as the uninterrupted run)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from cli_utils import run_file

from infinity.checkpoint.export import consolidate


def _torchrun(cwd, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "infinity", "train", *args]
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _losses(folder):
    rows = [json.loads(line) for line in (folder / "out" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _weights(folder):
    out = folder / "export"
    consolidate(str(folder / "ck"), str(out), dtype="fp32")
    from safetensors.torch import load_file
    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


ZERO3 = "zero_stage = 3\noffload_params = \"host\"\noffload_optimizer = \"host\""


def test_zero3_on_two_ranks_trains_and_saves(tmp_path):
    """The CI-sized run: one torchrun of 2 steps, rank 0 alone writes metrics, one checkpoint."""
    run_file(tmp_path, steps=2, runtime=ZERO3, extra='[checkpoint]\ndir = "ck"')
    r = _torchrun(tmp_path, "run.toml")
    assert sorted(_losses(tmp_path)) == [1, 2]
    assert r.stderr.count("infinity train: step 2") == 1, r.stderr[-2000:]  # one summary: rank 0's
    assert len(_weights(tmp_path)) > 0


@pytest.mark.slow
def test_zero3_on_two_ranks_trains_and_resumes_exactly(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    full.mkdir()
    run_file(full, steps=4, runtime=ZERO3, extra='[checkpoint]\ndir = "ck"\nevery = 2')
    shutil.copytree(full, part)
    _torchrun(full, "run.toml")
    _torchrun(part, "run.toml", "--steps", "2")
    _torchrun(part, "run.toml", "--resume")
    want, got = _losses(full), _losses(part)
    assert sorted(want) == [1, 2, 3, 4] and all(got[s] == want[s] for s in (3, 4)), (want, got)
    a, b = _weights(full), _weights(part)
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        assert torch.equal(a[k], b[k]), k
