"""The estimator's peaks per tier within ±10% of the measured peaks
(issue 20): host and NVMe placements, ZeRO 0 and 3 on 2 ranks, activation
checkpointing on and off, two batch sizes, a Hugging Face Llama with SDPA at
sequence 2048 (scripts/bench/bench_estimate.py).
Each measured peak is the median of three runs: one run's RSS was seen 10%
above its usual value on a CI machine (the page cache's share of torch's
libraries moves it), and a single outlier must not decide the row."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# Each group under its own timeout. CI runs one host, one NVMe with checkpointing and one ZeRO-3 NVMe row of
# the six GPT runs, and the Hugging Face Llama with SDPA at sequence 2048; the other three GPT rows are slow
# (the benchmark runs all of them).
GROUPS = [pytest.param("0,3,5", 3, id="gpt"), pytest.param("1,2,4", 3, id="gpt-rest", marks=pytest.mark.slow),
          pytest.param("6", 1, id="llama-sdpa-2048")]


@pytest.mark.parametrize("only,count", GROUPS)
def test_estimate_is_within_ten_percent_of_every_measured_peak(tmp_path, only, count):
    if only == "6":
        pytest.importorskip("transformers")
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench" / "bench_estimate.py"), "--repeats", "3",
                        "--only", only, "--json", str(out)],
                       capture_output=True, text=True, timeout=900, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    rows = json.loads(out.read_text())
    assert len(rows) == count, r.stdout + r.stderr[-3000:]
    for row in rows:
        c, m = row["config"], row["measured"]
        assert m["device"] > 0 and m["host"] > 0 and m["rss"] > 0
        assert (m["nvme"] > 0) == (c["place"] == "nvme")
        for tier, err in row["error"].items():
            assert abs(err) <= 0.10, (c, tier, row["estimate"][tier], m[tier], row["runs"])
    assert r.returncode == 0 and "PASS" in r.stdout
