"""Every key of a run file is type- and range-checked: a bad value is a
ConfigFileError naming the file and 'section.key', and `infinity train`
exits 2 on it (issue 34, item 2), never 1 with a raw Python error."""

import dataclasses
import json

import pytest

from infinity.cli import main
from infinity.cli.runfile import _CHECKS, _SECTIONS, load_run_file
from infinity.config.files import ConfigFileError


def write(tmp_path, body: dict, name="run.json"):
    p = tmp_path / name
    p.write_text(json.dumps(body))
    return str(p)


BASE = {"data": {"path": "corpus.txt"}, "train": {"steps": 2}}

BAD = [
    ("data", "seq_len", "xl"), ("data", "seq_len", 0), ("data", "seq_len", 1.5), ("data", "micro_batch", None),
    ("data", "format", 3), ("data", "dtype", "float32"), ("data", "seed", -1), ("data", "path", 5),
    ("data", "grad_accumulation", 0), ("optimizer", "betas", 0.9), ("optimizer", "betas", [0.9]),
    ("optimizer", "betas", [0.9, 1.0]), ("optimizer", "betas", "ab"), ("optimizer", "lr", "3e-4"),
    ("optimizer", "lr", float("nan")), ("optimizer", "eps", 0), ("optimizer", "weight_decay", -0.1),
    ("optimizer", "no_decay_norm_and_bias", "yes"), ("checkpoint", "dir", 1.5), ("checkpoint", "every", -1),
    ("checkpoint", "keep_last", 0), ("log", "every", True), ("log", "metrics", []), ("log", "progress", 1),
    ("train", "steps", 0), ("train", "steps", 2**40), ("train", "torch_threads", 0), ("train", "seed", "0"),
    ("model", "size", "xxl"), ("model", "size", 7), ("model", "n_layer", -2), ("model", "tie_weights", "no"),
    ("model", "path", ""), ("schedule", "decay", "exp"), ("schedule", "min_lr_ratio", 2.0),
    ("schedule", "warmup_steps", -1), ("schedule", "warmup_type", None),
]


@pytest.mark.parametrize("section,key,value", BAD, ids=[f"{s}.{k}={v!r}" for s, k, v in BAD])
def test_bad_value_names_section_key(tmp_path, section, key, value):
    body = json.loads(json.dumps(BASE))
    body.setdefault(section, {})[key] = value
    path = write(tmp_path, body)
    with pytest.raises(ConfigFileError) as e:
        load_run_file(path)
    assert path in str(e.value) and f"'{section}.{key}'" in str(e.value)


@pytest.mark.parametrize("body", [{"data": {"path": "c.txt", "seq_len": "xl"}},
                                  {"data": {"path": "c.txt"}, "optimizer": {"betas": 0.9}},
                                  {"data": {"path": "c.txt"}, "checkpoint": {"dir": 1.5}},
                                  {"data": {"path": "c.txt"}, "runtime": {"swap_queue_depth": 2**64 + 1}},
                                  {"data": {"path": "c.txt"}, "runtime": {"swap_paths": 5}},
                                  {"data": {"path": "c.txt"}, "optimizer": []}])
def test_cli_exits_2_naming_the_key(tmp_path, capsys, body):
    path = write(tmp_path, body)
    assert main(["train", path, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and path in err and "Traceback" not in err


def test_every_field_has_a_check():
    for name, cls in _SECTIONS.items():
        assert set(_CHECKS[name]) == {f.name for f in dataclasses.fields(cls)}, name


def test_good_values_pass_and_normalise(tmp_path):
    body = {"data": {"path": "c.txt", "seq_len": 64, "grad_accumulation": 2},
            "optimizer": {"betas": [0.8, 0.99], "lr": 1}, "model": {"size": "tiny", "n_layer": 3},
            "checkpoint": {"dir": "ck"}, "train": {"torch_threads": 1}}
    run = load_run_file(write(tmp_path, body))
    assert run.optimizer.betas == (0.8, 0.99) and run.optimizer.lr == 1.0 and isinstance(run.optimizer.lr, float)
    assert run.config.grad_accumulation_steps == 2 and run.checkpoint.dir.endswith("ck")


@pytest.mark.parametrize("name,text", [("deep.json", "[" * 100000), ("deep.toml", "a = " + "[" * 100000)])
def test_deeply_nested_file_refused(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(ConfigFileError, match="nested too deeply"):
        load_run_file(str(p))
