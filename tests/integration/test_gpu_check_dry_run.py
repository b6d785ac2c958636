"""scripts/gpu/check.sh and scripts/gpu/bench_gpu.py --dry-run: the code paths
of the GPU check, tiny, on the CPU, so the scripts and each Python entry point
they call are proven before the few minutes of GPU time. CI runs a subset of
the stages (probe, nccl) with the packaging of the results, the plan, and the
bench's dry run; every stage runs in the slow test."""

import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu" / "check.sh"
STAGES = ["probe", "build", "smoke", "bench", "race", "sanitize", "nccl"]
LINE = re.compile(r"^stage (\d) (\w+)\s+(PASS|FAIL|SKIP)\s+(\d+) s(.*)$", re.M)


def check(tmp_path, *args, timeout=300):
    env = dict(os.environ, OUT=str(tmp_path / "out"), WORK=str(tmp_path / "work"), PYTHON=sys.executable)
    env.pop("INFINITY_NATIVE", None)  # the script decides, from its own build
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def results(tmp_path, proc, stages):
    """The summary's lines, after checking what $OUT holds: the tarball (a log
    per stage run), the summary, at most the profile; no stage failed."""
    log = proc.stdout + proc.stderr
    out = tmp_path / "out"
    assert {p.name for p in out.iterdir()} <= {"gpu_check.tgz", "summary.txt", "profile.json.gz"}, log[-3000:]
    summary = (out / "summary.txt").read_text()
    lines = LINE.findall(summary)
    assert [(int(n), name) for n, name, *_ in lines] == [(STAGES.index(s), s) for s in stages], summary
    with tarfile.open(out / "gpu_check.tgz") as tar:
        names = {Path(m.name).name for m in tar.getmembers()}
    for n, name, *_ in lines:
        assert f"stage{n}_{name}.log" in names, (name, names)
    assert "summary.txt" in names
    failed = [f"stage {n} {name}: {status}{rest}" for n, name, status, _, rest in lines if status == "FAIL"]
    assert not failed, "\n".join(failed) + "\n--- last output ---\n" + log[-4000:]
    return lines, names


def test_plan_fits_the_budget_and_only_names_a_stage(tmp_path):
    proc = check(tmp_path, "--dry-run", "--plan")  # the GPU run's plan, also from a dry run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = re.findall(r"^(\w+)\s+(\d+)\s+(\d+)$", proc.stdout, re.M)
    assert [r[0] for r in rows] == STAGES
    assert sum(int(r[1]) for r in rows) <= 420
    assert check(tmp_path, "--plan", "--budget", "300").returncode == 1  # caps over the budget
    bad = check(tmp_path, "--only", "probe,nosuch")
    assert bad.returncode == 2 and "no stage 'nosuch'" in bad.stderr


def test_gpu_check_dry_run_ci_subset(tmp_path):
    # probe and nccl: two Python starts, the packaging of $OUT, and the ZeRO
    # stages the real run sends through NCCL (gloo here).
    proc = check(tmp_path, "--dry-run", "--only", "probe,nccl")
    lines, names = results(tmp_path, proc, ["probe", "nccl"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert {"probe.json", "nccl.json"} <= names
    with tarfile.open(tmp_path / "out" / "gpu_check.tgz") as tar:
        probe = json.load(tar.extractfile("./probe.json"))
        nccl = json.load(tar.extractfile("./nccl.json"))
    assert {"meminfo", "ulimit_l_bytes", "nproc", "lscpu"} <= set(probe["host"])
    assert [r["zero"] for r in nccl] == [3, 2, 1] and not any(r["violations"] for r in nccl)


@pytest.mark.slow
def test_gpu_check_dry_run_every_stage(tmp_path):
    proc = check(tmp_path, "--dry-run", timeout=600)
    lines, names = results(tmp_path, proc, STAGES)
    assert [name for _, name, status, *_ in lines if status == "SKIP"] == ["sanitize"]  # needs CUDA
    assert {"bench_gpu.json", "race.json", "nccl.json", "sanitize.json"} <= names
    assert (tmp_path / "out" / "profile.json.gz").is_file()
    assert proc.returncode == 0


def test_bench_gpu_dry_run(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", INFINITY_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu" / "bench_gpu.py"), "--dry-run",
                           "--json", str(out), "--fp32-rows", "torch,inf-opt"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    report = json.loads(out.read_text())
    assert report["problems"] == []
    bf16, fp32 = report["phases"]["bf16"], report["phases"]["fp32"]
    assert set(bf16["rows"]) == {"torch", "inf-opt", "inf-all", "inf-nvme", "fsdp2"}
    assert "torchao" in bf16["skipped"]  # CUDA only
    assert set(fp32["rows"]) == {"torch", "inf-opt"}
    for name, row in bf16["rows"].items():
        assert row["steps"] == 3 and row["step_s"] > 0 and row["ratio_to_torch"] > 0, (name, row)
    assert bf16["rows"]["inf-opt"]["optimizer_threads"] == 1
    assert bf16["rows"]["inf-opt"]["transfer_source"] == "counted"
    assert bf16["rows"]["fsdp2"]["transfer_source"] == "modelled"
    for name in bf16["rows"]:  # one table line a row
        assert re.search(rf"^{re.escape(name)}\s+3\s+\d", proc.stdout, re.M), name


def test_bench_largest_dry_run_plans_below_its_cap_and_the_estimate_holds(tmp_path):
    """bench_largest.py --dry-run (issue 36, item 4): the estimator's plan stops below the search cap (the time
    plan binds), the planned model trains 2 steps, and its measured peaks are within the estimator's ±10%."""
    out = tmp_path / "largest.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", INFINITY_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu" / "bench_largest.py"), "--dry-run",
                           "--swap-dir", str(tmp_path / "swap"), "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    r = json.loads(out.read_text())
    assert 1 < r["layers"] < 64 and r["planned_s"] <= 30.0
    assert len(r["step_s"]) == 2 and r["parameters"] > 0
    for tier in ("device", "host", "nvme"):
        est, got = r["estimate"][tier], r["peak_bytes"][tier]
        assert abs(est - got) <= 0.10 * got, (tier, est, got)
