"""`infinity estimate`: the placement figures against what a run really used."""

import json

from cli_utils import cli, run_file
from infinity.cli.estimate import load_for_estimate
from infinity.cli.estimate import estimate


def test_estimate_matches_a_real_run(tmp_path, capsys):
    p = run_file(tmp_path, steps=2, runtime='offload_params = "nvme"\noffload_optimizer = "nvme"\n'
                 'host_memory = "64MiB"')
    config, model = load_for_estimate(str(p))
    est = estimate(model, config)
    assert model.wte.weight.device.type == "meta"  # nothing was allocated
    assert cli("estimate", p) == 0
    out = capsys.readouterr().out
    assert f"{est['nvme']['capacity']:,}" in out and "paging units" in out
    assert cli("train", p) == 0
    last = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[-1])
    peak, budget = last["peak_bytes"], last["budget_bytes"]
    assert budget["nvme"] >= est["nvme"]["capacity"] >= peak["nvme"] > 0
    assert est["host"]["minimum"] <= est["host"]["capacity"] and peak["host"] <= est["host"]["capacity"]
    assert peak["device"] <= est["device"]["everything"]
    assert est["device"]["minimum"] <= est["device"]["everything"]


def test_budget_below_minimum_exits_1(tmp_path, capsys):
    p = run_file(tmp_path, runtime='offload_params = "nvme"\noffload_optimizer = "nvme"\nhost_memory = "4KiB"')
    assert cli("estimate", p) == 1
    assert "host budget 4.00 KiB is below the minimum" in capsys.readouterr().out
    assert cli("estimate", p, "--world", "0") == 2


def test_suggested_placement_follows_the_machine(tmp_path, monkeypatch, capsys):
    import torch

    import infinity
    from infinity.system import sysinfo
    from infinity.cli.estimate import suggest
    from infinity.engine.plan.estimator import estimate_peaks
    from infinity.models import GPT, GPTConfig
    p = run_file(tmp_path, runtime='offload_params = "nvme"\noffload_optimizer = "nvme"\nhost_memory = "64MiB"')
    assert cli("estimate", p) == 0
    out = capsys.readouterr().out
    assert "suggested for this machine" in out
    assert "without activation checkpointing" in out and "with activation checkpointing" in out
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=8, n_head=8, n_embd=512))  # 400 MB of state
    x = torch.zeros(2, 64, dtype=torch.long, device="meta")
    forward = lambda m: m(x, x)  # noqa: E731
    config = infinity.Config(device="cpu", dtype="fp32", offload_params="nvme", offload_optimizer="nvme",
                             host_memory="64MiB", device_memory="48MiB", swap_paths=[str(tmp_path / "swap")])
    nvme = estimate_peaks(model, config, forward)["rss"]["peak"]
    # RAM for the NVMe placement's peak, not for keeping the state in memory.
    monkeypatch.setattr(sysinfo, "available_ram", lambda: int((nvme + (8 << 20)) / 0.8))
    got = suggest(model, config, forward, 1, False)
    assert "offload_params='nvme'" in got, got
    monkeypatch.setattr(sysinfo, "available_ram", lambda: 1 << 20)
    assert "no placement fits" in suggest(model, config, forward, 1, False)


def test_estimate_of_a_hugging_face_run_file_counts_activations(tmp_path, capsys):
    """HF's mask building reads tensor values, which a meta forward cannot:
    `infinity estimate` failed on every HF run file."""
    import pytest
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg.save_pretrained(tmp_path / "llama")
    p = run_file(tmp_path)
    p.write_text(p.read_text().replace('size = "tiny"', 'path = "llama"'))
    assert cli("estimate", p) == 0
    out = capsys.readouterr().out
    assert "activations saved for backward" in out and "NOT counted" not in out
    assert "with activation checkpointing" in out
