"""Worker of test_zero_unused.py: a model whose second branch rank 1 never
takes, trained on a gloo world of two (one process per rank)."""

import os

import torch
import torch.distributed as dist
import torch.nn as nn

import infinity

LR, STEPS = 1e-2, 3


class Branchy(nn.Module):
    """Three blocks of two linears each; ``skip_b`` leaves every ``b`` out."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.ModuleDict(dict(a=nn.Linear(16, 16), b=nn.Linear(16, 16)))
                                     for _ in range(3)])

    def forward(self, x, skip_b: bool):
        for blk in self.blocks:
            x = torch.tanh(blk["a"](x))
            if not skip_b:
                x = x + blk["b"](x)
        return x.pow(2).mean()


def data(case):
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4, 16, generator=g) for _ in range(STEPS * case.get("accum", 1))]


def reference(case) -> dict:
    """torch.optim.AdamW on the mean of the two ranks' losses (rank 1 without ``b``), as DDP with
    find_unused_parameters=True gives."""
    torch.manual_seed(0)
    m = Branchy()
    opt = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.0)
    accum, xs = case.get("accum", 1), data(case)
    for step in range(STEPS):
        for a in range(accum):
            x = xs[step * accum + a]
            ((m(x.chunk(2)[0], False) + m(x.chunk(2)[1], True)) / (2 * accum)).backward()
        if case.get("clip"):
            torch.nn.utils.clip_grad_norm_(m.parameters(), case["clip"])
        opt.step()
        opt.zero_grad()
    return m.state_dict()


def run(rank: int, world: int, rdzv: str, cases: list, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world)
    try:
        for ci, case in enumerate(cases):
            torch.manual_seed(0)
            cfg = infinity.Config(device="cpu", dtype="fp32", zero_stage=case["stage"], overlap=case["overlap"],
                                  offload_optimizer=case.get("opt", "host"), max_grad_norm=case.get("clip"),
                                  grad_accumulation_steps=case.get("accum", 1),
                                  swap_paths=[os.path.join(out_dir, f"swap{ci}")])
            model, opt = infinity.initialize(Branchy(), cfg, lr=LR, weight_decay=0.0)
            accum, xs = case.get("accum", 1), data(case)
            for step in range(STEPS):
                for a in range(accum):
                    (model(xs[step * accum + a].chunk(world)[rank], skip_b=rank == 1) / accum).backward()
                opt.step()
                opt.zero_grad()
            full = infinity.full_state_dict(model)
            if rank == 0:
                torch.save(full, os.path.join(out_dir, f"case{ci}.pt"))
            infinity.close(model)
    finally:
        dist.destroy_process_group()
