"""Command-line interface: ``speculum generate | enumerate | rank | audit | serve | demo | env``.

Each sub-command lives in its own module exposing ``register(subparsers)``; this module builds the
parser and runs the chosen handler. Every flag is checked before a model loads (``cli/checks.py``).
User errors become one line on stderr with exit code 2: :class:`CLIError` (the CLI's own argument
checks), :class:`speculum.validation.InputError` (every input check the library makes on purpose, e.g. a
prompt longer than the context window or a draft with another tokenizer), ``ModelCacheError`` (the
embedded model loads from neither its cache nor its GGUF), ``FileNotFoundError`` (a missing path),
``ImportError`` (a missing optional extra) and enumeration's resource limits (``IndexBudgetError``: raise
``--max-nodes``; ``BandTooLargeError``). Any other exception is a bug and keeps its traceback (exit code
1), a bare ``ValueError`` from deep inside included. When the reader of stdout goes away
(``speculum ... | head``), the command stops quietly with exit code 141, what the shell reports for a
process ended by SIGPIPE.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Sequence

from speculum import __version__
from speculum.cli.checks import CLIError
from speculum.enumeration.enumerable import BandTooLargeError, IndexBudgetError
from speculum.models.memory.allocator import keep_freed_memory
from speculum.models.checkpoints import ModelCacheError
from speculum.validation import InputError

__all__ = ["main", "build_parser", "CLIError", "USER_ERRORS", "BROKEN_PIPE_EXIT"]

# Sub-command modules, in the order shown by --help.
_COMMANDS = ("generate", "enumerate", "audit", "serve", "demo", "env")
# Enumeration's two resource limits (node budget, band size) are the user's to raise, not bugs.
USER_ERRORS = (CLIError, InputError, ModelCacheError, FileNotFoundError, ImportError, IndexBudgetError,
               BandTooLargeError)
BROKEN_PIPE_EXIT = 128 + 13  # 128 + SIGPIPE, as for `yes | head`


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="speculum",
        description=(
            "Draft-then-verify inference over autoregressive models. A cheap draft proposes, the "
            "expensive target verifies: generation with exactly the target's output distribution, and "
            "enumeration of the target's most probable sequences with exact scores."
        ),
        epilog=("exit status: 0 success, 1 an internal error (with its traceback), 2 a usage or input error, "
                "130 interrupted, 141 stdout closed early (e.g. by `| head`)"),
    )
    parser.add_argument("--version", action="version", version=f"speculum {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        # Each command's module registers its own options (a module per command, named in _COMMANDS).
        importlib.import_module(f"speculum.cli.{name}").register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):  # a usage error: usage on stderr, as argparse does
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: a COMMAND is required (see '{parser.prog} --help')", file=sys.stderr)
        return 2

    keep_freed_memory()   # large logits buffers reused instead of faulted in again on every forward
    try:
        code = int(args.handler(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's flush at exit
        return code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _discard_stdout()
        return BROKEN_PIPE_EXIT
    except USER_ERRORS as exc:
        print(f"speculum {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _discard_stdout() -> None:
    """Point file descriptor 1 at /dev/null: output still buffered then goes nowhere instead of raising
    BrokenPipeError again when the interpreter flushes stdout at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # stdout has no file descriptor (captured in-process): nothing to flush
        pass
    finally:
        os.close(devnull)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
