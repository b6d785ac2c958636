"""The gradients' global norm: the squared L2 norm of this rank's share,
read once, spilled gradients read back for it (the gradient owner's
``sum_of_squares``; step/scaling.py sums it over the ranks)."""

from __future__ import annotations

import torch

__all__ = ["sum_of_squares", "unit_part"]


def unit_part(grad, ranges):
    """One unit's share of the squared norm: a float64 scalar tensor over
    the index ``ranges`` of ``grad``, or None where there are none."""
    if not ranges:
        return None
    norms = torch._foreach_norm([grad[a:b] for a, b in ranges], 2, dtype=torch.float32)
    return torch.stack(norms).double().square().sum()


def sum_of_squares(grads, units_grads, runs) -> float:
    """The squared L2 norm (float, in the gradients' units squared) of
    this rank's gradients of ``units_grads`` ((unit, grad buffer or None,
    written flags) per unit), read once. ``runs(u, written, grad)`` gives
    the (start, end) index ranges of ``grad`` that count: the slots that
    got gradients, cut to this rank's shard. Spilled gradients are read
    back for it and dropped again; ``grads`` is the gradient owner
    (grads.Gradients: ``modes``, ``load``, ``drop_loaded``)."""
    parts = []  # per unit, float64, where the gradients live
    for u, grad, written in units_grads:
        kept = u.grads.norm_part
        if grad is None and kept is not None and kept[0] == list(written):
            if kept[1] is not None:  # taken before a speculative update spilled them: the same bytes
                parts.append(kept[1])
            continue
        if grad is None and grads.modes.opt_nvme:
            grads.load(u)  # spilled: read back for the norm (and dropped again)
            grad = u.grads.grad
        if grad is None:
            continue
        part = unit_part(grad, runs(u, written, grad))
        if part is not None:
            parts.append(part)
        if grads.modes.opt_nvme:
            grads.drop_loaded(u)
    # One read of the result: on CUDA each float() would be a sync.
    return float(torch.stack(parts).sum()) if parts else 0.0
