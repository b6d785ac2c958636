"""The planner's meta passes over a few repeated blocks ([Note: a meta pass
over repeated units] in infinity/engine/plan/repeats.py): the op costs and
the saved activations equal the full pass's exactly, and the work of
counting does not grow with the number of layers."""

from collections import Counter

import pytest
import torch
import torch.nn as nn

from infinity.engine.plan import activations, costs, repeats
from infinity.engine.plan.costs import count_pass
from infinity.engine.plan.units import build_units
from infinity.models import GPT, GPTConfig


def _gpt(n_layer, checkpoint=False):
    with torch.device("meta"):
        m = GPT(GPTConfig(vocab_size=96, block_size=16, n_layer=n_layer, n_head=2, n_embd=32, checkpoint=checkpoint))
    x = torch.zeros(2, 16, dtype=torch.long, device="meta")
    return m, (lambda mm: mm(x, x))


def _llama(n_layer):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layer,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    with torch.device("meta"):
        m = transformers.LlamaForCausalLM(cfg)
    x = torch.zeros(2, 16, dtype=torch.long, device="meta")
    mask = torch.zeros(1, 1, 1, 1, device="meta").expand(2, 1, 16, 16)  # as infinity estimate passes it
    return m, (lambda mm: mm(input_ids=x, attention_mask=mask, labels=x).loss)


def _units(m):
    return {u.index: u.modules for u in build_units(m, None, {}, 1)[1:]}


def _as_counts(pc):
    return {ph: {u: Counter(ops) for u, ops in getattr(pc, ph).items()} for ph in ("forward", "backward")}


def _full(monkeypatch, fn, *a):
    with monkeypatch.context() as mp:
        mp.setattr(costs, "find_run", lambda *_: None)
        mp.setattr(activations, "find_run", lambda *_: None)
        return fn(*a)


@pytest.mark.parametrize("make", [lambda: _gpt(6), lambda: _gpt(6, checkpoint=True), lambda: _llama(6)],
                         ids=["gpt", "gpt-checkpointing", "hf-llama"])
def test_short_passes_equal_the_full_pass(monkeypatch, make):
    m, run = make()
    um = _units(m)
    rep = repeats.find_run(m, um)
    assert rep is not None and rep.n == 6
    got = count_pass(m, run, um, torch.float32)
    full = _full(monkeypatch, count_pass, m, run, um, torch.float32)
    assert _as_counts(got) == _as_counts(full)
    assert got.dispatched < full.dispatched
    mods = [x for ms in um.values() for x in ms]
    assert activations.activation_bytes(m, run, mods) == _full(monkeypatch, activations.activation_bytes, m, run, mods)
    assert len(rep.container) == 6  # the cut is undone


def test_counting_work_does_not_grow_with_layers():
    few, many = (count_pass(m, run, _units(m), torch.float32) for m, run in (_gpt(6), _gpt(48)))
    assert few.dispatched == many.dispatched
    assert sum(len(v) for v in many.forward.values()) > 6 * sum(len(v) for v in few.forward.values()) // 2


class _Indexed(nn.Module):
    """Runs its blocks by a count of its own: the cut model fails, the full pass is made."""

    def __init__(self, n):
        super().__init__()
        self.n = n
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))

    def forward(self, x):
        for i in range(self.n):
            x = self.blocks[i](x)
        return x.sum()


def test_a_forward_that_counts_its_blocks_gets_the_full_pass(monkeypatch):
    with torch.device("meta"):
        m = _Indexed(6)
    x = torch.zeros(4, 8, device="meta")
    um = _units(m)
    assert repeats.find_run(m, um) is not None
    got = count_pass(m, lambda mm: mm(x), um, torch.float32)
    full = _full(monkeypatch, count_pass, m, lambda mm: mm(x), um, torch.float32)
    assert _as_counts(got) == _as_counts(full) and len(got.forward) == 7
