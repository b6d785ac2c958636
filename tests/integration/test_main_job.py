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


def test_main_job_without_matplotlib(tmp_path):
    """`pip install infinity` alone has no matplotlib: the demo still writes its
    metrics, says how to get the plots, and exits 0 (issue 35, item 1)."""
    shim = tmp_path / "shim"
    shim.mkdir()
    # None in sys.modules makes `import matplotlib` raise ImportError, as when it is not installed.
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['matplotlib'] = None\n")
    out, res_path = tmp_path / "out", tmp_path / "res.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--quick", "--steps", "4",
                        "--plain-steps", "2", "--layers", "1", "--out", str(out), "--swap-dir", str(tmp_path / "swap"),
                        "--json", str(res_path)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(shim), str(ROOT)])))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3, 4]
    assert json.loads(res_path.read_text())["steps"] == 4
    assert not (out / "report.png").exists()
    hint = [line for line in r.stdout.splitlines() if "matplotlib" in line]
    assert len(hint) == 1, r.stdout
    assert "pip install matplotlib" in hint[0] and f"infinity report {out / 'metrics.jsonl'}" in hint[0], hint
