"""Checks the sub-commands run on their arguments before anything loads, and the text they read.

Every check raises :class:`CLIError` with a message naming the flag (``speculum`` prints it as one line,
exit code 2), so a bad flag fails in milliseconds instead of after a model load. Text arguments and stdin
go through :func:`utf8_text` / :func:`read_stdin`: tokenizers reject the lone surrogates Python uses for
undecodable bytes, so invalid bytes become U+FFFD, with a one-line warning.
"""
from __future__ import annotations

import math
import re
import sys
from typing import Any

from speculum.drafts import DECODING, check_draft_spec

__all__ = ["CLIError", "warn", "utf8_text", "read_stdin", "check_at_least", "check_sampling", "check_draft"]

# Lone surrogates: how Python's surrogateescape error handler carries bytes that are not UTF-8.
_SURROGATE = re.compile("[\ud800-\udfff]")


class CLIError(Exception):
    """An expected user-facing failure: printed as one line, exit code 2."""


def warn(command: str, message: str) -> None:
    """One warning line on stderr, in the format of argparse's error lines."""
    print(f"speculum {command}: warning: {message}", file=sys.stderr)


def utf8_text(text: str, name: str, command: str) -> str:
    """``text`` with every byte that is not UTF-8 replaced by U+FFFD; warns once naming ``name``.

    Command-line arguments arrive decoded with ``surrogateescape``: each undecodable byte is a lone
    surrogate, which no tokenizer accepts. Re-encoding recovers the bytes and decoding them with
    ``"replace"`` gives what any UTF-8 reader shows.
    """
    if not _SURROGATE.search(text):
        return text
    try:
        clean = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # surrogates that do not stand for bytes (a string built in Python)
        clean = _SURROGATE.sub("\ufffd", text)
    warn(command, f"{name} is not valid UTF-8: invalid bytes replaced with U+FFFD")
    return clean


def read_stdin(command: str) -> str:
    """All of stdin as UTF-8 text (invalid bytes replaced by U+FFFD, with a warning), newlines as ``\\n``."""
    raw = getattr(sys.stdin, "buffer", None)
    if raw is None:  # a text-only stream (an embedding application's, or a test's)
        return utf8_text(sys.stdin.read(), "stdin", command)
    data = raw.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", "replace")
        warn(command, "stdin is not valid UTF-8: invalid bytes replaced with U+FFFD")
    return re.sub(r"\r\n?", "\n", text)  # what reading stdin in text mode gives


def check_at_least(value: int | float | None, minimum: int, flag: str) -> None:
    """Raise CLIError unless ``value`` (None: not given) is a finite number >= ``minimum``."""
    if value is not None and not (math.isfinite(value) and value >= minimum):
        raise CLIError(f"{flag} must be >= {minimum}, got {value}")


def check_sampling(args: Any) -> None:
    """``--max-new-tokens``, ``--temperature``, ``--top-k``, ``--top-p``, ``--seed`` (those ``args`` has)."""
    check_at_least(getattr(args, "max_new_tokens", None), 0, "--max-new-tokens")
    temperature = getattr(args, "temperature", None)
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        raise CLIError(f"--temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    check_at_least(getattr(args, "top_k", None), 1, "--top-k")
    top_p = getattr(args, "top_p", None)
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise CLIError(f"--top-p must be in (0, 1], got {top_p}")
    check_at_least(getattr(args, "seed", None), 0, "--seed")


def check_draft(spec: str, kinds: Any = None, *, purpose: str = DECODING) -> None:
    """Raise CLIError (naming ``--draft`` and the kinds on offer) unless ``spec`` names a draft that can be
    built for ``purpose`` (``speculum.drafts.DECODING`` or ``ENUMERATION``: the draft registry's checks);
    nothing is loaded. ``kinds``: the choices listed on error (default: the purpose's drafts)."""
    try:
        check_draft_spec(spec, kinds=kinds, purpose=purpose)
    except (ValueError, FileNotFoundError) as exc:
        raise CLIError(f"--draft: {exc}") from None

