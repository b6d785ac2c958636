"""infinity.load_pretrained: safetensors files and HF-style sharded
directories stream into the tiers and equal a plain load_state_dict."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn

safetensors_torch = pytest.importorskip("safetensors.torch")

import infinity
from infinity.models import GPT, GPTConfig

from engine_utils import batches

CFG = dict(device="cpu", dtype="fp32")


def make_gpt(tie: bool = True, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=2, n_embd=32, tie_weights=tie,
                         qkv_bias=False))


class WithBuffer(nn.Module):
    """A GPT plus a persistent and a non-persistent buffer."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.gpt = make_gpt(seed=seed)
        self.register_buffer("temperature", torch.ones(1))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)

    def forward(self, x, y):
        return self.gpt(x, y) * self.temperature


def pretrained_tensors(model: nn.Module, seed: int = 42) -> dict:
    """Distinct values for every state_dict key, as a checkpoint would hold
    (tied weights saved once, under the first name, as HF does)."""
    gen = torch.Generator().manual_seed(seed)
    out, seen = {}, set()
    for k, v in model.state_dict(keep_vars=True).items():
        if isinstance(v, nn.Parameter) and id(v) in seen:
            continue
        seen.add(id(v))
        out[k] = torch.randn(v.shape, generator=gen).to(v.dtype)
    return out


def write_sharded(tmp_path, tensors: dict, n_shards: int = 3, index: bool = True) -> str:
    keys = sorted(tensors)
    d = tmp_path / "ckpt"
    d.mkdir()
    weight_map = {}
    for s in range(n_shards):
        part = keys[s::n_shards]
        name = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        safetensors_torch.save_file({k: tensors[k].contiguous() for k in part}, str(d / name))
        weight_map.update({k: name for k in part})
    if index:
        with open(d / "model.safetensors.index.json", "w") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return str(d)


def managed(model: nn.Module):
    model, opt = infinity.initialize(model, infinity.Config(**CFG))
    return model, opt


@pytest.mark.parametrize("index", [True, False], ids=["index_json", "glob_shards"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_sharded_load_equals_load_state_dict(tmp_path, index, tie):
    tensors = pretrained_tensors(make_gpt(tie))
    path = write_sharded(tmp_path, tensors, index=index)
    before = sorted(os.listdir(path))
    ref = make_gpt(tie, seed=1)
    ref.load_state_dict(tensors, strict=False)   # tied head weight is saved once
    model, _ = managed(make_gpt(tie, seed=1))
    res = infinity.load_pretrained(model, path)
    got = infinity.full_state_dict(model)
    for k, v in ref.state_dict().items():
        assert torch.equal(got[k], v), k
    assert len(res.files) == 3 and not res.missing_keys and not res.unexpected_keys
    assert sorted(os.listdir(path)) == before   # nothing written next to the weights


def test_single_file_with_buffers_then_training_matches(tmp_path):
    src = WithBuffer()
    tensors = pretrained_tensors(src)
    tensors["temperature"] = torch.tensor([0.5])
    f = str(tmp_path / "model.safetensors")
    safetensors_torch.save_file(tensors, f)
    ref = WithBuffer(seed=3)
    ref.load_state_dict(tensors, strict=False)
    model, opt = managed(WithBuffer(seed=3))
    infinity.load_pretrained(model, f)
    assert model.temperature.item() == 0.5
    # Training after the load follows the plain model trained from the same weights.
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=1e-2, foreach=False)
    for x, y in batches(3, seed=5):
        loss, rl = model(x, y), ref(x, y)
        loss.backward()
        rl.backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        assert abs(loss.item() - rl.item()) <= 1e-5 * abs(rl.item())


def test_lazy_model_then_pretrained(tmp_path):
    tensors = pretrained_tensors(make_gpt())
    path = write_sharded(tmp_path, tensors, n_shards=2)
    config = infinity.Config(**CFG)
    with infinity.init(config):
        lazy = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=2, n_embd=32, qkv_bias=False))
    model, _ = infinity.initialize(lazy, config)
    infinity.load_pretrained(model, path)
    got = infinity.full_state_dict(model)
    for k, v in tensors.items():
        assert torch.equal(got[k], v), k


# ------------------------------------------------------------------ errors


def test_missing_key_is_named(tmp_path):
    tensors = pretrained_tensors(make_gpt())
    del tensors["blocks.2.fc.bias"]
    path = write_sharded(tmp_path, tensors)
    model, _ = managed(make_gpt())
    before = infinity.full_state_dict(model)
    with pytest.raises(KeyError, match=r"blocks\.2\.fc\.bias"):
        infinity.load_pretrained(model, path)
    # Nothing was written.
    after = infinity.full_state_dict(model)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    res = infinity.load_pretrained(model, path, strict=False)
    assert res.missing_keys == ["blocks.2.fc.bias"]


def test_unexpected_key_names_key_and_file(tmp_path):
    tensors = pretrained_tensors(make_gpt())
    tensors["lm_extra.weight"] = torch.zeros(3)
    path = write_sharded(tmp_path, tensors)
    model, _ = managed(make_gpt())
    with pytest.raises(KeyError, match=r"lm_extra\.weight.*model-0000\d-of-00003\.safetensors"):
        infinity.load_pretrained(model, path)
    assert infinity.load_pretrained(model, path, strict=False).unexpected_keys == ["lm_extra.weight"]


def test_wrong_shape_names_key_file_and_shapes(tmp_path):
    tensors = pretrained_tensors(make_gpt())
    tensors["blocks.1.proj.weight"] = torch.zeros(32, 31)
    path = write_sharded(tmp_path, tensors)
    model, _ = managed(make_gpt())
    with pytest.raises(ValueError, match=r"blocks\.1\.proj\.weight.*\.safetensors.*\(32, 31\).*\(32, 32\)"):
        infinity.load_pretrained(model, path, strict=False)   # shapes are checked even when not strict


def test_missing_shard_and_bad_index(tmp_path):
    tensors = pretrained_tensors(make_gpt())
    path = write_sharded(tmp_path, tensors)
    os.remove(os.path.join(path, "model-00002-of-00003.safetensors"))
    model, _ = managed(make_gpt())
    with pytest.raises(FileNotFoundError, match="model-00002-of-00003.safetensors"):
        infinity.load_pretrained(model, path)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="model.safetensors.index.json"):
        infinity.load_pretrained(model, path)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        infinity.load_pretrained(model, str(tmp_path / "nowhere"))
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage!")
    with pytest.raises(ValueError, match="bad.safetensors"):
        infinity.load_pretrained(model, str(bad))


def test_unmanaged_model_is_refused(tmp_path):
    f = str(tmp_path / "m.safetensors")
    safetensors_torch.save_file({"x": torch.zeros(1)}, f)
    with pytest.raises(ValueError, match="initialize"):
        infinity.load_pretrained(make_gpt(), f)


def test_hf_cache_links_load_and_untrusted_names_are_refused(tmp_path):
    """[Note: pretrained weights are a folder the user named]: the Hugging
    Face cache's links into blobs/ load; an index naming a shard outside the
    folder, a FIFO shard, or an index nested too deep is refused at once with
    the file named, and the model keeps its weights."""
    tensors = pretrained_tensors(make_gpt())
    src = write_sharded(tmp_path, tensors)
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "rev"
    blobs.mkdir()
    snap.mkdir(parents=True)
    for n in os.listdir(src):  # the cache's layout: snapshot entries are links to content-named blobs
        os.rename(os.path.join(src, n), blobs / f"blob-{n}")
        os.symlink(os.path.join("..", "..", "blobs", f"blob-{n}"), snap / n)
    model, _ = managed(make_gpt(seed=1))
    infinity.load_pretrained(model, str(snap))
    want = infinity.full_state_dict(model)
    assert all(torch.equal(want[k], v) for k, v in tensors.items())

    index = snap / "model.safetensors.index.json"
    wm = json.loads(index.read_text())["weight_map"]
    os.remove(index)
    for bad in ("../../blobs/x.safetensors", "/etc/passwd", "a/../../x"):
        index.write_text(json.dumps({"weight_map": {**wm, next(iter(wm)): bad}}))
        with pytest.raises(ValueError, match="outside its directory"):
            infinity.load_pretrained(model, str(snap))
    index.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="index.json.*nested too deep"):
        infinity.load_pretrained(model, str(snap))
    index.write_text(json.dumps({"weight_map": wm}))
    shard = snap / sorted(set(wm.values()))[0]
    os.remove(shard)
    os.mkfifo(shard)  # open(2) on it would block until a writer came
    with pytest.raises(ValueError, match="not a regular file"):
        infinity.load_pretrained(model, str(snap))
    got = infinity.full_state_dict(model)
    assert all(torch.equal(got[k], want[k]) for k in want)
