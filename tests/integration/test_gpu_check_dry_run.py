"""scripts/gpu/check.sh --dry-run: every stage of the GPU check, tiny, on the
CPU, so the script and each Python entry point it calls are proven before the
few minutes of GPU time (the stages that need CUDA report SKIP)."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAGES = ["probe", "build", "smoke", "race", "sanitize", "bench", "nccl"]

def test_gpu_check_dry_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable)
    env.pop("INFINITY_NATIVE", None)  # the script decides, from its own build
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu" / "check.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text()
    lines = re.findall(r"^stage (\d) (\w+)\s+(PASS|FAIL|SKIP)\s+(\d+) s(.*)$", summary, re.M)
    assert [(int(n), name) for n, name, *_ in lines] == list(enumerate(STAGES)), summary
    for n, name, *_ in lines:
        assert (tmp_path / "out" / f"stage{n}_{name}.log").is_file(), name
    failed = [f"stage {n} {name}: {status}{rest}" for n, name, status, _, rest in lines if status == "FAIL"]
    assert not failed, "\n".join(failed) + "\n--- last output ---\n" + log[-4000:]
    skipped = [name for _, name, status, *_ in lines if status == "SKIP"]
    assert skipped == ["sanitize"], summary  # the only stage that cannot run without CUDA
    assert proc.returncode == 0, log[-4000:]
