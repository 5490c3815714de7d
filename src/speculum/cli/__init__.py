"""Command-line interface: ``speculum generate | enumerate | rank | demo``.

Each sub-command lives in its own module exposing ``register(subparsers)``; this module only builds the
parser and turns expected errors (bad input, missing files, missing extras) into one-line messages with
exit code 2 — never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

# Sub-command modules, in the order shown by --help.
_COMMANDS = ("generate", "enumerate", "demo")


class CLIError(Exception):
    """An expected user-facing failure: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    from speculum import __version__

    parser = argparse.ArgumentParser(
        prog="speculum",
        description=(
            "Draft-then-verify inference over autoregressive models. A cheap draft proposes, the "
            "expensive target verifies: generation with exactly the target's output distribution, and "
            "enumeration of the target's most probable sequences with exact scores."
        ),
    )
    parser.add_argument("--version", action="version", version=f"speculum {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        try:
            module = importlib.import_module(f"speculum.cli.{name}")
        except ModuleNotFoundError as exc:  # a sub-command still being built
            if exc.name == f"speculum.cli.{name}":
                continue
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (CLIError, ValueError, FileNotFoundError, ImportError, IndexError) as exc:
        print(f"speculum {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
