"""Streaming text out of streamed tokens: :class:`TextStream` (incremental detokenisation) and
:class:`StopMatcher` (stop strings that may straddle chunks).

Example:
    >>> stops = StopMatcher(["\\n\\n"])
    >>> stops.add("Hello\\n")          # the "\\n" may start a stop string: held back
    ('Hello', False)
    >>> stops.add("\\nWorld")          # the stop string completes: cut before it
    ('', True)
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

__all__ = ["TextStream", "StopMatcher"]


class TextStream:
    """Incremental detokenisation: returns only the text that became final since the last call.

    Decoding the whole output each time (not token by token) keeps merges and multi-byte characters
    right; a trailing U+FFFD (an incomplete UTF-8 sequence) is held back until it completes. ``decoder``
    is a model with ``decode(ids)`` or the function itself.
    """

    def __init__(self, decoder: Any) -> None:
        self._decode: Callable[[Sequence[int]], str] = decoder if callable(decoder) else decoder.decode
        self.tokens: list[int] = []
        self._shown = 0

    def text(self) -> str:
        return self._decode(self.tokens)

    def add(self, tokens: Iterable[int]) -> str:
        self.tokens.extend(int(t) for t in tokens)
        text = self.text()
        final = len(text.rstrip("\ufffd"))
        piece, self._shown = text[self._shown:final], max(self._shown, final)
        return piece

    def flush(self) -> str:
        text = self.text()
        piece, self._shown = text[self._shown:], len(text)
        return piece


class StopMatcher:
    """Cuts streamed text at the first occurrence of any stop string (OpenAI's ``stop``; the stop string
    itself is not returned). Text that could be the start of a stop string is held back until the next
    piece tells, so at most the longest stop string's length is held and a piece costs O((piece + longest
    stop) x stops) in C-level searches."""

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._held = ""

    def add(self, piece: str) -> tuple[str, bool]:
        """(text safe to show, whether a stop string was found: then nothing more may be shown)."""
        text = self._held + piece
        first = self._first_stop(text)
        # A stop string that starts before the first one found may still complete in a later piece, and
        # then it is the cut: hold everything from the earliest such start.
        pending = min((len(text) - k for k in (_started(text, s) for s in self.stops) if k), default=len(text))
        if first is not None and first <= pending:
            self._held = ""
            return text[:first], True
        self._held = text[pending:]
        return text[:pending], False

    def flush(self) -> tuple[str, bool]:
        """(the held-back text at the end of the stream, cut at a stop string it holds; whether it held one)."""
        held, self._held = self._held, ""
        first = self._first_stop(held)
        return (held, False) if first is None else (held[:first], True)

    def cut(self, text: str) -> tuple[str, bool]:
        """(a whole ``text`` cut at its first stop string; whether it held one): :meth:`add` then :meth:`flush`."""
        shown, hit = self.add(text)
        if hit:
            return shown, True
        rest, hit = self.flush()
        return shown + rest, hit

    def _first_stop(self, text: str) -> int | None:
        """Where the earliest stop string in ``text`` starts (None: none there)."""
        return min((at for at in (text.find(s) for s in self.stops) if at >= 0), default=None)


def _started(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop`` (0: none)."""
    at = text.find(stop[0], max(0, len(text) - len(stop) + 1))
    while at >= 0:                          # the earliest start is the longest suffix
        if stop.startswith(text[at:]):
            return len(text) - at
        at = text.find(stop[0], at + 1)
    return 0
