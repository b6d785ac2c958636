"""What the subcommands share: the error type that becomes exit status 1 or 2."""

from __future__ import annotations


class CLIError(Exception):
    """A failure the user can fix; printed without a traceback, exit status 1."""


class UsageError(CLIError):
    """A bad argument or run file; exit status 2."""
