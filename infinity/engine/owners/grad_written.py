"""Which slots of a unit got a gradient on some rank (data parallelism and
ZeRO): the per-slot ``written`` flags OR-ed over the ranks.

[Note: a gradient on any rank is a gradient on every rank]
A parameter may get a gradient on one rank and none on another (a branch
one rank's micro-batch does not take, a MoE expert no token was routed to).
torch's DistributedDataParallel (find_unused_parameters=True) sums a zero
contribution for it and every rank's ``.grad`` holds the mean: every rank
then steps it. Local flags would make the rank whose shard holds the
parameter skip it (ZeRO 2-3: the other ranks' gradient is reduced into its
shard and never applied), ranks drift apart at stage 0, and the global norm
misses it. So each unit's reduction starts an all-reduce (MAX) of its flags
on the host group, in the same program order on every rank; the slots this
rank did not write are zeros in what it reduces (see Gradients.reduce; the
flags start after that data reduction, in the same order on every rank), and
once the flags are in, a slot written anywhere counts as written (and as
holding a ``.grad``) here. Readers of the flags settle them first:
``Gradients.wait`` does, and the early update asks ``written_now``.
"""

from __future__ import annotations

import torch

__all__ = ["start", "settle"]


def start(rec, sharding) -> object:
    """Starts OR-ing ``rec.written`` over the ranks (asynchronously); the
    ticket, also kept on ``rec`` for :func:`settle`."""
    flags = torch.tensor(rec.written, dtype=torch.int32)
    ticket = sharding.any_rank_(flags)
    rec.anywhere = (ticket, flags)
    return ticket


def settle(rec) -> None:
    """Waits for the flags started by :func:`start` (if any) and marks the
    slots written on some rank as written, and holding a ``.grad``, here."""
    if rec.anywhere is None:
        return
    ticket, flags = rec.anywhere
    ticket.wait()
    for ti, f in enumerate(flags.tolist()):
        if f and not rec.written[ti]:
            rec.written[ti] = rec.had[ti] = True
    rec.anywhere = None  # after the flags are applied: a second thread finding None reads them set
