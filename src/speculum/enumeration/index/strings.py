"""String mode: the strings of a constraint's language in exact descending probability, each scored over
all the token sequences that spell it.

A string ``s`` has probability ``P(s) = sum of p(t)`` over every token sequence ``t`` whose text is ``s``
(followed by eos when the index has one): the canonical tokenization is rarely the only one with mass. The
token index (exact order of token sequences) supplies the evidence, and two bounds make the string order
exact:

* every tokenization of ``s`` the token index has not certified is below its certified budget ``tau``, so
  ``P(s) <= known(s) + (N(s) - known count) * e^tau`` where ``N(s)`` is the number of tokenizations of ``s``;
* a string with no certified tokenization has ``P(s) < N_max * e^tau``, where ``N_max`` bounds ``N(s)`` over
  the whole language (a dynamic programme over the token automaton: :func:`max_tokenizations`).

A string is placed only when its exact score (all its tokenizations scored by one batched teacher-forcing
call) is above every bound of the strings that could still pass it; strings whose brackets already decide
a query are never scored. Every returned log-prob is exact, every order exact, ``mass_above`` is a sound
bracket. The cost is the token index built ``log2 N_max`` bits below the answer: cheap when strings have
few tokenizations (numbers, codes), expensive for long free text.

Example:
    >>> from speculum.models import MarkovModel
    >>> from speculum.enumeration import AutoregressiveEnumerable, Regex
    >>> vocab = ["7", "8", "77", "x", "y", "xy"]
    >>> ar = AutoregressiveEnumerable(MarkovModel.random(6, seed=0), constraint=Regex("(7|8){2}", vocabulary=vocab),
    ...                               strings=True)
    >>> text, log_prob = ar.unrank(0)
    >>> ar.rank(text)
    0
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ...validation import InputError, check_int, check_logprob
from .seek_index import SeekIndex
from .support import SupportAttributes

__all__ = ["StringIndex", "max_tokenizations", "DEFAULT_MAX_TOKENIZATIONS"]

# Most tokenizations one string may have (all are scored to give its exact probability).
DEFAULT_MAX_TOKENIZATIONS = 4096
# Relative slack on bracket decisions: tree sums and teacher-forced scores may differ in the last bits.
_SLACK = 1e-9


def max_tokenizations(automaton, *, max_len: int | None, eos: bool) -> float:
    """An upper bound on the number of token sequences (at most ``max_len`` tokens, eos included) that spell
    one member of ``automaton``'s language, maximised over the members; ``inf`` when unbounded.

    From a state ``q``, a string's tokenizations split by the byte length of their first token, and for a
    given length the first token's bytes are fixed by the string; so ``F(q) = [q accepts] + sum over lengths
    l of max over the l-byte tokens x allowed at q of mult(x) * F(next(q, x))`` bounds the count of every
    string from ``q`` (``mult``: tokens with the same bytes)."""
    pieces = automaton.token_bytes
    lengths = np.array([len(p) if p else 0 for p in pieces], dtype=np.int64)
    multiplicity = {}
    for p in pieces:
        if p:
            multiplicity[p] = multiplicity.get(p, 0) + 1
    mult = np.array([multiplicity.get(p, 0) if p else 0 for p in pieces], dtype=np.float64)
    steps = automaton.longest_path()
    if steps is None:
        if max_len is None:
            return math.inf
        steps = max_len - (1 if eos else 0)
    elif max_len is not None:
        steps = min(steps, max_len - (1 if eos else 0))
    # F_k is needed only at states within steps - k tokens of the start: building the moves of the states
    # within steps - 1 tokens suffices, and a state beyond them keeps F = [accepts], which no needed value reads.
    expanded = automaton.explore(max(steps, 0))
    accept = automaton.accepting.astype(np.float64)
    bound = accept.copy()                       # F with 0 tokens left
    for _ in range(max(steps, 0)):
        nxt = accept.copy()
        for state in expanded:
            tokens, targets = automaton.moves(state)
            if not len(tokens):
                continue
            weight = mult[tokens] * bound[targets]
            best = np.zeros(int(lengths[tokens].max()) + 1)
            np.maximum.at(best, lengths[tokens], weight)
            nxt[state] += best.sum()
        bound = nxt
    return float(bound[0])


class StringIndex(SupportAttributes):
    """The strings of a constrained token index's language, in exact descending probability over all their
    tokenizations (ties: smaller UTF-8 bytes first). Items are ``(text, log P(text))``.

    Exact: ``top_k``, ``slice``, ``unrank``, ``rank``, ``count``, ``threshold`` (every returned log-prob is the
    exact log of the sum over all tokenizations, scored by teacher forcing). Certified: ``mass_above`` (a
    sound bracket). Built by ``AutoregressiveEnumerable(..., constraint=..., strings=True)``.
    """

    order_error = 0.0

    def __init__(self, token_index: SeekIndex, *, max_tokenizations_per_string: int = DEFAULT_MAX_TOKENIZATIONS
                 ) -> None:
        support = token_index.support
        if support.constraint is None:
            raise InputError("string mode needs a constraint (Regex or Choices)")
        if token_index.capped:
            raise InputError("string mode needs the whole support: branch_cap is not allowed")
        self.token_index = token_index
        self.support, self.prompt, self.vocab_size = support, token_index.prompt, token_index.vocab_size
        self.automaton = support.constraint
        self.max_tokenizations = check_int(max_tokenizations_per_string, "max_tokenizations_per_string", minimum=1)
        bound = max_tokenizations(self.automaton, max_len=support.max_len, eos=support.eos is not None)
        if not math.isfinite(bound):
            raise InputError(f"string mode needs a bound on the tokens of a string: the {self.automaton.description}"
                             " is unbounded; pass max_len")
        self.log_max_tokenizations = math.log(max(bound, 1.0))
        by_bytes: dict[bytes, list[int]] = {}
        for token, piece in enumerate(self.automaton.token_bytes):
            if piece and token != support.eos:
                by_bytes.setdefault(bytes(piece), []).append(token)
        self._by_bytes = by_bytes
        self._longest_piece = max(len(p) for p in by_bytes)
        self._exact: dict[bytes, float] = {}          # exact log P(string), scored so far

    @property
    def forwards(self) -> int:
        return self.token_index.forwards

    @property
    def complete(self) -> bool:
        return self.token_index.complete

    # ------------------------------------------------------------------------------------ tokenizations
    def tokenizations(self, text: str | bytes) -> list[tuple[int, ...]]:
        """Every token sequence of the support that spells ``text`` (eos appended when the support has one),
        in lexicographic order. ``InputError`` when there are more than ``max_tokenizations``."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        eos = self.support.eos
        cap = self.support.max_len
        limit = None if cap is None else cap - (1 if eos is not None else 0)
        found: list[tuple[int, ...]] = []
        automaton = self.automaton

        def walk(position: int, state: int, tokens: list[int]) -> None:
            if position == len(data):
                if automaton.accepting[state]:
                    found.append(tuple(tokens) + ((eos,) if eos is not None else ()))
                    if len(found) > self.max_tokenizations:
                        raise InputError(f"{data.decode('utf-8', 'replace')!r} has more than "
                                         f"{self.max_tokenizations} tokenizations; raise max_tokenizations_per_string")
                return
            if limit is not None and len(tokens) >= limit:
                return
            for size in range(1, min(self._longest_piece, len(data) - position) + 1):
                for token in self._by_bytes.get(data[position:position + size], ()):
                    nxt = int(automaton.advance(np.array([state]), np.array([token]))[0])
                    if nxt >= 0:
                        tokens.append(token)
                        walk(position + size, nxt, tokens)
                        tokens.pop()

        walk(0, 0, [])
        return sorted(found)

    def score(self, texts: Sequence[str | bytes]) -> np.ndarray:
        """``(n,)`` exact ``log P(text)``: the log-sum-exp of every tokenization's teacher-forced score, all
        strings in one batched call (cached). ``-inf`` for a string of the language no token sequence of the
        support spells."""
        keys = [t.encode("utf-8") if isinstance(t, str) else bytes(t) for t in texts]
        todo = [k for k in dict.fromkeys(keys) if k not in self._exact]
        if todo:
            spelled = [self.tokenizations(k) for k in todo]
            flat = [seq for seqs in spelled for seq in seqs]
            scores = self.token_index.score_sequences(flat) if flat else np.zeros(0)
            at = 0
            for key, seqs in zip(todo, spelled):
                part = np.asarray(scores[at:at + len(seqs)], dtype=np.float64)
                at += len(seqs)
                self._exact[key] = _logsumexp(part)
        return np.array([self._exact[k] for k in keys], dtype=np.float64)

    # ---------------------------------------------------------------------------------------- evidence
    def _groups(self) -> tuple[dict[bytes, tuple[float, int]], float]:
        """``{string: (log of its certified tokenizations' mass, how many)}`` and the certified budget."""
        index = self.token_index
        ids = np.arange(len(index.leaf_lp))
        tokens = index.tokens_of(ids) if len(ids) else np.zeros((0, 0), dtype=np.int64)
        eos = self.support.eos
        mass: dict[bytes, list[float]] = {}
        pieces = self.automaton.token_bytes
        for row, lp in zip(tokens.tolist(), index.leaf_lp.tolist()):
            text = b"".join(pieces[t] for t in row if t >= 0 and t != eos)
            mass.setdefault(text, []).append(lp)
        groups = {text: (_logsumexp(np.array(lps)), len(lps)) for text, lps in mass.items()}
        return groups, index.certified_logprob

    def _upper(self, text: bytes, lo: float, known: int, tau: float) -> float:
        """Upper end of ``log P(text)`` given its certified tokenizations."""
        if text in self._exact:
            return self._exact[text]
        if tau == -math.inf:
            return lo
        missing = len(self.tokenizations(text)) - known
        if missing <= 0:
            return lo
        return float(np.logaddexp(lo, math.log(missing) + tau))

    def _unseen_upper(self, tau: float) -> float:
        """Upper bound on ``log P`` of a string with no certified tokenization."""
        return -math.inf if tau == -math.inf else self.log_max_tokenizations + tau

    def _deepen(self, target: float | None) -> bool:
        """Certify the token index down to ``target`` (None: about twice as many token sequences); False when
        nothing is left to certify."""
        index = self.token_index
        if index.tree.exhausted:
            return False
        if target is None or target >= index.certified_logprob:
            index.grow_to_count(2 * len(index.leaf_lp) + 1)
        else:
            index.grow_to_logprob(target)
        return True

    def _top(self, needed: int) -> list[tuple[bytes, float]]:
        """The ``needed`` most probable strings (fewer when the language has fewer), exactly ordered."""
        self.token_index.grow_to_count(needed)
        while True:
            groups, tau = self._groups()
            # A scored string counts at its exact score, the value its contention is judged by: a float32
            # model's tree sums differ from teacher forcing by ~1e-7, far more than _SLACK.
            lows = sorted((self._exact.get(t, lo) for t, (lo, _) in groups.items()), reverse=True)
            kth_low = lows[needed - 1] if len(lows) >= needed else -math.inf
            floor = kth_low - _SLACK * (1.0 + abs(kth_low)) if math.isfinite(kth_low) else -math.inf
            contenders = [t for t, (lo, n) in groups.items() if self._upper(t, lo, n, tau) >= floor]
            exact = self.score(contenders)
            ranked = sorted(zip(contenders, exact.tolist()), key=lambda item: (-item[1], item[0]))
            ranked = [item for item in ranked if item[1] > -math.inf]
            unseen = self._unseen_upper(tau)
            if len(ranked) >= needed and ranked[needed - 1][1] > unseen + _SLACK * (1.0 + abs(unseen)):
                return ranked[:needed]
            target = None
            if len(ranked) >= needed:
                kth = ranked[needed - 1][1]
                target = kth - self.log_max_tokenizations - 2 * _SLACK * (1.0 + abs(kth))
            if not self._deepen(target):
                if tau != -math.inf:
                    continue          # exhausted just now: one more pass over the whole language
                return ranked[:needed]

    def _decide(self, log_prob: float, groups, tau: float, *, text: bytes | None = None
                ) -> list[tuple[bytes, float, float]]:
        """``(string, lower, upper)`` of every certified string at or above ``log_prob`` (strictly before
        ``text`` in the order when ``text`` is given), scoring exactly only the strings whose brackets
        straddle it."""
        slack = _SLACK * (1.0 + abs(log_prob))
        above = []
        straddling = []
        for candidate, (lo, n) in groups.items():
            if candidate == text:
                continue
            hi = self._upper(candidate, lo, n, tau)
            if candidate in self._exact:
                lo = hi
            if lo > log_prob + slack:
                above.append((candidate, lo, hi))
            elif hi >= log_prob - slack:
                straddling.append(candidate)
        for candidate, exact in zip(straddling, self.score(straddling).tolist()):
            before = exact > log_prob or (exact == log_prob and (text is None or candidate < text))
            if before or (text is None and exact >= log_prob):
                above.append((candidate, exact, exact))
        return above

    def _certify_to(self, log_prob: float) -> None:
        """Certify the token index deep enough that no unseen string reaches ``log_prob``."""
        target = log_prob - self.log_max_tokenizations - 2 * _SLACK * (1.0 + abs(log_prob))
        if target < self.token_index.certified_logprob:
            self._deepen(target)

    # ---------------------------------------------------------------------------------------- queries
    def top_k(self, k: int) -> list[tuple[str, float]]:
        """The ``k`` most probable strings with exact log-probs, descending. Exact."""
        k = check_int(k, "k", minimum=0)
        return [(_text(t), lp) for t, lp in self._top(k)] if k else []

    def slice(self, start: int, k: int) -> list[tuple[str, float]]:
        """Strings of ranks ``start .. start+k-1``. Exact."""
        start, k = check_int(start, "start", minimum=0), check_int(k, "k", minimum=0)
        return [(_text(t), lp) for t, lp in self._top(start + k)[start:]] if k else []

    def unrank(self, i: int) -> tuple[str, float]:
        """The ``i``-th most probable string (0-based) and its exact log-prob. Exact."""
        i = check_int(i, "i", minimum=0)
        top = self._top(i + 1)
        if len(top) <= i:
            raise IndexError(f"rank {i} is beyond the language: it has {len(top)} strings with positive probability")
        return _text(top[i][0]), top[i][1]

    def threshold(self, k: int) -> float:
        """Exact log-prob of the ``k``-th most probable string (``k >= 1``). Exact."""
        k = check_int(k, "k", minimum=1)
        return self.unrank(k - 1)[1]

    def rank(self, text: str) -> int:
        """Number of strings before ``text`` (more probable, or tied and smaller). Exact.

        ``InputError`` when ``text`` is not a member of the language or no token sequence spells it."""
        key = self._member(text)
        log_prob = float(self.score([key])[0])
        self._certify_to(log_prob)
        groups, tau = self._groups()
        return len(self._decide(log_prob, groups, tau, text=key))

    def log_prob(self, text: str) -> float:
        """Exact ``log P(text)`` over all its tokenizations."""
        return float(self.score([self._member(text)])[0])

    def count(self, min_log_prob: float) -> int:
        """Number of strings with ``log P >= min_log_prob``. Exact."""
        min_log_prob = check_logprob(min_log_prob)
        self._certify_to(min_log_prob)
        groups, tau = self._groups()
        return len(self._decide(min_log_prob, groups, tau))

    def mass_above(self, min_log_prob: float) -> tuple[float, float]:
        """Sound ``(lo, hi)`` bracket on the total probability of the strings with ``log P >= min_log_prob``.
        Certified."""
        min_log_prob = check_logprob(min_log_prob)
        self._certify_to(min_log_prob)
        groups, tau = self._groups()
        above = self._decide(min_log_prob, groups, tau)
        lo = math.fsum(math.exp(lo) for _, lo, _ in above)
        hi = math.fsum(math.exp(hi) for _, _, hi in above)
        return lo * (1.0 - 1e-12), min(hi * (1.0 + 1e-9), 1.0)

    def size(self) -> int | float:
        """Number of strings in the language (``math.inf`` when infinite)."""
        return self.automaton.language_size()

    def mass(self, **options) -> tuple[float, float]:
        """Sound bracket on the probability of the whole language (every tokenization of every member):
        the token index's ``mass``. Certified."""
        return self.token_index.mass(**options)

    def score_sequences(self, sequences):
        return self.token_index.score_sequences(sequences)

    def _member(self, text: str) -> bytes:
        if not isinstance(text, (str, bytes)):
            raise InputError(f"a string-mode item is text, got {type(text).__name__}")
        key = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        if not self.tokenizations(key):
            raise InputError(f"{_text(key)!r} is not a member of the {self.automaton.description} that this "
                             "vocabulary can spell within the support")
        return key


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _logsumexp(values: np.ndarray) -> float:
    values = np.asarray(values, dtype=np.float64)
    if not len(values) or not np.isfinite(values).any():
        return -math.inf
    top = float(values.max())
    return top + math.log(math.fsum(np.exp(values - top).tolist()))
