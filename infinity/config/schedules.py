"""Learning-rate schedules as data: warmup then constant, linear or cosine
decay, or a one-cycle, built into a ``torch.optim.lr_scheduler.LambdaLR``.

``infinity train``'s ``[schedule]`` section and DeepSpeed's ``scheduler``
(:mod:`infinity.config.deepspeed`) both become a :class:`Schedule`; call
``scheduler.step()`` once after each ``optimizer.step()``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

__all__ = ["Schedule", "KINDS"]

KINDS = ("constant", "linear", "cosine", "onecycle")


@dataclass
class Schedule:
    """A learning-rate schedule; every ``*_ratio`` is a fraction of the peak lr.

    Attributes:
        kind: after warmup: ``"constant"``, ``"linear"`` (to ``min_ratio`` at
            ``total_steps``), ``"cosine"`` (half a cosine to ``min_ratio``) or
            ``"onecycle"`` (up over ``warmup_steps``, down over ``down_steps``,
            then ``min_ratio / (1 + decay_rate * k)`` after ``k`` blocks of
            ``decay_steps``).
        warmup_steps: optimizer steps of warmup from ``start_ratio`` to 1.
        warmup_type: ``"linear"`` or ``"log"`` (DeepSpeed's default:
            ``log(step + 1) / log(warmup_steps)``).
        total_steps: the step at which linear/cosine decay ends (needed by them).
        peak_lr: the peak lr; None keeps the optimizer's lr as the peak.
    """

    kind: str = "constant"
    warmup_steps: int = 0
    warmup_type: str = "linear"
    start_ratio: float = 0.0
    total_steps: Optional[int] = None
    min_ratio: float = 0.0
    peak_lr: Optional[float] = None
    down_steps: int = 0
    decay_rate: float = 0.0
    decay_steps: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"schedule kind {self.kind!r}: choose one of {list(KINDS)}")
        if self.warmup_type not in ("linear", "log"):
            raise ValueError(f"schedule warmup_type {self.warmup_type!r}: choose 'linear' or 'log'")
        if self.kind in ("linear", "cosine") and (self.total_steps is None or self.total_steps <= self.warmup_steps):
            raise ValueError(f"schedule kind {self.kind!r} needs total_steps > warmup_steps "
                             f"({self.warmup_steps}); got total_steps={self.total_steps}")
        if self.warmup_steps < 0 or not (0 <= self.min_ratio <= 1) or not (0 <= self.start_ratio <= 1):
            raise ValueError("schedule: warmup_steps must be >= 0 and min_ratio, start_ratio in [0, 1]")

    def _warm(self, step: int) -> float:
        if self.warmup_type == "log" and self.warmup_steps > 1:
            frac = math.log(step + 1) / math.log(self.warmup_steps)
        else:
            frac = step / max(1, self.warmup_steps)
        return self.start_ratio + (1.0 - self.start_ratio) * min(1.0, frac)

    def factor(self, step: int) -> float:
        """The lr multiplier (of the peak lr) after ``step`` optimizer steps."""
        if step < self.warmup_steps:
            return self._warm(step)
        if self.kind == "constant":
            return 1.0
        if self.kind == "onecycle":
            down = step - self.warmup_steps
            if down < self.down_steps:
                return 1.0 - (1.0 - self.min_ratio) * down / self.down_steps
            k = (down - self.down_steps) // self.decay_steps if self.decay_steps else 0
            return self.min_ratio / (1.0 + self.decay_rate * k)
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        if self.kind == "linear":
            return 1.0 - (1.0 - self.min_ratio) * progress
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def lr_lambda(self) -> Callable[[int], float]:
        """``factor`` as the function ``LambdaLR`` takes."""
        return self.factor

    def build(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        """A LambdaLR over ``optimizer``; sets each group's lr to ``peak_lr`` first when given."""
        if self.peak_lr is not None:
            for g in optimizer.param_groups:
                g["lr"] = self.peak_lr
                g.pop("initial_lr", None)
        return torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_lambda())

    def to_dict(self) -> dict:
        """The fields as a plain dict (``Schedule(**d)`` gives it back)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict, where: str = "schedule") -> "Schedule":
        """A Schedule from a table; unknown keys raise naming ``where`` and the valid keys."""
        names = [f.name for f in dataclasses.fields(cls)]
        bad = sorted(set(d) - set(names))
        if bad:
            from .files import nearest
            raise ValueError(f"unknown key(s) {[f'{where}.{k}' for k in bad]}{nearest(bad[0], names)}; "
                             f"valid keys: {names}")
        kw: Any = dict(d)
        return cls(**kw)
