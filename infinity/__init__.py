"""infinity: an out-of-core training runtime for PyTorch.

Tiered memory (device, pinned host, NVMe), async prefetch, a native CPU SIMD
AdamW and ZeRO stages 1-3. See docs/architecture.md.

The package's root owns only the public names; each folder owns one concept
and says in its ``__init__`` what it may import (the layer table is
tests/test_layout.py). Top to bottom: cli → integrations, stress →
checkpoint → api.py → engine → optim → io → lazy_init, system → config,
models. The root may import anything; nothing below cli may import it.

    config = infinity.Config(device="cuda", dtype="bf16", device_memory="8GiB", host_memory="32GiB")
    model, optimizer = infinity.initialize(model, config, lr=3e-4, weight_decay=0.1)
"""

from .system import native
from . import optim
from .api import close, full_state_dict, initialize, set_step_prediction, stats
from .checkpoint import (AsyncCheckpoint, CheckpointSpaceError, CorruptCheckpointError, export_pretrained, load_checkpoint,
                         save_checkpoint, verify_checkpoint)
from .config.runtime import Config
from .engine.faults import EngineFailedError
from .engine.adapt.pressure import MemoryPressureError
from .engine.owners.residency import DeviceOutOfMemoryError
from .engine.mechanism.tiers import BudgetError
from .engine.adapt.floor import MemoryLimitError
from .lazy_init import init
from .checkpoint.pretrained import load_pretrained
from .optim import CPUAdamW
from .progress import StepMeter, on_steps

__version__ = "0.1.0"

__all__ = ["native", "optim", "CPUAdamW", "Config", "initialize", "stats", "set_step_prediction", "full_state_dict",
           "BudgetError", "MemoryLimitError",
           "EngineFailedError", "init", "load_pretrained", "close", "save_checkpoint", "load_checkpoint",
           "verify_checkpoint", "export_pretrained", "CorruptCheckpointError", "CheckpointSpaceError", "MemoryPressureError", "DeviceOutOfMemoryError", "AsyncCheckpoint",
           "StepMeter", "on_steps", "__version__"]

import sys as _sys

# `import infinity.native` keeps working: the loader lives in system/.
_sys.modules[__name__ + ".native"] = native
