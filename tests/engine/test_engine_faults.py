"""Faults on the engine side (issue rows 1-4, 6, 7, 10, 11): transient I/O
errors retried, a lasting one failing the engine with one clear error and
every later call refusing, nothing unverified served, worker-thread errors
reaching the caller, close() after a fault, exact optimizer state loading,
cgroup memory limits, and no reference cycles per step."""

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import infinity

# A child process imports this folder's tests and the shared helpers in tests/.
HERE_AND_TESTS = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from infinity.engine.faults import EngineFailedError
from infinity.io.errors import ChecksumError, SwapIOError
from paging_zoo import Chain, base_config
from engine_utils import assert_params_close


def nvme_cfg(tmp_path, **kw):
    return infinity.Config(**base_config(offload_params="nvme", offload_optimizer="nvme", device_memory=1 << 20,
                                         swap_paths=[str(tmp_path)], swap_block_size=4096, **kw))


def data(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)) for _ in range(n)]


def train(m, o, batches):
    for x, y in batches:
        m(x, y).backward()
        o.step()
        o.zero_grad()


def model():
    torch.manual_seed(0)
    return Chain([32, 16, 64, 8])


@pytest.mark.parametrize("fault", ["read:10:EIO", "write:10:EIO", "write:12:ENOSPC", "read:7:EAGAIN"])
@pytest.mark.parametrize("overlap", ["step", "backward"])
def test_transient_io_error_is_retried_and_nothing_changes(tmp_path, fault, overlap):
    """Row 1 (and 6): one failed block no longer wedges the run, drifts the
    units' step counts apart or drops a key: it is retried, and the run ends
    bit-equal to one without the fault."""
    ref, ro = infinity.initialize(model(), nvme_cfg(tmp_path / "a", overlap=overlap), lr=1e-2)
    m, o = infinity.initialize(model(), nvme_cfg(tmp_path / "b", overlap=overlap), lr=1e-2)
    eng = infinity.api.engine_of(m)
    eng.nvme.store._inject_fault(*fault.split(":"))
    train(ref, ro, data(4))
    train(m, o, data(4))
    assert len(eng.nvme.retried) == 1, eng.nvme.retried
    assert {s.step for u in eng.units for s in u.layout.trainable_slots} == {4}
    a, b = infinity.full_state_dict(m), infinity.full_state_dict(ref)
    assert all(torch.equal(a[k], b[k]) for k in a)
    sa, sb = o.state_dict()["state"], ro.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)
    infinity.close(m)
    infinity.close(ref)


class _Failing:
    """A handle that always fails with EIO (a disk that stays broken)."""

    def __init__(self, key):
        self.key = key

    def done(self):
        return True

    def wait(self):
        raise SwapIOError(5, f"write of key {self.key} failed: Input/output error (injected, lasting)")


def test_lasting_io_error_fails_the_engine_with_one_clear_error(tmp_path, monkeypatch):
    """Row 1 (and 7): a fault retries cannot clear makes that step raise the
    fault itself; every later call raises EngineFailedError naming it and the
    units' step counts (no mix returned); close() tears down without
    re-raising; a new run on the same directory starts."""
    m, o = infinity.initialize(model(), nvme_cfg(tmp_path), lr=1e-2)
    train(m, o, data(2))
    store = infinity.api.engine_of(m).nvme.store
    monkeypatch.setattr(store, "write", lambda key, t, crcs=None, keep_old=False: _Failing(key))
    x, y = data(1)[0]
    with pytest.raises(SwapIOError, match="lasting"):
        m(x, y).backward()
        o.step()
    for call in (lambda: m(x, y), o.step, o.zero_grad, o.state_dict, lambda: infinity.full_state_dict(m)):
        with pytest.raises(EngineFailedError, match=r"lasting.*Optimizer steps per unit: <root>: \d"):
            call()
    monkeypatch.undo()
    infinity.close(m)  # no stale error
    infinity.close(m)  # again: nothing
    m2, o2 = infinity.initialize(model(), nvme_cfg(tmp_path), lr=1e-2)
    train(m2, o2, data(1))
    infinity.close(m2)
    rank_dir = tmp_path / "rank0"
    assert not rank_dir.exists() or not [p for p in rank_dir.iterdir() if p.name.startswith("swap-")]


def _flip_byte(store, key, at: int = 7) -> None:
    """Flips byte ``at`` of ``key``'s first extent in its swap file (from outside, as a bad disk would)."""
    entry = store._index[key]
    piece = entry.pieces[0]
    path = store._paths[piece.path_index].file_path
    with open(path, "r+b") as f:
        f.seek(piece.offset + at)
        b = f.read(1)
        f.seek(piece.offset + at)
        f.write(bytes([b[0] ^ 0x40]))
        f.flush()
        os.fsync(f.fileno())


@pytest.mark.parametrize("overlap", ["step", "backward"])
def test_a_corrupt_extent_is_never_served(tmp_path, overlap):
    """Rows 2 and 3: after a byte of a moment is flipped on disk, neither the
    optimizer (on the main thread or the host worker) nor state_dict() gets
    the bad bytes: the checksum error reaches the caller (not a BudgetError
    with the wrong advice), and the engine refuses from then on."""
    m, o = infinity.initialize(model(), nvme_cfg(tmp_path, overlap=overlap), lr=1e-2)
    train(m, o, data(2))
    store = infinity.api.engine_of(m).nvme.store
    for u in range(5):
        _flip_byte(store, (u, "exp_avg"))
    x, y = data(1)[0]
    with pytest.raises((ChecksumError, EngineFailedError)) as err:
        m(x, y).backward()
        o.step()
    assert "ChecksumError" in f"{type(err.value).__name__} {err.value}" or isinstance(err.value, ChecksumError)
    with pytest.raises(EngineFailedError, match="ChecksumError"):
        o.state_dict()
    infinity.close(m)


@pytest.mark.parametrize("params,opt", [("host", "host"), ("nvme", "nvme"), ("host", "none")])
def test_optimizer_state_dict_round_trip_resumes_exactly(tmp_path, params, opt):
    """Row 4: load_state_dict() loads every moment and step count (torch's
    inherited one dropped them): a run resumed from state_dict() and the
    weights continues bit-equal to the one that never stopped."""
    cfg = lambda d: infinity.Config(**base_config(offload_params=params, offload_optimizer=opt,  # noqa: E731
                                                  device_memory=4 << 20, swap_paths=[str(tmp_path / d)]))
    base, batches = model(), data(6)
    a, oa = infinity.initialize(copy.deepcopy(base), cfg("a"), lr=1e-2)
    train(a, oa, batches[:3])
    sd, weights = oa.state_dict(), infinity.full_state_dict(a)
    fresh = copy.deepcopy(base)
    fresh.load_state_dict(weights)
    b, ob = infinity.initialize(fresh, cfg("b"), lr=1e-2)
    ob.load_state_dict(sd)
    for x, y in batches[3:]:
        la, lb = a(x, y), b(x, y)
        la.backward()
        lb.backward()
        for opt_ in (oa, ob):
            opt_.step()
            opt_.zero_grad()
        assert la.item() == lb.item()
    assert_params_close(infinity.full_state_dict(b), infinity.full_state_dict(a), rtol=0.0)
    bad = copy.deepcopy(sd)
    bad["state"][0]["exp_avg"] = torch.zeros(3)
    with pytest.raises(ValueError, match="exp_avg of parameter"):
        ob.load_state_dict(bad)
    infinity.close(a)
    infinity.close(b)


def test_cgroup_limits_are_read_up_the_hierarchy(tmp_path):
    """Row 10: the tightest limit of the process's cgroups, v2 and v1."""
    from infinity.system import sysinfo
    (tmp_path / "proc").write_text("0::/job/step\n4:memory:/batch/42\n")
    v2 = tmp_path / "cg" / "job"
    (v2 / "step").mkdir(parents=True)
    (v2 / "step" / "memory.max").write_text("max\n")
    (v2 / "memory.max").write_text(str(2 << 30))
    (v2 / "memory.current").write_text(str(1 << 30))
    v1 = tmp_path / "cg" / "memory" / "batch" / "42"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(str(3 << 30))
    (v1 / "memory.usage_in_bytes").write_text(str(1 << 29))
    lim = sysinfo.cgroup_limit(str(tmp_path / "proc"), str(tmp_path / "cg"))
    assert (lim.limit, lim.usage, lim.headroom) == (2 << 30, 1 << 30, 1 << 30)
    assert lim.path.endswith("job/memory.max")
    (v2 / "memory.max").write_text("max")
    lim = sysinfo.cgroup_limit(str(tmp_path / "proc"), str(tmp_path / "cg"))
    assert lim.limit == 3 << 30 and lim.path.endswith("42/memory.limit_in_bytes")


def _memory_cgroup(limit: int):
    """A child of this process's v1 memory cgroup with ``limit`` bytes, or None (not root, no v1)."""
    try:
        rel = next(line.split(":", 2)[2] for line in open("/proc/self/cgroup")
                   if "memory" in line.split(":")[1].split(","))
    except (OSError, StopIteration):
        return None
    path = os.path.join("/sys/fs/cgroup/memory", rel.strip("/"), f"infinity-test-{os.getpid()}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))
    except OSError:
        return None
    return path


def test_default_host_budget_respects_a_memory_cgroup(tmp_path):
    """Row 10: in a 300 MB cgroup, host_memory=None is sized from the limit,
    and a placement that cannot fit is refused with the limit named, instead
    of the OOM killer's SIGKILL inside initialize."""
    cg = _memory_cgroup(300 << 20)
    if cg is None:
        pytest.skip("needs root and a v1 memory cgroup hierarchy to make a limited cgroup")
    script = textwrap.dedent(f"""
        import os, sys, torch
        sys.path[:0] = {HERE_AND_TESTS!r}
        with open({os.path.join(cg, "cgroup.procs")!r}, "w") as f:
            f.write(str(os.getpid()))
        import infinity
        m = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4096, 4096) for _ in range(3)]))
        try:
            infinity.initialize(m, infinity.Config(device="cpu", dtype="fp32"))
        except infinity.BudgetError as e:
            print("REFUSED", e)
    """)
    try:
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    finally:
        os.rmdir(cg)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert "REFUSED" in out.stdout and "cgroup limit" in out.stdout, out.stdout


CYCLES = textwrap.dedent("""
    import gc, sys
    sys.path[:0] = {tests!r}
    import infinity
    from test_engine_faults import model, data, train
    from paging_zoo import base_config
    params, opt, overlap, swap = sys.argv[1:5]
    cfg = infinity.Config(**base_config(offload_params=params, offload_optimizer=opt, overlap=overlap,
                                        device_memory=1 << 20, swap_paths=[swap]))
    m, o = infinity.initialize(model(), cfg, lr=1e-2)
    batches = data(7)
    train(m, o, batches[:3])  # the first steps make what lives for good (ctypes types, traces)
    gc.collect()
    gc.disable()
    found = []
    for x, y in batches[3:]:
        train(m, o, [(x, y)])
        found.append(gc.collect())
    gc.enable()
    print(found)
    infinity.close(m)
""")


@pytest.mark.parametrize("params,opt,overlap", [("host", "host", "step"), ("nvme", "nvme", "backward"),
                                                ("none", "host", "backward")])
def test_no_reference_cycles_per_step(tmp_path, params, opt, overlap):
    """Row 11: a step leaves nothing for the cycle collector (hooks made
    cycles through the autograd graph, so memory grew between full
    collections, unbounded by any budget). In a process of its own: what
    earlier tests left running (threads ending, late imports) is not a step's."""
    code = CYCLES.format(tests=HERE_AND_TESTS)
    r = subprocess.run([sys.executable, "-c", code, params, opt, overlap, str(tmp_path)], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[0, 0, 0, 0]", r.stdout
