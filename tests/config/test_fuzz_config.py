"""Fuzz of Config's keyword arguments (issue 34, item 5): each case is
either accepted with every field valid, or refused with a ValueError or
TypeError whose message names one of the fields given. Seeded; ~600 cases."""

import dataclasses
import math
import random

import pytest
from fuzz_values import NASTY, finite

from infinity import Config

FIELDS = [f.name for f in dataclasses.fields(Config)]
GOOD = {
    "device": ["cpu", "auto", "cuda:1"], "dtype": ["bf16", "fp16", "fp32"], "device_memory": ["8GiB", 1 << 20, None],
    "host_memory": ["1.5GB", 10**9, None], "offload_params": ["none", "host", "nvme"],
    "offload_optimizer": ["none", "host", "nvme"], "moment_dtype": ["fp32", "bf16", "int8"], "master_dtype": ["fp32", "bf16"], "swap_paths": [["/a"], ("/a", "/b")],
    "swap_block_size": ["1MiB", 4096, 1 << 30], "state_chunk_bytes": ["64MiB", 256 << 10, 1 << 30], "swap_queue_depth": [1, 32, 1024],
    "swap_backend": ["auto", "threads"], "swap_checksum": [True, False], "prefetch_depth": [0, 2, 1024],
    "prefetch_bytes": [None, "64MiB"], "max_grad_norm": [None, 1.0, 0.5], "overlap": ["step", "backward"],
    "grad_accumulation_steps": [1, 8], "zero_stage": [0, 1, 2, 3], "unit_classes": [None, ["Block"], "Block"],
    "num_threads": [None, 1, 8], "loss_scale": ["dynamic", 128.0], "initial_loss_scale": [2.0**16, 1024],
    "loss_scale_growth_interval": [1, 1000], "min_loss_scale": [1.0, 0.5], "seed": [0, -1, 2**63],
}


def _valid(c: Config) -> None:
    """Every field of an accepted Config is of its type and in range."""
    assert c.device in ("auto", "cpu", "cuda") or c.device.startswith("cuda:")
    for name in ("device_memory", "host_memory", "prefetch_bytes"):
        v = getattr(c, name)
        assert v is None or (type(v) is int and 0 <= v <= 1 << 60), (name, v)
    assert type(c.swap_block_size) is int and 4096 <= c.swap_block_size <= 1 << 30 and c.swap_block_size % 4096 == 0
    assert type(c.swap_queue_depth) is int and 1 <= c.swap_queue_depth <= 1024
    assert type(c.state_chunk_bytes) is int and c.state_chunk_bytes % (256 << 10) == 0
    assert 256 << 10 <= c.state_chunk_bytes <= 1 << 30
    assert isinstance(c.swap_paths, list) and c.swap_paths and all(isinstance(p, str) and p for p in c.swap_paths)
    for name in ("prefetch_depth", "grad_accumulation_steps", "loss_scale_growth_interval", "zero_stage", "seed"):
        assert type(getattr(c, name)) is int, name
    assert c.num_threads is None or (type(c.num_threads) is int and 1 <= c.num_threads <= 4096)
    assert c.max_grad_norm is None or (finite(c.max_grad_norm) and c.max_grad_norm > 0)
    assert c.loss_scale == "dynamic" or (finite(c.loss_scale) and c.loss_scale > 0)
    assert finite(c.initial_loss_scale) and finite(c.min_loss_scale) and 0 < c.min_loss_scale <= c.initial_loss_scale
    assert isinstance(c.swap_checksum, bool)
    assert Config(**c.to_dict()) == c


@pytest.mark.parametrize("seed", range(6))
def test_fuzz_config_kwargs(seed):
    rng = random.Random(seed)
    accepted = refused = 0
    for _ in range(100):
        kw = {}
        for name in rng.sample(FIELDS, rng.randint(1, 3)):
            kw[name] = rng.choice(GOOD[name]) if rng.random() < 0.4 else rng.choice(NASTY)
        try:
            c = Config(**kw)
        except (ValueError, TypeError) as exc:
            msg = str(exc)
            assert any(name in msg for name in kw), (kw, msg)
            assert not isinstance(exc, (OverflowError, ZeroDivisionError)), (kw, msg)
            refused += 1
            continue
        _valid(c)
        for name, v in kw.items():  # nothing NaN or infinite got through under another name
            assert not (isinstance(v, float) and not math.isfinite(v)), (kw, name)
        accepted += 1
    assert accepted and refused
