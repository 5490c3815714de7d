"""Model-agnostic drafts that propose fixed tokens (no honest distribution): verified by the point-mass rule.

* :class:`PromptLookup` — copy what followed the most recent earlier occurrence of the context's last
  n-gram (prompt lookup decoding, Saxena 2023; "LLMA", Yang et al. 2023). Strong when the output
  repeats the input (summaries, code edits), useless on open chat.
* :class:`NGramProposer` — the greedy continuation of an :class:`NGramModel`, optionally learning from
  the context as it grows (an online n-gram draft).

Point-mass verification is exact for *any* proposal, so these drafts affect speed only.

Both declare ``propose_with_match`` (the evidence behind a proposal, from which ``gamma="auto"`` learns
acceptance per situation) and are safe to share between threads: a lock serialises each call, and a
:class:`PromptLookup`'s proposal depends on the context it is given only, so concurrent generations sharing
one get exactly what each would get alone.

Example:
    >>> lookup = PromptLookup(max_ngram=2)
    >>> lookup.propose([5, 6, 7, 8, 5, 6], max_tokens=3)
    [7, 8, 5]
"""
from __future__ import annotations

import threading
from typing import Sequence

import numpy as np

from ..models.base import check_token_ids, common_prefix_length
from ..models.reference.ngram import NGramModel
from ..validation import InputError, check_int

__all__ = ["PromptLookup", "NGramProposer"]


def _as_list(context: Sequence[int]) -> list:
    """The context as a list without a per-token Python loop (ints are normalised only where new)."""
    if isinstance(context, np.ndarray):
        return context.astype(np.int64, copy=False).ravel().tolist()
    return context if isinstance(context, list) else list(context)


def _check_max_tokens(max_tokens: int) -> int:
    return check_int(max_tokens, "max_tokens", minimum=0)


class _Locked:
    """One call at a time on the object's state (``_lock``); a copy or an unpickled object gets its own lock."""

    _lock: threading.Lock

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class PromptLookup(_Locked):
    """Prompt-lookup proposer: the tokens that followed the best earlier match of the context's tail.

    For ``n`` from ``max_ngram`` down to ``min_ngram``, find the earlier occurrences of the last ``n``
    context tokens (not the tail itself); among them take the one whose preceding tokens agree longest
    with the context's (ties: the earliest) and propose up to ``min(num_pred_tokens, max_tokens)`` tokens
    that followed it; ``[]`` when nothing matches.

    An incremental index (n-gram → its end positions) is kept across calls, so a context that grows by
    a few tokens costs O(new tokens), not a rescan. A context that was truncated (rejected tokens rolled
    back) or that differs from the previous one is handled by undoing the index back to the common
    prefix. The proposal is always exactly the brute-force answer (tested), whatever was asked before.

    Example:
        >>> PromptLookup(max_ngram=3).propose([1, 2, 3, 4, 1, 2, 3], max_tokens=2)
        [4, 1]
        >>> PromptLookup(max_ngram=1).propose_with_match([7, 5, 1, 6, 5, 1, 9, 5, 1], max_tokens=1)
        ([6], 2)
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, num_pred_tokens: int = 10,
                 *, vocab_size: int | None = None, max_agreement: int = 32) -> None:
        max_ngram = check_int(max_ngram, "max_ngram", minimum=1)
        min_ngram = check_int(min_ngram, "min_ngram", minimum=1)
        if min_ngram > max_ngram:
            raise InputError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.num_pred_tokens = check_int(num_pred_tokens, "num_pred_tokens", minimum=1)
        self.max_agreement = check_int(max_agreement, "max_agreement", minimum=1)
        if self.max_agreement < max_ngram:
            raise InputError(f"max_agreement must be >= max_ngram ({max_ngram}), got {max_agreement}")
        self.vocab_size = vocab_size  # None: proposes whatever ids the context contains
        self._lock = threading.Lock()  # one call at a time: the index below follows the caller's context
        self._tokens: list[int] = []
        # _ends[n][ngram] = ascending end positions (exclusive) of that n-gram in _tokens.
        self._ends: dict[int, dict[tuple[int, ...], list[int]]] = {
            n: {} for n in range(self.min_ngram, self.max_ngram + 1)}

    def reset(self) -> None:
        """Forget the indexed context (optional: a new context is detected automatically)."""
        with self._lock:
            self._truncate(0)

    @property
    def indexed(self) -> int:
        """Tokens of context its index holds (the last context it proposed after)."""
        return len(self._tokens)

    def per_generation(self) -> "PromptLookup":
        """A proposer with the same settings and an index of its own, for one generation: generations that
        share one object take turns at its index, and each turn undoes the other's context and indexes its
        own again (O(context) a call instead of O(new tokens)). Proposals are the same either way."""
        return PromptLookup(self.max_ngram, self.min_ngram, self.num_pred_tokens, vocab_size=self.vocab_size,
                            max_agreement=self.max_agreement)

    def _truncate(self, length: int) -> None:
        tokens = self._tokens
        for end in range(len(tokens), length, -1):
            for n, index in self._ends.items():
                if end >= n:
                    key = tuple(tokens[end - n:end])
                    ends = index[key]
                    ends.pop()  # the last entry is this very end position
                    if not ends:
                        del index[key]
        del tokens[length:]

    def _append(self, new_tokens: list[int]) -> None:
        tokens = self._tokens
        for t in new_tokens:
            tokens.append(t)
            end = len(tokens)
            for n, index in self._ends.items():
                if end >= n:
                    index.setdefault(tuple(tokens[end - n:end]), []).append(end)

    def _sync(self, context: list) -> None:
        common = common_prefix_length(context, self._tokens)
        if common < len(self._tokens):
            self._truncate(common)
        new_tokens = context[common:]
        if self.vocab_size is not None:
            self._append(check_token_ids(new_tokens, self.vocab_size, name="context"))
        else:
            self._append([int(t) for t in new_tokens])

    def propose(self, context: Sequence[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` tokens copied from after the best earlier match of the context's tail.

        Deterministic; the empty list means "no proposal" (the caller decodes one token plainly).
        """
        return self.propose_with_match(context, max_tokens)[0]

    def propose_with_match(self, context: Sequence[int], max_tokens: int) -> tuple[list[int], int]:
        """The proposal and its match length: how many context tokens agree with the copied source.

        Among the earlier occurrences of the longest matching tail n-gram, the one whose preceding tokens
        agree longest with the context's (up to ``max_agreement``) is copied; ties go to the earliest,
        which in summaries and edits is the source text rather than the model's own output. A longer
        agreement predicts a longer accepted run (on SmolLM2, from under one token after a 1-token match
        to about ten after seven or more), which ``gamma="auto"`` uses to choose γ.
        The copy may overlap the tail (a repeating pattern continues periodically). ``([], 0)``: no match.
        """
        max_tokens = _check_max_tokens(max_tokens)
        context = _as_list(context)
        with self._lock:
            self._sync(context)
            return self._best_copy(max_tokens)

    def _best_copy(self, max_tokens: int) -> tuple[list[int], int]:
        """:meth:`propose_with_match` on the indexed context (the caller holds the lock)."""
        tokens, length = self._tokens, len(self._tokens)
        budget = min(max_tokens, self.num_pred_tokens)
        if budget == 0:
            return [], 0
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            if length <= n:
                continue  # an earlier occurrence needs at least one token after it
            ends = self._ends[n].get(tuple(tokens[length - n:]))
            if ends is None or len(ends) < 2:
                continue
            best_end, best_agreement = -1, -1
            for end in ends[:-1]:  # ascending; ends[-1] == length is the tail itself
                agreement = n + self._agreement(end - n, length - n, self.max_agreement - n)
                if agreement > best_agreement:
                    best_end, best_agreement = end, agreement
            proposal: list[int] = []
            for k in range(budget):  # an overlapping copy (LZ77-style) continues a repeating pattern
                source = best_end + k
                proposal.append(tokens[source] if source < length else proposal[source - length])
            return proposal, best_agreement
        return [], 0

    def _agreement(self, earlier: int, later: int, limit: int) -> int:
        """How many tokens before ``earlier`` equal those before ``later`` (at most ``limit``)."""
        tokens, k = self._tokens, 0
        while k < limit and earlier - 1 - k >= 0 and tokens[earlier - 1 - k] == tokens[later - 1 - k]:
            k += 1
        return k


class NGramProposer(_Locked):
    """Greedy continuation of an n-gram model as a fixed-token proposal (point-mass verification).

    Args:
        model: the :class:`NGramModel` to follow (ties go to the smallest token id).
        num_pred_tokens: most tokens proposed per call.
        learn: if true, every context token not yet counted is added to ``model`` before proposing
            (an online n-gram draft learning from the prompt and the accepted text). Counts are never
            removed: if the context later diverges, the new part is counted from the divergence point.
        min_context: stop proposing once the longest seen suffix of the running context is shorter
            than this (0 = always propose ``num_pred_tokens`` tokens); avoids guessing from unigrams.

    Example:
        >>> draft = NGramProposer(NGramModel(3, vocab_size=10), learn=True, min_context=1)
        >>> draft.propose([1, 2, 3, 1, 2], max_tokens=4)
        [3, 1, 2, 3]
    """

    def __init__(self, model: NGramModel, *, num_pred_tokens: int = 8, learn: bool = False,
                 min_context: int = 0) -> None:
        if not isinstance(model, NGramModel):
            raise InputError(f"model must be an NGramModel, got {type(model).__name__}")
        num_pred_tokens = check_int(num_pred_tokens, "num_pred_tokens", minimum=1)
        min_context = check_int(min_context, "min_context", minimum=0)
        if min_context > model.n - 1:
            raise InputError(
                f"min_context must be in [0, {model.n - 1}] for an order-{model.n} model, got {min_context}")
        self.model, self.num_pred_tokens = model, num_pred_tokens
        self.learn, self.min_context = bool(learn), min_context
        self.vocab_size = model.vocab_size
        self._counted: list[int] = []  # the context already added to the model's counts (learn mode)
        # One call at a time: learning updates the model's counts, which the proposal then reads. A learning
        # proposer shared by concurrent generations learns from all of them, so its proposals depend on
        # what the others have seen (verification keeps every output exact all the same).
        self._lock = threading.Lock()

    def _learn(self, context: list[int]) -> None:
        common = common_prefix_length(context, self._counted)
        first = max(0, common - self.model.n + 1)  # only the tail that new n-grams can reach
        self.model.update(context[first:], start=common - first)
        self._counted = list(context)

    def propose(self, context: Sequence[int], max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` greedy tokens of the n-gram model after ``context`` (deterministic)."""
        return self.propose_with_match(context, max_tokens)[0]

    def propose_with_match(self, context: Sequence[int], max_tokens: int) -> tuple[list[int], tuple[int, int]]:
        """The proposal and the evidence behind its first token: ``(context order, confidence quarter)``.

        The context order is the length of the seen context the model predicts from, the quarter is
        ``int(4 p)`` (capped at 3) of the model's probability of its argmax. ``gamma="auto"`` keeps
        acceptance statistics per such situation: how far an n-gram continuation is copied correctly
        depends on both.
        """
        max_tokens = _check_max_tokens(max_tokens)
        context = _as_list(context)
        with self._lock:
            if self.learn:
                self._learn(context)
            return self._greedy_continuation(context, max_tokens)

    def _greedy_continuation(self, context: list[int], max_tokens: int) -> tuple[list[int], tuple[int, int]]:
        """:meth:`propose_with_match` on the model as it stands (the caller holds the lock)."""
        window = context[max(0, len(context) - self.model.n + 1):] if self.model.n > 1 else []
        proposal: list[int] = []
        evidence = (0, 0)
        for _ in range(min(max_tokens, self.num_pred_tokens)):
            order = self.model.context_order(window) if self.min_context or not proposal else 0
            if self.min_context and order < self.min_context:
                break
            probabilities = self.model.next_probabilities(window)
            token = int(np.argmax(probabilities))
            if not proposal:
                evidence = (order, min(int(4 * probabilities[token]), 3))
            proposal.append(token)
            window = (window + [token])[1:] if len(window) == self.model.n - 1 else window + [token]
        return proposal, evidence
