"""`infinity train` under memory pressure (issue 34, item 3): the engine's
MemoryPressureError comes at the end of a step, after its update, so the
command saves a checkpoint of that whole step (when the run file has a
[checkpoint] section) and exits 1 naming the error; resuming from it gives
the uninterrupted run's losses. The pressure is simulated: the engine's
RAM signal (PressureMonitor.available) reads low, as in
tests/stress/test_memory_pressure.py."""

import json

import infinity
from cli_utils import cli, run_file

NVME = 'offload_params = "nvme"\noffload_optimizer = "nvme"\nhost_memory = "64MiB"'
SCHEDULE = '[schedule]\nwarmup_steps = 1\ndecay = "constant"\n'


def _losses(tmp_path):
    path = tmp_path / "out" / "metrics.jsonl"
    out = [json.loads(line)["loss"] for line in path.read_text().splitlines()]
    path.unlink()
    return out


def _squeezed(monkeypatch, free=10 << 20):
    """Every engine made from now on reads ``free`` bytes of RAM left: below
    the critical level, so once it has given what it can, a step raises."""
    real = infinity.initialize

    def initialize(*a, **kw):
        model, opt = real(*a, **kw)
        opt.engine.pressure.available = lambda: free
        return model, opt
    monkeypatch.setattr(infinity, "initialize", initialize)


def test_memory_pressure_saves_the_last_whole_step_and_exits_naming_it(tmp_path, monkeypatch, capsys):
    full = run_file(tmp_path, steps=6, runtime=NVME, extra=SCHEDULE)
    assert cli("train", full) == 0
    want = _losses(tmp_path)
    capsys.readouterr()
    part = run_file(tmp_path, steps=6, runtime=NVME, extra=SCHEDULE + '[checkpoint]\ndir = "ckpt"\nevery = 100')
    with monkeypatch.context() as m:
        _squeezed(m)
        assert cli("train", part) == 1
    err = capsys.readouterr().err
    first = _losses(tmp_path)
    done = len(first)
    assert 1 <= done < 6, err
    assert "MemoryPressureError" in err and f"checkpoint of step {done} in {tmp_path / 'ckpt'}" in err, err
    assert first == want[:done]  # giving way changed no result
    steps = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-"))
    assert len(steps) == 1 and int(steps[0].split("-")[1]) == done, steps
    assert cli("train", part, "--resume") == 0
    assert first + _losses(tmp_path) == want  # nothing lost: the saved step resumes exactly


def test_memory_pressure_without_a_checkpoint_section_says_nothing_was_saved(tmp_path, monkeypatch, capsys):
    p = run_file(tmp_path, steps=6, runtime=NVME)
    _squeezed(monkeypatch)
    assert cli("train", p) == 1
    err = capsys.readouterr().err
    assert "MemoryPressureError" in err and "save a checkpoint now" in err
    assert "no [checkpoint] section in the run file, so nothing was saved" in err
    assert not (tmp_path / "ckpt").exists()


def test_a_save_that_fails_under_pressure_is_said_and_the_pressure_error_stays(tmp_path, monkeypatch, capsys):
    p = run_file(tmp_path, steps=6, runtime=NVME, extra='[checkpoint]\ndir = "ckpt"\nevery = 1')
    _squeezed(monkeypatch)
    saved = []
    real_save = infinity.save_checkpoint

    def save_checkpoint(d, model, optimizer, **kw):
        # The save of the step that raised fails, as a save short of memory would.
        if any(e["action"] == "out of memory" for e in infinity.stats(model)["pressure_events"]):
            raise OSError(12, "Cannot allocate memory")
        saved.append(kw["extra"]["step"])
        return real_save(d, model, optimizer, **kw)
    monkeypatch.setattr(infinity, "save_checkpoint", save_checkpoint)
    assert cli("train", p) == 1
    err = capsys.readouterr().err
    done = len(_losses(tmp_path))
    assert saved == list(range(1, done))  # every step saved until the one under pressure
    assert f"the checkpoint of step {done} could not be saved (OSError: [Errno 12] Cannot allocate memory)" in err
    assert "error: MemoryPressureError" in err, err
