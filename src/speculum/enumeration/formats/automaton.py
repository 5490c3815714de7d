"""The token-level automaton of a regular expression over a model's vocabulary, built on demand.

``interegular`` compiles the pattern (Python ``re`` syntax) to a deterministic automaton over characters
(:mod:`.charfsm`, within a state budget). A token-level state is a character state plus the bytes of a
character not yet complete, since byte-level tokens may end inside a UTF-8 character. From each state, the
tokens allowed next and the state each leads to are computed the first time they are asked for, by one
vectorised walk of the whole vocabulary (:mod:`.spelling`), and only towards states that can still reach an
accepting one (:mod:`.liveness`). An enumeration thus builds only the states its prefixes reach: with
``max_len=3`` those within three tokens of the start, and of those only the ones it expands.

Memory is bounded: at most ``max_states`` states (:data:`MAX_TOKEN_STATES`) and ``max_moves`` stored moves
(:data:`MAX_TOKEN_MOVES`, 8 bytes each); a query that needs more stops with :class:`AutomatonBudgetError`,
which names the pattern and the limit.

Example:
    >>> automaton = TokenAutomaton.build("7[78]", [b"7", b"8", b"77", None])
    >>> automaton.walk([0, 1]) in automaton.accepting_states(), automaton.walk([2]) in automaton.accepting_states()
    (True, True)
    >>> automaton.language_size()
    2
"""
from __future__ import annotations

import hashlib
import math
from collections import OrderedDict, deque
from typing import Sequence

import numpy as np

from ...validation import InputError
from .charfsm import MAX_CHAR_STATES, CharAutomaton, compile_chars, topological
from .liveness import Liveness
from .spelling import VocabularySpelling

__all__ = ["TokenAutomaton", "AutomatonBudgetError", "MAX_TOKEN_STATES", "MAX_TOKEN_MOVES"]

# Most token-level states one automaton may build (each holds its key and two small arrays).
MAX_TOKEN_STATES = 100_000
# Most token moves stored over all states, 8 bytes each (~160 MB): a pattern like ".{0,1000}" allows almost
# every token from every state, ~49k moves per state on a 49k vocabulary.
MAX_TOKEN_MOVES = 20_000_000
# Masking reads only the allowed columns when they are fewer than 1/8 of the vocabulary (fancy indexing
# costs several times a contiguous pass per element).
_GATHER_BELOW = 8
# Vocabularies read as characters, by digest of their token bytes (a 49k vocabulary takes ~0.2 s to read).
_SPELLINGS: "OrderedDict[str, VocabularySpelling]" = OrderedDict()
_SPELLINGS_KEPT = 4


class AutomatonBudgetError(InputError):
    """A token automaton needs more states or moves than its budget: cap the tokens or simplify the pattern."""


class _Moves:
    """``automaton.tokens[s]`` / ``automaton.targets[s]``: one state's moves, computed on first access."""

    def __init__(self, automaton: "TokenAutomaton", which: int) -> None:
        self._automaton, self._which = automaton, which

    def __getitem__(self, state) -> np.ndarray:
        return self._automaton.moves(int(state))[self._which]

    def __len__(self) -> int:
        return self._automaton.n_states


class TokenAutomaton:
    """A deterministic automaton over token ids: state 0 is the initial state, every state can still reach
    an accepting one, and a token sequence walks to an accepting state iff its decoded bytes are a member of
    the language. Token sequences of one string are all walked (every tokenization of a member is accepted).

    Attributes: ``n_states`` (the states reached so far; every id a move returns is one; ``built_states`` of
    them have their moves built, ``stored_moves`` moves in all); ``accepting``
    ((n_states,) bool); ``tokens[s]`` / ``targets[s]``: the tokens allowed from ``s`` (ascending) and the
    state each leads to, built on first access; ``token_bytes``: the bytes of every token id (None: no
    text); ``key``: a digest of the pattern and the vocabulary (two automata are equal iff their keys are).
    State ids depend on the order states are first reached; the language, and every answer, do not.
    """

    def __init__(self, *, chars: CharAutomaton, spelling: VocabularySpelling, token_bytes: Sequence[bytes | None],
                 pattern: str, key: str, description: str, max_states: int = MAX_TOKEN_STATES,
                 max_moves: int = MAX_TOKEN_MOVES) -> None:
        self.chars = chars                       # the pattern's automaton over characters
        self.spelling = spelling
        self.token_bytes = tuple(token_bytes)
        self.vocab_size = len(self.token_bytes)
        self.pattern = pattern
        self.key = key
        self.description = description
        self.max_states, self.max_moves = int(max_states), int(max_moves)
        self.stored_moves = 0
        self._built = 0
        self.tokens, self.targets = _Moves(self, 0), _Moves(self, 1)
        self._liveness = Liveness(chars, spelling)
        self._states: list[tuple[int, bytes]] = []
        self._number: dict[tuple[int, bytes], int] = {}
        self._moves: list[tuple[np.ndarray, np.ndarray] | None] = []
        self._accepting = np.zeros(16, dtype=bool)
        self._longest: int | None | bool = False           # False: not computed yet
        start = (chars.initial, b"")
        if not self._is_live(start):
            if chars.empty():
                raise InputError(f"the {description} matches no string")
            raise InputError(f"no token sequence of this vocabulary can spell the {description}")
        self._add([start])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenAutomaton) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"TokenAutomaton({self.description}, {self.n_states} states built)"

    # ------------------------------------------------------------------------------------- building
    @classmethod
    def build(cls, pattern: str, token_bytes: Sequence[bytes | None], *, exclude: Sequence[int] = (),
              description: str | None = None, max_char_states: int = MAX_CHAR_STATES,
              max_states: int = MAX_TOKEN_STATES, max_moves: int = MAX_TOKEN_MOVES) -> "TokenAutomaton":
        """Compile ``pattern`` over tokens spelled by ``token_bytes`` (None / empty: never allowed; ``exclude``:
        token ids never allowed). Only the initial state is built here; ``InputError`` for an invalid
        pattern, an empty language or one no token sequence spells."""
        description = description or f"regex {pattern!r}"
        chars = compile_chars(pattern, description, max_states=max_char_states)
        excluded = {int(t) for t in exclude}
        pieces = [None if (not piece or token in excluded) else bytes(piece) for token, piece in enumerate(token_bytes)]
        if not any(pieces):
            raise InputError("the vocabulary has no token with text: a constraint cannot be spelled")
        vocabulary = hashlib.sha256()
        for piece in pieces:
            vocabulary.update(b"\x00" if piece is None else b"\x01" + piece + b"\x02")
        digest = vocabulary.hexdigest()
        spelling = _SPELLINGS.pop(digest, None) or VocabularySpelling(pieces)
        _SPELLINGS[digest] = spelling
        while len(_SPELLINGS) > _SPELLINGS_KEPT:
            _SPELLINGS.popitem(last=False)
        key = hashlib.sha256(pattern.encode("utf-8", "surrogatepass") + b"\x00" + digest.encode()).hexdigest()
        return cls(chars=chars, spelling=spelling, token_bytes=token_bytes, pattern=pattern, key=key,
                   description=description, max_states=max_states, max_moves=max_moves)

    @property
    def n_states(self) -> int:
        return len(self._states)

    @property
    def built_states(self) -> int:
        """How many states have their moves built (the rest are only named as targets)."""
        return self._built

    @property
    def accepting(self) -> np.ndarray:
        view = self._accepting[:len(self._states)]
        view.flags.writeable = False
        return view

    def moves(self, state: int) -> tuple[np.ndarray, np.ndarray]:
        """``(tokens, targets)`` of ``state``: the tokens allowed from it (ascending, int32) and the state each
        leads to. Built on the first call; :class:`AutomatonBudgetError` past the budget."""
        found = self._moves[state]
        if found is not None:
            return found
        char_state, pending = self._states[state]
        continuations = self.spelling.after(pending)
        tokens, ends, tails = continuations.walk(self.chars, char_state)
        n_tails = len(continuations.tail_bytes)
        unique, inverse = np.unique(ends * n_tails + tails, return_inverse=True)
        keys = [(int(u) // n_tails, continuations.tail_bytes[int(u) % n_tails]) for u in unique.tolist()]
        live = np.array([key in self._number or self._is_live(key) for key in keys], dtype=bool)
        new = [key for key, alive in zip(keys, live) if alive and key not in self._number]
        keep = live[inverse] if len(keys) else np.zeros(0, dtype=bool)
        count = int(keep.sum())
        self._check_budget(len(new), count)
        self._add(new)
        ids = np.array([self._number.get(key, -1) for key in keys], dtype=np.int32)
        found = (tokens[keep].astype(np.int32), ids[inverse[keep]] if count else np.zeros(0, dtype=np.int32))
        for array in found:
            array.flags.writeable = False
        self._moves[state] = found
        self.stored_moves += count
        self._built += 1
        return found

    def explore(self, depth: int | None = None) -> list[int]:
        """Build the moves of every state within ``depth - 1`` tokens of the start (None: every state), so
        that all states within ``depth`` tokens exist. Returns the states whose moves are built."""
        distance, queue = {0: 0}, deque([0])
        while queue:
            state = queue.popleft()
            if depth is not None and distance[state] >= depth:
                continue
            for target in self.moves(state)[1].tolist():
                if target not in distance:
                    distance[target] = distance[state] + 1
                    queue.append(target)
        return [s for s in range(self.n_states) if self._moves[s] is not None]

    def _is_live(self, key: tuple[int, bytes]) -> bool:
        found = self._liveness.live(key, self._raw_targets, self.max_states)
        if found is None:
            raise AutomatonBudgetError(f"deciding which token sequences can spell the {self.description} needs more "
                                       f"than {self.max_states:,} states (the limit, max_states); simplify the "
                                       f"pattern")
        return found

    def _raw_targets(self, key: tuple[int, bytes]) -> list[tuple[int, bytes]]:
        """The states the tokens lead to from ``key``, live or not (for the liveness search)."""
        continuations = self.spelling.after(key[1])
        _, ends, tails = continuations.walk(self.chars, key[0])
        pairs = set(zip(ends.tolist(), tails.tolist()))
        return [(end, continuations.tail_bytes[tail]) for end, tail in pairs]

    def _check_budget(self, new_states: int, new_moves: int) -> None:
        if self.n_states + new_states > self.max_states:
            raise AutomatonBudgetError(
                f"the token automaton of the {self.description} needs more than {self.max_states:,} states over "
                f"this vocabulary (the limit, max_states); cap the tokens (max_len) or simplify the pattern")
        if self.stored_moves + new_moves > self.max_moves:
            raise AutomatonBudgetError(
                f"the token automaton of the {self.description} needs more than {self.max_moves:,} token moves "
                f"over this vocabulary (the limit, max_moves: {self.max_moves * 8 / 2 ** 20:,.0f} MB); cap the "
                f"tokens (max_len) or simplify the pattern")

    def _add(self, keys: list[tuple[int, bytes]]) -> None:
        size = len(self._states) + len(keys)
        if size > len(self._accepting):
            grown = np.zeros(max(size, 2 * len(self._accepting)), dtype=bool)
            grown[:len(self._states)] = self._accepting[:len(self._states)]
            self._accepting = grown
        for key in keys:
            self._accepting[len(self._states)] = not key[1] and key[0] in self.chars.finals
            self._number[key] = len(self._states)
            self._states.append(key)
            self._moves.append(None)

    # -------------------------------------------------------------------------------------- stepping
    def accepting_states(self) -> set[int]:
        return set(np.flatnonzero(self.accepting).tolist())

    def advance(self, states: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """(n,) the state after each ``tokens[i]`` from ``states[i]``; -1 where the token is not allowed."""
        states, tokens = np.asarray(states, dtype=np.int64), np.asarray(tokens, dtype=np.int64)
        out = np.full(len(states), -1, dtype=np.int32)
        for state in np.unique(states):
            rows = np.flatnonzero(states == state)
            allowed, targets = self.moves(int(state))
            if not len(allowed):
                continue
            at = np.minimum(np.searchsorted(allowed, tokens[rows]), len(allowed) - 1)
            hit = allowed[at] == tokens[rows]
            out[rows[hit]] = targets[at[hit]]
        return out

    def mask(self, rows: np.ndarray, states: np.ndarray, *, eos: int | None) -> tuple[np.ndarray, np.ndarray]:
        """``(c, V)`` copy of ``rows`` with every token not allowed after ``states[i]`` set to ``-inf`` (``eos``,
        if given, stays allowed exactly in accepting states), and ``(c,)`` the log of each row's allowed
        probability (computed on the allowed entries only)."""
        out = np.full(rows.shape, -np.inf)
        log_mass = np.full(len(rows), -np.inf)
        states = np.asarray(states)
        for state in np.unique(states):
            r = np.flatnonzero(states == state)
            allowed = self.moves(int(state))[0]
            if self._accepting[state] and eos is not None:
                allowed = np.append(allowed, eos)
            if not len(allowed):
                continue
            if len(allowed) * _GATHER_BELOW < rows.shape[1]:
                # A narrow pattern (ten digits of 49,152 tokens): only the allowed columns are read.
                kept = rows[np.ix_(r, allowed)]
                out[np.ix_(r, allowed)] = kept
            else:
                # Whole rows through a boolean mask: a wide pattern allows most of a large vocabulary, and
                # gathering tens of thousands of columns per row costs far more.
                keep = np.zeros(rows.shape[1], dtype=bool)
                keep[allowed] = True
                kept = np.where(keep, rows[r], -np.inf)
                out[r] = kept
            top = kept.max(axis=1)
            safe = np.where(np.isfinite(top), top, 0.0)
            with np.errstate(divide="ignore"):
                log_mass[r] = safe + np.log(np.exp(kept - safe[:, None]).sum(axis=1))
        return out, log_mass

    def walk(self, tokens: Sequence[int]) -> int:
        """The state after ``tokens`` from the initial state, or -1 when some token is not allowed."""
        state = 0
        for token in tokens:
            state = int(self.advance(np.array([state]), np.array([int(token)]))[0])
            if state < 0:
                return -1
        return state

    def text(self, tokens: Sequence[int]) -> bytes:
        """The bytes ``tokens`` spell (tokens with no text add nothing)."""
        return b"".join(self.token_bytes[int(t)] or b"" for t in tokens)

    # ------------------------------------------------------------------------------------ structure
    def prefix_free(self) -> bool:
        """Whether no member of the language is a proper prefix of another (no accepting state continues).
        Decided on the character automaton when it can be, else over every state."""
        decided = self._liveness.prefix_free()
        if decided is None:
            self.explore()
            decided = not any(self._accepting[s] and len(self.moves(s)[0]) for s in range(self.n_states))
        return decided

    def prefix_example(self) -> tuple[str, str] | None:
        """A member that is a proper prefix of another member (shortest first), as text; None if none."""
        return self.chars.prefix_example()

    def longest_path(self) -> int | None:
        """Most tokens any accepted sequence has; None when unbounded (a cycle). Read off the character
        automaton when its bounds meet (a token per byte), else computed over every state."""
        if self._longest is False:
            lo, hi = self._liveness.longest_bytes()
            if lo == hi:
                self._longest = None if hi == math.inf else int(hi)
            else:
                self.explore()
                depth = _longest(self.n_states, lambda s: self.moves(s)[1].tolist())
                self._longest = None if depth is None else max(
                    (depth[s] for s in range(self.n_states) if self._accepting[s]), default=0)
        return self._longest

    def sequence_count(self, max_len: int | None, *, eos: bool) -> int | None:
        """Number of accepted token sequences (``eos``: each followed by eos) of at most ``max_len`` tokens,
        eos included; None when infinite. Builds every state within ``max_len`` tokens."""
        if max_len is None and self.longest_path() is None:
            return None
        steps = max_len - (1 if eos else 0) if max_len is not None else self.longest_path()
        counts = {0: 1}
        total = 1 if self._accepting[0] else 0
        for _ in range(max(steps, 0)):
            nxt: dict[int, int] = {}
            for state, count in counts.items():
                for target in self.moves(state)[1].tolist():
                    nxt[target] = nxt.get(target, 0) + count
            counts = nxt
            total += sum(c for s, c in counts.items() if self._accepting[s])
            if not counts:
                break
        return total

    def language_size(self) -> float | int:
        """Number of strings in the pattern's language (``math.inf`` when infinite), whatever the vocabulary
        or a length cap."""
        return self.chars.size()


def _longest(n: int, successors) -> list[int] | None:
    """Longest path (in edges) from node 0 to each node; None when a cycle makes it unbounded."""
    order = topological(n, successors)
    if order is None:
        return None
    depth = [-(10 ** 9)] * n
    depth[0] = 0
    for i in order:
        for j in successors(i):
            depth[j] = max(depth[j], depth[i] + 1)
    return depth
