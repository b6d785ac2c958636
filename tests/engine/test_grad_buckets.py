"""Gradients leaving the device in buckets (issue 36; [Note: gradients leave
the device in buckets] in grad_buckets.py): the bucket cut, the runs each
bucket crosses in, and the same bytes as the per-parameter path for every
optimizer home, compute dtype, overlap mode, and accumulation with a
parameter left out of some micro-batches (two accumulate flags in a bucket)."""

import pytest
import torch
import torch.nn as nn

import infinity
import infinity.engine.core as core
from infinity.engine.mechanism.mover import CpuMover
from infinity.engine.owners.grad_buckets import make_buckets, open_stage, runs_of
from infinity.engine.plan.units import Layout


def _layout(sizes):
    ps = [nn.Parameter(torch.zeros(n)) for n in sizes]
    return Layout([(f"p{i}", p) for i, p in enumerate(ps)], {})


def test_buckets_cut_by_span_and_leave_big_slots_alone():
    lay = _layout([10, 20, 5, 100, 3, 3])  # offsets 0, 32, 64, 96, 224, 256 (32-element alignment)
    buckets, of = make_buckets(lay, 80)
    assert [(b.first, b.end, b.start, b.stop) for b in buckets] == [(0, 3, 0, 69), (4, 6, 224, 259)]
    assert of == [0, 0, 0, -1, 1, 1]  # the 100-element slot alone exceeds the span: per-parameter path


def test_runs_split_on_a_missing_slot_and_on_the_accumulate_flag():
    lay = _layout([10, 20, 5, 7])
    (b,), _ = make_buckets(lay, 1000)
    b.landed = [(3, True), (0, False), (1, False)]
    assert runs_of(b, lay) == [(0, 52, False), (96, 103, True)]  # slot 2 did not land
    b.landed = [(0, False), (1, True), (2, True), (3, True)]
    assert runs_of(b, lay) == [(0, 10, False), (32, 103, True)]


def test_the_stage_has_zero_gaps(monkeypatch):
    lay = _layout([10, 20, 5])
    (b,), _ = make_buckets(lay, 1000)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))  # garbage
    open_stage(b, lay, torch.zeros(3))
    assert b.stage[:10].isnan().all() and b.stage[32:52].isnan().all()  # the slots: written by the gradients
    gaps = torch.cat([b.stage[10:32], b.stage[52:64]])
    assert torch.equal(gaps, torch.zeros_like(gaps))


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.a, self.b, self.ln = nn.Linear(d, d), nn.Linear(d, d), nn.LayerNorm(d)

    def forward(self, x, skip_b):
        x = torch.relu(self.a(x))
        return self.ln(x if skip_b else x + self.b(x))


class Net(nn.Module):
    def __init__(self, d=16, n=3):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.blocks, self.out = nn.Linear(4, d), nn.ModuleList(Block(d) for _ in range(n)), nn.Linear(d, 1)

    def forward(self, x, skip_b=False):
        x = self.inp(x)
        for blk in self.blocks:
            x = blk(x, skip_b)
        return self.out(x).square().mean()


class BatchingMover(CpuMover):
    batches_grads = True

    def __init__(self):
        super().__init__()
        self.grad_copies = 0

    def grad_out(self, host_dst, dev_grad, accumulate):
        self.grad_copies += 1
        return super().grad_out(host_dst, dev_grad, accumulate)


def _train(cfg, batching, monkeypatch):
    made = []

    def make(device):
        m = BatchingMover() if batching else CpuMover()
        m.grad_copies = 0
        if not batching:
            real = m.grad_out

            def counted(*a):
                m.grad_copies += 1
                return real(*a)
            m.grad_out = counted
        made.append(m)
        return m

    monkeypatch.setattr(core, "make_mover", make)
    model, opt = infinity.initialize(Net(), infinity.Config(**cfg), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(3)
    losses = []
    try:
        for step in range(3):
            for micro in range(cfg["grad_accumulation_steps"]):
                x = torch.randn(8, 4, generator=g).to(torch.bfloat16 if cfg["dtype"] == "bf16" else torch.float32)
                loss = model(x, skip_b=(micro == 0) if cfg["grad_accumulation_steps"] > 1 else step == 1)
                loss.backward()
                losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        opt.flush()
        state = {k: v.clone() for k, v in infinity.full_state_dict(model).items()}
    finally:
        infinity.close(model)
    return losses, state, made[0].grad_copies


CASES = [("fp32", "host", "step", 1), ("bf16", "host", "backward", 2), ("fp32", "nvme", "step", 2),
         ("bf16", "nvme", "backward", 1), ("fp32", "host", "delayed", 1)]


@pytest.mark.parametrize("dtype,opt,overlap,accum", CASES)
def test_buckets_give_the_per_parameter_bytes(tmp_path, monkeypatch, dtype, opt, overlap, accum):
    cfg = dict(device="cpu", dtype=dtype, offload_params="host", offload_optimizer=opt, overlap=overlap,
               grad_accumulation_steps=accum, device_memory=1 << 20, host_memory="64MiB",
               swap_paths=[str(tmp_path)], swap_block_size=4096)
    want = _train(cfg, False, monkeypatch)
    got = _train(cfg, True, monkeypatch)
    assert got[0] == want[0]
    for k, v in want[1].items():
        assert torch.equal(got[1][k], v), k
    assert got[2] < want[2], (got[2], want[2])  # fewer copies off the device
