"""Loss scaling and the step's gradient scale, one object per optimizer.

[Note: the step's gradient scale]
Every update multiplies the gradients by one scale: 1 / world (gradients are
sums over the data-parallel ranks), times 1 / loss scale (fp16), times the
clip coefficient ``min(max_grad_norm / (norm + 1e-6), 1)`` when clipping.
The norm and the fp16 overflow check need every gradient first, so with
either the updates wait for ``step()`` (see [Note: when the optimizer runs]
in schedule.py), or run speculatively with the scale without clipping and
are checked at ``step()`` ([Note: speculative updates] in speculate.py). A non-finite norm skips the step; fp16's dynamic loss scale
halves on a skip (not below ``min_loss_scale``) and doubles after
``loss_scale_growth_interval`` good steps.
"""

from __future__ import annotations

import logging
import math
from typing import Callable, Optional, Tuple

__all__ = ["Scaling"]

log = logging.getLogger("infinity")


class Scaling:
    """The loss scale and the step's gradient scale (see the Note above).

    Handed the config (its ``dtype``, ``max_grad_norm`` and loss-scale
    fields), ``sharding`` (the world size and ``sum_shards``), the gradient
    owner (``sum_of_squares``), ``runs(u, written, grad)`` (the ranges of a
    unit's gradient buffer that count: the update's) and ``stats``."""

    def __init__(self, config, sharding, grads, runs: Callable, stats):
        self.sharding, self.grads, self.runs, self.stats = sharding, grads, runs, stats
        self.max_grad_norm = config.max_grad_norm
        self.fp16 = config.dtype == "fp16"
        self.dynamic = self.fp16 and config.loss_scale == "dynamic"
        self.loss_scale = float(config.initial_loss_scale if self.dynamic else config.loss_scale) \
            if self.fp16 else 1.0
        self.min_loss_scale = float(config.min_loss_scale)
        self.growth_interval = config.loss_scale_growth_interval
        self.good_steps = 0
        self.last_grad_norm: Optional[float] = None

    @property
    def waits_for_step(self) -> bool:
        """True when updates need every gradient first (clipping or fp16)."""
        return self.max_grad_norm is not None or self.fp16

    def base_scale(self) -> float:
        """The gradient scale without clipping: 1 / world, times 1 / loss
        scale with fp16 (what a speculative update runs with: [Note:
        speculative updates] in speculate.py)."""
        return (1.0 / self.loss_scale if self.fp16 else 1.0) / self.sharding.world

    def global_scale(self, units_grads) -> Tuple[bool, float]:
        """(skip, grad_scale): unscaling, clipping and the fp16 overflow check
        over all gradients; ``units_grads`` lists (unit, grad buffer, written)."""
        world = self.sharding.world  # under data parallelism the gradients are sums over the ranks
        inv = self.base_scale()
        if not self.waits_for_step:
            return False, inv
        norm = math.sqrt(self.sharding.sum_shards(self.grads.sum_of_squares(units_grads, self.runs))) / world
        if not math.isfinite(norm):
            self.last_grad_norm = norm
            return True, inv
        norm /= self.loss_scale if self.fp16 else 1.0
        self.last_grad_norm = norm
        coef = 1.0 if self.max_grad_norm is None else min(self.max_grad_norm / (norm + 1e-6), 1.0)
        return False, inv * coef

    def after_overflow_check(self, skip: bool) -> None:
        """Counts a step skipped for a non-finite gradient norm (logged, in
        ``stats``); fp16: adjusts the dynamic scale."""
        if skip:
            self.stats.skipped_steps += 1
            # fp16's dynamic scale skips a few steps by design while it finds its scale.
            level = logging.INFO if self.dynamic else logging.WARNING
            log.log(level, "infinity: optimizer step skipped: the gradient norm is %s (%d skipped so far)%s",
                    self.last_grad_norm, self.stats.skipped_steps,
                    f"; loss scale {self.loss_scale:g}" if self.fp16 else "")
        if not self.fp16:
            return
        if skip:
            self.good_steps = 0
            if self.dynamic:
                self.loss_scale = max(self.loss_scale / 2.0, self.min_loss_scale)
        else:
            self.good_steps += 1
            if self.dynamic and self.good_steps % self.growth_interval == 0:
                self.loss_scale *= 2.0
