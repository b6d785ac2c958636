"""Worker of test_hf_torchrun.py, run under ``torchrun``: the plain
``Trainer`` (DDP) or ``InfinityTrainer`` at a ZeRO stage on the same data;
rank 0 writes the logged losses and the final full state dict to OUT."""

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import infinity
from infinity.integrations.hf import InfinityTrainer


def main(which: str, stage: int, out: str, work: str) -> None:
    torch.set_num_threads(1)
    args = TrainingArguments(output_dir=f"{work}/{which}{stage}", per_device_train_batch_size=2, max_steps=3,
                             learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             max_grad_norm=0.5, seed=0, dataloader_num_workers=0, weight_decay=0.1,
                             disable_tqdm=True, ddp_backend="gloo")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    g = torch.Generator().manual_seed(3)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 64, (16, 8), generator=g)]
    if which == "plain":
        tr = Trainer(model=model, args=args, train_dataset=data)
    else:
        cfg = infinity.Config(device="cpu", dtype="fp32", offload_params="host", offload_optimizer="host",
                              device_memory=1 << 20, unit_classes=["LlamaDecoderLayer"], zero_stage=stage,
                              swap_paths=[f"{work}/swap{stage}"], swap_block_size=4096)
        tr = InfinityTrainer(model=model, args=args, train_dataset=data, infinity_config=cfg)
    tr.train()
    losses = [h["loss"] for h in tr.state.log_history if "loss" in h]
    state = infinity.full_state_dict(tr.model) if which != "plain" else \
        {k: v.detach().clone() for k, v in tr.model.state_dict().items()}
    if torch.distributed.get_rank() == 0:
        torch.save({"losses": losses, "state": state}, out)
    if which != "plain":
        infinity.close(tr.model)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
