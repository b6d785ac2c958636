"""The model of a run file: the built-in GPT by size, or a Hugging Face causal
LM built from a local config.json (no download), and the loss of a batch."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..config.runtime import Config
from ..config.files import ConfigFileError
from ..models import GPT, GPTConfig
from .runfile import ModelSection

# (n_layer, n_head, n_embd) of the GPT-2 family, plus a tiny one for tests.
SIZES = {"tiny": (2, 4, 64), "small": (12, 12, 768), "medium": (24, 16, 1024), "large": (36, 20, 1280),
         "xl": (48, 25, 1600)}

Loss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def gpt_config(m: ModelSection, seq_len: int, vocab: int) -> GPTConfig:
    """The GPTConfig of ``[model]``: the ``size`` preset with any overrides."""
    if m.size not in SIZES:
        from ..config.files import nearest
        raise ConfigFileError(f"'model.size'={m.size!r}: choose one of {list(SIZES)}{nearest(m.size, SIZES)}")
    n_layer, n_head, n_embd = SIZES[m.size]
    return GPTConfig(vocab_size=m.vocab_size or vocab, block_size=m.block_size or seq_len,
                     n_layer=m.n_layer or n_layer, n_head=m.n_head or n_head, n_embd=m.n_embd or n_embd,
                     tie_weights=m.tie_weights, checkpoint=m.checkpoint)


def _hf_model(m: ModelSection) -> nn.Module:
    if not os.path.isfile(os.path.join(m.path, "config.json")):
        raise ConfigFileError(f"'model.path': {m.path} has no config.json (a Hugging Face model directory is "
                              "expected; nothing is downloaded)")
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise ConfigFileError("'model.path' needs transformers: pip install transformers") from None
    cfg = AutoConfig.from_pretrained(m.path, local_files_only=True)
    return AutoModelForCausalLM.from_config(cfg).float()


# [Note: a meta build skips the fills]
# The estimator reads a model's structure, never its values, and a meta
# tensor has none: an initialiser's in-place fill on it changes nothing.
# Yet torch runs the fills' meta kernels as Python references, and the first
# one imports torch._dynamo (torch._compile's wrapper): for `infinity
# estimate` of an 8 B model that import and the fills were ~40% of the
# command's wall time. So the planner's builds (`meta=True`) answer the fills
# below by returning their tensor untouched; every other op runs. Only ops
# that write values in place and return their first argument are listed.
_FILLS = frozenset(("normal_", "uniform_", "trunc_normal_", "_no_grad_trunc_normal_", "kaiming_uniform_",
                    "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "constant_", "ones_", "zeros_",
                    "eye_", "dirac_", "orthogonal_", "sparse_", "zero_", "fill_", "random_", "bernoulli_",
                    "exponential_", "log_normal_", "cauchy_", "geometric_"))


class _SkipFillsOnMeta(TorchFunctionMode):
    """Answers an in-place fill of a meta tensor with the tensor, unrun."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) in _FILLS:
            t = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes its tensor by keyword
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


def build_model(m: ModelSection, config: Config, seq_len: int, vocab: int, seed: int,
                meta: bool = False) -> Tuple[nn.Module, Loss, int]:
    """``(model, loss_fn, vocab_size)``: the model in fp32 on the CPU (or meta
    under ``infinity.init`` when ``model.lazy``), seeded with ``seed``. With
    ``meta``: the structure alone, on the meta device, for the planner
    ([Note: a meta build skips the fills]); ``model.lazy`` changes nothing there."""
    from ..lazy_init import init
    torch.manual_seed(seed)
    if meta:
        ctx = contextlib.ExitStack()
        ctx.enter_context(torch.device("meta"))
        ctx.enter_context(_SkipFillsOnMeta())
    else:
        ctx = init(config) if m.lazy else contextlib.nullcontext()
    with ctx:
        if m.path:
            model = _hf_model(m)
        else:
            model = GPT(gpt_config(m, seq_len, vocab))
    if m.path:
        vocab_size = int(model.config.vocab_size)
        return model, _hf_loss, vocab_size
    return model, _gpt_loss, model.cfg.vocab_size


def _gpt_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, y)


def _hf_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # The loss from the logits, not labels=: y is already shifted by the sampler.
    logits = model(input_ids=x).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def param_groups(model: nn.Module, weight_decay: float, no_decay_small: bool) -> Any:
    """Groups for ``infinity.initialize``: with ``no_decay_small`` every
    parameter of fewer than 2 dimensions (norm weights, biases) goes to a
    group with weight_decay 0; None (one group) otherwise."""
    if not no_decay_small:
        return None
    seen, decay, no_decay = set(), [], []
    for p in model.parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        (no_decay if p.ndim < 2 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
