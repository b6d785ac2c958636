"""Optimizers of infinity: the native CPU AdamW and its fused functional form."""

from .cpu_adamw import CPUAdamW
from .functional import adamw_step_

__all__ = ["CPUAdamW", "adamw_step_"]
