"""The token-level automaton of a regular expression over a model's vocabulary.

``interegular`` compiles the pattern (Python ``re`` syntax) to a deterministic automaton over characters;
walking every token's bytes through it — a byte trie of the vocabulary, abandoned where the pattern dies —
gives, from each state, the tokens allowed next and the state each leads to. A state is a character state
plus the bytes of a character not yet complete, since byte-level tokens may end inside a UTF-8 character.

Example:
    >>> automaton = TokenAutomaton.build("7[78]", [b"7", b"8", b"77", None])
    >>> automaton.walk([0, 1]) in automaton.accepting_states(), automaton.walk([2]) in automaton.accepting_states()
    (True, True)
    >>> automaton.language_size()
    2
"""
from __future__ import annotations

import hashlib
from collections import deque
from typing import Sequence

import numpy as np

from ..validation import InputError

__all__ = ["TokenAutomaton"]

def _refuse_unsupported(pattern: str, description: str) -> None:
    """Anchors are refused (a constraint always matches the whole continuation); so are lookaheads and
    lookbehinds: interegular reads a lookahead that reaches past the end of
    the match as a condition on text after it (``a(?!b)`` then accepts ``"ax"``), not as ``re.fullmatch``
    does, so the language would silently differ from the pattern's."""
    try:
        import re._parser as sre_parse          # Python >= 3.11
    except ImportError:                         # pragma: no cover - Python 3.10
        import sre_parse                        # type: ignore[no-redef]
    try:
        parsed = sre_parse.parse(pattern)
    except Exception:
        return                                  # interegular reports the syntax error itself

    def walk(node, opcodes: tuple[str, ...]) -> bool:
        if isinstance(node, sre_parse.SubPattern):
            node = node.data
        if isinstance(node, (list, tuple)):
            return any(str(item) in opcodes or walk(item, opcodes) for item in node)
        return False

    if walk(parsed, ("AT",)):
        raise InputError(f"invalid {description}: anchors (^, $, \\A, \\Z, \\b) are not supported: the pattern "
                         f"always matches the whole continuation, so none is needed")
    if walk(parsed, ("ASSERT", "ASSERT_NOT")):
        raise InputError(f"invalid {description}: lookaheads and lookbehinds ((?=...), (?!...), (?<=...), "
                         f"(?<!...)) are not supported in constraints; write the format without them")


def _interegular():
    try:
        import interegular
    except ImportError as exc:  # pragma: no cover - a core dependency
        raise ImportError("constraints need interegular: pip install 'interegular>=0.3.3'") from exc
    return interegular


class TokenAutomaton:
    """A deterministic automaton over token ids: state 0 is the initial state, every state can still reach
    an accepting one (dead ends are trimmed), and a token sequence walks to an accepting state iff its
    decoded bytes are a member of the language. Token sequences of one string are all walked (every
    tokenization of a member is accepted).

    Attributes: ``n_states``; ``accepting`` ((S,) bool); ``tokens[s]`` / ``targets[s]``: the tokens allowed
    from ``s`` (ascending) and the state each leads to; ``token_bytes``: the bytes of every token id (None:
    no text); ``key``: a digest of the pattern and the vocabulary (two automata are equal iff their keys are).
    """

    def __init__(self, *, accepting: np.ndarray, tokens: list[np.ndarray], targets: list[np.ndarray],
                 token_bytes: Sequence[bytes | None], chars: "_CharAutomaton", pattern: str, key: str,
                 description: str) -> None:
        self.accepting = accepting
        self.tokens = tokens
        self.targets = targets
        self.n_states = len(tokens)
        self.token_bytes = tuple(token_bytes)
        self.vocab_size = len(self.token_bytes)
        self.chars = chars                       # the pattern's automaton over characters
        self.pattern = pattern
        self.key = key
        self.description = description

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TokenAutomaton) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"TokenAutomaton({self.description}, {self.n_states} states)"

    # ------------------------------------------------------------------------------------- building
    @classmethod
    def build(cls, pattern: str, token_bytes: Sequence[bytes | None], *, exclude: Sequence[int] = (),
              description: str | None = None) -> "TokenAutomaton":
        """Compile ``pattern`` over tokens spelled by ``token_bytes`` (None / empty: never allowed)."""
        description = description or f"regex {pattern!r}"
        chars = _CharAutomaton.parse(pattern, description)
        excluded = {int(t) for t in exclude}
        pieces = [None if (not piece or token in excluded) else bytes(piece) for token, piece in enumerate(token_bytes)]
        if not any(pieces):
            raise InputError("the vocabulary has no token with text: a constraint cannot be spelled")
        trie = _token_trie(pieces)
        # A token-level state is (character state, bytes of a character not yet complete): byte-level
        # tokens may end inside a multi-byte UTF-8 character.
        start = (chars.initial, b"")
        number = {start: 0}
        order = [start]
        edges: list[dict[int, int]] = []
        queue = deque([start])
        while queue:
            state = queue.popleft()
            moves = {}
            for token, reached in _walk_trie(trie, chars, state):
                if reached not in number:
                    number[reached] = len(order)
                    order.append(reached)
                    queue.append(reached)
                moves[token] = number[reached]
            edges.append(moves)
        accepting_set = {i for i, (char_state, pending) in enumerate(order) if not pending and char_state in chars.finals}
        transitions = dict(enumerate(edges))
        live = _coaccessible(transitions, accepting_set)
        if 0 not in live:
            if chars.empty():
                raise InputError(f"the {description} matches no string")
            raise InputError(f"no token sequence of this vocabulary can spell the {description}")
        keep = _reachable_order(transitions, 0, live)
        renumber = {state: i for i, state in enumerate(keep)}
        tokens, targets = [], []
        for state in keep:
            pairs = sorted((t, renumber[n]) for t, n in transitions[state].items() if n in live)
            tokens.append(np.array([t for t, _ in pairs], dtype=np.int64))
            targets.append(np.array([n for _, n in pairs], dtype=np.int32))
        accepting = np.array([state in accepting_set for state in keep], dtype=bool)
        digest = hashlib.sha256(pattern.encode())
        for piece in pieces:
            digest.update(b"\x00" if piece is None else b"\x01" + piece + b"\x02")
        return cls(accepting=accepting, tokens=tokens, targets=targets, token_bytes=token_bytes,
                   chars=chars, pattern=pattern, key=digest.hexdigest(), description=description)

    # -------------------------------------------------------------------------------------- stepping
    def accepting_states(self) -> set[int]:
        return set(np.flatnonzero(self.accepting).tolist())

    def advance(self, states: np.ndarray, tokens: np.ndarray) -> np.ndarray:
        """(n,) the state after each ``tokens[i]`` from ``states[i]``; -1 where the token is not allowed."""
        states, tokens = np.asarray(states, dtype=np.int64), np.asarray(tokens, dtype=np.int64)
        out = np.full(len(states), -1, dtype=np.int32)
        for state in np.unique(states):
            rows = np.flatnonzero(states == state)
            allowed, targets = self.tokens[state], self.targets[state]
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
            allowed = self.tokens[state]
            if self.accepting[state] and eos is not None:
                allowed = np.append(allowed, eos)
            if not len(allowed):
                continue
            kept = rows[np.ix_(r, allowed)]
            out[np.ix_(r, allowed)] = kept
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
        """Whether no member of the language is a proper prefix of another (no accepting state continues)."""
        return not any(self.accepting[s] and len(self.tokens[s]) for s in range(self.n_states))

    def prefix_example(self) -> tuple[str, str] | None:
        """A member that is a proper prefix of another member (shortest first), as text; None if none."""
        return self.chars.prefix_example()

    def longest_path(self) -> int | None:
        """Most tokens any accepted sequence has; None when unbounded (a cycle)."""
        depth = _longest(self.n_states, lambda s: self.targets[s].tolist())
        if depth is None:
            return None
        return max(depth[s] for s in range(self.n_states) if self.accepting[s]) if self.accepting.any() else 0

    def sequence_count(self, max_len: int | None, *, eos: bool) -> int | None:
        """Number of accepted token sequences (``eos``: each followed by eos) of at most ``max_len`` tokens,
        eos included; None when infinite."""
        if max_len is None and self.longest_path() is None:
            return None
        steps = max_len - (1 if eos else 0) if max_len is not None else self.longest_path()
        counts = {0: 1}
        total = 1 if self.accepting[0] else 0
        for _ in range(max(steps, 0)):
            nxt: dict[int, int] = {}
            for state, count in counts.items():
                for target in self.targets[state].tolist():
                    nxt[target] = nxt.get(target, 0) + count
            counts = nxt
            total += sum(c for s, c in counts.items() if self.accepting[s])
            if not counts:
                break
        return total

    def language_size(self) -> float | int:
        """Number of strings in the pattern's language (``math.inf`` when infinite), whatever the vocabulary
        or a length cap."""
        return self.chars.size()


def _coaccessible(transitions: dict[int, dict[int, int]], finals: set[int]) -> set[int]:
    """States from which an accepting state can be reached."""
    reverse: dict[int, set[int]] = {}
    for state, edges in transitions.items():
        for target in edges.values():
            reverse.setdefault(target, set()).add(state)
    live, queue = set(finals), deque(finals)
    while queue:
        for source in reverse.get(queue.popleft(), ()):
            if source not in live:
                live.add(source)
                queue.append(source)
    return live


def _reachable_order(transitions, initial: int, live: set[int]) -> list[int]:
    """Live states reachable from ``initial``, breadth first (the initial state first)."""
    order, seen, queue = [initial], {initial}, deque([initial])
    while queue:
        for _, target in sorted(transitions.get(queue.popleft(), {}).items()):
            if target in live and target not in seen:
                seen.add(target)
                order.append(target)
                queue.append(target)
    return order


# Unicode scalar values (code points that are not surrogates): the characters a string can hold.
_UNICODE_SCALARS = 0x110000 - 0x800


class _CharAutomaton:
    """The pattern's deterministic automaton over characters (``interegular``): states, finals, and
    ``step(state, char)``."""

    def __init__(self, fsm) -> None:
        from interegular.fsm import anything_else

        self.initial = fsm.initial
        self.finals = set(fsm.finals)
        self.map = {state: dict(moves) for state, moves in fsm.map.items()}
        self._alphabet = fsm.alphabet
        self._other = anything_else
        listed = [ch for ch in fsm.alphabet.keys() if ch is not anything_else]
        self._listed = set(listed)
        self._symbols = {ch: fsm.alphabet[ch] for ch in listed}
        self._other_symbol = fsm.alphabet[anything_else] if anything_else in fsm.alphabet.keys() else None
        self._prefixes: dict = {}       # state -> proper UTF-8 prefixes of the characters it allows
        # How many characters each symbol stands for (anything_else: every character not listed).
        self.class_size = {}
        self.example = {}
        for symbol, members in fsm.alphabet.by_transition.items():
            named = [ch for ch in members if ch is not anything_else]
            others = _UNICODE_SCALARS - len(listed) if any(ch is anything_else for ch in members) else 0
            self.class_size[symbol] = len(named) + others
            self.example[symbol] = min(named) if named else self._unlisted()

    @classmethod
    def parse(cls, pattern: str, description: str) -> "_CharAutomaton":
        interegular = _interegular()
        _refuse_unsupported(pattern, description)
        try:
            fsm = interegular.parse_pattern(pattern).to_fsm()
        except Exception as exc:       # interegular's InvalidSyntax / Unsupported and parser errors
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise InputError(f"invalid {description}: {reason}") from None
        return cls(fsm)

    def _unlisted(self) -> str:
        code = 0x21
        while chr(code) in self._listed:
            code += 1
        return chr(code)

    def step(self, state, char: str):
        """The state after ``char``, or None when the pattern cannot continue with it."""
        return self.map.get(state, {}).get(self._symbols.get(char, self._other_symbol))

    def may_start(self, state, partial: bytes) -> bool:
        """Whether some character the pattern allows after ``state`` begins with the bytes ``partial``."""
        moves = self.map.get(state, {})
        if self._other_symbol in moves:
            return True                 # some character outside the listed ones may complete it
        prefixes = self._prefixes.get(state)
        if prefixes is None:
            prefixes = self._prefixes[state] = {
                ch.encode("utf-8")[:n] for ch, symbol in self._symbols.items() if symbol in moves
                for n in range(1, len(ch.encode("utf-8")))}
        return partial in prefixes

    def _live(self) -> set:
        reverse: dict = {}
        for state, moves in self.map.items():
            for target in moves.values():
                reverse.setdefault(target, set()).add(state)
        live, queue = set(self.finals), deque(self.finals)
        while queue:
            for source in reverse.get(queue.popleft(), ()):
                if source not in live:
                    live.add(source)
                    queue.append(source)
        return live

    def empty(self) -> bool:
        return self.initial not in self._live()

    def size(self) -> float | int:
        """Number of strings accepted (``math.inf`` when infinite)."""
        live = self._live()
        if self.initial not in live:
            return 0
        states = sorted(live, key=repr)
        number = {state: i for i, state in enumerate(states)}
        succ = [[number[t] for t in self.map.get(state, {}).values() if t in live] for state in states]
        order = _topological(len(states), lambda i: succ[i])
        if order is None:
            return float("inf")
        paths = [0] * len(states)
        for i in reversed(order):
            state = states[i]
            paths[i] = (1 if state in self.finals else 0) + sum(
                self.class_size[symbol] * paths[number[t]] for symbol, t in self.map.get(state, {}).items() if t in live)
        return paths[number[self.initial]]

    def prefix_example(self) -> tuple[str, str] | None:
        """The shortest member that is a proper prefix of another member, and the shortest such other."""
        live = self._live()
        seen = {self.initial: ""}
        queue = deque([self.initial])
        while queue:
            state = queue.popleft()
            moves = sorted((self.example[sym], t) for sym, t in self.map.get(state, {}).items() if t in live)
            if state in self.finals and moves:
                return seen[state], self._shortest_final(moves, seen[state], live)
            for char, target in moves:
                if target not in seen:
                    seen[target] = seen[state] + char
                    queue.append(target)
        return None

    def _shortest_final(self, moves, prefix: str, live: set) -> str:
        queue = deque((t, prefix + ch) for ch, t in moves)
        visited = set()
        while queue:
            state, text = queue.popleft()
            if state in self.finals:
                return text
            if state in visited:
                continue
            visited.add(state)
            queue.extend((t, text + self.example[sym]) for sym, t in self.map.get(state, {}).items() if t in live)
        return prefix


def _token_trie(pieces: Sequence[bytes | None]) -> dict:
    """A byte trie of the vocabulary: ``{byte: child}``, with the token ids ending at a node under key -1."""
    root: dict = {}
    for token, piece in enumerate(pieces):
        if not piece:
            continue
        node = root
        for byte in piece:
            node = node.setdefault(byte, {})
        node.setdefault(-1, []).append(token)
    return root


def _utf8_length(lead: int) -> int:
    """Bytes of the UTF-8 character that starts with ``lead`` (0: not a valid lead byte)."""
    if lead < 0x80:
        return 1
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0


def _walk_trie(trie: dict, chars: _CharAutomaton, start: tuple) -> list[tuple[int, tuple]]:
    """``(token, state after it)`` for every token whose bytes the pattern can read from ``start`` (a
    character state and the bytes of an unfinished character), walking the vocabulary trie depth first and
    abandoning a branch as soon as the pattern dies on it (an unfinished character as soon as no character
    the pattern allows there begins with its bytes)."""
    out = []
    stack = [(trie, start[0], start[1])]
    while stack:
        node, state, pending = stack.pop()
        for byte, child in node.items():
            if byte == -1:
                continue
            if not pending and byte < 0x80:
                nxt, rest = chars.step(state, chr(byte)), b""
                if nxt is None:
                    continue
            else:
                data = pending + bytes((byte,))
                need = _utf8_length(data[0])
                if need == 0 or (pending and not 0x80 <= byte <= 0xBF):
                    continue
                if len(data) < need:
                    if not chars.may_start(state, data):
                        continue
                    nxt, rest = state, data
                else:
                    try:
                        char = data.decode("utf-8")
                    except UnicodeDecodeError:      # overlong or surrogate encodings
                        continue
                    nxt, rest = chars.step(state, char), b""
                    if nxt is None:
                        continue
            for token in child.get(-1, ()):
                out.append((token, (nxt, rest)))
            stack.append((child, nxt, rest))
    return out
def _topological(n: int, successors) -> list[int] | None:
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


def _longest(n: int, successors) -> list[int] | None:
    """Longest path (in edges) from node 0 to each node; None when a cycle makes it unbounded."""
    order = _topological(n, successors)
    if order is None:
        return None
    depth = [-(10 ** 9)] * n
    depth[0] = 0
    for i in order:
        for j in successors(i):
            depth[j] = max(depth[j], depth[i] + 1)
    return depth
