"""Which token-automaton states can still reach an accepting one, read off the character automaton.

A token state ``(q, p)`` (character state ``q``, incomplete character ``p`` pending) is live iff some token
sequence leads it to an accepting state. Two character-level sets bracket that:

* **lower**: the states from which a final state is reached through characters whose every byte is a
  token by itself (such a string is always spelled, one byte per token): live for sure;
* **upper**: the states from which a final state is reached at all: every live state is in it.

For vocabularies with a token per byte (byte-level BPE, SentencePiece with byte fallback) the two agree on
every state a pattern reaches in practice, and liveness costs nothing; a state on which they disagree is
settled exactly by a search of its token moves. The same brackets decide, for the whole automaton, whether
a member is a prefix of another and how many tokens an accepted sequence can have.
"""
from __future__ import annotations

import math
from collections import deque
from typing import Callable, Iterable

import numpy as np

from .charfsm import CharAutomaton, topological
from .spelling import VocabularySpelling, completions, utf8_length

__all__ = ["Liveness"]

_LENGTHS = {1: (0, 0x7F), 2: (0x80, 0x7FF), 3: (0x800, 0xFFFF), 4: (0x10000, 0x10FFFF)}
_SURROGATES = (0xD800, 0xDFFF)


class Liveness:
    """Liveness of token states ``(q, pending)`` for one pattern over one vocabulary (memoised)."""

    def __init__(self, chars: CharAutomaton, spelling: VocabularySpelling) -> None:
        self.chars = chars
        single = spelling.single_bytes
        self._single = single
        # Every continuation byte a token: any incomplete character can be completed one byte at a time.
        self._continuations = all(b in single for b in range(0x80, 0xC0))
        self.bytes_all = [0] * chars.n_symbols      # most UTF-8 bytes of a character of each class
        self.bytes_spelled = [0] * chars.n_symbols  # the same over characters spelled one byte per token
        for code, symbol in zip(chars.listed_codes.tolist(), chars.listed_symbols.tolist()):
            if _SURROGATES[0] <= code <= _SURROGATES[1]:
                continue
            data = chr(code).encode("utf-8")
            self.bytes_all[symbol] = max(self.bytes_all[symbol], len(data))
            if all(b in single for b in data):
                self.bytes_spelled[symbol] = max(self.bytes_spelled[symbol], len(data))
        if chars.other >= 0:
            listed = set(chars.listed_codes.tolist())
            for length in (4, 3, 2, 1):
                low, high = _LENGTHS[length]
                if high - low + 1 > sum(1 for c in listed if low <= c <= high) + _surrogates_in(low, high):
                    self.bytes_all[chars.other] = max(self.bytes_all[chars.other], length)
                if _unlisted_spelled(length, listed, single):
                    self.bytes_spelled[chars.other] = max(self.bytes_spelled[chars.other], length)
        self.upper = chars.live(lambda s: self.bytes_all[s] > 0)
        self.lower = chars.live(lambda s: self.bytes_spelled[s] > 0)
        self._known: dict[tuple[int, bytes], bool] = {}

    # --------------------------------------------------------------------------------- one state
    def bracket(self, key: tuple[int, bytes]) -> bool | None:
        """True: live; False: dead; None: the character automaton cannot tell (see :meth:`live`)."""
        known = self._known.get(key)
        if known is not None:
            return known
        state, pending = key
        if not pending:
            return True if state in self.lower else (False if state not in self.upper else None)
        span = completions(pending)
        if span is None:
            return False
        lo, hi = span
        chars = self.chars
        moves = chars.map[state]
        first, last = np.searchsorted(chars.listed_codes, [lo, hi + 1])
        codes = chars.listed_codes[first:last]
        plain = (codes < _SURROGATES[0]) | (codes > _SURROGATES[1])
        targets = {moves.get(int(s)) for s in np.unique(chars.listed_symbols[first:last][plain]).tolist()}
        unlisted = (hi - lo + 1) - int(plain.sum()) - _surrogates_in(lo, hi)
        if unlisted > 0 and chars.other >= 0:
            targets.add(moves.get(chars.other))
        targets.discard(None)
        if self._continuations and any(t in self.lower for t in targets):
            return True
        return None if any(t in self.upper for t in targets) else False

    def live(self, key: tuple[int, bytes], moves: Callable[[tuple[int, bytes]], Iterable[tuple[int, bytes]]],
             limit: int) -> bool | None:
        """Whether ``key`` is live, exact: the bracket, else a search of the token moves (``moves(key)``: the
        states each token leads to) until an accepting or surely live state. None when the search would
        visit more than ``limit`` states."""
        found = self.bracket(key)
        if found is not None:
            return found
        seen, stack = {key}, [key]
        while stack:
            for target in moves(stack.pop()):
                status = self.bracket(target)
                if status is True or (not target[1] and target[0] in self.chars.finals):
                    self._known[key] = True
                    return True
                if status is None and target not in seen:
                    if len(seen) >= limit:
                        return None
                    seen.add(target)
                    stack.append(target)
        for state in seen:              # nothing reachable from them accepts
            self._known[state] = False
        return False

    # ---------------------------------------------------------------------------- whole automaton
    def prefix_free(self) -> bool | None:
        """Whether no accepted token sequence is a proper prefix of another (None: undecided here)."""
        chars = self.chars
        maybe = self._reachable(lambda s: self.bytes_all[s] > 0, self.upper)
        if not any(q in chars.finals and any(self.bytes_all[s] and t in self.upper for s, t in chars.map[q].items())
                   for q in maybe):
            return True
        sure = self._reachable(lambda s: self.bytes_spelled[s] > 0, self.lower)
        if any(
                q in chars.finals and any(self.bytes_spelled[s] and t in self.lower for s, t in chars.map[q].items())
                for q in sure):
            return False
        return None

    def longest_bytes(self) -> tuple[float, float]:
        """``(lo, hi)`` bounds on the most tokens of an accepted sequence (``inf``: unbounded)."""
        hi = self._longest(lambda s: self.bytes_all[s], self.upper)
        lo = self._longest(lambda s: self.bytes_spelled[s], self.lower)
        return lo, hi

    def _reachable(self, usable, within: frozenset) -> set[int]:
        chars = self.chars
        if chars.initial not in within:
            return set()
        seen, queue = {chars.initial}, deque([chars.initial])
        while queue:
            for symbol, target in chars.map[queue.popleft()].items():
                if usable(symbol) and target in within and target not in seen:
                    seen.add(target)
                    queue.append(target)
        return seen

    def _longest(self, weight, within: frozenset) -> float:
        """Most bytes along a path from the initial state to a final one through ``within`` (``inf`` on a
        cycle, ``-inf`` when there is no such path)."""
        states = sorted(self._reachable(lambda s: weight(s) > 0, within))
        if not states:
            return -math.inf
        number = {q: i for i, q in enumerate(states)}
        edges = [[(number[t], weight(s)) for s, t in self.chars.map[q].items() if weight(s) > 0 and t in number]
                 for q in states]
        order = topological(len(states), lambda i: [j for j, _ in edges[i]])
        if order is None:
            return math.inf
        best = [-math.inf] * len(states)
        best[number[self.chars.initial]] = 0
        for i in order:
            if best[i] > -math.inf:
                for j, w in edges[i]:
                    best[j] = max(best[j], best[i] + w)
        return max((best[number[q]] for q in states if q in self.chars.finals), default=-math.inf)


def _surrogates_in(lo: int, hi: int) -> int:
    return max(0, min(hi, _SURROGATES[1]) - max(lo, _SURROGATES[0]) + 1)


def _unlisted_spelled(length: int, listed: set[int], single: frozenset) -> bool:
    """Whether some character of ``length`` UTF-8 bytes outside ``listed`` has every byte a token by itself.
    Tries the characters built from those bytes in order; the listed ones are finite, so an answer comes
    within ``len(listed)`` valid tries unless the bytes allow fewer characters than that."""
    leads = [b for b in sorted(single) if utf8_length(b) == length]
    tails = [b for b in sorted(single) if 0x80 <= b <= 0xBF]
    budget = len(listed) + 1

    def extend(prefix: bytes):
        nonlocal budget
        if len(prefix) == length:
            try:
                code = ord(prefix.decode("utf-8"))
            except UnicodeDecodeError:
                return False
            budget -= 1
            return code not in listed
        if len(prefix) > 1 and completions(prefix) is None:     # an overlong start: nothing completes it
            return False
        for byte in tails:
            if budget <= 0:
                return False
            if extend(prefix + bytes((byte,))):
                return True
        return False

    return any(extend(bytes((lead,))) for lead in leads if budget > 0)

