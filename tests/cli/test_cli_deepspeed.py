"""Config.from_deepspeed on published DeepSpeed configs: every mapped field
and every ignored key asserted."""

import json

import pytest
import torch

from infinity import Config
from infinity.config.files import ConfigFileError
from infinity.config.deepspeed import DeepSpeedConfigWarning, is_deepspeed
from infinity.models import GPT, GPTConfig

# Source: Hugging Face Transformers docs, DeepSpeed integration, "NVMe Support"
# (ZeRO-Infinity example; note "aio" nested under zero_optimization there).
HF_ZERO_INFINITY = {
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 4,
                              "fast_init": False},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True, "buffer_count": 5,
                          "buffer_size": 1e8, "max_in_cpu": 1e9},
        "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 1, "single_submit": False,
                "overlap_events": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}

# Source: Hugging Face Transformers docs, DeepSpeed integration, ZeRO-2 config
# with optimizer offload to the CPU (ds_config_zero2.json, ZeRO-Offload).
HF_ZERO_OFFLOAD = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}

# Source: deepspeedai/DeepSpeedExamples inference/sglang/ds_offload_nvme_aio.json
# (as annotated in claude_tutorials/annotated_configs/zero3_nvme_offload_annotated.json).
DSE_NVME = {
    "zero_optimization": {
        "stage": 3,
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": "auto",
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme/sglang", "pin_memory": True,
                          "buffer_size": "auto", "buffer_count": 5},
    },
    "aio": {"block_size": 8388608, "queue_depth": 32, "intra_op_parallelism": 8, "single_submit": False,
            "overlap_events": True, "use_gds": False},
    "train_batch_size": 1,
}

# Source: DeepSpeed tests/unit/runtime/zero/test_nvme_checkpointing.py
# (TestNVMeCheckpointing, the nvme/nvme case; nvme_path is the test's tmpdir).
DS_UNIT_NVME = {
    "train_micro_batch_size_per_gpu": 1,
    "steps_per_print": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
    "fp16": {"enabled": True, "initial_scale_power": 8},
    "zero_optimization": {
        "stage": 3,
        "offload_param": {"device": "nvme", "nvme_path": "/tmp/zero"},
        "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp/zero"},
        "sub_group_size": 100,
        "stage3_max_live_parameters": 100,
        "stage3_param_persistence_threshold": 0,
    },
    "aio": {"block_size": 1048576},
}


def _fields(cfg, **expected):
    for k, v in expected.items():
        assert getattr(cfg, k) == v, (k, getattr(cfg, k), v)


def test_hf_zero_infinity(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps(HF_ZERO_INFINITY))
    model = GPT(GPTConfig(n_embd=64, n_layer=1))
    c = Config.from_deepspeed(str(p), model=model)
    r = c.report
    _fields(c, zero_stage=3, offload_params="nvme", offload_optimizer="nvme", swap_paths=["/local_nvme"],
            swap_block_size=262144, swap_queue_depth=32, dtype="fp32", prefetch_bytes=int(0.9 * 64 * 64) * 4)
    assert r.source == str(p)
    assert set(r.ignored) == {
        "zero_optimization.offload_optimizer.pin_memory", "zero_optimization.offload_optimizer.buffer_count",
        "zero_optimization.offload_optimizer.fast_init", "zero_optimization.offload_param.pin_memory",
        "zero_optimization.offload_param.buffer_count", "zero_optimization.offload_param.buffer_size",
        "zero_optimization.offload_param.max_in_cpu", "zero_optimization.aio.thread_count",
        "zero_optimization.aio.single_submit", "zero_optimization.aio.overlap_events",
        "zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients",
        "zero_optimization.sub_group_size", "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.stage3_max_live_parameters",
        "zero_optimization.stage3_max_reuse_distance", "zero_optimization.stage3_gather_16bit_weights_on_model_save"}
    assert not r.unknown
    assert any("zero_optimization.aio" in w for w in r.warnings)
    assert "zero_optimization.stage3_prefetch_bucket_size" in r.auto
    assert "gradient_clipping" in r.defaults
    # Without a model the auto prefetch size stays unresolved and is reported so.
    c2 = Config.from_deepspeed(HF_ZERO_INFINITY)
    assert c2.prefetch_bytes is None
    assert c2.report.auto["zero_optimization.stage3_prefetch_bucket_size"].startswith("unresolved")


def test_hf_zero_offload_autos():
    c = Config.from_deepspeed(HF_ZERO_OFFLOAD)
    r = c.report
    _fields(c, zero_stage=2, offload_optimizer="host", offload_params="none", dtype="bf16", loss_scale="dynamic",
            initial_loss_scale=65536.0, loss_scale_growth_interval=1000, min_loss_scale=1.0, max_grad_norm=1.0,
            grad_accumulation_steps=1)
    assert set(r.ignored) == {
        "fp16.hysteresis", "zero_optimization.offload_optimizer.pin_memory", "zero_optimization.allgather_partitions",
        "zero_optimization.allgather_bucket_size", "zero_optimization.overlap_comm",
        "zero_optimization.reduce_scatter", "zero_optimization.reduce_bucket_size",
        "zero_optimization.contiguous_gradients", "steps_per_print", "wall_clock_breakdown"}
    assert set(r.auto) == {"fp16.enabled", "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.eps",
                           "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr",
                           "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps",
                           "gradient_accumulation_steps", "gradient_clipping", "train_batch_size",
                           "train_micro_batch_size_per_gpu"}
    assert r.optimizer == {"adamw_mode": True}
    assert r.schedule is None and r.micro_batch is None and not r.unknown


def test_deepspeed_examples_nvme():
    c = Config.from_deepspeed(DSE_NVME)
    r = c.report
    _fields(c, zero_stage=3, offload_params="nvme", offload_optimizer="host", swap_paths=["/local_nvme/sglang"],
            swap_block_size=8388608, swap_queue_depth=32, dtype="fp32")
    assert set(r.ignored) == {
        "zero_optimization.stage3_param_persistence_threshold", "zero_optimization.stage3_max_live_parameters",
        "zero_optimization.offload_param.pin_memory", "zero_optimization.offload_param.buffer_size",
        "zero_optimization.offload_param.buffer_count", "aio.intra_op_parallelism", "aio.single_submit",
        "aio.overlap_events", "aio.use_gds"}
    assert r.train_batch == 1 and not r.unknown
    assert any("offload_optimizer" in w for w in r.warnings)


def test_deepspeed_unit_test_nvme():
    c = Config.from_deepspeed(DS_UNIT_NVME)
    r = c.report
    _fields(c, zero_stage=3, offload_params="nvme", offload_optimizer="nvme", swap_paths=["/tmp/zero"],
            swap_block_size=1048576, dtype="fp16", initial_loss_scale=256.0)
    # DeepSpeed's "Adam" defaults to adam_w_mode; absent params take DeepSpeed's Adam defaults (issue 35)
    assert r.optimizer == {"adamw_mode": True, "lr": 0.00015, "betas": (0.9, 0.999), "eps": 1e-8,
                           "weight_decay": 0.0}
    assert r.micro_batch == 1
    assert set(r.ignored) == {"steps_per_print", "zero_optimization.sub_group_size",
                              "zero_optimization.stage3_max_live_parameters",
                              "zero_optimization.stage3_param_persistence_threshold"}
    assert set(r.defaults) == {"gradient_clipping", "zero_optimization.offload_param.pin_memory",
                               "zero_optimization.offload_optimizer.pin_memory", "optimizer.params.betas",
                               "optimizer.params.eps", "optimizer.params.weight_decay"}


def test_legacy_keys_misspelling_and_scheduler():
    ds = {
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": True,
                              "stage3_gather_fp16_weights_on_model_save": True, "overlap_com": True},
        "aio": {"block_size": 1000000, "thread_count": 2, "queue_dept": 8},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4,
                                                          "warmup_num_steps": 10, "total_num_steps": 100,
                                                          "warmup_type": "linear", "last_batch_iteration": -1}},
        "gradient_clipping": 0.5,
        "gradient_accumulation_steps": 4,
        "train_micro_batch_size_per_gpu": 2,
        "train_batch_size": 8,
        "gradient_clippin": 1.0,
    }
    with pytest.warns(DeepSpeedConfigWarning, match="gradient_clippin"):
        c = Config.from_deepspeed(ds)
    r = c.report
    _fields(c, dtype="bf16", zero_stage=2, offload_optimizer="host", offload_params="none", max_grad_norm=0.5,
            grad_accumulation_steps=4, swap_block_size=1003520)
    assert "zero_optimization.cpu_offload" in r.mapped
    assert {"zero_optimization.cpu_offload_use_pin_memory", "zero_optimization.stage3_gather_fp16_weights_on_model_save",
            "aio.thread_count", "scheduler.params.last_batch_iteration"} <= set(r.ignored)
    assert "did you mean 'overlap_comm'" in r.unknown["zero_optimization.overlap_com"]
    assert "did you mean 'queue_depth'" in r.unknown["aio.queue_dept"]
    assert "did you mean 'gradient_clipping'" in r.unknown["gradient_clippin"]
    assert r.optimizer == {"adamw_mode": True, "lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    assert (r.micro_batch, r.train_batch) == (2, 8)
    s = r.schedule
    assert (s.kind, s.warmup_steps, s.total_steps, s.peak_lr, s.warmup_type) == ("linear", 10, 100, 3e-4, "linear")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = s.build(opt)
    lrs = []
    for _ in range(100):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == 0.0 and lrs[5] == pytest.approx(1.5e-4) and lrs[10] == pytest.approx(3e-4)
    assert lrs[55] == pytest.approx(1.5e-4) and lrs[99] == pytest.approx(3e-4 / 90)


def test_errors_and_detection():
    with pytest.raises(ConfigFileError, match="offload_param.device'='disk'.*choose one of"):
        Config.from_deepspeed({"zero_optimization": {"stage": 3, "offload_param": {"device": "disk"}}})
    with pytest.raises(ConfigFileError, match="scheduler.*WarmupLRR.*did you mean 'WarmupLR'"):
        Config.from_deepspeed({"scheduler": {"type": "WarmupLRR"}})
    assert is_deepspeed(HF_ZERO_OFFLOAD) and not is_deepspeed({"model": {}, "runtime": {}})
