"""A regex's deterministic automaton over characters, compiled within a state budget.

``interegular`` determinises the pattern (Python ``re`` syntax). Subset construction can need exponentially
many states (``(a|b)*a(a|b){15}`` needs 2^16), so every automaton it builds on the way is built here with at
most ``max_states`` states (default :data:`MAX_CHAR_STATES`) and a pattern that needs more is an
``InputError`` naming it and the limit: compilation takes bounded time whatever the pattern.

Before ``interegular`` sees the pattern, what it would misread or refuse with a misleading message is
settled here: anchors, lookarounds and unicode property classes (``\\p{L}``) are refused by name, Python's
own parser reports syntax errors with their position, and ``\\uXXXX`` / ``\\UXXXXXXXX`` / ``\\N{name}`` escapes
become the characters they stand for (so ``[\\u4e00-\\u9fff]`` is a plain range of code points).

Example:
    >>> chars = compile_chars(r"[\\u4e00-\\u9fff]{2}", "regex")
    >>> chars.size() == 20992 ** 2, chars.step(chars.step(chars.initial, "中"), "文") in chars.finals
    (True, True)
"""
from __future__ import annotations

import re
import threading
import unicodedata
from collections import deque
from functools import lru_cache

import interegular
import interegular.fsm as interegular_fsm
import numpy as np
from interegular.fsm import FSM, OblivionError, anything_else

from ...validation import InputError

__all__ = ["CharAutomaton", "compile_chars", "MAX_CHAR_STATES"]

# Most states any automaton built for one pattern may have: a fraction of a second of determinisation.
MAX_CHAR_STATES = 10_000
# Unicode scalar values (code points that are not surrogates): the characters a string can hold.
_UNICODE_SCALARS = 0x110000 - 0x800
_SURROGATES = (0xD800, 0xDFFF)


def compile_chars(pattern: str, description: str, *, max_states: int = MAX_CHAR_STATES) -> "CharAutomaton":
    """The pattern's automaton over characters. ``InputError`` (``invalid {description}: reason``) for a
    syntax error, what constraints do not support (anchors, lookarounds, back-references, ``\\p{...}``),
    or a pattern whose automaton needs more than ``max_states`` states."""
    try:
        return _compile(pattern, max_states)
    except _PatternError as exc:
        raise InputError(f"invalid {description}: {exc}") from None


class _PatternError(Exception):
    """Why a pattern cannot be compiled (the caller names the pattern)."""


@lru_cache(maxsize=64)
def _compile(pattern: str, max_states: int) -> "CharAutomaton":
    # Cached: the command line checks a pattern before the model loads and the index compiles it again.
    _refuse_unsupported(pattern)
    try:
        parsed = interegular.parse_pattern(_translate_escapes(pattern))
        with _BudgetedCrawl(max_states):
            fsm = parsed.to_fsm()
    except _TooManyStates:
        raise _PatternError(f"its automaton needs more than {max_states:,} states (the limit); simplify the "
                            f"pattern") from None
    except Exception as exc:       # interegular's InvalidSyntax / Unsupported and parser errors
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if type(exc).__name__ == "Unsupported":
            reason = f"unsupported: {reason}"
        raise _PatternError(reason) from None
    return CharAutomaton(fsm)


# ------------------------------------------------------------------------------------ pattern checks
def _escapes(pattern: str):
    """``(position, character after the backslash)`` of every escape, an escaped backslash counting once."""
    at = 0
    while at < len(pattern) - 1:
        if pattern[at] == "\\":
            yield at, pattern[at + 1]
            at += 2
        else:
            at += 1


def _refuse_unsupported(pattern: str) -> None:
    """What Python accepts but a constraint cannot mean, and syntax errors in Python's own words.

    Anchors are refused (a constraint always matches the whole continuation); so are lookaheads and
    lookbehinds: ``interegular`` reads a lookahead that reaches past the match as a condition on text after
    it (``a(?!b)`` then accepts ``"ax"``), so the language would silently differ from the pattern's."""
    if any(char in "pP" for _, char in _escapes(pattern)):
        raise _PatternError("unicode property classes (\\p{...}, \\P{...}) are not supported; write the "
                            "characters or a range of code points ([\\u4e00-\\u9fff])")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise _PatternError(str(exc)) from None
    try:
        import re._parser as sre_parse  # Python >= 3.11
    except ImportError:                         # pragma: no cover - Python 3.10
        import sre_parse  # type: ignore[no-redef]
    parsed = sre_parse.parse(pattern)

    def walk(node, opcodes: tuple[str, ...]) -> bool:
        if isinstance(node, sre_parse.SubPattern):
            node = node.data
        if isinstance(node, (list, tuple)):
            return any(str(item) in opcodes or walk(item, opcodes) for item in node)
        return False

    if walk(parsed, ("AT",)):
        raise _PatternError("anchors (^, $, \\A, \\Z, \\b) are not supported: the pattern always matches the "
                            "whole continuation, so none is needed")
    if walk(parsed, ("ASSERT", "ASSERT_NOT")):
        raise _PatternError("lookaheads and lookbehinds ((?=...), (?!...), (?<=...), (?<!...)) are not "
                            "supported in constraints; write the format without them")


def _translate_escapes(pattern: str) -> str:
    """``pattern`` with ``\\uXXXX``, ``\\UXXXXXXXX`` and ``\\N{name}`` replaced by the character (``interegular``
    reads none of them). An ASCII character becomes ``\\xHH``, which keeps a metacharacter literal; no other
    character is special. Runs after ``re.compile`` accepted the pattern, so every escape is well formed."""
    out, last = [], 0
    for at, char in _escapes(pattern):
        if char in "uU":
            end = at + 2 + (4 if char == "u" else 8)
            code = int(pattern[at + 2:end], 16)
        elif char == "N":
            end = pattern.index("}", at) + 1
            code = ord(unicodedata.lookup(pattern[at + 3:end - 1]))
        else:
            continue
        out.append(pattern[last:at])
        out.append(f"\\x{code:02x}" if code < 0x80 else chr(code))
        last = end
    out.append(pattern[last:])
    return "".join(out)


# ------------------------------------------------------------------------------- bounded determinisation
class _TooManyStates(Exception):
    pass


class _Limit(threading.local):
    """The budget of the crawls this thread runs (None: unlimited)."""

    value: int | None = None


class _BudgetedCrawl:
    """While active, ``interegular`` builds every automaton with the crawl below: the same states in the same
    order, found through a hash table instead of a list scan, and at most ``limit`` of them.

    Every construction ``interegular`` makes (concatenation, repetition, union, star) goes through its
    module-level ``crawl``; swapping that one function is the only hook it offers. The swap is process-wide,
    so a lock keeps one budget active at a time; another thread's crawl meanwhile runs the same way without
    a limit."""

    _lock = threading.Lock()
    limit_here = _Limit()

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def __enter__(self) -> "_BudgetedCrawl":
        self._lock.acquire()
        self._module, self._original = interegular_fsm, interegular_fsm.crawl
        self.limit_here.value = self.limit
        interegular_fsm.crawl = _crawl
        return self

    def __exit__(self, *exc) -> None:
        self._module.crawl = self._original
        self.limit_here.value = None
        self._lock.release()


def _state_key(state):
    # interegular's states are frozensets, sets (equal to the frozensets that follow them) or dicts.
    if isinstance(state, dict):
        return (dict, frozenset(state.items()))
    if isinstance(state, set):
        return frozenset(state)
    return state


def _crawl(alphabet, initial, final, follow):
    """``interegular.fsm.crawl`` with a hash table of the states seen and a limit on their number."""
    limit = _BudgetedCrawl.limit_here.value
    states, index = [initial], {_state_key(initial): 0}
    finals, transitions = set(), {}
    i = 0
    while i < len(states):
        state = states[i]
        if final(state):
            finals.add(i)
        transitions[i] = {}
        for transition in alphabet.by_transition:
            try:
                nxt = follow(state, transition)
            except OblivionError:
                continue
            key = _state_key(nxt)
            j = index.get(key)
            if j is None:
                j = len(states)
                if limit is not None and j >= limit:
                    raise _TooManyStates
                index[key] = j
                states.append(nxt)
            transitions[i][transition] = j
        i += 1
    return FSM(alphabet=alphabet, states=range(len(states)), initial=0, finals=finals, map=transitions,
               __no_validation__=True)


# ------------------------------------------------------------------------------------- the automaton
class CharAutomaton:
    """The pattern's deterministic automaton over characters: states ``0 .. n_states - 1``, ``initial``,
    ``finals``, and ``step(state, char)``. Characters fall in classes (``symbols``) that move alike; the
    characters the pattern does not name share one class (``other``, -1 when the pattern allows none)."""

    def __init__(self, fsm) -> None:
        states = sorted(fsm.states)
        number = {state: i for i, state in enumerate(states)}
        symbols = sorted(fsm.alphabet.by_transition)
        symbol_id = {symbol: i for i, symbol in enumerate(symbols)}
        self.n_states, self.n_symbols = len(states), len(symbols)
        self.initial = number[fsm.initial]
        self.finals = frozenset(number[s] for s in fsm.finals)
        self.map: list[dict[int, int]] = [
            {symbol_id[sym]: number[t] for sym, t in fsm.map.get(state, {}).items()} for state in states]
        listed = {ch: symbol_id[fsm.alphabet[ch]] for ch in fsm.alphabet.keys() if ch is not anything_else}
        self._listed = listed
        self.other = symbol_id[fsm.alphabet[anything_else]] if anything_else in fsm.alphabet.keys() else -1
        codes = sorted(ord(ch) for ch in listed)
        self.listed_codes = np.array(codes, dtype=np.int64)          # ascending
        self.listed_symbols = np.array([listed[chr(c)] for c in codes], dtype=np.int64)
        # How many characters each class stands for (``other``: every scalar not listed), one example each.
        scalars = [c for c in codes if not _SURROGATES[0] <= c <= _SURROGATES[1]]
        self.class_size = [0] * self.n_symbols
        self.example: list[str | None] = [None] * self.n_symbols
        for code in scalars:
            symbol = listed[chr(code)]
            self.class_size[symbol] += 1
            if self.example[symbol] is None:
                self.example[symbol] = chr(code)
        if self.other >= 0:
            self.class_size[self.other] += _UNICODE_SCALARS - len(scalars)
            self.example[self.other] = self.example[self.other] or self._unlisted()
        # Transitions as sorted keys ``state * n_symbols + symbol`` for the vectorised walk over a vocabulary.
        pairs = sorted((q * self.n_symbols + s, t) for q, moves in enumerate(self.map) for s, t in moves.items())
        self._keys = np.array([k for k, _ in pairs], dtype=np.int64)
        self._values = np.array([t for _, t in pairs], dtype=np.int64)

    def _unlisted(self) -> str:
        code = 0x21
        while chr(code) in self._listed:
            code += 1
        return chr(code)

    # ------------------------------------------------------------------------------------ stepping
    def symbol(self, char: str) -> int:
        """The class of ``char`` (-1: the pattern allows it nowhere)."""
        return self._listed.get(char, self.other)

    def step(self, state: int, char: str) -> int | None:
        """The state after ``char``, or None when the pattern cannot continue with it."""
        return self.map[state].get(self.symbol(char))

    def symbols_of(self, codes: np.ndarray) -> np.ndarray:
        """``(n,)`` the class of each code point (-1: allowed nowhere)."""
        unique, inverse = np.unique(np.asarray(codes, dtype=np.int64), return_inverse=True)
        mapped = np.array([self.symbol(chr(c)) for c in unique.tolist()], dtype=np.int64)
        return mapped[inverse] if len(unique) else np.zeros(0, dtype=np.int64)

    def next_states(self, states: np.ndarray, symbols: np.ndarray) -> np.ndarray:
        """Element-wise state after one character of each class from each state; -1 where none (also from
        state -1 or class -1)."""
        keys = states * self.n_symbols + symbols
        if not len(self._keys):
            return np.full(len(keys), -1, dtype=np.int64)
        at = np.minimum(np.searchsorted(self._keys, keys), len(self._keys) - 1)
        hit = (self._keys[at] == keys) & (states >= 0) & (symbols >= 0)
        return np.where(hit, self._values[at], -1)

    # ------------------------------------------------------------------------------------ structure
    def live(self, usable=None) -> frozenset:
        """States from which a final state can be reached through classes ``usable(symbol)`` allows (all
        classes with a character when None)."""
        if usable is None:
            usable = self.class_size.__getitem__
        reverse: dict[int, set[int]] = {}
        for state, moves in enumerate(self.map):
            for symbol, target in moves.items():
                if usable(symbol):
                    reverse.setdefault(target, set()).add(state)
        live, queue = set(self.finals), deque(self.finals)
        while queue:
            for source in reverse.get(queue.popleft(), ()):
                if source not in live:
                    live.add(source)
                    queue.append(source)
        return frozenset(live)

    def empty(self) -> bool:
        return self.initial not in self.live()

    def size(self) -> float | int:
        """Number of strings accepted (``math.inf`` when infinite)."""
        live = self.live()
        if self.initial not in live:
            return 0
        states = sorted(live)
        number = {state: i for i, state in enumerate(states)}
        succ = [[number[t] for s, t in self.map[state].items() if t in live and self.class_size[s]]
                for state in states]
        order = topological(len(states), lambda i: succ[i])
        if order is None:
            return float("inf")
        paths = [0] * len(states)
        for i in reversed(order):
            state = states[i]
            paths[i] = (1 if state in self.finals else 0) + sum(
                self.class_size[s] * paths[number[t]] for s, t in self.map[state].items()
                if t in live and self.class_size[s])
        return paths[number[self.initial]]

    def prefix_example(self) -> tuple[str, str] | None:
        """The shortest member that is a proper prefix of another member, and the shortest such other."""
        live = self.live()
        seen = {self.initial: ""}
        queue = deque([self.initial] if self.initial in live else [])
        while queue:
            state = queue.popleft()
            moves = self._moves(state, live)
            if state in self.finals and moves:
                return seen[state], self._shortest_final(moves, seen[state], live)
            for char, target in moves:
                if target not in seen:
                    seen[target] = seen[state] + char
                    queue.append(target)
        return None

    def _moves(self, state: int, live: frozenset) -> list[tuple[str, int]]:
        return sorted((self.example[s], t) for s, t in self.map[state].items() if t in live and self.class_size[s])

    def _shortest_final(self, moves, prefix: str, live: frozenset) -> str:
        queue = deque((t, prefix + ch) for ch, t in moves)
        visited = set()
        while queue:
            state, text = queue.popleft()
            if state in self.finals:
                return text
            if state in visited:
                continue
            visited.add(state)
            queue.extend((t, text + ch) for ch, t in self._moves(state, live))
        return prefix


def topological(n: int, successors) -> list[int] | None:
    """A topological order of ``n`` nodes, or None when there is a cycle (Kahn's algorithm)."""
    indegree = [0] * n
    for i in range(n):
        for j in successors(i):
            indegree[j] += 1
    queue = deque(i for i in range(n) if indegree[i] == 0)
    order = []
    while queue:
        i = queue.popleft()
        order.append(i)
        for j in successors(i):
            indegree[j] -= 1
            if indegree[j] == 0:
                queue.append(j)
    return order if len(order) == n else None
