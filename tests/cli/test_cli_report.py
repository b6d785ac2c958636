"""`infinity report`: a PNG from a metrics file written by `infinity train`."""

import builtins

import pytest

from cli_utils import cli, run_file


def test_report_png_from_a_training_run(tmp_path):
    image = pytest.importorskip("matplotlib.image")
    p = run_file(tmp_path, steps=4, runtime='offload_params = "nvme"\noffload_optimizer = "nvme"\n'
                 'host_memory = "64MiB"')
    assert cli("train", p) == 0
    out = tmp_path / "report.png"
    assert cli("report", tmp_path / "out" / "metrics.jsonl", "-o", out) == 0
    assert out.stat().st_size > 20_000
    img = image.imread(str(out))
    assert img.shape[0] == 8 * 80 and img.shape[1] == 12 * 80  # figsize x dpi
    assert img.std() > 0.05  # not a blank canvas


def test_report_errors(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "m.jsonl"
    bad.write_text("{not json\n")
    assert cli("report", bad, "-o", tmp_path / "r.png") == 2
    assert f"{bad}:1: not a JSON line" in capsys.readouterr().err
    bad.write_text('{"step": 1, "loss": 1.0, "peak_bytes": {}, "budget_bytes": {}}\n')
    real = builtins.__import__

    def no_matplotlib(name, *a, **kw):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert cli("report", bad, "-o", tmp_path / "r.png") == 1
    assert "pip install matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "r.png").exists()


def test_report_plots_the_predicted_step_beside_the_measured(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from infinity.cli import report
    p = run_file(tmp_path, steps=3)
    p.write_text(p.read_text().replace("[log]\n", '[log]\nprofile = "rtx4090-pcie4-nvme"\n'))
    assert cli("train", p) == 0
    drawn = []
    real = report._pyplot

    def spy():
        plt = real()
        orig = plt.Axes.plot

        def plot(ax, *a, **kw):
            drawn.append(kw.get("label"))
            return orig(ax, *a, **kw)
        monkeypatch.setattr(plt.Axes, "plot", plot)
        return plt
    monkeypatch.setattr(report, "_pyplot", spy)
    assert cli("report", tmp_path / "out" / "metrics.jsonl", "-o", tmp_path / "r.png") == 0
    assert "step, measured" in drawn and "step, predicted" in drawn
