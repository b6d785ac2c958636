"""Worker of tests/integration/test_speculation_ranks.py: on one rank of a
gloo group, trains each case with overlap="step" and with
overlap="backward" (speculative updates under clipping or fp16) and writes
what the test compares: every rank its own file, case{i}_r{rank}.pt."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import infinity  # noqa: E402
from engine_utils import batches, unequal_net  # noqa: E402


def _train(case: dict, overlap: str, rank: int, world: int) -> dict:
    """One run of ``case`` (stage, clip, factors, dtype, accum, params,
    optimizer and its swap folder ``swap``):
    losses, parameters, optimizer state and stats of this rank."""
    accum, factors = case.get("accum", 1), case["factors"]
    cfg = infinity.Config(device="cpu", dtype=case.get("dtype", "fp32"), offload_params=case.get("params", "host"),
                          offload_optimizer=case.get("optimizer", "host"), host_memory="64MiB",
                          zero_stage=case["stage"], overlap=overlap, max_grad_norm=case.get("clip"),
                          grad_accumulation_steps=accum, swap_paths=[case.get("swap", "./infinity-swap")],
                          swap_block_size=4096, master_dtype=case.get("master_dtype", "fp32"))
    model, opt = infinity.initialize(unequal_net(hidden=(16, 8, 24, 8)), cfg, lr=1e-2, weight_decay=0.1)
    try:
        data, losses = batches(len(factors) * accum, b=world), []
        for i in range(len(factors) * accum):
            x, y = (t.chunk(world)[rank] for t in data[i])
            loss = model(x, y) * factors[i // accum] / accum
            opt.scale_loss(loss).backward()
            losses.append(loss.item())
            if (i + 1) % accum == 0:
                opt.step()
                opt.zero_grad()
        state = {k: v.clone() for k, v in infinity.full_state_dict(model).items()}  # collective
        osd = opt.state_dict()  # collective: the moments of every shard
        s = infinity.stats(model)
        return {"losses": losses, "state": state, "optimizer": osd, "speculation": s["speculation"],
                "skipped_steps": s["skipped_steps"], "loss_scale": s.get("loss_scale"), "norm": opt.last_grad_norm}
    finally:
        infinity.close(model)


def run(rank: int, world: int, rdzv: str, cases: list, out_dir: str) -> None:
    """Each case with overlap="step", then "backward"; writes both results."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world)
    try:
        for ci, case in enumerate(cases):
            got = {o: _train(case, o, rank, world) for o in ("step", "backward")}
            torch.save(got, os.path.join(out_dir, f"case{ci}_r{rank}.pt"))
    finally:
        dist.destroy_process_group()
