"""The ``infinity`` command (also ``python -m infinity``): one module per
subcommand, each with ``add_parser(subparsers)`` setting ``run(args) -> int``.

Exit status: 0 success, 1 failure (a check failed, training failed), 2 usage
error (bad arguments, a bad run file), 130 interrupted by SIGINT. Set
``INFINITY_CLI_TRACEBACK=1`` to see the traceback of an unexpected error.

Owns: argument parsing, run files into runs, the checks of ``doctor`` and the
machine measurements shared with the benchmarks (perf.py). May import:
everything below it, the package root included.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import List, Optional

from ..config.deepspeed import DeepSpeedConfigWarning
from ..config.files import ConfigFileError
from .common import CLIError, UsageError

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand."""
    from . import checkpoint, doctor, estimate, report, stress, train
    ap = argparse.ArgumentParser(prog="infinity", description="infinity: out-of-core training for PyTorch "
                                 "(docs/cli.md)")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for mod in (train, doctor, report, estimate, checkpoint, stress):
        mod.add_parser(sub)
    return ap


def main(argv: Optional[List[str]] = None) -> int:
    """Parses ``argv`` (default sys.argv[1:]), runs the subcommand, returns its exit status."""
    ap = build_parser()
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:  # --help (0) and usage errors (2)
        return int(exc.code or 0)
    try:
        with warnings.catch_warnings():
            if args.command == "train":  # it prints the DeepSpeed report, which holds the warning's lines
                warnings.simplefilter("ignore", DeepSpeedConfigWarning)
            return int(args.run(args))
    except (UsageError, ConfigFileError) as exc:
        print(f"infinity {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except CLIError as exc:
        print(f"infinity {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"infinity {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # budget, I/O and engine failures: named, no traceback
        if os.environ.get("INFINITY_CLI_TRACEBACK"):
            raise
        print(f"infinity {args.command}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
