"""Markov chains of order 1 or 2 from explicit logits: the smallest exact model, for brute-force checks."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ...validation import InputError
from ..base import BaseModel, Capabilities, Feed, check_logits, check_session_blocks, check_token_ids, log_softmax

__all__ = ["MarkovModel"]


class MarkovSession:
    """Session of a Markov chain: the state is just the token list (rollback is free)."""

    def __init__(self, model: "MarkovModel", prompt: Sequence[int]) -> None:
        self.model = model
        self.tokens = check_token_ids(prompt, model.vocab_size, name="prompt")

    @property
    def length(self) -> int:
        return len(self.tokens)

    def next_logprobs(self) -> np.ndarray:
        return self.model._row(self.tokens)

    def extend(self, tokens: Sequence[int]) -> np.ndarray:
        tokens = check_token_ids(tokens, self.model.vocab_size, name="tokens")
        rows = []
        for t in tokens:
            self.tokens.append(t)
            rows.append(self.model._row(self.tokens))
        return np.stack(rows) if rows else np.zeros((0, self.model.vocab_size))

    def rollback(self, n: int) -> None:
        if not 0 <= n <= len(self.tokens):
            raise InputError(f"rollback({n}) on a session of length {len(self.tokens)}")
        if n:
            del self.tokens[-n:]


class MarkovModel(BaseModel):
    """Markov chain of order 1 or 2 over token ids, from logits (exact).

    Args:
        transition_logits: ``(V, V)`` for order 1 (``[prev, next]``) or ``(V, V, V)`` for order 2
            (``[prev2, prev1, next]``). ``-inf`` marks an impossible transition.
        initial_logits: ``(V,)`` distribution of the first token (an empty prefix is allowed).
        order: 1 or 2. With order 2 and a single context token ``x``, row ``[x, x]`` is used.
        eos_token_id: optional end-of-sequence id (for eos-terminated enumeration and decoding).

    Example:
        >>> rng = np.random.default_rng(0)
        >>> m = MarkovModel(rng.normal(size=(4, 4)), rng.normal(size=4))
        >>> m.next_logprobs([[], [2]]).shape
        (2, 4)
    """

    accepts_empty_prompt = True
    # Several sessions' blocks in one call (``extend_sessions``): the decoding scheduler verifies them so.
    capabilities = Capabilities(batched_extend=True)

    def __init__(
        self,
        transition_logits: np.ndarray,
        initial_logits: np.ndarray | None = None,
        order: int = 1,
        *,
        eos_token_id: int | None = None,
    ) -> None:
        if order not in (1, 2):
            raise InputError(f"order must be 1 or 2, got {order}")
        trans = check_logits(transition_logits, name="transition_logits")
        if trans.ndim != order + 1 or len(set(trans.shape)) != 1:
            raise InputError(
                f"transition_logits must be square with {order + 1} axes for order {order}, got shape {trans.shape}"
            )
        self.vocab_size = int(trans.shape[-1])
        if initial_logits is None:
            initial_logits = np.zeros(self.vocab_size)
        init = check_logits(initial_logits, name="initial_logits")
        if init.shape != (self.vocab_size,):
            raise InputError(f"initial_logits must have shape ({self.vocab_size},), got {init.shape}")
        self.order = order
        self.transition_logprobs = log_softmax(trans)
        self.initial_logprobs = log_softmax(init)
        if eos_token_id is not None:
            check_token_ids([eos_token_id], self.vocab_size, name="eos_token_id")
        self.eos_token_id = eos_token_id

    @classmethod
    def random(cls, vocab_size: int, *, order: int = 1, seed: int | np.random.Generator = 0,
               scale: float = 1.5, eos_token_id: int | None = None) -> "MarkovModel":
        """A random chain with Gaussian logits of standard deviation ``scale``."""
        rng = np.random.default_rng(seed)
        shape = (vocab_size,) * (order + 1)
        return cls(rng.normal(scale=scale, size=shape), rng.normal(scale=scale, size=vocab_size),
                   order, eos_token_id=eos_token_id)

    def _row(self, context: Sequence[int]) -> np.ndarray:
        if not context:
            return self.initial_logprobs
        if self.order == 1:
            return self.transition_logprobs[context[-1]]
        prev2 = context[-2] if len(context) >= 2 else context[-1]
        return self.transition_logprobs[prev2, context[-1]]

    def start(self, prompt: Sequence[int]) -> MarkovSession:
        return MarkovSession(self, prompt)

    def extend_sessions(self, feeds: Sequence[Feed] | Sequence[MarkovSession],
                        token_lists: Sequence[Sequence[int]] | None = None,
                        prompt_limits: Sequence[int | None] | None = None) -> list[np.ndarray]:
        """Each feed's ``session.extend(tokens)`` for several of this chain's sessions in one gather: every
        row of every block is a row of the transition table, looked up together. Exact: the same rows.
        ``feeds``: :class:`~speculum.models.base.Feed` records, or the sessions with ``token_lists`` beside
        them (prompt limits have nothing to limit: no prompt is deferred).

        Example:
            >>> m = MarkovModel.random(4, seed=0)
            >>> a, b = m.start([1]), m.start([2, 3])
            >>> [rows.shape for rows in m.extend_sessions([Feed(a, [0, 2]), Feed(b, [1])])]
            [(2, 4), (1, 4)]
        """
        feeds = check_session_blocks(self, MarkovSession, feeds, token_lists, prompt_limits)
        sessions, checked = [feed.session for feed in feeds], [feed.tokens for feed in feeds]
        contexts = [session.tokens + tokens for session, tokens in zip(sessions, checked)]
        # Row j of a block follows its context up to the block's j-th token: (previous, last) table indices.
        last = np.array([t for tokens in checked for t in tokens], dtype=np.int64)
        if self.order == 1:
            rows = self.transition_logprobs[last]
        else:
            previous = np.array([ctx[max(len(ctx) - len(tokens) + j - 1, 0)]
                                 for ctx, tokens in zip(contexts, checked) for j in range(len(tokens))],
                                dtype=np.int64)
            rows = self.transition_logprobs[previous, last]
        out, at = [], 0
        for session, tokens in zip(sessions, checked):
            session.tokens.extend(tokens)
            out.append(rows[at: at + len(tokens)])
            at += len(tokens)
        return out

    def next_logprobs(self, prefixes: Sequence[Sequence[int]]) -> np.ndarray:
        rows = [self._row(check_token_ids(p, self.vocab_size, name="prefix")) for p in prefixes]
        return np.stack(rows) if rows else np.zeros((0, self.vocab_size))

    def score_sequences(self, sequences: Sequence[Sequence[int]], prompt: Sequence[int] = ()) -> np.ndarray:
        context = check_token_ids(prompt, self.vocab_size, name="prompt")
        out = np.empty(len(sequences))
        for b, seq in enumerate(sequences):
            ctx = list(context)
            total = 0.0
            for t in check_token_ids(seq, self.vocab_size, name="sequence"):
                total += float(self._row(ctx)[t])
                ctx.append(t)
            out[b] = total
        return out

