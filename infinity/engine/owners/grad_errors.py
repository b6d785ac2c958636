"""The usage errors of the gradient owner (grads.py): each says what torch
would have done, that nothing changed where that is so, and the right way."""

from __future__ import annotations

from ..faults import UsageError

__all__ = ["stale_backward", "backward_after_window", "forward_in_window"]


def stale_backward() -> UsageError:
    """``step()`` after a backward that followed the last ``step()`` with no
    ``zero_grad()`` between (see [Note: a backward after step() without
    zero_grad()] in grads.py)."""
    return UsageError(
        "optimizer.step() after a backward() that followed the last step() without optimizer.zero_grad() "
        "(or model.zero_grad()) in between: torch would add that backward's gradients to the last step's "
        "and apply both, but infinity freed the last step's at step(). Nothing was changed. Call "
        "optimizer.zero_grad() after each step(); to accumulate over micro-batches, call step() once every "
        "Config.grad_accumulation_steps backward() calls")


def backward_after_window(micro_batches: int, accum_steps: int, overlap: str) -> UsageError:
    """A backward after the accumulation window's last-backward work ran
    (``micro_batches`` backward passes so far)."""
    n = accum_steps
    return UsageError(
        f"backward() number {micro_batches + 1} before optimizer.step(), with "
        f"Config.grad_accumulation_steps={n}: the last backward of the accumulation window already "
        + ("ran the updates (overlap='backward')" if overlap == "backward"
           else "reduced the gradients over the ranks")
        + f", so the gradients of this one would be dropped. Call optimizer.step() after every {n} "
        "backward() calls, or set grad_accumulation_steps to the number of backward() calls per step "
        "(see [Note: the accumulation window] in infinity/engine/step/schedule.py)")


def forward_in_window(accum_steps: int) -> UsageError:
    """A forward between the backward that started the updates
    (overlap="backward") and ``step()``."""
    n = accum_steps
    return UsageError(
        f"forward before optimizer.step(), with overlap='backward' and Config.grad_accumulation_steps={n}: "
        "the last backward of the accumulation window already started the updates, so the parameters are "
        "neither the old values nor the new ones (a forward would use a mix). Call optimizer.step() after "
        f"every {n} backward() call(s), or use overlap='step'")
