"""InfinityTrainer and the Trainer's 8-bit AdamW choices: TrainingArguments.optim
"adamw_bnb_8bit", "adamw_torch_8bit", ... run infinity's AdamW with
Config.moment_dtype="int8", said in a log line."""

import dataclasses
import logging

import pytest
import torch

import infinity

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments  # noqa: E402

from infinity.integrations.hf import InfinityTrainer  # noqa: E402


def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def args(out, optim):
    return TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, max_steps=2, learning_rate=1e-2,
                             report_to=[], use_cpu=True, max_grad_norm=0.0, dataloader_num_workers=0,
                             disable_tqdm=True, optim=optim, save_strategy="no")


def dataset():
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": x, "labels": x} for x in torch.randint(0, 64, (4, 8), generator=g)]


def config(tmp_path, md="fp32"):
    return infinity.Config(device="cpu", dtype="fp32", unit_classes=["LlamaDecoderLayer"], moment_dtype=md,
                           host_memory="256MiB", swap_paths=[str(tmp_path / "swap")])


@pytest.mark.parametrize("optim", ["adamw_bnb_8bit", "adamw_torch_8bit"])
def test_eight_bit_optim_runs_int8_moments_and_says_so(tmp_path, optim, caplog):
    with caplog.at_level(logging.INFO, logger="infinity"):
        tr = InfinityTrainer(model=llama(), args=args(tmp_path, optim), train_dataset=dataset(),
                             infinity_config=config(tmp_path))
    assert tr.infinity_engine.config.moment_dtype == "int8"
    assert any(optim in r.getMessage() and "moment_dtype='int8'" in r.getMessage() for r in caplog.records)
    tr.train()
    assert infinity.stats(tr.model)["state_bytes"]["exp_avg_scale"] > 0  # the moments are int8 codes
    infinity.close(tr.model)


def test_plain_optim_keeps_the_configs_moments_and_a_conflict_raises(tmp_path):
    tr = InfinityTrainer(model=llama(), args=args(tmp_path / "a", "adamw_torch"), train_dataset=dataset(),
                         infinity_config=config(tmp_path / "a", "bf16"))
    assert tr.infinity_engine.config.moment_dtype == "bf16"
    infinity.close(tr.model)
    with pytest.raises(infinity.engine.faults.UsageError, match="optim='adamw_bnb_8bit'.*moment_dtype='bf16'"):
        InfinityTrainer(model=llama(), args=args(tmp_path / "b", "adamw_bnb_8bit"), train_dataset=dataset(),
                        infinity_config=dataclasses.replace(config(tmp_path / "b"), moment_dtype="bf16"))
