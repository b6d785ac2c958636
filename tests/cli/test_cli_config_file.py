"""Config.from_file (TOML, JSON, run file or flat), to_dict round trip, and
docs/config.md covering every field."""

import dataclasses
import json
import re
from pathlib import Path

import pytest

from infinity import Config
from infinity.config.files import ConfigFileError

DOCS = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_run_file_toml_runtime_section(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text('[model]\nsize = "tiny"\n\n[runtime]\ndevice = "cpu"\ndtype = "fp32"\noffload_params = "nvme"\n'
                 'offload_optimizer = "nvme"\nswap_paths = ["/tmp/a", "/tmp/b"]\nswap_block_size = "1MiB"\n'
                 'host_memory = "2GiB"\nmax_grad_norm = 1.0\n')
    c = Config.from_file(str(p))
    assert (c.device, c.dtype, c.offload_params, c.offload_optimizer) == ("cpu", "fp32", "nvme", "nvme")
    assert c.swap_paths == ["/tmp/a", "/tmp/b"]
    assert c.swap_block_size == 1 << 20 and c.host_memory == 2 << 30 and c.max_grad_norm == 1.0
    assert c.zero_stage == 0  # untouched fields keep their defaults


def test_flat_json_file(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"device": "cpu", "overlap": "backward", "grad_accumulation_steps": 4}))
    c = Config.from_file(str(p))
    assert (c.overlap, c.grad_accumulation_steps) == ("backward", 4)


def test_misspelled_key_names_file_path_and_nearest(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text('[runtime]\nofload_params = "host"\n')
    with pytest.raises(ConfigFileError) as e:
        Config.from_file(str(p))
    msg = str(e.value)
    assert str(p) in msg and "'runtime.ofload_params'" in msg and "did you mean 'offload_params'" in msg


def test_bad_value_names_key_path_and_choices(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text('[runtime]\noffload_params = "disk"\n')
    with pytest.raises(ConfigFileError) as e:
        Config.from_file(str(p))
    msg = str(e.value)
    assert str(p) in msg and "runtime.offload_params" in msg and "['none', 'host', 'nvme']" in msg


def test_misspelled_section_and_bad_syntax(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text('[model]\nsize = "tiny"\n[runtme]\ndevice = "cpu"\n')
    with pytest.raises(ConfigFileError, match="unknown section 'runtme'.*did you mean 'runtime'"):
        Config.from_file(str(p))
    p.write_text("[runtime\n")
    with pytest.raises(ConfigFileError, match="not valid TOML"):
        Config.from_file(str(p))
    with pytest.raises(ConfigFileError, match="cannot read"):
        Config.from_file(str(tmp_path / "missing.toml"))


def test_deepspeed_file_points_to_from_deepspeed(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_batch_size": 8}))
    with pytest.raises(ConfigFileError, match="DeepSpeed config.*Config.from_deepspeed"):
        Config.from_file(str(p))
    assert Config.from_deepspeed(str(p)).zero_stage == 2


def test_to_dict_round_trip_through_json(tmp_path):
    c = Config(device="cpu", dtype="fp16", host_memory="3GiB", offload_optimizer="nvme", offload_params="nvme",
               swap_paths=[str(tmp_path)], unit_classes=["Block"], loss_scale=128.0, prefetch_bytes="64MiB")
    p = tmp_path / "c.json"
    p.write_text(json.dumps(c.to_dict()))
    back = Config.from_file(str(p))
    assert back == c and back.to_dict() == c.to_dict()


def test_every_field_is_documented():
    text = DOCS.read_text()
    documented = set(re.findall(r"^\| `(\w+)` \|", text, flags=re.M))
    fields = {f.name for f in dataclasses.fields(Config)}
    missing = sorted(fields - documented)
    assert not missing, f"Config fields missing from docs/config.md's table: {missing}"
    assert len(fields) > 20


def test_every_run_file_key_is_documented():
    from infinity.cli.runfile import _SECTIONS
    text = (DOCS.parent / "cli.md").read_text()
    missing = [f"{name}.{f.name}" for name, cls in _SECTIONS.items() for f in dataclasses.fields(cls)
               if f"`{name}.{f.name}`" not in text]
    assert not missing, f"run-file keys missing from docs/cli.md: {missing}"
