"""The README's main job, short (issue 24): `scripts/demo.py --quick` learns
readable text through infinity with NVMe swap, runs plain PyTorch beside it,
holds its budgets, and its step accounting adds up."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_main_job(tmp_path):
    out, res_path = tmp_path / "out", tmp_path / "res.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--quick", "--out", str(out),
                        "--swap-dir", str(tmp_path / "swap"), "--json", str(res_path)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(res_path.read_text())
    # Bytes of English: a model that learnt only their frequencies is > 2 nats below uniform guessing.
    assert abs(res["loss_start"] - math.log(256)) < 0.2
    assert res["loss_end"] < res["loss_start"] - 1.0, res["losses"]
    assert res["budgets_held"]
    for tier in ("device", "host"):
        assert 0 < res["peak_bytes"][tier] <= res["budget_bytes"][tier]
    assert res["step_bytes_moved"]["nvme_read"] > 0  # the state really lived in the swap files
    assert res["plain_steps"] >= 2 and res["plain_step_s"] > 0 and res["overhead_ratio"] > 0
    acc = res["accounting"]
    assert abs(acc["parts_sum_s"] - acc["step_s"]) <= 0.10 * acc["step_s"], acc
    assert (out / "metrics.jsonl").stat().st_size > 0
    assert not (tmp_path / "swap").exists() or not any((tmp_path / "swap").iterdir())  # swap files removed
    for line in ("where the time of a step went", "overhead ratio", "lower bound", "sample after training",
                 "peak RSS"):
        assert line in r.stdout, line
