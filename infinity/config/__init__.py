"""How a run is described: :class:`Config` (runtime.py), TOML/JSON run files
(files.py), the DeepSpeed import and its LR schedule (deepspeed.py,
deepspeed_schedule.py) and the LR schedules (schedules.py). See docs/config.md.

Owns: every user-facing knob and its validation. May import: nothing of
infinity (it is the bottom layer; system/ and everything above import it).
"""

from .runtime import Config, format_bytes, parse_bytes

# Named in Config.from_file / Config.from_deepspeed's docstrings.
from .files import ConfigFileError  # noqa: E402
from .deepspeed import DeepSpeedReport  # noqa: E402

__all__ = ["Config", "parse_bytes", "format_bytes", "ConfigFileError", "DeepSpeedReport"]
