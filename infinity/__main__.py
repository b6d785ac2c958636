"""``python -m infinity``: the ``infinity`` command (see infinity/cli)."""

import sys

from .cli import main

sys.exit(main())
