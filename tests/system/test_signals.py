"""SIGTERM (what timeout, Slurm and Kubernetes send) ends an NVMe-offloaded
run as SIGINT does: the step is aborted, the swap files and the lock are
removed, the exit status is 143 (issue 18, row 9). A program's own SIGTERM
handler is left alone."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

RUN = textwrap.dedent("""
    import signal, sys, time
    sys.path.insert(0, {tests!r})
    import torch, infinity
    from paging_zoo import Chain, base_config
    got = []
    if {own_handler!r}:
        signal.signal(signal.SIGTERM, lambda s, f: got.append(s))  # no print here: it may land inside one
    torch.manual_seed(0)
    cfg = infinity.Config(**base_config(offload_params="nvme", offload_optimizer="nvme", device_memory=1 << 20,
                                        swap_paths=[{swap!r}], swap_block_size=4096, overlap={overlap!r}))
    m, o = infinity.initialize(Chain([32, 16, 64, 8]), cfg, lr=1e-2)
    print("handler", signal.getsignal(signal.SIGTERM).__module__ if callable(signal.getsignal(signal.SIGTERM))
          else signal.getsignal(signal.SIGTERM), flush=True)
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    step = 0
    while True:
        m(x, y).backward(); o.step(); o.zero_grad()
        step += 1
        print("step", step, flush=True)
        if got and step >= 3:  # the program's own handler ran, and training went on
            break
    print("own handler", flush=True)
    infinity.close(m)
""")


def _start(tmp_path, overlap="backward", own_handler=False):
    swap = tmp_path / "swap"
    code = RUN.format(tests=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), swap=str(swap), overlap=overlap, own_handler=own_handler)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, swap


def _wait_for(proc, prefix: str, timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith(prefix):
            return line
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"no {prefix!r} line; stderr: {proc.stderr.read()}")


@pytest.mark.parametrize("overlap", ["step", "backward"])
def test_sigterm_aborts_the_step_removes_the_swap_files_and_exits_143(tmp_path, overlap):
    proc, swap = _start(tmp_path, overlap)
    assert "infinity.system.signals" in _wait_for(proc, "handler")
    _wait_for(proc, "step 2")
    assert any((swap / "rank0").iterdir()), "the run's swap files exist while it runs"
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 143, (proc.returncode, err)
    assert "SIGTERM received" in err, err
    assert "Traceback" not in err, err
    assert not swap.exists() or not any(swap.rglob("*")), sorted(swap.rglob("*"))


def test_a_programs_own_sigterm_handler_is_kept(tmp_path):
    """The program stops only once its own handler has run (after step 3 at
    the earliest): a fixed step count could end it before a loaded machine
    delivers the signal."""
    proc, swap = _start(tmp_path, own_handler=True)
    assert "infinity.system.signals" not in _wait_for(proc, "handler")
    _wait_for(proc, "step 1")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "own handler" in out
