"""``consolidate`` and ``export_pretrained`` of the built-in GPT (issue 35):
they wrote no ``config.json`` (only Hugging Face models got one), so nothing
could rebuild the model from the folder, and the files were mode 0600 though
they are made to be handed on."""

import json
import os
import stat

import pytest
import torch

import infinity
from infinity.checkpoint import consolidate, export_pretrained
from infinity.checkpoint.safe_files import CorruptCheckpointError
from infinity.models import GPT, GPTConfig

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=False)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _trained(tmp_path):
    torch.manual_seed(0)
    cfg = infinity.Config(device="cpu", dtype="fp32", offload_params="host", offload_optimizer="host",
                          swap_paths=[str(tmp_path / "swap")])
    m, o = infinity.initialize(GPT(CFG), cfg, lr=1e-2)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    m(x, x).backward()
    o.step()
    return m, o


def _reload(folder):
    """What a loader does with the folder: the config, then every shard."""
    from safetensors.torch import load_file
    model = GPT(GPTConfig.from_json_dict(json.loads((folder / "config.json").read_text())))
    state = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    model.load_state_dict(state, strict=False)  # the causal-mask buffer is not persistent
    return model, state


def test_consolidate_writes_a_config_json_a_loader_uses_with_normal_modes(tmp_path, umask_022):
    pytest.importorskip("safetensors")
    m, o = _trained(tmp_path)
    ckpt = infinity.save_checkpoint(tmp_path / "ckpt", m, o)
    out = tmp_path / "hf"
    files = consolidate(ckpt, out, dtype="fp32", max_shard_size="40KB")
    assert len(files) > 1 and (out / "model.safetensors.index.json").exists()
    assert json.loads((out / "config.json").read_text())["model_type"] == "infinity-gpt"
    reloaded, state = _reload(out)
    assert reloaded.cfg == CFG
    want = infinity.full_state_dict(m)
    assert set(state) <= set(want) and all(torch.equal(state[k], want[k]) for k in state)
    x = torch.arange(16).reshape(1, 16)
    with torch.no_grad():
        assert torch.equal(reloaded(x), m(x))
    for f in out.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f
    infinity.close(m)


def test_export_of_a_live_gpt_writes_its_config_too(tmp_path, umask_022):
    m, _ = _trained(tmp_path)
    export_pretrained(m, tmp_path / "out", dtype="fp32")
    assert GPTConfig.from_json_dict(json.loads((tmp_path / "out" / "config.json").read_text())) == CFG
    assert all(stat.S_IMODE(f.stat().st_mode) == 0o644 for f in (tmp_path / "out").iterdir())
    infinity.close(m)


@pytest.mark.parametrize("bad, named", [({"model_type": "llama"}, "model_type='llama'"),
                                        ({"n_layer": "2"}, "n_layer='2'"), ({"n_head": 0}, "n_head=0"),
                                        ({"evil": 1}, "'evil': not a GPTConfig field")])
def test_a_bad_model_config_in_the_manifest_is_named(tmp_path, bad, named):
    m, o = _trained(tmp_path)
    ckpt = infinity.save_checkpoint(tmp_path / "ckpt", m, o)
    infinity.close(m)
    path = os.path.join(ckpt, "manifest.json")
    man = json.loads(open(path).read())
    man["model_config"].update(bad)
    open(path, "w").write(json.dumps(man))
    with pytest.raises(CorruptCheckpointError, match="'model_config'.*" + named.replace("(", r"\(")):
        consolidate(ckpt, tmp_path / "out")
    assert not (tmp_path / "out" / "config.json").exists()
