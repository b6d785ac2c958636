"""`infinity stress --quick` (issue 21): one case of each scenario family,
each in its own processes: budget squeeze, RAM squeeze (simulated signal),
pinned-memory squeeze, disk faults (EIO, short I/O, a corrupt extent then
an exact resume; where root can loop-mount ext4: a full checkpoint disk, the
swap filesystem unmounted and its device gone mid-run, a too-small swap
filesystem), process faults (SIGKILL, SIGTERM and SIGINT mid-step, SIGKILL
mid-save, then an exact resume on the same swap folder) and a short soak."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_quick_stress_passes_every_scenario(tmp_path):
    r = subprocess.run([sys.executable, "-m", "infinity", "stress", "--quick", "--out", str(tmp_path / "out"),
                        "--swap-path", str(tmp_path / "swap")], capture_output=True, text=True, timeout=1800,
                       cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    rows = json.loads((tmp_path / "out" / "stress.json").read_text())
    assert [row["name"].split(" (")[0] for row in rows] == ["budget squeeze", "RAM squeeze", "pinned-memory squeeze",
                                                            "disk faults", "process faults", "soak"]
    failed = {row["name"]: [k for k, ok in row["checks"].items() if not ok] for row in rows if not row["passed"]}
    assert not failed, (failed, r.stdout[-3000:], r.stderr[-3000:])
    assert r.returncode == 0
    assert not (tmp_path / "swap").exists()  # the scenarios' swap files are gone
    disk = next(row for row in rows if row["name"] == "disk faults")
    assert "checksum mismatch in" in disk["first_error"] and "at offset" in disk["first_error"]
