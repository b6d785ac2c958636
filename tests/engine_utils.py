"""Shared harness of the engine tests: a reference model trained with plain
torch beside the same model trained through infinity, on the same data."""

from __future__ import annotations

import copy
from typing import Callable, List, Optional

import torch

import infinity
from infinity.models import GPT, GPTConfig

VOCAB, T, B = 256, 32, 4


def small_gpt(**kw) -> GPT:
    torch.manual_seed(1234)
    cfg = dict(vocab_size=VOCAB, block_size=T, n_layer=8, n_head=4, n_embd=32, qkv_bias=False)
    cfg.update(kw)
    return GPT(GPTConfig(**cfg))


def batches(n: int, seed: int = 0, b: int = B):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (b, T), generator=gen), torch.randint(0, VOCAB, (b, T), generator=gen))
            for _ in range(n)]


def unit_bytes(model: GPT, dtype_bytes: int = 4) -> int:
    return max(sum(p.numel() for p in blk.parameters()) for blk in model.blocks) * dtype_bytes


def assert_params_close(actual: dict, expected: dict, rtol: float = 1e-5, global_scale: bool = False) -> None:
    """max |a - e| <= rtol x scale + 1e-7 per tensor; the scale is the tensor's
    max |e|, or with ``global_scale`` the model's (for data-parallel runs,
    whose gradient sums differ from the single-process ones in rounding,
    which Adam amplifies in near-zero-gradient elements)."""
    assert set(actual) == set(expected), set(actual) ^ set(expected)
    model_scale = max(e.abs().max().item() for e in expected.values())
    for k, e in expected.items():
        a = actual[k]
        assert a.shape == e.shape, (k, a.shape, e.shape)
        scale = model_scale if global_scale else e.abs().max().item()
        diff = (a.float() - e.float()).abs().max().item()
        assert diff <= rtol * scale + 1e-7, f"{k}: max abs diff {diff:.3e} > {rtol} x scale {scale:.3e}"


def train_steps(model: torch.nn.Module, opt, n: int, seed: int = 0) -> List[float]:
    """``n`` plain steps (forward, backward, step, zero_grad) on ``batches(n, seed)``; the losses."""
    losses = []
    for x, y in batches(n, seed):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_pair(make_model: Callable[[], torch.nn.Module], config: infinity.Config, steps: int = 20, *,
               lr: float = 1e-3, weight_decay: float = 0.1, accum: int = 1, clip: Optional[float] = None,
               scheduler: Optional[Callable] = None, forward: Optional[Callable] = None,
               between: Optional[Callable] = None, seed: int = 0, rtol: float = 1e-5):
    """Trains ``make_model()`` with torch.optim.AdamW (foreach=False) and a deep
    copy through infinity on the same batches; compares every loss and the
    final parameters. Returns (model, optimizer, losses, reference losses)."""
    ref = make_model()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=lr,
                                weight_decay=weight_decay, foreach=False)
    model, opt = infinity.initialize(model, config, lr=lr, weight_decay=weight_decay)
    ref_sched = scheduler(ref_opt) if scheduler else None
    sched = scheduler(opt) if scheduler else None
    fwd = forward or (lambda m, x, y: m(x, y))
    data = batches(steps * accum, seed)
    losses, ref_losses = [], []
    for step in range(steps):
        tot, ref_tot = 0.0, 0.0
        for a in range(accum):
            x, y = data[step * accum + a]
            loss = fwd(model, x, y) / accum
            loss.backward()
            rl = fwd(ref, x, y) / accum
            rl.backward()
            tot += loss.item()
            ref_tot += rl.item()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], clip)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        if sched:
            sched.step()
            ref_sched.step()
        losses.append(tot)
        ref_losses.append(ref_tot)
        if between:
            between(model, ref, step)
    for i, (l, r) in enumerate(zip(losses, ref_losses)):
        assert abs(l - r) <= rtol * abs(r), f"step {i}: loss {l} != reference {r}"
    assert_params_close(infinity.full_state_dict(model), ref.state_dict(), rtol)
    return model, opt, losses, ref_losses
