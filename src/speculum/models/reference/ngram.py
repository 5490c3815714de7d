"""A smoothed token-id n-gram model: exact, normalised, every token possible, counts updatable online.

Smoothing is *interpolated* (every order mixes with the one below, down to the uniform distribution):

    P(w | h) = (c(h, w) + α(h) · P(w | h')) / (c(h) + α(h)),      P(w | ()) mixes with 1 / V,

where ``h'`` drops the oldest token of ``h``, ``c`` are counts and ``α(h)`` is

* ``"witten-bell"`` (default): the number of distinct tokens seen after ``h`` (Witten & Bell 1991;
  Chen & Goodman 1998 §2.4) — contexts followed by many different tokens trust the lower order more;
* ``"dirichlet"``: a constant ``concentration`` (MacKay & Peto 1995's Dirichlet prior), the
  interpolated form of add-k smoothing.

A context never seen uses its lower order unchanged. Each row sums to one exactly (up to float
rounding) and is strictly positive, so the model is a valid target or draft for exact verification.

Example:
    >>> model = NGramModel.fit([[0, 1, 2, 0, 1, 2]], n=3, vocab_size=4)
    >>> int(model.next_logprobs([[0, 1]]).argmax())
    2
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np

from ...validation import InputError, check_int, check_number
from ..base import BaseModel, check_token_ids

__all__ = ["NGramModel", "NGramSession", "SMOOTHINGS"]

SMOOTHINGS = ("witten-bell", "dirichlet")
# Row cache budget: rows are vocab_size floats, so the row count adapts to the vocabulary.
DEFAULT_ROW_CACHE_BYTES = 64 * 2**20
MAX_DEFAULT_CACHED_ROWS = 4096


class NGramModel(BaseModel):
    """Interpolated n-gram model over token ids (exact log-probs of the smoothed estimate).

    Args:
        n: order (1 = unigram; the context is the last ``n - 1`` tokens, fewer at the start).
        vocab_size: number of token ids.
        smoothing: ``"witten-bell"`` or ``"dirichlet"`` (see the module docstring).
        concentration: ``α`` for ``"dirichlet"`` smoothing (> 0).
        max_cached_rows: rows kept in the LRU row cache (each is ``vocab_size`` floats); default
            fits 64 MiB (at most 4096 rows); 0 disables caching.
        bos_token_id / eos_token_id: optional special ids (an empty prompt is allowed regardless:
            it gets the lower-order distribution).

    Counts change only through :meth:`update`; rows computed earlier (e.g. returned by a session's
    ``extend``) reflect the counts at the time they were computed, and later calls reflect the new
    counts. Build with :meth:`fit`.
    """

    accepts_empty_prompt = True

    def __init__(
        self,
        n: int,
        vocab_size: int,
        *,
        smoothing: str = "witten-bell",
        concentration: float = 1.0,
        max_cached_rows: int | None = None,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        self.n, self.vocab_size = check_int(n, "n", minimum=1), check_int(vocab_size, "vocab_size", minimum=1)
        if smoothing not in SMOOTHINGS:
            raise InputError(f"smoothing must be one of {SMOOTHINGS}, got {smoothing!r}")
        self.smoothing = smoothing
        self.concentration = check_number(concentration, "concentration", above=0)
        if max_cached_rows is None:
            max_cached_rows = min(MAX_DEFAULT_CACHED_ROWS, max(8, DEFAULT_ROW_CACHE_BYTES // (8 * self.vocab_size)))
        self.max_cached_rows = check_int(max_cached_rows, "max_cached_rows", minimum=0)
        for name, tok in (("bos_token_id", bos_token_id), ("eos_token_id", eos_token_id)):
            if tok is not None:
                check_token_ids([tok], self.vocab_size, name=name)
        self.bos_token_id, self.eos_token_id = bos_token_id, eos_token_id
        # context tuple (length 0 .. n-1) -> {next token: count}, and the summed count per context.
        self._counts: dict[tuple[int, ...], dict[int, int]] = {}
        self._totals: dict[tuple[int, ...], int] = {}
        self._rows: OrderedDict[tuple[int, ...], np.ndarray] = OrderedDict()  # context -> (V,) probabilities

    @classmethod
    def fit(cls, sequences: Sequence[Sequence[int]], n: int, vocab_size: int, **options) -> "NGramModel":
        """Count every n-gram (and all lower orders) of ``sequences``; ``options`` go to the constructor.

        Example:
            >>> NGramModel.fit([[1, 2, 3], [1, 2]], n=2, vocab_size=5, smoothing="dirichlet").n
            2
        """
        model = cls(n, vocab_size, **options)
        for seq in sequences:
            model.update(seq)
        return model

    def update(self, sequence: Sequence[int], *, start: int = 0) -> None:
        """Add the counts of ``sequence[start:]``, each token counted with up to ``n - 1`` tokens before it.

        ``start`` lets an online draft add only newly generated tokens while still using the earlier
        tokens as their context. Clears the row cache (rows depend on the counts).
        """
        tokens = check_token_ids(sequence, self.vocab_size, name="sequence")
        if not 0 <= start <= len(tokens):
            raise InputError(f"start must be in [0, {len(tokens)}], got {start}")
        for i in range(start, len(tokens)):
            token = tokens[i]
            for k in range(min(self.n - 1, i) + 1):
                context = tuple(tokens[i - k:i])
                following = self._counts.setdefault(context, {})
                following[token] = following.get(token, 0) + 1
                self._totals[context] = self._totals.get(context, 0) + 1
        if len(tokens) > start:
            self._rows.clear()

    # ------------------------------------------------------------------------------------- rows
    def _context(self, tokens: Sequence[int]) -> tuple[int, ...]:
        return tuple(tokens[max(0, len(tokens) - self.n + 1):]) if self.n > 1 else ()

    def _alpha(self, context: tuple[int, ...]) -> float:
        return float(len(self._counts[context])) if self.smoothing == "witten-bell" else self.concentration

    def context_order(self, tokens: Sequence[int]) -> int:
        """Length of the longest suffix of ``tokens`` (at most ``n - 1``) that has been seen as a context."""
        context = self._context(tokens)
        for k in range(len(context), 0, -1):
            if context[len(context) - k:] in self._counts:
                return k
        return 0

    def _prob_row(self, context: tuple[int, ...]) -> np.ndarray:
        cached = self._rows.get(context)
        if cached is not None:
            self._rows.move_to_end(context)
            return cached
        if context:
            lower = self._prob_row(context[1:])
        else:
            lower = np.full(self.vocab_size, 1.0 / self.vocab_size)
            lower.setflags(write=False)
        following = self._counts.get(context)
        if not following:
            row = lower  # an unseen context backs off entirely
        else:
            alpha = self._alpha(context)
            row = alpha * lower
            row[np.fromiter(following.keys(), dtype=np.int64, count=len(following))] += np.fromiter(
                following.values(), dtype=np.float64, count=len(following))
            row /= self._totals[context] + alpha
            row.setflags(write=False)
        if self.max_cached_rows:
            self._rows[context] = row
            if len(self._rows) > self.max_cached_rows:
                self._rows.popitem(last=False)
        return row

    def next_probabilities(self, tokens: Sequence[int]) -> np.ndarray:
        """``(vocab,)`` exact next-token probabilities after ``tokens`` (a cached, read-only array)."""
        return self._prob_row(self._context(check_token_ids(tokens, self.vocab_size, name="tokens")))

    def _prob(self, context: tuple[int, ...], token: int) -> float:
        """Scalar P(token | context) by the same recursion, without building rows (for scoring)."""
        prob = 1.0 / self.vocab_size
        for k in range(len(context) + 1):
            suffix = context[len(context) - k:]
            following = self._counts.get(suffix)
            if not following:
                break  # every longer suffix is unseen too: each occurrence counts all its suffixes
            alpha = self._alpha(suffix)
            prob = (following.get(token, 0) + alpha * prob) / (self._totals[suffix] + alpha)
        return prob

    # ------------------------------------------------------------------------------------- protocol
    def start(self, prompt: Sequence[int]) -> "NGramSession":
        """A session after ``prompt`` (may be empty); rows are computed from the counts at call time."""
        return NGramSession(self, prompt)

    def next_logprobs(self, prefixes: Sequence[Sequence[int]]) -> np.ndarray:
        """``(batch, vocab)`` exact log-probs of the smoothed model after each prefix.

        Example:
            >>> NGramModel.fit([[0, 1]], n=2, vocab_size=3).next_logprobs([[], [0]]).shape
            (2, 3)
        """
        rows = [self._prob_row(self._context(check_token_ids(p, self.vocab_size, name="prefix"))) for p in prefixes]
        return np.log(np.stack(rows)) if rows else np.zeros((0, self.vocab_size))

    def score_sequences(self, sequences: Sequence[Sequence[int]], prompt: Sequence[int] = ()) -> np.ndarray:
        """``(batch,)`` exact log p(sequence | prompt) (scalar recursion per token; no rows built)."""
        context = check_token_ids(prompt, self.vocab_size, name="prompt")
        out = np.zeros(len(sequences))
        for b, seq in enumerate(sequences):
            tokens = context + check_token_ids(seq, self.vocab_size, name="sequence")
            width = self.n - 1
            out[b] = sum(np.log(self._prob(tuple(tokens[max(0, i - width):i]) if width else (), tokens[i]))
                         for i in range(len(context), len(tokens)))
        return out


class NGramSession:
    """Session of an n-gram model: the state is the token list, so rollback is free.

    Rows reflect the model's counts when they are computed: after ``model.update``, rows already
    returned stay as they were and later ``extend`` / ``next_logprobs`` calls use the new counts.
    """

    def __init__(self, model: NGramModel, prompt: Sequence[int]) -> None:
        self.model = model
        self.tokens: list[int] = check_token_ids(prompt, model.vocab_size, name="prompt")

    @property
    def length(self) -> int:
        return len(self.tokens)

    def next_logprobs(self) -> np.ndarray:
        """``(vocab,)`` exact log-probs after the current tokens."""
        return np.log(self.model._prob_row(self.model._context(self.tokens)))

    def extend(self, tokens: Sequence[int]) -> np.ndarray:
        """Consume ``tokens``; returns ``(len(tokens), vocab)`` exact rows (row j after ``tokens[j]``)."""
        tokens = check_token_ids(tokens, self.model.vocab_size, name="tokens")
        rows = []
        for t in tokens:
            self.tokens.append(t)
            rows.append(self.model._prob_row(self.model._context(self.tokens)))
        return np.log(np.stack(rows)) if rows else np.zeros((0, self.model.vocab_size))

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` tokens (free)."""
        if not 0 <= n <= len(self.tokens):
            raise InputError(f"rollback({n}) on a session of length {len(self.tokens)}")
        if n:
            del self.tokens[-n:]
