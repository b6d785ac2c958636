"""Small models whose structure stresses paging (units of unequal size,
shared and tied parameters, several and nested ModuleLists, skipped and
repeated blocks, parameters used outside their block, frozen parts, buffers,
dropout, checkpointing), and a harness that trains one beside plain PyTorch
at budgets read from the engine's own minimum."""

from __future__ import annotations

import copy
import re
import warnings
from typing import Callable, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import infinity
from engine_utils import assert_params_close, min_device_budget

D = 16
UNEQUAL = [64, 8, 32, 8, 64, 16, 8, 32]


class Block(nn.Module):
    """x + W2 tanh(W1 x + b1) + b2 with a hidden width of ``h`` (optionally
    dropout on the hidden layer, batch norm on the branch's input)."""

    def __init__(self, h: int, dropout: float = 0.0, norm: bool = False):
        super().__init__()
        self.a = nn.Linear(D, h)
        self.b = nn.Linear(h, D)
        self.drop = nn.Dropout(dropout) if dropout else None
        self.norm = nn.BatchNorm1d(D) if norm else None

    def forward(self, x):
        # The norm (running-stat buffers) sits on the branch, so no bias
        # feeds a normalisation alone (its gradient would be rounding noise).
        h = torch.tanh(self.a(self.norm(x) if self.norm is not None else x))
        if self.drop is not None:
            h = self.drop(h)
        return x + self.b(h)


class Chain(nn.Module):
    """Blocks of widths ``hs`` in a ModuleList; ``order`` (a list, or a
    callable of the step) chooses which run; ``ckpt``: "reentrant" or
    "nonreentrant" activation checkpointing of each block."""

    def __init__(self, hs=UNEQUAL, ckpt: Optional[str] = None, **block_kw):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList(Block(h, **block_kw) for h in hs)
        self.out = nn.Linear(D, D)
        self.ckpt = ckpt
        self.order = None
        self.step = 0

    def run_blocks(self, x):
        order = self.order(self.step) if callable(self.order) else self.order
        for i in (order if order is not None else range(len(self.blocks))):
            blk = self.blocks[i]
            if self.ckpt and torch.is_grad_enabled():
                x = checkpoint(blk, x, use_reentrant=self.ckpt == "reentrant")
            else:
                x = blk(x)
        return x

    def forward(self, x, y):
        return F.mse_loss(self.out(self.run_blocks(self.inp(x))), y)


def unequal(**kw) -> Chain:
    return Chain(UNEQUAL, **kw)


def shared_block() -> Chain:
    """One block instance at two places of the list (one unit, used twice)."""
    m = Chain([16, 32, 8, 64])
    m.blocks[3] = m.blocks[1]
    return m


def tied_across_blocks() -> Chain:
    """A weight shared by two blocks (it lives in the root unit)."""
    m = Chain([32, 8, 32, 16])
    m.blocks[2].a.weight = m.blocks[0].a.weight
    return m


class OutsideUse(Chain):
    """A block's parameter used in the root's forward too."""

    def forward(self, x, y):
        h = self.run_blocks(self.inp(x)) * self.blocks[1].b.bias
        return F.mse_loss(self.out(h), y)


class TwoLists(nn.Module):
    """An encoder and a decoder list of unequal blocks."""

    def __init__(self):
        super().__init__()
        self.enc = nn.ModuleList(Block(h) for h in [64, 8, 32, 8])
        self.dec = nn.ModuleList(Block(h) for h in [8, 48, 16])
        self.step = 0

    def forward(self, x, y):
        for b in self.enc:
            x = b(x)
        for b in self.dec:
            x = b(x)
        return F.mse_loss(x, y)


class Nested(nn.Module):
    """Outer blocks that each hold an inner ModuleList (the outer ones are the units)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleList(Block(h) for h in hs) for hs in ([32, 8], [8], [64, 16, 8]))
        self.step = 0

    def forward(self, x, y):
        for outer in self.blocks:
            for b in outer:
                x = b(x)
        return F.mse_loss(x, y)


def frozen_mix() -> Chain:
    m = Chain([32, 8, 64, 16])
    m.blocks[1].requires_grad_(False)
    m.blocks[2].a.weight.requires_grad_(False)
    m.inp.bias.requires_grad_(False)
    return m


ZOO = {
    "unequal": unequal,
    "shared": shared_block,
    "tied": tied_across_blocks,
    "outside": lambda: OutsideUse([16, 32, 8, 48]),
    "two_lists": TwoLists,
    "nested": Nested,
    "skip_repeat": lambda: _with_order(unequal(), lambda s: [0, 2, 2, 5, 1, 7] if s % 2 else [7, 3, 0, 4]),
    "frozen": frozen_mix,
    "buffers": lambda: Chain([32, 8, 16], norm=True),
    "dropout": lambda: Chain([32, 8, 64], dropout=0.25),
    "ckpt": lambda: unequal(ckpt="nonreentrant"),
    "ckpt_reentrant": lambda: Chain([32, 8, 64, 16], ckpt="reentrant"),
}


def _with_order(m: Chain, order) -> Chain:
    m.order = order
    return m


def make(name: str) -> nn.Module:
    torch.manual_seed(0)
    return ZOO[name]()


def base_config(**kw) -> dict:
    cfg = dict(device="cpu", dtype="fp32", host_memory="64MiB", prefetch_depth=1)
    cfg.update(kw)
    return cfg


def minimum(model: nn.Module, tier: str, **cfg) -> int:
    """The engine's own minimum ``device_memory`` or ``host_memory`` (bytes)
    for ``model`` under ``cfg``, read from the BudgetError a budget of 1 byte
    gets; 0 when the host holds nothing under ``cfg``."""
    if tier == "device":
        return min_device_budget(lambda: copy.deepcopy(model), **cfg)
    cfg = dict(cfg, host_memory=1)
    cfg.setdefault("device_memory", 64 << 20)
    try:
        m, _ = infinity.initialize(copy.deepcopy(model), infinity.Config(**cfg))
    except infinity.BudgetError as e:
        return int(re.search(r"needs (\d+) bytes", str(e)).group(1))
    infinity.close(m)
    return 0


def train_against_torch(model_fn: Callable[[], nn.Module], cfg: dict, steps: int = 4, *, calls: int = 1,
                        lr: float = 1e-2, clip: Optional[float] = None, rtol: float = 1e-5,
                        scheduler: Optional[Callable] = None, seed: int = 1) -> List[float]:
    """Trains ``model_fn()`` with torch.optim.AdamW(foreach=False) and a deep
    copy through infinity with ``cfg`` on the same data (``calls`` backward
    passes per step, RNG reseeded before each forward so dropout matches);
    asserts every loss and, after the first and the last step, every
    parameter and buffer within ``rtol``. Returns the losses."""
    ref = model_fn()
    model = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=lr, weight_decay=0.1,
                                foreach=False)
    model, opt = infinity.initialize(model, infinity.Config(**cfg), lr=lr, weight_decay=0.1)
    scheds = [scheduler(ref_opt), scheduler(opt)] if scheduler else []
    gen = torch.Generator().manual_seed(seed)
    losses = []
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "infinity: parameters of unit", RuntimeWarning)
            _train_steps(model, ref, opt, ref_opt, scheds, steps, calls, gen, clip, rtol, losses)
        s = infinity.stats(model)
        for tier in ("device", "host"):
            assert s["peak_bytes"][tier] <= s["budget_bytes"][tier], (tier, s["peak_bytes"], s["budget_bytes"])
    finally:
        infinity.close(model)
    return losses


def _train_steps(model, ref, opt, ref_opt, scheds, steps, calls, gen, clip, rtol, losses) -> None:
    for step in range(steps):
        for call in range(calls):
            x, y = torch.randn(6, D, generator=gen), torch.randn(6, D, generator=gen)
            pair = []
            for m in (model, ref):
                m.step = step
                torch.manual_seed(1000 * step + call)
                loss = m(x, y) / calls
                loss.backward()
                pair.append(loss.item())
            assert abs(pair[0] - pair[1]) <= rtol * abs(pair[1]) + 1e-7, (step, call, pair)
            losses.append(pair[0])
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([p for p in ref.parameters() if p.requires_grad], clip)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        for s in scheds:
            s.step()
        if step in (0, steps - 1):
            assert_params_close(infinity.full_state_dict(model), ref.state_dict(), rtol)


def small_chain() -> "Chain":
    """The 4-layer Chain (32, 16, 64, 8) of the state-dict and moment tests, seeded."""
    torch.manual_seed(0)
    return Chain([32, 16, 64, 8])


def chain_data(n: int, seed: int = 3) -> list:
    """``n`` seeded (input, target) batches of 4 × 16 for :func:`small_chain`."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)) for _ in range(n)]
