"""A memory cgroup limit below the run's memory floor is refused at
initialize with MemoryLimitError, naming the limit, where it was read and
the floor, before anything is allocated (issue 34, item 4; [Note: the memory
floor] in infinity/engine/adapt/floor.py). The cgroup reader is replaced
here; where root can make a memory cgroup, a real one checks the same in a
child process (skipped, saying why, otherwise)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from paging_zoo import Chain, base_config

import infinity
from infinity.engine.adapt import floor
from infinity.stress.scenarios import memory_cgroup
from infinity.system import sysinfo

ROOT = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def model():
    torch.manual_seed(0)
    return Chain([64] * 8)


def config(swap):
    return infinity.Config(**base_config(offload_params="nvme", offload_optimizer="nvme", device_memory=1 << 20,
                                         swap_paths=[str(swap)], swap_block_size=4096))


def limited(monkeypatch, limit):
    """This process's cgroup reads as limited to ``limit`` bytes (``usage`` small)."""
    path = "/sys/fs/cgroup/memory/job/memory.limit_in_bytes"
    monkeypatch.setattr(sysinfo, "cgroup_limit", lambda *a, **kw: sysinfo.MemoryLimit(limit, 8 * MiB, path))
    return path


def the_floor(m, swap):
    """The floor initialize will compute for ``m`` (bytes), read back from the refusal of a 1-byte limit."""
    with pytest.MonkeyPatch.context() as mp:
        limited(mp, 1)
        with pytest.raises(infinity.MemoryLimitError) as e:
            infinity.initialize(m, config(swap), lr=1e-2)
    return int(str(e.value).split("below the ")[1].split(" bytes")[0])


def test_limit_below_the_floor_is_refused_before_anything_is_allocated(tmp_path, monkeypatch):
    m = model()
    need = the_floor(m, tmp_path / "swap")
    assert need > sysinfo.rss_bytes() - 64 * MiB  # at least the interpreter and libraries resident now
    # 64 MiB below: the floor moves with this process's RSS, by far less than that between two reads.
    limit = need - 64 * MiB
    path = limited(monkeypatch, limit)
    with pytest.raises(infinity.MemoryLimitError) as e:
        infinity.initialize(m, config(tmp_path / "swap"), lr=1e-2)
    msg = str(e.value)
    assert isinstance(e.value, infinity.BudgetError)  # a budget refusal: callers catching BudgetError see it
    assert f"cgroup limit is {limit} bytes" in msg and path in msg, msg
    assert int(msg.split("below the ")[1].split(" bytes")[0]) > limit, msg
    assert "host pool minimum" in msg and "NVMe staging" in msg and "Raise the limit to at least" in msg, msg
    assert not (tmp_path / "swap").exists()  # refused before the tiers: no swap folder made


def test_limit_at_or_above_the_floor_runs_and_no_limit_is_no_check(tmp_path, monkeypatch):
    m = model()
    need = the_floor(m, tmp_path / "swap")
    for lim in (lambda *a, **kw: sysinfo.MemoryLimit(need + 512 * MiB, 8 * MiB, "x"), lambda *a, **kw: None):
        monkeypatch.setattr(sysinfo, "cgroup_limit", lim)
        net, opt = infinity.initialize(model(), config(tmp_path / "swap"), lr=1e-2)
        x = torch.randn(4, 16)
        net(x, x).backward()
        opt.step()
        infinity.close(net)


def test_the_floor_is_the_estimators_sum_at_the_minimum_budgets():
    m = model()
    f = floor.memory_floor(m, host_min=5 * MiB, device_min=3 * MiB, on_cpu=True, staging=2 * MiB, rss=400 * MiB)
    weights = sum(p.numel() * 4 for p in m.parameters())
    assert f["model"] == weights and f["base"] == 400 * MiB - weights
    assert f["floor"] == f["base"] + max(5 * MiB + 2 * MiB + floor.RUNTIME_BYTES + 3 * MiB, weights + 5 * MiB)
    on_gpu = floor.memory_floor(m, 5 * MiB, 3 * MiB, on_cpu=False, staging=0, rss=400 * MiB)
    assert on_gpu["device_tier"] == 0 and on_gpu["floor"] < f["floor"]  # a real device's tier is not in RAM


CHILD = """
import json, sys, torch, infinity
sys.path.insert(0, sys.argv[2])
from paging_zoo import Chain, base_config
from infinity.engine.adapt import floor
from infinity.stress.scenarios import memory_cgroup
from infinity.system import sysinfo
parts = {}
if sys.argv[3] == "probe":  # no real limit: a 1-byte one read, and the floor's parts kept
    sysinfo.cgroup_limit = lambda *a, **kw: sysinfo.MemoryLimit(1, 0, "probe")
    real = floor.memory_floor
    floor.memory_floor = lambda *a, **kw: parts.update(real(*a, **kw)) or dict(parts)
torch.manual_seed(0)
m = Chain([64] * 8)
cfg = infinity.Config(**base_config(offload_params="nvme", offload_optimizer="nvme", device_memory=1 << 20,
                                    swap_paths=[sys.argv[1]], swap_block_size=4096))
try:
    net, opt = infinity.initialize(m, cfg, lr=1e-2)
    print("RESULT " + json.dumps({"error": None}))
except infinity.MemoryLimitError as e:
    print("RESULT " + json.dumps({"error": str(e), "parts": parts}))
"""


def _child(tmp_path, mode, preexec=None):
    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "swap"), str(ROOT / "tests"), mode],
                       capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=300,
                       preexec_fn=preexec)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    return r, (json.loads(lines[0][7:]) if lines else None)


def test_a_real_cgroup_below_the_floor_is_refused_not_killed(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("making a memory cgroup needs root")
    cg = memory_cgroup("infinity-floor")
    if cg is None:
        pytest.skip("no writable memory cgroup here")
    try:
        _, probe = _child(tmp_path, "probe")  # the floor, and the RSS at initialize, without a limit
        parts = probe["parts"]
        # Room to reach initialize (RSS then: base + model), not to train.
        limit = (parts["base"] + parts["model"] + parts["floor"]) // 2
        v1 = os.path.exists(os.path.join(cg, "memory.limit_in_bytes"))
        with open(os.path.join(cg, "memory.limit_in_bytes" if v1 else "memory.max"), "w") as f:
            f.write(str(limit))

        def join():
            with open(os.path.join(cg, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        r, res = _child(tmp_path, "run", join)
    finally:
        try:
            os.rmdir(cg)
        except OSError:
            pass
    assert r.returncode == 0 and res is not None, (r.returncode, r.stderr[-2000:])  # not SIGKILLed
    # The limit read may be a page-rounded one of the limit written.
    assert res["error"] and "cgroup limit is " in res["error"] and cg in res["error"], res
    assert abs(int(res["error"].split("cgroup limit is ")[1].split(" bytes")[0]) - limit) < 1 << 16, res
