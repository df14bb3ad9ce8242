"""``python -m flake8_amp COMMAND``: the linter's own commands.

Linting itself runs through flake8 (``flake8 --select=AMP``); this entry point holds what
flake8 has no place for: ``fix``, which rewrites reported findings (see ``fix --help``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from flake8_amp import __version__
from flake8_amp.fix import command as fix_command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m flake8_amp",
        description="flake8-amp's commands. Lint with flake8: flake8 --select=AMP PATH...",
    )
    parser.add_argument("--version", action="version", version=f"flake8-amp {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    fix_command.add_parser(commands)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.print_help(sys.stderr)
        return fix_command.USAGE_ERROR
    try:
        return args.run(args)
    except BrokenPipeError:  # the reader went away (``| head``): not an error to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return fix_command.FIXES
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
