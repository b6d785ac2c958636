"""`infinity train`: the built-in GPT and a Hugging Face Llama from a run
file, a DeepSpeed JSON, metrics, checkpoint calls, --resume, SIGINT, exit codes."""

import json
import os
import signal
import threading
import subprocess
import sys
from pathlib import Path

import pytest

import infinity
import infinity.cli
from cli_utils import cli, corpus, run_file

ROOT = Path(__file__).resolve().parents[2]


def _metrics(tmp_path):
    return [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]


def test_train_gpt_nvme_writes_metrics_and_cleans_swap(tmp_path):
    p = run_file(tmp_path, steps=6, runtime='offload_params = "nvme"\noffload_optimizer = "nvme"\n'
                 'host_memory = "64MiB"',
                 extra='[optimizer]\nlr = 3e-3\n[schedule]\nwarmup_steps = 2\ndecay = "cosine"\nmin_lr_ratio = 0.1')
    assert cli("train", p) == 0
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[-1]["loss"] < rows[0]["loss"]
    # warmup 0 -> peak over 2 steps, then cosine to 10% at step 6
    assert rows[0]["lr"] == 0.0 and rows[2]["lr"] == pytest.approx(3e-3)
    assert rows[-1]["peak_bytes"]["nvme"] > 0 and rows[-1]["step_bytes_moved"]["nvme_write"] > 0
    for key in ("tokens_per_s", "s_per_step", "stall_s", "optimizer_wait_s", "compute_s", "budget_bytes", "rss_bytes"):
        assert key in rows[-1]
    assert rows[-1]["peak_bytes"]["host"] <= 64 << 20
    swap = tmp_path / "swap"
    assert not swap.exists() or not any(swap.rglob("*.bin"))  # swap files removed at close


def test_train_hf_llama_from_config_dir(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg.save_pretrained(tmp_path / "llama")
    p = run_file(tmp_path, steps=3)
    p.write_text(p.read_text().replace('size = "tiny"', 'path = "llama"'))
    assert cli("train", p) == 0
    rows = _metrics(tmp_path)
    assert len(rows) == 3 and rows[0]["loss"] == pytest.approx(5.55, abs=0.3)  # ~ln(256) at the start


def test_train_deepspeed_json(tmp_path, capsys):
    corpus(tmp_path)
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                       "warmup_num_steps": 2, "warmup_type": "linear"}},
          "zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"},
                                "stage3_prefetch_bucket_size": "auto"}}
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(ds))
    assert cli("train", p, "--data", tmp_path / "corpus.txt", "--steps", 3, "--no-progress",
               "--metrics", tmp_path / "out" / "metrics.jsonl") == 0
    rows = _metrics(tmp_path)
    assert [r["lr"] for r in rows] == pytest.approx([0.0, 5e-4, 1e-3])
    err = capsys.readouterr().err
    # the report, with "auto" resolved from the model (the tiny GPT: 0.9 x 64^2 elements of fp32)
    assert f"prefetch_bytes={int(0.9 * 64 * 64) * 4}" in err and "defaults gradient_clipping" not in err


def test_checkpoint_calls_and_resume(tmp_path, monkeypatch):
    saved = []

    def save_checkpoint(d, model, optimizer, lr_scheduler=None, extra=None, keep_last=None):
        saved.append((d, extra["step"], dict(extra["sampler"]), keep_last, lr_scheduler is not None))

    monkeypatch.setattr(infinity, "save_checkpoint", save_checkpoint, raising=False)
    p = run_file(tmp_path, steps=5, extra='[checkpoint]\ndir = "ckpt"\nevery = 2\nkeep_last = 3\n'
                 '[schedule]\ndecay = "constant"')
    assert cli("train", p) == 0
    assert [s[1] for s in saved] == [2, 4, 5]
    assert all(s[0] == str(tmp_path / "ckpt") and s[3] == 3 and s[4] for s in saved)
    assert saved[-1][2]["index"] == 5 * 4  # 5 steps of 4 windows
    loaded = []
    at_step_4 = saved[1][2]

    def load_checkpoint(d, model, optimizer, lr_scheduler=None):
        loaded.append(d)
        return {"step": 4, "sampler": at_step_4}

    monkeypatch.setattr(infinity, "load_checkpoint", load_checkpoint, raising=False)
    saved.clear()
    (tmp_path / "out" / "metrics.jsonl").unlink()
    assert cli("train", p, "--resume") == 0
    assert loaded == [str(tmp_path / "ckpt")]
    assert [r["step"] for r in _metrics(tmp_path)] == [5]
    assert [s[1] for s in saved] == [5] and saved[0][2]["index"] == 20  # the sampler went on from step 4


@pytest.fixture
def ctrl_c():
    """SIGINT handled as a user's Ctrl-C finds it, Python's own handler, even where the suite inherited
    it ignored (a shell starts background jobs so); what was there before afterwards."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def test_sigint_finishes_the_step_saves_and_exits_130(tmp_path, monkeypatch, ctrl_c):
    saved = []
    monkeypatch.setattr(infinity, "save_checkpoint", lambda d, m, o, **kw: saved.append(kw["extra"]["step"]),
                        raising=False)
    real_stats = infinity.stats

    def stats(model):
        s = real_stats(model)
        if s["steps"] == 2:
            # To this (the main) thread, where Python runs the handler at the next bytecode.
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        return s

    monkeypatch.setattr(infinity, "stats", stats)
    p = run_file(tmp_path, steps=50, extra='[checkpoint]\ndir = "ckpt"')
    assert cli("train", p) == 130
    assert saved == [2]
    assert [r["step"] for r in _metrics(tmp_path)] == [1, 2]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_usage_errors_exit_2(tmp_path, capsys):
    p = run_file(tmp_path)
    p.write_text(p.read_text().replace("micro_batch", "micro_bach"))
    assert cli("train", p) == 2
    err = capsys.readouterr().err
    assert "data.micro_bach" in err and "did you mean 'micro_batch'" in err and str(p) in err
    assert cli("train") == 2
    assert cli("nosuchcommand") == 2
    assert cli("train", "--help") == 0
    assert "--resume" in capsys.readouterr().out


def test_resume_continues_to_the_uninterrupted_losses_and_verify_consolidate(tmp_path):
    """The real checkpoints: a run of 4 steps, against 2 steps + a checkpoint
    + `--resume` to 4 (same losses, bit for bit); `python -m infinity verify`
    and `consolidate` on the checkpoint."""
    nvme = 'offload_params = "nvme"\noffload_optimizer = "nvme"\nhost_memory = "64MiB"'
    full = run_file(tmp_path, steps=4, runtime=nvme, extra='[schedule]\nwarmup_steps = 1\ndecay = "constant"')
    assert cli("train", full) == 0
    want = [r["loss"] for r in _metrics(tmp_path)]
    (tmp_path / "out" / "metrics.jsonl").unlink()
    part = run_file(tmp_path, steps=2, runtime=nvme,
                    extra='[schedule]\nwarmup_steps = 1\ndecay = "constant"\n[checkpoint]\ndir = "ckpt"\nevery = 2')
    assert cli("train", part) == 0
    first = [r["loss"] for r in _metrics(tmp_path)]
    (tmp_path / "out" / "metrics.jsonl").unlink()
    part.write_text(part.read_text().replace("steps = 2", "steps = 4"))
    assert cli("train", part, "--resume") == 0
    assert first + [r["loss"] for r in _metrics(tmp_path)] == want
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    ck = tmp_path / "ckpt"
    r = subprocess.run([sys.executable, "-m", "infinity", "verify", str(ck)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "infinity", "consolidate", str(ck), str(tmp_path / "hf")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and (tmp_path / "hf" / "model.safetensors").exists(), r.stderr
    newest = sorted(p for p in ck.iterdir() if p.name.startswith("step-"))[-1]
    shard = next(newest.glob("model-*.safetensors"))
    with open(shard, "r+b") as f:
        f.seek(-5, 2)
        b = f.read(1)
        f.seek(-5, 2)
        f.write(bytes([b[0] ^ 1]))
    r = subprocess.run([sys.executable, "-m", "infinity", "verify", str(ck)], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 1 and "CRC32C" in r.stdout, r.stdout + r.stderr


def test_every_subcommand_has_help_and_the_console_script_resolves(capsys):
    import importlib
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        import tomli as tomllib
    for cmd in ("train", "doctor", "report", "estimate", "consolidate", "verify"):
        assert cli(cmd, "--help") == 0, cmd
        assert "usage: infinity " + cmd in capsys.readouterr().out
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    mod, _, fn = scripts["infinity"].partition(":")
    assert getattr(importlib.import_module(mod), fn) is infinity.cli.main


def test_weights_are_loaded_through_load_pretrained(tmp_path):
    import torch
    from safetensors.torch import save_file

    from infinity.models import GPT, GPTConfig
    p = run_file(tmp_path, steps=1, extra="[optimizer]\nlr = 0.0")
    torch.manual_seed(123)  # other weights than the run's seed gives
    ref = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64))
    state = {k: v for k, v in ref.state_dict().items() if k != "head.weight"}  # tied to wte
    save_file(state, str(tmp_path / "w.safetensors"))
    p.write_text(p.read_text().replace('size = "tiny"', 'size = "tiny"\nweights = "w.safetensors"'))
    assert cli("train", p) == 0
    loss = _metrics(tmp_path)[0]["loss"]
    from infinity.cli.data import Sampler, open_tokens
    x, y = Sampler(open_tokens(str(tmp_path / "corpus.txt"))[0], 32, 4, 0).next_batch()
    with torch.no_grad():
        assert loss == pytest.approx(float(ref(x, y)), rel=1e-4)


def test_progress_shows_tiers_against_budgets_and_a_summary(tmp_path, capsys):
    p = run_file(tmp_path, steps=2, runtime='offload_params = "nvme"\noffload_optimizer = "nvme"\n'
                 'host_memory = "64MiB"')
    p.write_text(p.read_text().replace("progress = false", "progress = true"))
    assert cli("train", p) == 0
    err = capsys.readouterr().err
    assert "2/2" in err and "tok/s" in err and "s/step" in err  # the tqdm bar
    assert "host " in err and "/64.00 MiB" in err and "nvme " in err
    rows = _metrics(tmp_path)
    assert f"infinity train: step 2, loss {rows[0]['loss']:.4f} -> {rows[1]['loss']:.4f}," in err


def test_resume_says_which_run_file_values_the_checkpoint_overrides(tmp_path, capsys):
    """issue 35: a learning rate edited in the run file before --resume is not silently dropped: the restored
    value wins (as in torch and Hugging Face) and stderr says so, naming both values."""
    p = run_file(tmp_path, steps=2, extra='[optimizer]\nlr = 3e-3\n[checkpoint]\ndir = "ckpt"')
    assert cli("train", p) == 0
    capsys.readouterr()
    p.write_text(p.read_text().replace("steps = 2", "steps = 3").replace("lr = 3e-3", "lr = 1e-3"))
    assert cli("train", p, "--resume") == 0
    err = capsys.readouterr().err
    assert "optimizer.lr = 0.001 in the run file, 0.003 restored" in err and "betas" not in err, err
    p.write_text(p.read_text().replace("steps = 3", "steps = 4").replace("lr = 1e-3", "lr = 3e-3"))
    assert cli("train", p, "--resume") == 0
    assert "restored" not in capsys.readouterr().err  # the same values: nothing to say


def test_log_profile_predicts_the_step_beside_the_measured_one(tmp_path, capsys):
    """With ``log.profile`` the step is predicted once before the run; the
    metrics, stats() and the summary carry it beside the measured step, and
    the run's losses are those of the same run without it (the prediction's
    meta model leaves the seeding alone)."""
    from infinity.engine.plan.profile import load_profile
    prof = load_profile("rtx4090-pcie4-nvme")
    prof.device = "cpu"
    (tmp_path / "prof.json").write_text(prof.to_json())
    p = run_file(tmp_path, steps=3)
    assert cli("train", p) == 0
    plain = _metrics(tmp_path)
    (tmp_path / "out" / "metrics.jsonl").unlink()
    capsys.readouterr()
    p.write_text(p.read_text().replace("[log]\n", '[log]\nprofile = "prof.json"\n'))
    assert cli("train", p) == 0
    rows, err = _metrics(tmp_path), capsys.readouterr().err
    assert [r["loss"] for r in rows] == [r["loss"] for r in plain]
    pred = rows[0]["predicted_s"]
    assert pred > 0 and all(r["predicted_s"] == pred for r in rows) and all(r["step_s"] > 0 for r in rows)
    assert f"infinity train: predicted step {pred:.3f} s on {tmp_path / 'prof.json'} (bound " in err
    assert f"predicted {pred:.3f} s (" in err and "infinity train: step time measured " in err
    p.write_text(p.read_text().replace('profile = "prof.json"', 'profile = "none.json"'))
    assert cli("train", p) == 2
    assert "log.profile: profile 'none.json': no such file" in capsys.readouterr().err
