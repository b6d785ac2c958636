"""Config.moment_dtype outside the engine: the run file, `infinity estimate`,
the DeepSpeed import (bf16.bf16_optimizer_states, deepspeed/runtime/precision_config.py)."""

import pytest
from cli_utils import cli, run_file
from infinity import Config
from infinity.cli.estimate import estimate, load_for_estimate


def test_run_file_and_estimate_know_moment_dtype(tmp_path):
    est = {}
    for md in ("fp32", "bf16", "int8"):
        (tmp_path / md).mkdir()
        p = run_file(tmp_path / md, steps=2, runtime=f'moment_dtype = "{md}"\nhost_memory = "256MiB"')
        config, model = load_for_estimate(str(p))
        assert config.moment_dtype == md
        e = estimate(model, config)
        est[md] = e["host"]["permanent"]
        assert e["optimizer_state"]["moment_dtype"] == md
        per = e["optimizer_state"]["bytes_per_parameter"]
        assert {"fp32": 11.9 <= per <= 12.5, "bf16": 7.9 <= per <= 8.5, "int8": 5.9 <= per <= 6.6}[md], (md, per)
    # host homes: master 4 + moments 8 / 4 / ~2 bytes a parameter (+ gradients, alike in all three)
    assert est["int8"] < est["bf16"] < est["fp32"]
    assert cli("estimate", p) == 0
    assert cli("train", p) == 0  # the int8 run file trains


def test_run_file_refuses_a_bad_moment_dtype(tmp_path, capsys):
    p = run_file(tmp_path, runtime='moment_dtype = "fp8"')
    assert cli("estimate", p) != 0
    assert "moment_dtype" in capsys.readouterr().err


DS = {"train_micro_batch_size_per_gpu": 1,
      "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}


def test_deepspeed_bf16_optimizer_states_is_bf16_moments():
    c = Config.from_deepspeed(dict(DS, bf16={"enabled": True, "bf16_optimizer_states": True}))
    assert c.moment_dtype == "bf16" and c.dtype == "bf16" and c.master_dtype == "fp32"
    assert c.report.mapped["bf16.bf16_optimizer_states"] == "moment_dtype='bf16'"
    off = Config.from_deepspeed(dict(DS, bf16={"enabled": True, "bf16_optimizer_states": False}))
    assert off.moment_dtype == "fp32" and "bf16.bf16_optimizer_states" in off.report.ignored
    no_bf16 = Config.from_deepspeed(dict(DS, bf16={"enabled": False, "bf16_optimizer_states": True}))
    assert no_bf16.moment_dtype == "fp32"
    assert "bf16 is not enabled" in no_bf16.report.ignored["bf16.bf16_optimizer_states"]
    try:
        Config.from_deepspeed(dict(DS, bf16={"enabled": True, "bf16_optimizer_states": "yes"}))
    except (TypeError, ValueError) as e:
        assert "bf16.bf16_optimizer_states" in str(e)
    else:
        raise AssertionError("a non-bool bf16_optimizer_states was taken")


def test_deepspeed_bf16_master_weights_and_grads_is_a_bf16_master():
    both = {"enabled": True, "bf16_optimizer_states": True, "bf16_master_weights_and_grads": True}
    c = Config.from_deepspeed(dict(DS, bf16=both))
    assert (c.master_dtype, c.moment_dtype, c.dtype) == ("bf16", "bf16", "bf16")
    assert c.report.mapped["bf16.bf16_master_weights_and_grads"] == "master_dtype='bf16'"
    assert any("stochastic rounding" in w for w in c.report.warnings)
    off = Config.from_deepspeed(dict(DS, bf16={"enabled": True, "bf16_master_weights_and_grads": False}))
    assert off.master_dtype == "fp32" and "master stay fp32" in off.report.ignored[
        "bf16.bf16_master_weights_and_grads"]
    fp16 = Config.from_deepspeed(dict(DS, fp16={"enabled": True}, bf16={"enabled": False,
                                                                        "bf16_master_weights_and_grads": True}))
    assert fp16.master_dtype == "fp32"
    assert "bf16 is not enabled" in fp16.report.ignored["bf16.bf16_master_weights_and_grads"]
    # Stage 0 without offload keeps the optimizer on the device, where a bf16 master does not exist:
    # refused with the field at fault, not silently kept fp32.
    with pytest.raises(ValueError, match="'bf16.bf16_master_weights_and_grads'.*master_dtype='bf16' needs "
                                         "offload_optimizer"):
        Config.from_deepspeed({"train_micro_batch_size_per_gpu": 1,
                               "bf16": {"enabled": True, "bf16_master_weights_and_grads": True}})
