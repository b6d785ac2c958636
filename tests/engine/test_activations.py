"""The activation count on meta tensors against what a real CPU forward saves
([Note: attention on meta tensors] in infinity/engine/plan/activations.py):
on meta, SDPA fell back to the math path and the count held the
seq x seq scores, 2-3x what the run keeps at sequence 2048."""

import pytest
import torch

from infinity.engine.plan.activations import activation_bytes
from infinity.models import GPT, GPTConfig

SEQ = 512


def _both(build, meta_loss, real_loss):
    with torch.device("meta"):
        meta = build()
    est = activation_bytes(meta, lambda m: meta_loss(m, torch.zeros(2, SEQ, dtype=torch.long, device="meta")))
    torch.manual_seed(0)
    real = build()
    x = torch.randint(0, 256, (2, SEQ))
    return est, activation_bytes(real, lambda m: real_loss(m, x))


def test_gpt_sdpa_counted_as_the_cpu_kernel_saves_it():
    cfg = GPTConfig(vocab_size=256, block_size=SEQ, n_layer=2, n_head=4, n_embd=64)
    est, real = _both(lambda: GPT(cfg), lambda m, x: m(x, x), lambda m, x: m(x, x))
    assert est["saved"] == real["saved"] and est["saved_other"] == real["saved_other"]
    # The scores the math path would keep: 2 layers x batch 2 x 4 heads x SEQ^2 x fp32, twice.
    assert est["saved"] < 2 * 2 * 4 * SEQ * SEQ * 4


def test_hugging_face_llama_sdpa_counted_as_the_cpu_kernel_saves_it():
    transformers = pytest.importorskip("transformers")
    lc = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ)

    def meta_loss(m, x):  # as `infinity estimate` runs it (infinity/cli/estimate.py)
        mask = torch.zeros(1, 1, 1, 1, device="meta").expand(x.shape[0], 1, SEQ, SEQ)
        return m(input_ids=x, attention_mask=mask, labels=x).loss

    est, real = _both(lambda: transformers.LlamaForCausalLM(lc), meta_loss,
                      lambda m, x: m(input_ids=x, labels=x).loss)
    # The stand-in mask's one fp32 element is the only difference.
    assert real["saved"] > 0 and est["saved"] - real["saved"] == 4, (est, real)
    assert est["saved_other"] == real["saved_other"]
