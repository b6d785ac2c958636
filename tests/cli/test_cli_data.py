"""Token files (.bin, .npy, text) and the resumable sampler of `infinity train`;
the optimizer groups of a run file."""

import numpy as np
import pytest
import torch

from cli_utils import cli, run_file
from infinity.cli.data import Sampler, open_tokens
from infinity.cli.model import param_groups
from infinity.config.files import ConfigFileError
from infinity.models import GPT, GPTConfig


def test_bin_npy_and_text_are_memory_mapped(tmp_path):
    ids = (np.arange(5000) * 7 % 300).astype(np.uint16)
    ids.tofile(tmp_path / "t.bin")
    np.save(tmp_path / "t.npy", ids.astype(np.int32))
    (tmp_path / "t.txt").write_bytes(bytes(range(256)) * 4)
    for name, vocab in (("t.bin", 300), ("t.npy", 300), ("t.txt", 256)):
        arr, v = open_tokens(str(tmp_path / name))
        assert isinstance(arr, np.memmap) and v == vocab, name
    arr, _ = open_tokens(str(tmp_path / "t.bin"))
    assert np.array_equal(arr, ids)
    with pytest.raises(ConfigFileError, match="is not a file"):
        open_tokens(str(tmp_path / "missing.bin"))
    np.save(tmp_path / "f.npy", np.zeros(10, dtype=np.float32))
    with pytest.raises(ConfigFileError, match="integer token ids"):
        open_tokens(str(tmp_path / "f.npy"))


def test_sampler_is_deterministic_and_resumes(tmp_path):
    tokens = np.arange(1000, dtype=np.int64)
    a = Sampler(tokens, seq_len=10, batch=4, seed=3)
    first = [a.next_batch() for _ in range(30)]  # 120 windows: crosses the epoch of 99
    x, y = first[0]
    assert x.shape == (4, 10) and torch.equal(y[:, :-1], x[:, 1:])
    b = Sampler(tokens, seq_len=10, batch=4, seed=3)
    for _ in range(12):
        b.next_batch()
    state = b.state_dict()
    c = Sampler(tokens, seq_len=10, batch=4, seed=3)
    c.load_state_dict(state)
    for i in range(12, 30):
        assert torch.equal(c.next_batch()[0], first[i][0])
    assert state["epoch"] == 0 and c.epoch == 1
    with pytest.raises(ValueError, match="does not match this data"):
        Sampler(tokens, seq_len=10, batch=4, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="vocabulary size"):
        Sampler(tokens, seq_len=10, batch=4, vocab=100).next_batch()


def test_no_decay_groups_take_every_1d_parameter():
    m = GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2))
    decay, no = param_groups(m, 0.1, True)
    assert no["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1
    assert all(p.ndim < 2 for p in no["params"]) and all(p.ndim >= 2 for p in decay["params"])
    assert len(decay["params"]) + len(no["params"]) == len(list(m.parameters()))
    assert param_groups(m, 0.1, False) is None


def test_train_on_npy_with_accumulation(tmp_path):
    p = run_file(tmp_path, steps=3)
    np.save(tmp_path / "ids.npy", (np.arange(20000) * 13 % 500).astype(np.uint16))
    p.write_text(p.read_text().replace('path = "corpus.txt"', 'path = "ids.npy"\ngrad_accumulation = 2'))
    assert cli("train", p) == 0
    import json
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    assert rows[1]["tokens_per_s"] * rows[1]["s_per_step"] == pytest.approx(4 * 32 * 2)  # micro x seq x accum
    assert rows[0]["loss"] == pytest.approx(np.log(500), abs=0.3)  # vocabulary taken from the ids
