"""Hugging Face models under infinity (issue 23): save_pretrained,
PEFT LoRA, Trainer (with checkpoints and resume) and lazy initialisation
give what they give without infinity. On 5147b56: save_pretrained raised
on shared tensors, PEFT saved NaN adapters, Trainer logged grad_norm 0 and
clipped nothing, and a lazy build had embeddings of std 1.0."""

import dataclasses
import os

import pytest
import torch

import infinity

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("accelerate")

from transformers import (GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM,  # noqa: E402
                          Trainer, TrainingArguments)

from infinity.integrations.hf import InfinityTrainer  # noqa: E402


def llama(tied=False):
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))


def gpt2():
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


BUILDERS = {"llama": (llama, "LlamaDecoderLayer"), "llama-tied": (lambda: llama(True), "LlamaDecoderLayer"),
            "gpt2": (gpt2, "GPT2Block")}


def config(unit, tmp_path, placement="host"):
    return infinity.Config(device="cpu", dtype="fp32", offload_params=placement, offload_optimizer=placement,
                           device_memory=1 << 20, unit_classes=[unit], swap_paths=[str(tmp_path / "swap")],
                           swap_block_size=4096)


def ids(seed=1, n=2):
    return torch.randint(0, 64, (n, 8), generator=torch.Generator().manual_seed(seed))


def trained(name, tmp_path, placement="host", steps=2):
    build, unit = BUILDERS[name]
    torch.manual_seed(0)
    m, o = infinity.initialize(build(), config(unit, tmp_path, placement), lr=1e-2)
    for s in range(steps):
        x = ids(s)
        m(input_ids=x, labels=x).loss.backward()
        o.step()
        o.zero_grad()
    return m, o


@pytest.mark.parametrize("name,placement", [("llama", "host"), ("llama-tied", "nvme"), ("gpt2", "host")])
def test_save_pretrained_then_from_pretrained_gives_the_same_logits(tmp_path, name, placement):
    m, o = trained(name, tmp_path, placement)
    x = ids(9)
    with torch.no_grad():
        want = m(input_ids=x).logits
    m.save_pretrained(tmp_path / "out")
    back = type(m).from_pretrained(tmp_path / "out")
    with torch.no_grad():
        assert torch.equal(back(input_ids=x).logits, want)
    infinity.close(m)


def test_peft_lora_adapters_save_reload_and_merge(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    torch.manual_seed(0)
    base = llama()
    base_sd = {k: v.clone() for k, v in base.state_dict().items()}
    lora = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    m, o = infinity.initialize(lora, config("LlamaDecoderLayer", tmp_path), lr=1e-2)
    for s in range(2):
        x = ids(s)
        m(input_ids=x, labels=x).loss.backward()
        o.step()
        o.zero_grad()
    x = ids(9)
    with torch.no_grad():
        want = m(input_ids=x).logits
    m.save_pretrained(tmp_path / "adapter")
    plain = llama()
    plain.load_state_dict(base_sd)
    reloaded = PeftModel.from_pretrained(plain, tmp_path / "adapter")
    saved = peft.get_peft_model_state_dict(reloaded)
    assert saved and all(not torch.isnan(v).any() for v in saved.values())
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=x).logits, want)
    merged = m.merge_and_unload()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=x).logits, want, rtol=1e-5, atol=1e-5)
    infinity.close(m)


def training_args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=4, max_steps=4, learning_rate=1e-2,
                logging_steps=1, save_steps=2, report_to=[], use_cpu=True, max_grad_norm=0.5, seed=0,
                dataloader_num_workers=0, weight_decay=0.1, lr_scheduler_type="linear", warmup_steps=1,
                disable_tqdm=True)
    base.update(kw)
    return TrainingArguments(**base)


def dataset():
    return [{"input_ids": x, "labels": x} for x in ids(3, 16)]


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_trainer_matches_the_plain_trainer_and_resumes_exactly(tmp_path, name):
    build, unit = BUILDERS[name]
    torch.manual_seed(0)
    plain = Trainer(model=build(), args=training_args(tmp_path / "plain", save_strategy="no"),
                    train_dataset=dataset())
    plain.train()
    torch.manual_seed(0)
    ours = InfinityTrainer(model=build(), args=training_args(tmp_path / "ours"), train_dataset=dataset(),
                           infinity_config=config(unit, tmp_path))
    ours.train()
    assert logged(ours, "loss") == pytest.approx(logged(plain, "loss"), rel=1e-5)
    # The norm infinity measured (and clipped with), not torch's 0 over p.grad=None.
    assert logged(ours, "grad_norm") == pytest.approx(logged(plain, "grad_norm"), rel=1e-4)
    assert min(logged(ours, "grad_norm")) > 0.5  # so the clipping was in play
    got = infinity.full_state_dict(ours.model)
    for k, v in plain.model.state_dict().items():
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-5, msg=k)
    ckpt = tmp_path / "ours" / "checkpoint-2"
    assert (ckpt / "infinity").is_dir() and (ckpt / "model.safetensors").is_file()
    ours.save_model(str(tmp_path / "final"))
    x = ids(9)
    with torch.no_grad():
        want = ours.model(input_ids=x).logits
        assert torch.equal(type(ours.model).from_pretrained(tmp_path / "final")(input_ids=x).logits, want)
    want_tail = logged(ours, "loss")[2:]
    infinity.close(ours.model)
    # A new process's view: a fresh model and trainer, resumed from checkpoint-2.
    torch.manual_seed(123)
    again = InfinityTrainer(model=build(), args=training_args(tmp_path / "again"), train_dataset=dataset(),
                            infinity_config=config(unit, tmp_path))
    again.train(resume_from_checkpoint=str(ckpt))
    assert logged(again, "loss")[-2:] == want_tail  # the history before holds the checkpoint's own steps
    infinity.close(again.model)


@pytest.mark.parametrize("overlap", ["step", "backward"])
def test_trainer_without_clipping_logs_the_plain_trainers_grad_norm(tmp_path, overlap, monkeypatch):
    """max_grad_norm=0: the plain Trainer still logs grad_norm; so does
    InfinityTrainer, measuring it only for the steps it logs, without
    changing the training (issue 35, item 3)."""
    build, unit = BUILDERS["llama"]
    kw = dict(max_grad_norm=0.0, logging_steps=2, logging_first_step=True, save_strategy="no", max_steps=5)
    torch.manual_seed(0)
    plain = Trainer(model=build(), args=training_args(tmp_path / "plain", **kw), train_dataset=dataset())
    plain.train()
    torch.manual_seed(0)
    ours = InfinityTrainer(model=build(), args=training_args(tmp_path / "ours", **kw), train_dataset=dataset(),
                           infinity_config=dataclasses.replace(config(unit, tmp_path), overlap=overlap))
    grads = ours.infinity_engine.grads
    measured = []
    real = grads.sum_of_squares
    monkeypatch.setattr(grads, "sum_of_squares", lambda *a: measured.append(1) or real(*a))
    ours.train()
    assert logged(plain, "grad_norm") and len(logged(plain, "grad_norm")) == 3  # steps 1, 2 and 4
    assert logged(ours, "grad_norm") == pytest.approx(logged(plain, "grad_norm"), rel=1e-4)
    assert logged(ours, "loss") == pytest.approx(logged(plain, "loss"), rel=1e-5)
    assert len(measured) == 3  # the logged steps only, of 5
    opt = ours.infinity_optimizer
    assert opt.scaling.max_grad_norm is None and opt.schedule.early_ok  # no clipping after the last logged step
    infinity.close(ours.model)


def test_trainer_keeps_overlap_backward_under_clipping_and_logs_the_replay_rate(tmp_path):
    """The Trainer's clipping (max_grad_norm 0.5 here; the norms are above
    it, so the first step's speculation is replayed and every later step
    follows a clipped one, so waits) with overlap="backward": the
    updates are speculative, the training is overlap="step"'s bit for bit,
    and each log says which share of its steps was replayed."""
    build, unit = BUILDERS["llama"]
    out = {}
    for overlap in ("step", "backward"):
        torch.manual_seed(0)
        tr = InfinityTrainer(model=build(), args=training_args(tmp_path / overlap, save_strategy="no", max_steps=6),
                             train_dataset=dataset(),
                             infinity_config=dataclasses.replace(config(unit, tmp_path), overlap=overlap))
        tr.train()
        out[overlap] = (tr, logged(tr, "loss"), logged(tr, "replay_rate"),
                        {k: v.clone() for k, v in infinity.full_state_dict(tr.model).items()},
                        infinity.stats(tr.model)["speculation"], tr.infinity_engine.config.overlap)
        infinity.close(tr.model)
    (_, loss_s, rate_s, sd_s, _, _), (_, loss_b, rate_b, sd_b, spec, overlap) = out["step"], out["backward"]
    assert overlap == "backward" and spec["off"] is None
    assert loss_b == loss_s and all(torch.equal(sd_b[k], sd_s[k]) for k in sd_s)
    assert rate_s == []  # nothing speculates with overlap="step"
    # Step 1 speculates and is replayed; steps 2-6 follow a clipped step and wait (no log has a rate then).
    assert spec["steps"] == spec["replayed"] == 1 and spec["waited"] == 5, spec
    assert rate_b == [1.0], rate_b


def test_trainer_refuses_its_own_mixed_precision(tmp_path):
    with pytest.raises(infinity.engine.faults.UsageError, match="Config\\(dtype"):
        InfinityTrainer(model=llama(), args=training_args(tmp_path, bf16=True), train_dataset=dataset())


def test_trainer_and_config_disagreeing_on_clipping_or_accumulation_raise(tmp_path):
    """One of the two silently winning would train with a norm or window the user did not ask for."""
    base = config("LlamaDecoderLayer", tmp_path)
    with pytest.raises(infinity.engine.faults.UsageError, match="max_grad_norm=2.0 but TrainingArguments"):
        InfinityTrainer(model=llama(), args=training_args(tmp_path / "a"), train_dataset=dataset(),
                        infinity_config=dataclasses.replace(base, max_grad_norm=2.0))
    with pytest.raises(infinity.engine.faults.UsageError, match="gradient_accumulation_steps=2"):
        InfinityTrainer(model=llama(), args=training_args(tmp_path / "b", gradient_accumulation_steps=2),
                        train_dataset=dataset(), infinity_config=dataclasses.replace(base, grad_accumulation_steps=3))
    tr = InfinityTrainer(model=llama(), args=training_args(tmp_path / "c", gradient_accumulation_steps=2),
                         train_dataset=dataset(), infinity_config=base)
    assert tr.infinity_engine.config.grad_accumulation_steps == 2 and tr.infinity_engine.config.max_grad_norm == 0.5
    infinity.close(tr.model)


@pytest.mark.parametrize("name", ["llama", "llama-tied", "gpt2"])
def test_lazy_and_eager_hf_builds_are_equal(tmp_path, name):
    build, unit = BUILDERS[name]
    torch.manual_seed(0)
    eager = build()
    cfg = config(unit, tmp_path)
    torch.manual_seed(0)
    with infinity.init(cfg):
        lazy = build()
    m, _ = infinity.initialize(lazy, cfg)
    full = infinity.full_state_dict(m)
    for k, v in eager.state_dict().items():
        assert torch.equal(full[k], v), k
    infinity.close(m)
    assert os.path.isdir(tmp_path)
