"""The planner's meta build (`build_model(meta=True)`, what `infinity estimate`
reads): the eager build's structure exactly, with the initialisers' fills on
meta tensors skipped ([Note: a meta build skips the fills])."""

import pytest
import torch
import torch.nn as nn

from infinity.cli.model import _SkipFillsOnMeta, build_model
from infinity.cli.runfile import ModelSection
from infinity.config.runtime import Config


def _structure(model: nn.Module):
    return ([(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in model.named_parameters()],
            [(n, tuple(b.shape), b.dtype) for n, b in model.named_buffers()],
            [(n, type(m).__name__) for n, m in model.named_modules()])


def _both(section: ModelSection):
    config = Config(device="cpu", dtype="fp32")
    eager, _, v1 = build_model(section, config, 32, 256, 0)
    meta, _, v2 = build_model(section, config, 32, 256, 0, meta=True)
    return eager, meta, v1, v2


@pytest.mark.parametrize("lazy", [False, True])
def test_meta_build_of_the_gpt_has_the_eager_structure(lazy):
    eager, meta, v1, v2 = _both(ModelSection(size="tiny", lazy=lazy, tie_weights=False))
    assert v1 == v2 == 256
    assert _structure(meta) == _structure(eager)
    assert all(t.is_meta for t in list(meta.parameters()) + list(meta.buffers()))


def test_meta_build_of_a_hugging_face_model_has_the_eager_structure(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg.save_pretrained(tmp_path / "llama")
    eager, meta, _, _ = _both(ModelSection(path=str(tmp_path / "llama")))
    assert _structure(meta) == _structure(eager)
    assert all(t.is_meta for t in meta.parameters())


def test_fills_are_skipped_on_meta_tensors_only():
    """A fill of a meta tensor returns it unrun, whichever way it is called;
    a fill of a real tensor and every other op run as usual."""
    seen = []

    class Probe(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", "?"))
            return func(*args, **(kwargs or {}))

    with Probe(), torch.device("meta"), _SkipFillsOnMeta():
        w = torch.empty(4, 3)
        assert nn.init.normal_(w) is w and w.normal_() is w and nn.init.kaiming_uniform_(w) is w
        real = torch.zeros(3, device="cpu")
        nn.init.constant_(real, 2.0)
        real.add_(1.0)
        y = torch.ones(2, 2) @ torch.ones(2, 2)
    assert real.tolist() == [3.0, 3.0, 3.0]
    assert y.is_meta and y.shape == (2, 2)
    # the skipped fills never reached the modes below the skipping one
    assert "normal_" not in seen and "kaiming_uniform_" not in seen
    assert "constant_" in seen and "add_" in seen

