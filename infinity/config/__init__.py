"""How a run is described: :class:`Config` (runtime.py), TOML/JSON run files
(files.py), the DeepSpeed import and its LR schedule (deepspeed.py, its
ignored keys deepspeed_keys.py, its value checks, batch arithmetic and Adam
defaults deepspeed_values.py, deepspeed_schedule.py), the LR schedules
(schedules.py) and the checks of single values they share (validate.py).
See docs/config.md.

Owns: every user-facing knob and its validation. May import: nothing of
infinity (it is the bottom layer; system/ and everything above import it).
"""

from .runtime import Config, format_bytes, parse_bytes

# Named in Config.from_file / Config.from_deepspeed's docstrings.
from .files import ConfigFileError  # noqa: E402
from .deepspeed import DeepSpeedReport  # noqa: E402

__all__ = ["Config", "parse_bytes", "format_bytes", "ConfigFileError", "DeepSpeedReport"]
