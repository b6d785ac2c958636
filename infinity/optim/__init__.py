"""Optimizers of infinity: the native CPU AdamW and its fused functional form.

Owns: the AdamW maths over flat buffers (functional.py), the bf16 and
block-scaled 8-bit encodings of its moments (moments.py), and the
torch.optim.Optimizer built on it (cpu_adamw.py). May import: io/ (the I/O
engine's chunking), system/ (the native library), config/.
"""

from .cpu_adamw import CPUAdamW
from .functional import adamw_step_

__all__ = ["CPUAdamW", "adamw_step_"]
