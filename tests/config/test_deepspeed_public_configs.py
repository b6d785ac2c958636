"""The nine public DeepSpeed configs of tests/data/deepspeed (sources in its
README) through ``Config.from_deepspeed``: each key of each file mapped,
ignored with a reason, resolved as "auto" or flagged, and the fields checked
against DeepSpeed's own semantics (fp16 ``loss_scale`` 0 is dynamic; absent
``gradient_clipping`` is 0.0, no clipping; Adam's ``adam_w_mode`` defaults
to true; ``train_batch_size = micro x accumulation x world``; absent
optimizer keys take DeepSpeed's defaults)."""

import json
import warnings
from pathlib import Path

import pytest

from infinity import Config
from infinity.config.files import ConfigFileError

DATA = Path(__file__).resolve().parents[1] / "data" / "deepspeed"
AUTO_BATCH = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
              "gradient_clipping"}
HOST3 = dict(zero_stage=3, offload_params="host", offload_optimizer="host")

# file: (Config fields, report fields, "auto" keys, unknown keys)
EXPECTED = {
    "hf_ds_config_zero2.json": (
        dict(zero_stage=2, offload_params="none", offload_optimizer="host", dtype="bf16", loss_scale="dynamic",
             initial_loss_scale=65536.0, max_grad_norm=1.0, grad_accumulation_steps=1),
        dict(train_batch=None, micro_batch=None, optimizer={"adamw_mode": True}, schedule=None),
        AUTO_BATCH | {"bf16.enabled", "fp16.enabled", "optimizer.params.lr", "optimizer.params.betas",
                      "optimizer.params.eps", "optimizer.params.weight_decay", "scheduler.params.warmup_min_lr",
                      "scheduler.params.warmup_max_lr", "scheduler.params.warmup_num_steps"}, set()),
    "hf_ds_config_zero3.json": (
        dict(HOST3, dtype="fp16", loss_scale="dynamic", initial_loss_scale=65536.0, max_grad_norm=None,
             prefetch_bytes=0),
        dict(optimizer={"adamw_mode": True, "lr": 3e-5, "betas": (0.8, 0.999), "eps": 1e-8, "weight_decay": 3e-7}),
        set(), set()),
    "dse_ds_zero_stage_infinity_config.json": (
        dict(zero_stage=3, offload_params="nvme", offload_optimizer="nvme", swap_paths=["/nvme_data"],
             dtype="fp16", loss_scale=1024.0, max_grad_norm=1.0, swap_block_size=1048576, swap_queue_depth=16,
             prefetch_bytes=100_000_000, grad_accumulation_steps=1),
        dict(train_batch=4, micro_batch=4), set(), {"zero_optimization.stage3_param_persitance_threshold"}),
    "dse_ds_zero2_cpu_offload_config.json": (
        dict(zero_stage=2, offload_params="none", offload_optimizer="host", dtype="fp16", loss_scale="dynamic",
             max_grad_norm=1.0, grad_accumulation_steps=1),
        dict(train_batch=16, micro_batch=16,
             optimizer={"adamw_mode": True, "lr": 1.5e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}),
        set(), set()),
    "dse_ds_zero-offload_10B_config.json": (
        dict(zero_stage=2, offload_params="none", offload_optimizer="host", dtype="fp16", loss_scale=4096.0,
             max_grad_norm=1.0, grad_accumulation_steps=3),
        dict(train_batch=30, micro_batch=10,
             optimizer={"adamw_mode": True, "lr": 1.5e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}),
        set(), {"zero_optimization.comm_overlap"}),
    "llamafactory_ds_z2_offload_config.json": (
        dict(zero_stage=2, offload_params="none", offload_optimizer="host", dtype="bf16", max_grad_norm=1.0),
        dict(train_batch=None, micro_batch=None, optimizer={}),
        AUTO_BATCH | {"bf16.enabled", "fp16.enabled"}, {"comms_config", "monitor_config"}),
    "llamafactory_ds_z3_offload_config.json": (
        dict(HOST3, dtype="bf16", max_grad_norm=1.0),
        dict(train_batch=None, micro_batch=None, optimizer={}),
        AUTO_BATCH | {"bf16.enabled", "fp16.enabled", "zero_optimization.stage3_prefetch_bucket_size"},
        {"comms_config", "monitor_config"}),
    "axolotl_zero3_bf16_cpuoffload_all.json": (
        dict(HOST3, dtype="bf16", max_grad_norm=1.0),
        dict(train_batch=None, micro_batch=None, optimizer={}),
        AUTO_BATCH | {"zero_optimization.stage3_prefetch_bucket_size"}, set()),
    # No offload_optimizer: DeepSpeed keeps the optimizer state on the GPU; infinity's ZeRO needs it on the
    # host, which the report says under "(absent)".
    "axolotl_zero3_bf16_cpuoffload_params.json": (
        dict(HOST3, dtype="bf16", max_grad_norm=1.0),
        dict(train_batch=None, micro_batch=None, optimizer={}),
        AUTO_BATCH | {"zero_optimization.stage3_prefetch_bucket_size"}, set()),
}


def _leaves(d, pre=""):
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from _leaves(v, f"{pre}{k}.")
        else:
            yield pre + k


def _import(name):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = Config.from_deepspeed(str(DATA / name))
    return config, [str(w.message) for w in caught]


def test_the_nine_files_are_there_with_their_sources():
    files = sorted(p.name for p in DATA.glob("*.json"))
    assert files == sorted(EXPECTED)
    readme = (DATA / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in files)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_public_config_imports_key_by_key(name):
    fields, report_fields, auto, unknown = EXPECTED[name]
    config, warned = _import(name)
    for field, want in fields.items():
        assert getattr(config, field) == want, (name, field, getattr(config, field))
    r = config.report
    for field, want in report_fields.items():
        assert getattr(r, field) == want, (name, field, getattr(r, field))
    assert set(r.auto) == auto, set(r.auto) ^ auto
    assert set(r.unknown) == unknown
    assert bool(warned) == bool(unknown) and all(k in " ".join(warned) for k in unknown)  # said once, by name
    # Every key of the file has a place in the report: mapped, ignored with a reason, "auto", defaulted or unknown.
    named = {part for table in (r.mapped, r.ignored, r.unknown, r.auto, r.defaults) for k in table
             for part in k.split(" (")[0].split("/")}
    for leaf in _leaves(json.loads((DATA / name).read_text())):
        assert any(leaf == n or leaf.startswith(n + ".") for n in named), (name, leaf)
    for key, why in r.ignored.items():
        assert why.strip(), (name, key)


def test_a_bad_value_in_a_public_config_is_refused_naming_its_key(tmp_path):
    ds = json.loads((DATA / "hf_ds_config_zero3.json").read_text())
    ds["zero_optimization"]["offload_param"]["device"] = "disk"
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(ds))
    with pytest.raises(ConfigFileError, match=r"zero_optimization\.offload_param\.device"):
        Config.from_deepspeed(str(p))
