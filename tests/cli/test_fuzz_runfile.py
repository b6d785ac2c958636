"""Fuzz of run files (issue 34, item 5): a valid run file with one to three
keys mutated is either loaded with every key valid, or refused with a
ConfigFileError naming the file and the mutated 'section.key'; through
`infinity train` the refusal is exit 2. Seeded; ~300 cases."""

import dataclasses
import json
import math
import random

import pytest
from fuzz_values import NASTY, finite, near

from infinity import Config
from infinity.cli import main
from infinity.cli.runfile import _CHECKS, load_run_file
from infinity.config.files import ConfigFileError

BASE = {"model": {"size": "tiny", "n_layer": 2, "lazy": False},
        "data": {"path": "corpus.txt", "seq_len": 32, "micro_batch": 2, "grad_accumulation": 2, "seed": 1},
        "optimizer": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        "schedule": {"warmup_steps": 1, "min_lr_ratio": 0.1}, "train": {"steps": 3, "seed": 1},
        "runtime": {"device": "cpu", "swap_queue_depth": 8, "prefetch_depth": 2, "max_grad_norm": 1.0,
                    "initial_loss_scale": 1024.0, "swap_checksum": True},
        "checkpoint": {"dir": "ck", "every": 2, "keep_last": 2}, "log": {"every": 1, "progress": True}}
KEYS = [(s, k) for s, checks in _CHECKS.items() for k in checks] + \
       [("runtime", f.name) for f in dataclasses.fields(Config)]


def _valid(run) -> None:
    """Every key of a loaded run file is of its type and in range."""
    d, o, t = run.data, run.optimizer, run.train
    assert type(d.seq_len) is int and d.seq_len >= 1 and type(d.micro_batch) is int and d.micro_batch >= 1
    assert type(d.grad_accumulation) is int and d.grad_accumulation >= 1 and isinstance(d.path, str) and d.path
    assert all(finite(x) for x in (o.lr, o.eps, o.weight_decay, *o.betas)) and len(o.betas) == 2
    assert all(0 <= b < 1 for b in o.betas) and o.eps > 0
    assert type(t.steps) is int and t.steps >= 1 and isinstance(run.log.progress, bool)
    assert type(run.checkpoint.every) is int and run.checkpoint.every >= 0 and run.checkpoint.keep_last >= 1
    assert run.checkpoint.dir is None or isinstance(run.checkpoint.dir, str)
    assert run.schedule is None or (finite(run.schedule.min_lr_ratio) and 0 <= run.schedule.min_lr_ratio <= 1)
    assert Config(**run.config.to_dict()) == run.config


def _mutate(rng: random.Random) -> tuple:
    body = json.loads(json.dumps(BASE))
    names = []
    for section, key in rng.sample(KEYS, rng.randint(1, 3)):
        orig = BASE.get(section, {}).get(key)
        value = near(orig, rng) if orig is not None and rng.random() < 0.5 else rng.choice(NASTY)
        if isinstance(value, float) and not math.isfinite(value) and rng.random() < 0.5:
            value = str(value)  # JSON has no NaN: the strings are what a file may hold too
        body.setdefault(section, {})[key] = value
        names.append(f"{section}.{key}")
    if rng.random() < 0.05:
        section = rng.choice(list(BASE))
        body[section] = rng.choice([5, "x", [], None])
        names.append(section)
    return body, names


@pytest.mark.parametrize("seed", range(3))
def test_fuzz_run_files(tmp_path, capsys, seed):
    rng = random.Random(seed)
    accepted = refused = 0
    for i in range(100):
        body, names = _mutate(rng)
        path = tmp_path / f"run{i}.json"
        path.write_text(json.dumps(body))
        try:
            run = load_run_file(str(path))
        except ConfigFileError as exc:
            msg = str(exc)
            assert str(path) in msg and any(n in msg for n in names), (body, msg)
            if i % 10 == 0:
                assert main(["train", str(path), "--no-progress"]) == 2, body
                assert "Traceback" not in capsys.readouterr().err
            refused += 1
            continue
        _valid(run)
        accepted += 1
    assert accepted and refused
