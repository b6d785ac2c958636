"""What the subcommands share: the error type that becomes exit status 1 or 2,
and the checkpoint functions of issue 19, looked up when needed."""

from __future__ import annotations

from typing import Callable

import infinity


class CLIError(Exception):
    """A failure the user can fix; printed without a traceback, exit status 1."""


class UsageError(CLIError):
    """A bad argument or run file; exit status 2."""


def checkpoint_api(name: str) -> Callable:
    """``infinity.<name>`` (save_checkpoint, load_checkpoint, ...), or a
    CLIError saying it is not there yet."""
    fn = getattr(infinity, name, None)
    if fn is None:
        raise CLIError(f"not available yet: needs infinity.{name} (issue 19); this infinity "
                       f"({infinity.__version__}) has no checkpoint support: remove the [checkpoint] section and "
                       "--resume, or update infinity")
    return fn
