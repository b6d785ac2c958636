"""Export to the Hugging Face layout (issue 19): a tiny LlamaForCausalLM
trained through infinity (weights on NVMe), exported from the live model and
consolidated from a checkpoint, reloads with ``from_pretrained`` to the same
logits; ``load_pretrained`` of the export into a fresh infinity run equals
the live weights; sharded exports carry the index; consolidation of a
checkpoint holds one tensor at a time."""

import json
import os

import pytest
import torch

import infinity
from infinity.checkpoint import consolidate

transformers = pytest.importorskip("transformers")


def tiny_llama():
    torch.manual_seed(0)
    conf = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(conf)


def trained(tmp_path, tag="a"):
    cfg = infinity.Config(device="cpu", dtype="fp32", offload_params="nvme", offload_optimizer="nvme",
                          device_memory=1 << 20, host_memory="64MiB", swap_paths=[str(tmp_path / f"swap-{tag}")],
                          swap_block_size=4096)
    m, o = infinity.initialize(tiny_llama(), cfg, lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 96, (2, 12), generator=g)
        m(input_ids=ids, labels=ids).loss.backward()
        o.step()
        o.zero_grad()
    return m, o


IDS = torch.arange(24).reshape(2, 12) % 96


def _hf_logits(path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    with torch.no_grad():
        return hf(input_ids=IDS).logits


def test_export_and_consolidate_reload_with_from_pretrained(tmp_path):
    m, o = trained(tmp_path)
    with torch.no_grad():
        live = m(input_ids=IDS).logits
    files = infinity.export_pretrained(m, tmp_path / "hf", dtype="fp32")
    assert files == ["model.safetensors"] and (tmp_path / "hf" / "config.json").exists()
    torch.testing.assert_close(_hf_logits(tmp_path / "hf"), live, rtol=1e-5, atol=1e-5)
    infinity.save_checkpoint(tmp_path / "ck", m, o)
    weights = infinity.full_state_dict(m)
    infinity.close(m)
    consolidate(tmp_path / "ck", tmp_path / "hf2", dtype="fp32", max_shard_size="40KB")
    index = json.loads((tmp_path / "hf2" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((tmp_path / "hf2" / s).exists() for s in shards)
    torch.testing.assert_close(_hf_logits(tmp_path / "hf2"), live, rtol=1e-5, atol=1e-5)
    # The export loads back into a fresh infinity run as the live weights.
    m2, _ = trained(tmp_path, "b")
    infinity.load_pretrained(m2, tmp_path / "hf2")
    again = infinity.full_state_dict(m2)
    assert all(torch.equal(again[k], weights[k]) for k in weights)
    infinity.close(m2)


def test_bf16_export_is_the_rounded_master(tmp_path):
    from safetensors.torch import load_file
    m, o = trained(tmp_path)
    infinity.export_pretrained(m, tmp_path / "hf", dtype="bf16")
    live = infinity.full_state_dict(m)
    got = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(got) == sorted(k for k in live if k in got) and len(got) >= len(live) - 1
    for k, v in got.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, live[k].to(torch.bfloat16)), k
    infinity.close(m)
    assert not os.path.exists(tmp_path / "hf" / ".export.partial")


CONSOLIDATE = """
import sys
sys.path.insert(0, {root!r})
import torch, infinity
from infinity.checkpoint import consolidate
def hwm(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1]) << 10
# torch's one-time start-up (its thread pool, their allocator arenas, the cast kernels) is not the consolidation's.
torch.randn(1 << 22).to(torch.bfloat16).float().sum()
open("/proc/self/clear_refs", "w").write("5")  # the peak mark starts here
base = hwm("VmRSS")
consolidate(sys.argv[1], sys.argv[2], dtype="bf16", max_shard_size="64MB")
print(hwm("VmHWM") - base)
"""


def test_consolidation_holds_one_tensor_at_a_time(tmp_path):
    """A 623 MB checkpoint's weights are converted with the process growing by
    less than a few tensors and the fixed I/O blocks (~176 MB)."""
    import subprocess
    import sys
    from paging_zoo import Chain, base_config
    torch.manual_seed(0)
    m, o = infinity.initialize(Chain([131072] * 36), infinity.Config(**base_config(
        offload_params="host", offload_optimizer="host", device_memory=64 << 20, host_memory="3GiB")), lr=1e-3)
    path = infinity.save_checkpoint(tmp_path / "ck", m, o)
    weights = os.path.getsize(path / "model-00001-of-00001.safetensors")
    infinity.close(m)
    del m, o
    code = CONSOLIDATE.format(root=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ck"), str(tmp_path / "hf")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    grew = int(r.stdout.strip().splitlines()[-1])
    from infinity.checkpoint.direct_stream import BLOCK, DEPTH, WRITE_DEPTH
    largest = 131072 * 16 * 4  # one Linear weight, fp32
    # A few tensors (read, cast, the allocator's slack) and the reader's and writer's blocks.
    bound = 4 * largest + (DEPTH + 1 + WRITE_DEPTH + 1) * BLOCK + (32 << 20)
    assert weights > 3 * bound, (weights, bound)
    assert grew < bound, (grew, bound, weights)
    assert sum(os.path.getsize(tmp_path / "hf" / f) for f in os.listdir(tmp_path / "hf")) < weights * 0.51 + (1 << 20)
