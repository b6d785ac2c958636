"""infinity: an out-of-core training runtime for PyTorch.

Tiered memory (device, pinned host, NVMe), async prefetch, a native CPU SIMD
AdamW and ZeRO stages 1-3. See docs/architecture.md.
"""

from . import native, optim
from .optim import CPUAdamW

__version__ = "0.1.0"

__all__ = ["native", "optim", "CPUAdamW", "__version__"]
