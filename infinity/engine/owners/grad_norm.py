"""The gradients' global norm: the squared L2 norm of this rank's share,
read once, spilled gradients read back for it (the gradient owner's
``sum_of_squares``; step/scaling.py sums it over the ranks)."""

from __future__ import annotations

import torch

from ...optim import sumsq
from ...system import native

__all__ = ["sum_of_squares", "unit_part", "fixed_bits"]

# [Note: the norm's shares have fixed bits]
# Under clipping, a speculated unit's share of the squared norm is taken in
# its update's job, on a worker thread during backward (See [Note:
# speculative updates] in step/speculate.py), the other units' in step() on
# the main thread, and overlap="step" takes all of them in step(): the shares
# must have the same bits wherever they are taken, or the clip coefficient,
# and so every update, differs from overlap="step"'s. torch's CPU reductions
# split their work by the intra-op thread count, which is process-wide: a
# worker setting it to 1 changes the autograd thread's parallelism mid-backward,
# and two threads setting it race. So a host share is the native fixed-split
# sum (infinity.optim.sumsq; the order is in native/src/sumsq_kernel.inc):
# each element squared exactly in double, added in an order fixed by its index
# alone (16 lanes, blocks of 65536, a fixed tree, blocks in order), the same
# bytes on every ISA, thread count and thread. The job runs it on its own thread
# (num_threads=1), step() with the library's threads. The shares are added in
# unit order in step(). CUDA gradients keep torch's reduction (deterministic for
# a given shape) and are taken in step() only, as are host shares without the
# native library.


def fixed_bits(grad) -> bool:
    """True when ``unit_part`` of ``grad`` has the same bits on any thread
    and thread count: host gradients summed by the native fixed-split sum.
    Only then may a share be taken ahead of ``step()``, on a worker thread
    (See [Note: the norm's shares have fixed bits])."""
    return grad.device.type == "cpu" and grad.dtype in sumsq.DTYPES and native.available()


def unit_part(grad, ranges, num_threads: int = 0):
    """One unit's share of the squared norm over the index ``ranges`` of
    ``grad``, or None where there are none: a float for host gradients
    (``fixed_bits``: the native sum, ``num_threads`` as there, 0 = its
    default), else a float64 scalar tensor where the gradients live (torch's
    reduction: on CUDA deterministic for a given shape)."""
    if not ranges:
        return None
    views = [grad[a:b] for a, b in ranges]
    if fixed_bits(grad):
        return sumsq.sum_of_squares(views, num_threads)
    norms = torch._foreach_norm(views, 2, dtype=torch.float32)
    return torch.stack(norms).double().square().sum()


def sum_of_squares(grads, units_grads, runs) -> float:
    """The squared L2 norm (float, in the gradients' units squared) of
    this rank's gradients of ``units_grads`` ((unit, grad buffer or None,
    written flags) per unit), read once. ``runs(u, written, grad)`` gives
    the (start, end) index ranges of ``grad`` that count: the slots that
    got gradients, cut to this rank's shard. Spilled gradients are read
    back for it and dropped again; ``grads`` is the gradient owner
    (grads.Gradients: ``modes``, ``load``, ``drop_loaded``). A share taken
    ahead (``Gradients.take_norm_part``) from the same gradients is used
    as it is."""
    host, device = 0.0, []  # per unit, float64: host shares added in unit order, device ones where they live
    for u, grad, written in units_grads:
        kept = u.grads.norm_part
        if kept is not None and kept[0] == list(written) and (grad is None or grad is kept[2]):
            part = kept[1]  # taken by a speculative update's job (and kept over a spill): the same bytes
        else:
            if grad is None and grads.modes.opt_nvme:
                grads.load(u)  # spilled: read back for the norm (and dropped again)
                grad = u.grads.grad
            if grad is None:
                continue
            part = unit_part(grad, runs(u, written, grad))
            if grads.modes.opt_nvme:
                grads.drop_loaded(u)
        if isinstance(part, float):
            host += part
        elif part is not None:
            device.append(part)
    # One read of the device result: on CUDA each float() would be a sync.
    return host + (float(torch.stack(device).sum()) if device else 0.0)
