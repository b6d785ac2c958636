"""Shared helpers of the tests/test_cli_*.py files: a tiny corpus and run file."""

import random
from pathlib import Path

from infinity.cli import main

WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran"]


def corpus(tmp_path: Path, words: int = 4000) -> Path:
    rng = random.Random(0)
    p = tmp_path / "corpus.txt"
    p.write_text(" ".join(rng.choice(WORDS) for _ in range(words)))
    return p


def run_file(tmp_path: Path, extra: str = "", runtime: str = "", steps: int = 4, name: str = "run.toml") -> Path:
    """A run file for the tiny built-in GPT on a byte corpus, CPU, host offload."""
    corpus(tmp_path)
    p = tmp_path / name
    p.write_text(f"""
[model]
size = "tiny"

[data]
path = "corpus.txt"
seq_len = 32
micro_batch = 4

[train]
steps = {steps}
torch_threads = 1

[runtime]
device = "cpu"
dtype = "fp32"
swap_paths = ["swap"]
{runtime}

[log]
metrics = "out/metrics.jsonl"
progress = false
{extra}
""")
    return p


def cli(*args) -> int:
    return main([str(a) for a in args])
