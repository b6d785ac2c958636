"""Fuzz of DeepSpeed configs (issue 34, item 5): published configs with one
to three values mutated are either mapped to a valid Config and report, or
refused with a ConfigFileError naming a mutated key path. Seeded; 300 cases."""

import json
import math
import random
import warnings

import pytest
from fuzz_values import NASTY, finite, near
from test_cli_deepspeed import DS_UNIT_NVME, DSE_NVME, HF_ZERO_INFINITY, HF_ZERO_OFFLOAD

from infinity import Config
from infinity.config.files import ConfigFileError

EXTRA = {  # keys the published configs lack, added so that they are mutated too
    "train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0, "bf16": {"enabled": False},
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
             "min_loss_scale": 1, "hysteresis": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                                              "adam_w_mode": True, "torch_adam": False}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-4,
                                                      "warmup_num_steps": 10, "total_num_steps": 100}},
    "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1},
    "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                          "offload_optimizer": {"device": "cpu"}, "max_live_parameters": 1e9,
                          "stage3_prefetch_bucket_size": 5e7, "overlap_comm": True, "reduce_bucket_size": 5e8},
    "steps_per_print": 10, "wall_clock_breakdown": False,
}
BASES = [HF_ZERO_INFINITY, HF_ZERO_OFFLOAD, DSE_NVME, DS_UNIT_NVME, EXTRA]


def _paths(d, prefix=""):
    for k, v in d.items():
        yield prefix + k
        if isinstance(v, dict):
            yield from _paths(v, prefix + k + ".")


def _put(d, path, rng) -> bool:
    """Mutates ``path``; False if a parent was already replaced by a non-table."""
    *parents, last = path.split(".")
    for p in parents:
        d = d.get(p) if isinstance(d, dict) else None
    if not isinstance(d, dict) or last not in d:
        return False
    d[last] = near(d[last], rng) if rng.random() < 0.5 else rng.choice(NASTY)
    return True


def _valid(c: Config) -> None:
    r = c.report
    assert Config(**c.to_dict()) == c
    for b in (r.micro_batch, r.train_batch):
        assert b is None or (type(b) is int and b >= 1)
    if r.micro_batch and r.train_batch:
        assert r.train_batch == r.micro_batch * c.grad_accumulation_steps * r.world_size
    for k, v in r.optimizer.items():
        assert all(finite(x) for x in v) if k == "betas" else isinstance(v, bool) if k == "adamw_mode" \
            else finite(v) and v >= 0, (k, v)
    if r.schedule is not None:
        assert all(math.isfinite(r.schedule.factor(s)) for s in (0, 1, 5, 50, 500))


@pytest.mark.parametrize("seed", range(3))
def test_fuzz_deepspeed_configs(seed):
    rng = random.Random(seed)
    accepted = refused = 0
    for _ in range(100):
        base = json.loads(json.dumps(rng.choice(BASES)))
        if rng.random() < 0.5:
            base = {**json.loads(json.dumps(EXTRA)), **base}
        names = [p for p in rng.sample(sorted(_paths(base)), rng.randint(1, 3)) if _put(base, p, rng)]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                c = Config.from_deepspeed(base)
        except ConfigFileError as exc:
            msg = str(exc)
            assert any(n.split(".")[-1] in msg for n in names) or "train_batch_size=" in msg, (names, base, msg)
            refused += 1
            continue
        _valid(c)
        accepted += 1
    assert accepted and refused
