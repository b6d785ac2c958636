"""scripts/gpu_check.sh --dry-run: every stage of the GPU check, tiny, on the
CPU, so the script and each Python entry point it calls are proven before the
few minutes of GPU time (the stages that need CUDA report SKIP)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STAGES = ["probe", "build", "smoke", "race", "sanitize", "bench", "nccl"]

# Stages that fail on the CPU today because they find real engine bugs (the
# scripts are right to fail): the test reports them as xfail, naming the bug,
# and fails on any other failing stage. Remove an entry with its fix; when
# none is left the test is strict.
KNOWN_FAILURES = {
    "smoke": "A1: saved weight.t() views keep a stale arena range (test_cuda_race[*-host-unequal])",
    "race": "A1: UnequalNet at the minimum budget, offload_params='host', prefetch_depth=1",
    "nccl": "world size 1: ZeRO-2 raises BudgetError in backward (host tier), ZeRO-1 drops the gradients",
}


def test_gpu_check_dry_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), PYTHON=sys.executable)
    env.pop("INFINITY_NATIVE", None)  # the script decides, from its own build
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text()
    lines = re.findall(r"^stage (\d) (\w+)\s+(PASS|FAIL|SKIP)\s+(\d+) s(.*)$", summary, re.M)
    assert [(int(n), name) for n, name, *_ in lines] == list(enumerate(STAGES)), summary
    for n, name, *_ in lines:
        assert (tmp_path / "out" / f"stage{n}_{name}.log").is_file(), name
    failed = {name: f"stage {n} {name}: {status}{rest}" for n, name, status, _, rest in lines if status == "FAIL"}
    unknown = [v for k, v in failed.items() if k not in KNOWN_FAILURES]
    assert not unknown, "\n".join(unknown) + "\n--- last output ---\n" + log[-4000:]
    if failed:
        assert proc.returncode == 1, log[-4000:]
        pytest.xfail("; ".join(f"{k}: {KNOWN_FAILURES[k]}" for k in failed))
    assert proc.returncode == 0, log[-4000:]
