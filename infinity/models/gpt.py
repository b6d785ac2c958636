"""A GPT-style decoder (token + position embeddings, pre-norm blocks of causal
self-attention and MLP, tied or untied output head), sized by a config."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

MODEL_TYPE = "infinity-gpt"  # config.json's model_type for the built-in GPT


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 8
    n_head: int = 4
    n_embd: int = 64
    tie_weights: bool = True
    checkpoint: bool = False  # activation checkpointing of each block
    # The key part of a qkv bias gets an exactly-zero gradient (softmax is
    # shift-invariant), so Adam amplifies rounding noise in it: tests that
    # compare two implementations leave it out.
    qkv_bias: bool = True

    def to_json_dict(self) -> dict:
        """The fields as ``config.json`` holds them beside consolidated weights,
        tagged ``model_type`` ``"infinity-gpt"`` (read back by :meth:`from_json_dict`)."""
        return {"model_type": MODEL_TYPE, "architectures": ["GPT"], **dataclasses.asdict(self)}

    @classmethod
    def from_json_dict(cls, d: dict) -> "GPTConfig":
        """The config a :meth:`to_json_dict` dict describes; ValueError naming
        the key at fault (another model type, an unknown key, a wrong type)."""
        if not isinstance(d, dict) or d.get("model_type") != MODEL_TYPE:
            got = d.get("model_type") if isinstance(d, dict) else type(d).__name__
            raise ValueError(f"model_type={got!r}: not the built-in GPT's config ({MODEL_TYPE!r})")
        kinds = {f.name: type(f.default) for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in d.items() if k not in ("model_type", "architectures")}
        for k, v in fields.items():
            if k not in kinds:
                raise ValueError(f"{k!r}: not a GPTConfig field (fields: {sorted(kinds)})")
            if type(v) is not kinds[k] or (kinds[k] is int and v < 1):
                raise ValueError(f"{k}={v!r}: must be {'a positive int' if kinds[k] is int else kinds[k].__name__}")
        return cls(**fields)

    def num_params(self) -> int:
        """Parameters of this configuration (tied head counted once)."""
        d, v, t, L = self.n_embd, self.vocab_size, self.block_size, self.n_layer
        block = 2 * 2 * d + (3 * d * d + (3 * d if self.qkv_bias else 0)) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
        return v * d + t * d + L * block + 2 * d + (0 if self.tie_weights else v * d)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.n_embd
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=cfg.qkv_bias)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        h = self.n_head
        q = q.view(B, T, h, C // h).transpose(1, 2)
        k = k.view(B, T, h, C // h).transpose(1, 2)
        v = v.view(B, T, h, C // h).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.head.weight = self.wte.weight
        self.apply(self._init)

    def _init(self, m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None, order=None):
        """Logits, or the mean cross-entropy loss when ``targets`` is given.
        ``order`` optionally lists block indices to run (default: all, in order)."""
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for i in (order if order is not None else range(len(self.blocks))):
            blk = self.blocks[i]
            if self.cfg.checkpoint and torch.is_grad_enabled():
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
