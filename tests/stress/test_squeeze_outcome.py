"""What a run squeezed from outside (a ballast, a cgroup limit) may do
(infinity/stress/scenarios.py, [Note: what a squeezed run may do]; issue 34):
finish, stop with MemoryPressureError, or be refused at start-up with a
named error naming the bytes; never be OOM-killed, end with an unnamed
error, or lose a step's result. Judged on synthetic job results."""

from infinity.stress.scenarios import squeezed_outcome

REF = {0: 5.6, 1: 5.5, 2: 5.4}


def res(error=None, losses=None, returncode=0):
    return {"error": error, "losses": dict(REF) if losses is None else losses, "returncode": returncode}


def test_finished_with_the_undisturbed_losses_passes():
    assert squeezed_outcome(res(), REF) == (True, "finished")


def test_memory_pressure_error_mid_run_passes():
    ok, how = squeezed_outcome(res("MemoryPressureError: nothing left to give", {0: 5.6}), REF)
    assert ok and "MemoryPressureError after 1 steps" in how


def test_a_named_refusal_at_start_up_passes():
    for err in ("BudgetError: host tier: a pool of 5000 bytes (4.9 KiB) for host_memory=None is more than ...",
                "MemoryLimitError: memory limit: this process's cgroup limit is 314572800 bytes (300.00 MiB, /sys/fs/cgroup/x), below the 367001600 bytes (350.00 MiB) this run needs"):
        ok, how = squeezed_outcome(res(err, {}), REF)
        assert ok and how.startswith("refused at start-up")


def test_oom_kill_fails():
    ok, how = squeezed_outcome(res(None, {0: 5.6}, returncode=-9), REF)
    assert not ok and "SIGKILL" in how


def test_a_refusal_after_steps_ran_or_an_unnamed_error_fails():
    assert not squeezed_outcome(res("BudgetError: 5 bytes", {0: 5.6}), REF)[0]
    ok, how = squeezed_outcome(res("RuntimeError: boom", {}), REF)
    assert not ok and "does not name" in how


def test_a_lost_step_fails():
    ok, how = squeezed_outcome(res(None, {0: 5.6, 1: 9.9}), REF)
    assert not ok and "losses differ" in how
