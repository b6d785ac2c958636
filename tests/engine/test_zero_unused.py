"""A parameter that gets a gradient on one rank and none on the other (a
branch rank 1's micro-batch never takes) is trained as torch's DDP with
find_unused_parameters=True trains it: the mean of the ranks' gradients,
zeros from the rank without one, stepped on every rank. See [Note: a
gradient on any rank is a gradient on every rank] in owners/grad_written.py.
Before, the rank holding its ZeRO shard skipped it (stages 2-3 wrong after
one step) and the ranks drifted apart at stage 0."""

import torch
import torch.multiprocessing as mp

import unused_worker

CASES = [
    dict(stage=0, overlap="step"),
    dict(stage=1, overlap="step", clip=0.05),                 # the global norm counts the other rank's gradient
    dict(stage=2, overlap="backward"),                        # device reduction, updates during backward
    dict(stage=2, overlap="step", accum=2),                   # host reduction (an accumulation window)
    dict(stage=3, overlap="step", opt="nvme", clip=0.05),     # NVMe state
    dict(stage=0, overlap="backward", opt="nvme"),            # stage 0 with NVMe state: gradients spilled
    dict(stage=1, overlap="backward", clip=0.05),             # speculative updates of the shards during backward
    dict(stage=3, overlap="backward", clip=1e9),              # speculation committed: the flags came in time
]


def test_a_parameter_used_on_one_rank_trains_as_ddp(tmp_path):
    mp.spawn(unused_worker.run, args=(2, str(tmp_path / "rendezvous"), CASES, str(tmp_path)), nprocs=2, join=True)
    for ci, case in enumerate(CASES):
        ref = unused_worker.reference(case)
        got = torch.load(tmp_path / f"case{ci}.pt")
        for k, v in ref.items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=1e-6, msg=lambda m: f"{case} {k}: {m}")
