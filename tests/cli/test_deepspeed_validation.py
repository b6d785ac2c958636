"""The DeepSpeed import checks every value and follows DeepSpeed where it
used to differ silently (issues 34 and 35): keys named in every error, the
batch arithmetic, Adam's defaults, no offload without zero_optimization,
one warning for unknown keys, the stage3_* aliases."""

import json
import warnings

import pytest

from infinity import Config
from infinity.cli import main
from infinity.config.deepspeed import DeepSpeedConfigWarning
from infinity.config.deepspeed_values import ZERO_ALIASES
from infinity.config.files import ConfigFileError

INF = float("inf")

REFUSED = [
    ({"train_batch_size": -1}, r"'train_batch_size'=-1: must be an int in \[1, "),
    ({"train_batch_size": "32"}, r"'train_batch_size'='32'"),
    ({"train_batch_size": 2.5}, r"'train_batch_size'=2.5"),
    ({"gradient_accumulation_steps": "x", "train_batch_size": 4}, r"'gradient_accumulation_steps'='x'"),
    ({"fp16": {"enabled": INF}}, r"'fp16.enabled'=inf: must be true or false"),
    ({"fp16": "yes"}, r"'fp16'='yes': must be a JSON object"),
    ({"fp16": {"enabled": True, "loss_scale": INF}}, r"'fp16.loss_scale'=inf"),
    ({"fp16": {"enabled": True, "min_loss_scale": -1}}, r"'fp16.min_loss_scale'=-1"),
    ({"fp16": {"enabled": True, "initial_scale_power": "16"}}, r"'fp16.initial_scale_power'='16'"),
    ({"fp16": {"enabled": True, "hysteresis": "2"}}, r"'fp16.hysteresis'='2'"),
    ({"bf16": {"enabled": True, "loss_scale": "x"}}, r"'bf16.loss_scale'='x'"),
    ({"zero_optimization": "3"}, r"'zero_optimization'='3': must be a JSON object"),
    ({"zero_optimization": {"stage": "x"}}, r"'zero_optimization.stage'='x'"),
    ({"zero_optimization": {"stage": 4}}, r"'zero_optimization.stage'=4"),
    ({"zero_optimization": {"stage": True}}, r"'zero_optimization.stage'=True"),
    ({"zero_optimization": {"offload_optimizer": "cpu"}}, r"'zero_optimization.offload_optimizer'='cpu'"),
    ({"zero_optimization": {"offload_param": {"device": 3}}}, r"'zero_optimization.offload_param.device'=3"),
    ({"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": 5}}},
     r"'zero_optimization.offload_param.nvme_path'=5"),
    ({"zero_optimization": {"offload_param": {"device": "cpu", "pin_memory": "yes"}}},
     r"'zero_optimization.offload_param.pin_memory'='yes'"),
    ({"zero_optimization": {"stage3_prefetch_bucket_size": "lots"}}, r"'zero_optimization.stage3_prefetch_bucket"),
    ({"zero_optimization": {"reduce_bucket_size": -5}}, r"'zero_optimization.reduce_bucket_size'=-5"),
    ({"zero_optimization": {"overlap_comm": "yes"}}, r"'zero_optimization.overlap_comm'='yes'"),
    ({"zero_optimization": {"max_live_parameters": 1, "stage3_max_live_parameters": 2}},
     r"both 'zero_optimization.max_live_parameters' and 'zero_optimization.stage3_max_live_parameters'"),
    ({"aio": {"block_size": "1MB"}}, r"'aio.block_size'='1MB'"),
    ({"aio": {"block_size": 2**40}}, r"'aio.block_size'="),
    ({"aio": {"queue_depth": 2**64 + 1}}, r"'aio.queue_depth'="),
    ({"aio": []}, r"'aio'=\[\]"),
    ({"gradient_clipping": "big"}, r"'gradient_clipping'='big'"),
    ({"gradient_clipping": INF}, r"'gradient_clipping'=inf"),
    ({"optimizer": "adam"}, r"'optimizer'='adam'"),
    ({"optimizer": {"type": 3}}, r"'optimizer.type'=3"),
    ({"optimizer": {"type": "Adam", "params": {"lr": "fast"}}}, r"'optimizer.params.lr'='fast'"),
    ({"optimizer": {"type": "Adam", "params": {"betas": 0.9}}}, r"'optimizer.params.betas'=0.9"),
    ({"optimizer": {"type": "Adam", "params": {"eps": 0}}}, r"'optimizer.params.eps'=0"),
    ({"optimizer": {"type": "Adam", "params": {"amsgrad": True}}}, r"'optimizer.params.amsgrad'=True"),
    ({"optimizer": {"type": "Adam", "params": []}}, r"'optimizer.params'=\[\]"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "x"}}},
     r"'scheduler.params.warmup_num_steps'='x'"),
    ({"scheduler": {"type": "OneCycle", "params": {"cycle_max_lr": 1e-3}}}, r"'scheduler.params.cycle_min_lr' is required"),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 5, "warmup_num_steps": 10}}},
     r"'scheduler.params.total_num_steps'=5 must be above"),
    ({"scheduler": "WarmupLR"}, r"'scheduler'='WarmupLR'"),
    ({"steps_per_print": "often"}, r"'steps_per_print'='often'"),
    ({"wall_clock_breakdown": 1}, r"'wall_clock_breakdown'=1"),
    ({"tensorboard": True}, r"'tensorboard'=True"),
]


@pytest.mark.parametrize("ds,match", REFUSED, ids=[json.dumps(c[0])[:60] for c in REFUSED])
def test_bad_values_refused_naming_the_key(ds, match):
    with pytest.raises(ConfigFileError, match=match):
        Config.from_deepspeed(ds)


BATCHES = [  # (train, micro, accumulation) given ("auto" or absent = None) -> as DeepSpeed derives them
    ((30, None, 3), (30, 10, 3)), ((32, 4, "auto"), (32, 4, 8)), ((32, 4, None), (32, 4, 8)),
    ((None, 4, 2), (8, 4, 2)), ((16, None, None), (16, 16, 1)), ((None, 4, None), (4, 4, 1)),
    ((12, 2, 6), (12, 2, 6)), (("auto", 4, 3), (12, 4, 3)), ((None, None, 5), (None, None, 5)),
]


@pytest.mark.parametrize("given,want", BATCHES, ids=[str(b[0]) for b in BATCHES])
def test_batch_arithmetic_as_deepspeed(given, want):
    ds = {k: v for k, v in zip(("train_batch_size", "train_micro_batch_size_per_gpu",
                                "gradient_accumulation_steps"), given) if v is not None}
    ds["bf16"] = {"enabled": True}
    c = Config.from_deepspeed(ds)
    assert (c.report.train_batch, c.report.micro_batch, c.grad_accumulation_steps) == want


@pytest.mark.parametrize("given", [(30, 4, 2), (30, 4, None), (30, None, 4), (3, 4, None)])
def test_inconsistent_batches_refused_naming_the_numbers(given):
    ds = {k: v for k, v in zip(("train_batch_size", "train_micro_batch_size_per_gpu",
                                "gradient_accumulation_steps"), given) if v is not None}
    with pytest.raises(ConfigFileError, match=rf"train_batch_size={given[0]} must equal"):
        Config.from_deepspeed(ds)


def test_world_size_enters_the_arithmetic(monkeypatch):
    c = Config.from_deepspeed({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, world_size=2)
    assert c.grad_accumulation_steps == 4 and c.report.world_size == 2
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert Config.from_deepspeed({"train_batch_size": 32, "gradient_accumulation_steps": 2}).report.micro_batch == 4


def test_optimizer_defaults_are_deepspeeds():
    r = Config.from_deepspeed({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}).report
    assert r.optimizer == {"adamw_mode": True, "lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    assert {"optimizer.params.betas", "optimizer.params.eps", "optimizer.params.weight_decay"} <= set(r.defaults)
    r = Config.from_deepspeed({"optimizer": {"type": "Adam"}}).report
    assert r.optimizer["lr"] == 1e-3 and "optimizer.params.lr" in r.defaults
    r = Config.from_deepspeed({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}).report
    assert r.optimizer["weight_decay"] == 0.01  # torch.optim.AdamW's default


def test_run_file_takes_deepspeed_defaults_not_its_own(tmp_path):
    from infinity.cli.runfile import load_run_file
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW",
                                                                                 "params": {"lr": 1e-4}}}))
    run = load_run_file(str(p), {"data.path": "x.txt"})
    assert (run.optimizer.betas, run.optimizer.weight_decay, run.optimizer.lr) == ((0.9, 0.999), 0.0, 1e-4)


@pytest.mark.parametrize("ds", [{"train_batch_size": 8}, {"zero_optimization": {}}, {"zero_optimization": None},
                                {"zero_optimization": {"stage": 0}}, {"zero_optimization": False}])
def test_no_zero_means_no_offload(ds):
    c = Config.from_deepspeed(ds)
    assert (c.zero_stage, c.offload_params, c.offload_optimizer) == (0, "none", "none")


@pytest.mark.parametrize("stage", ["3", 3.0, " 3"])
def test_stage_as_pydantic_takes_it(stage):
    c = Config.from_deepspeed({"zero_optimization": {"stage": stage}})
    assert (c.zero_stage, c.offload_params, c.offload_optimizer) == (3, "host", "host")


@pytest.mark.parametrize("alias,key", sorted(ZERO_ALIASES.items()))
def test_zero_aliases_read_as_their_keys(alias, key):
    value = False if "gather" in key or "use_all" in key or "sequential" in key else 1000
    r = Config.from_deepspeed({"zero_optimization": {"stage": 3, alias: value}}).report
    path = f"zero_optimization.{alias}"
    assert path in r.mapped or path in r.ignored, r.text()
    assert not r.unknown


def test_prefetch_alias_maps():
    c = Config.from_deepspeed({"bf16": {"enabled": True}, "zero_optimization": {"prefetch_bucket_size": 1000}})
    assert c.prefetch_bytes == 2000


def test_unknown_keys_warn_once_with_the_cli_lines():
    ds = {"train_batch_size": 8, "gradient_clippin": 1.0, "zero_optimization": {"overlap_com": True}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = Config.from_deepspeed(ds)
    ours = [w for w in caught if issubclass(w.category, DeepSpeedConfigWarning)]
    assert len(ours) == 1
    for line in c.report.lines("unknown"):
        assert line in str(ours[0].message) and line in c.report.text()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Config.from_deepspeed({"train_batch_size": 8})
    assert not caught


def test_cli_exit_2_on_bad_deepspeed(tmp_path, capsys):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"train_batch_size": -1}))
    assert main(["train", str(p), "--data", str(tmp_path / "x.txt"), "--no-progress"]) == 2
    assert "'train_batch_size'=-1" in capsys.readouterr().err
